"""The step loop of an engine: each step asks the scheduler what runs, runs it on the model runner, draws the next
tokens and hands them back to the scheduler; with async scheduling the next decode step is launched before the host
has read the tokens of the one in flight (vLLM's async scheduling)."""

from __future__ import annotations

import dataclasses

import torch

from flashdecode.distributed.groups import ParallelState
from flashdecode.engine.kv_cache import BlockManager
from flashdecode.engine.outputs import check_stop_strings
from flashdecode.engine.runner import ModelRunner, PendingTokens
from flashdecode.engine.sampling import draw_tokens, sample
from flashdecode.engine.scheduler import Scheduler, Sequence


@dataclasses.dataclass
class _InFlightDecode:
    """A decode step launched under async scheduling whose tokens the host has not read: its rows' sequences
    (in row order) and the copy of its greedy tokens to the host."""
    seqs: list[Sequence]
    tokens: PendingTokens


class EngineCore:
    """Steps the engine's requests. ``async_scheduling``: launch a decode step whose tokens the device draws alone
    before the step in flight is read; ``single_forward``: with chunked prefill, a step's decodes and prompt chunks
    in one eager forward (each decode row a one-token chunk) instead of the decode CUDA graph and a second
    forward."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, runner: ModelRunner,
                 parallel: ParallelState, max_model_len: int, *, async_scheduling: bool, single_forward: bool):
        self.scheduler, self.block_manager, self.runner, self.parallel = scheduler, block_manager, runner, parallel
        self.max_model_len = max_model_len
        self.async_scheduling, self.single_forward = async_scheduling, single_forward
        self._in_flight: _InFlightDecode | None = None  # the decode step launched and not yet read (async)

    def step_sequences(self) -> tuple[list[Sequence], list[Sequence]]:
        """One engine step. Returns (the sequences that got a token, those of them that finished).

        With async scheduling the step whose tokens this returns may have been launched by the call before, and
        the step after it is launched here before its tokens are read (see _read_in_flight)."""
        if self._in_flight is not None:
            if any(not s.finished for s in self._in_flight.seqs):
                return self._read_in_flight()
            self._in_flight.tokens.wait()  # every row was aborted meanwhile: nothing to report
            self._in_flight = None
        step = self.scheduler.schedule_step()
        if not step:
            return [], []
        if not step.prefill and self._runs_ahead(step.decode, ahead=0):
            self._in_flight = self._launch_decode(step.decode, self._tables(step.decode), ahead=False)
            return self._read_in_flight()
        seqs, tokens, rows = [], [], step.prefill
        if step.decode and step.prefill and self.single_forward:
            for s in step.decode:  # one-token chunks after their pages, in the chunks' forward
                s.num_computed_tokens, s.num_scheduled_tokens = len(s) - 1, 1
            rows = step.decode + step.prefill
        elif step.decode:  # a CUDA-graph decode step, then (chunked prefill) the prompts' chunks in a second forward
            logits, greedy = self.runner.decode(step.decode, self._tables(step.decode))
            seqs, tokens = list(step.decode), self._sample(logits, step.decode, greedy)
        if rows:
            logits = self.runner.prefill(rows, self._tables(rows))
            last = [s.num_computed_tokens + s.num_scheduled_tokens == len(s) for s in rows]
            self.scheduler.advance([s for s, done in zip(rows, last) if not done])  # chunks mid-prompt
            done = [s for s, d in zip(rows, last) if d]
            if done:
                rows = [i for i, d in enumerate(last) if d]
                seqs += done
                tokens += self._sample(logits[rows] if len(rows) < len(last) else logits, done, None)
        # parallel ranks continue with rank 0's draws (its logprobs above are of its own draw)
        return seqs, self._finish_step(seqs, self.parallel.agree_tokens(tokens))

    def _tables(self, seqs: list[Sequence]) -> list[list[int]]:
        return [self.block_manager.table(s.seq_id) for s in seqs]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None) -> list[int]:
        """The next token of each row (and its logprobs, when asked for)."""
        result = sample(logits, seqs, greedy)
        for seq, lp, tok in zip(seqs, result.logprobs, result.tokens):
            if lp is not None:
                seq.logprobs.append(lp)
                seq.cumulative_logprob += lp[tok]
        return list(result.tokens)

    def _finish_step(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append the step's tokens; the sequences that finished (stop token, length, stop string)."""
        finished = self.scheduler.postprocess(seqs, tokens)
        for seq in seqs:
            if seq.params.stop and seq.detokenizer is not None and check_stop_strings(seq, self.scheduler):
                finished.append(seq)
        return finished

    # ------------------------------------------------------------------------------------- async scheduling
    def _runs_ahead(self, seqs: list[Sequence], ahead: int) -> bool:
        """Whether a decode step of ``seqs`` may be launched without reading the device's tokens: ``ahead`` = 0
        for a step whose inputs the host has, 1 for the step after the one in flight (whose token is still on
        the device). Rows whose token the device draws alone (greedy, or sampled from the row's generator; no
        penalties, logprobs or pending min_tokens mask, which need the host's token lists), no request waiting to
        join nor prompt chunk pending (they would be prefilled first), and for ahead = 1 no row ending by length at
        the step in flight (its next row would need a position past its limit)."""
        if not self.async_scheduling or self.scheduler.has_pending_prefill():
            return False
        for s in seqs:
            p, generated = s.params, s.num_generated + ahead
            if p.has_penalties or p.logprobs is not None or (generated < p.min_tokens and s.min_tokens_stop_ids):
                return False
            if ahead and (generated >= p.max_tokens or len(s) + ahead >= self.max_model_len):
                return False
        return True

    def _launch_decode(self, seqs: list[Sequence], tables: list[list[int]], ahead: bool) -> _InFlightDecode:
        """Launch a decode step and its tokens' way to the host, without waiting for either. Sampled rows draw on
        the device, before the next step's graph overwrites the logits; their tokens replace the argmax in the
        runner's token buffer, which the step after copies its input tokens from."""
        logits, greedy = self.runner.decode(seqs, tables, ahead=ahead)
        tokens = draw_tokens(logits, seqs, greedy)
        if tokens.data_ptr() != greedy.data_ptr():  # some row was sampled
            greedy.copy_(tokens)
        return _InFlightDecode(seqs, self.runner.greedy_tokens_to_host(len(seqs)))

    def _read_in_flight(self) -> tuple[list[Sequence], list[Sequence]]:
        """Launch the next decode step of the in-flight step's sequences ahead of its tokens (same rows, same
        order: each row's input token is copied on the device) where every row is still running and may run
        ahead and pages allow, then read the in-flight step's tokens and apply them. Rows of sequences that
        finished meanwhile (aborted; or, for a step launched ahead, stopped at the step before) are dropped."""
        flight, nxt = self._in_flight, None
        seqs = flight.seqs
        blocks = self.block_manager
        if all(not s.finished for s in seqs) and self._runs_ahead(seqs, ahead=1) and sum(
                blocks.pages_missing(s.seq_id, len(s) + 1) for s in seqs) <= blocks.num_free:
            tables = [blocks.ensure(s.seq_id, len(s) + 1) for s in seqs]
            nxt = self._launch_decode(seqs, tables, ahead=True)
        tokens = flight.tokens.wait()
        live = [i for i, s in enumerate(seqs) if not s.finished]
        stepped = [seqs[i] for i in live]
        finished = self._finish_step(stepped, [tokens[i] for i in live])
        self._in_flight = nxt if nxt is not None and any(not s.finished for s in seqs) else None
        if nxt is not None and self._in_flight is None:
            nxt.tokens.wait()  # every row stopped: the step ahead is discarded (its pinned slot comes free)
        return stepped, finished
