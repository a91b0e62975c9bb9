"""One engine loop in a background thread, fed and drained by an asyncio front end.

The thread owns the LLM: it admits new requests and aborts between steps, runs ``LLM.step_sequences`` (one prefill
batch or one decode step over every running sequence: continuous batching across all open requests) and pushes each
sequence's new tokens / text / log-probabilities to its request's asyncio queue with ``call_soon_threadsafe``. The
event loop never runs model code, and the model loop never waits on HTTP: a slow client only fills its own queue.
An abort (a client that went away) is taken before the next step; ``Scheduler.finish`` frees its pages at once.
On several ranks (serve --tp / --cp) this loop runs on rank 0 and sends each iteration's requests and aborts to the
other ranks before applying them (server/ranks.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import threading
import time
from typing import Callable

from flashdecode.engine.llm import LLM
from flashdecode.engine.sampling import SamplingParams
from flashdecode.engine.scheduler import Sequence
from flashdecode.engine.server.ranks import HEARTBEAT_S, Leader

logger = logging.getLogger(__name__)
# The engine thread and the HTTP event loop share the GIL. When a step's GPU work ends, the engine thread asks for
# the GIL back and waits until the loop thread yields it: at the latest after the interpreter's switch interval,
# 5 ms by default - half a decode step of an 8B model at batch 32. While serving the interval is at most this.
ENGINE_SWITCH_INTERVAL_S = 0.0005


class QueueFull(Exception):
    """More sequences are open than the engine's seats plus the configured queue (the server answers 429)."""


@dataclasses.dataclass
class Delta:
    """What one completion gained in one step: token ids, text (held back while a stop string may still
    complete), log-probabilities, and the finish / stop reason on its last delta."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class RequestStream:
    """The asyncio side of one request (n completions): iterate to receive lists of Deltas until all finished."""

    def __init__(self, engine: "AsyncEngine", prompt_token_ids: list[int], params: SamplingParams):
        self.engine = engine
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seqs: list[Sequence] = []
        self.prompt_logprobs = None
        self.remaining = params.n
        self.closed = False
        self.arrival = time.monotonic()
        self.ordinal: int | None = None  # its number on every rank when serving on several (server/ranks.py)
        self.token_times: dict[int, float] = {}  # choice index -> when its latest token was read (metrics)

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[Delta]:
        if self.remaining == 0:
            self.close()
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        deltas, when = item
        if self.engine.request_observer is not None:
            self.engine.request_observer(self, deltas, when)
        self.remaining -= sum(d.finish_reason is not None for d in deltas)
        return deltas

    def close(self) -> None:
        """Release the request: aborts what is still running (a client that left), frees its seats."""
        if self.closed:
            return
        self.closed = True
        self.engine._release(self, abort=self.remaining > 0)


@dataclasses.dataclass
class _Sent:
    """What a sequence's stream has delivered so far."""

    stream: RequestStream
    tokens: int = 0
    chars: int = 0
    logprobs: int = 0


