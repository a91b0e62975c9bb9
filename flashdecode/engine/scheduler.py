"""Sequences and the continuous-batching scheduler (vLLM / nano-vllm policy, our code).

Each engine step is either one prefill batch (waiting requests that fit: seats, a token budget and free pages) or
one decode step over every running sequence. New requests join between decode steps; finished ones leave and free
their pages at once. When a decode step lacks a page, the most recently admitted running sequence is preempted:
its pages are freed and it goes back to the front of the waiting queue, to be recomputed (its prompt plus the tokens
generated so far are prefilled again) when pages free up. Nothing is lost and nothing crashes; a request that could
not fit even alone is refused when it is added.
"""

from __future__ import annotations

import collections
import enum
import itertools

import torch

from flashdecode.engine.kv_cache import BlockManager
from flashdecode.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request: its tokens (prompt + generated), sampling params, and its own generator when seeded."""

    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, eos_token_ids=(), device="cpu"):
        self.seq_id = next(Sequence._ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: collections.deque[Sequence] = collections.deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a request. ValueError if it could never run (longer than max_model_len or the whole page pool)."""
        if len(seq) < 1:
            raise ValueError("a prompt needs at least one token")
        worst = min(len(seq) + seq.params.max_new_tokens, self.max_model_len)
        if len(seq) >= self.max_model_len:
            raise ValueError(f"prompt of {len(seq)} tokens does not fit max_model_len={self.max_model_len} "
                             f"(it needs room for at least one new token)")
        if self.blocks.pages_for(worst) > self.blocks.num_pages:
            raise ValueError(f"request needs up to {self.blocks.pages_for(worst)} KV pages but the pool has "
                             f"{self.blocks.num_pages}; raise kv_cache_memory or lower max_new_tokens")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next step's sequences and whether it is a prefill. Prefill has priority (new requests join asap)."""
        batch = self._schedule_prefill()
        if batch:
            return batch, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        batch, tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if batch and tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self.blocks.can_allocate(len(seq)):
                break
            self.blocks.allocate(seq.seq_id, len(seq))
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(seq)
            tokens += len(seq)
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        """Every running sequence gets room for one more token; preempt from the back when pages run out."""
        scheduled = []
        while self.running:
            seq = self.running.popleft()
            # the step writes the K/V of the last token (position len - 1): room for len(seq) tokens
            while not self.blocks.can_ensure(seq.seq_id, len(seq)):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.blocks.ensure(seq.seq_id, len(seq))
                scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and put it back at the front of the queue (it will be recomputed)."""
        self.blocks.free(seq.seq_id)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append each sequence's new token; finish (and free) the ones that hit a stop condition."""
        finished = []
        for seq, tok in zip(seqs, tokens):
            seq.token_ids.append(tok)
            reason = None
            if tok in seq.stop_ids:
                reason = "stop"
            elif seq.num_generated >= seq.params.max_new_tokens or len(seq) >= self.max_model_len:
                reason = "length"
            if reason:
                seq.status, seq.finish_reason = Status.FINISHED, reason
                self.blocks.free(seq.seq_id)
                self.running.remove(seq)
                finished.append(seq)
        return finished