class AsyncEngine:
    """Runs ``llm`` in a background thread. ``max_queue``: sequences that may wait beyond the engine's seats
    (max_num_seqs) before ``submit`` raises QueueFull."""

    def __init__(self, llm: LLM, max_queue: int = 256):
        self.llm = llm
        # several ranks (serve --tp / --cp): every loop iteration's requests and aborts go to the other ranks first
        self.leader = Leader(llm) if llm.parallel.world_size > 1 else None
        self.capacity = llm.scheduler.max_num_seqs + max_queue
        self._open = 0  # sequences submitted and not finished or aborted yet (under _lock)
        self._lock = threading.Lock()
        self._new: list[RequestStream] = []
        self._aborts: list[RequestStream] = []
        self._wake = threading.Event()
        self._stopping = False
        self._sent: dict[int, _Sent] = {}  # seq_id -> delivery state (engine thread only)
        self._loop: asyncio.AbstractEventLoop | None = None
        # called on the event loop as (stream, deltas, monotonic time the step's tokens were read) (/metrics)
        self.request_observer: Callable[[RequestStream, list[Delta], float], None] | None = None
        self._thread = threading.Thread(target=self._run, name="flashdecode-engine", daemon=True)

    @property
    def num_open(self) -> int:
        """Sequences submitted and not yet finished or aborted (queued ones included)."""
        return self._open

    @property
    def num_unadmitted(self) -> int:
        """Sequences submitted that the engine thread has not yet handed to the scheduler."""
        with self._lock:
            return sum(s.params.n for s in self._new)

    # ------------------------------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request (call from the event loop). ValueError if it could never run, QueueFull past capacity."""
        self.llm.check_request(prompt_token_ids, params)
        self._loop = asyncio.get_running_loop()
        stream = RequestStream(self, prompt_token_ids, params)
        with self._lock:
            if self._open + params.n > self.capacity:
                raise QueueFull(f"{self._open} sequences are open and the engine takes {self.capacity} "
                                f"(max_num_seqs + max_queue); retry later")
            self._open += params.n
            self._new.append(stream)
        self._wake.set()
        return stream

    def _release(self, stream: RequestStream, abort: bool) -> None:
        """The consumer is done with ``stream``; unfinished sequences (a client that left) are aborted."""
        if abort:
            with self._lock:
                self._aborts.append(stream)
            self._wake.set()

    # ------------------------------------------------------------------------------------------ engine thread
    def _deliver(self, stream: RequestStream, item) -> None:
        self._loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _admit(self) -> None:
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
        if self.leader is not None:
            self.leader.send(new, aborts)
        for stream in new:
            try:
                stream.seqs = self.llm.add_request(stream.prompt_token_ids, stream.params)
            except Exception as e:  # checked on submit; anything left (e.g. a prompt_logprobs forward) fails it
                with self._lock:
                    self._open -= stream.params.n
                self._deliver(stream, e)
                continue
            stream.prompt_logprobs = stream.seqs[0].prompt_logprobs
            for seq in stream.seqs:
                self._sent[seq.seq_id] = _Sent(stream)
        for stream in aborts:
            self.llm.abort([s for s in stream.seqs if not s.finished])
            for seq in stream.seqs:
                self._forget(seq.seq_id)

    def _forget(self, seq_id: int) -> None:
        """Stop tracking a sequence (finished, aborted or failed): its seat in the capacity count is free."""
        if self._sent.pop(seq_id, None) is not None:
            with self._lock:
                self._open -= 1

    def _delta(self, seq: Sequence, sent: _Sent) -> Delta:
        self.llm.update_text(seq)
        done = seq.finished
        visible = len(seq.text) if done else max(sent.chars, len(seq.text) - seq.params.stop_holdback)
        delta = Delta(seq.index, seq.output_token_ids[sent.tokens:], seq.text[sent.chars:visible],
                      None if seq.logprobs is None else seq.logprobs[sent.logprobs:],
                      seq.finish_reason if done else None, seq.stop_reason if done else None)
        sent.tokens, sent.chars = seq.num_generated, visible
        sent.logprobs = 0 if seq.logprobs is None else len(seq.logprobs)
        return delta

    def _publish(self, seqs: list[Sequence]) -> None:
        now = time.monotonic()
        by_stream: dict[int, tuple[RequestStream, list[Delta]]] = {}
        for seq in seqs:
            sent = self._sent.get(seq.seq_id)
            if sent is None:
                continue
            by_stream.setdefault(id(sent.stream), (sent.stream, []))[1].append(self._delta(seq, sent))
            if seq.finished:
                self._forget(seq.seq_id)
        for stream, deltas in by_stream.values():
            self._deliver(stream, (deltas, now))

    def _fail_all(self, error: BaseException) -> None:
        streams = {id(s.stream): s.stream for s in self._sent.values()}
        if self.leader is not None:
            self.leader.send([], list(streams.values()))
        for stream in streams.values():
            self.llm.abort([s for s in stream.seqs if not s.finished])
            for seq in stream.seqs:
                self._forget(seq.seq_id)
            self._deliver(stream, error)

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._admit()
                if not self.llm.scheduler.has_work():
                    self._wake.wait(HEARTBEAT_S if self.leader is not None else None)
                    self._wake.clear()
                    continue
                stepped, _ = self.llm.step_sequences()
                self._publish(stepped)
            except Exception as e:  # the model failed: fail every open request, keep serving new ones
                logger.exception("engine step failed; failing %d open sequences", len(self._sent))
                self._fail_all(RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
        if self.leader is not None:  # the other ranks leave their loops too
            self.leader.send([], [], stop=True)
