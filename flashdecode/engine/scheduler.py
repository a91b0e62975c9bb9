"""Sequences and the continuous-batching scheduler (vLLM / nano-vllm policy, our code).

Without chunked prefill each engine step is either one prefill batch (waiting requests that fit: seats, a token
budget and free pages) or one decode step over every running sequence. With chunked prefill
(``Scheduler(chunked_prefill=True)``, vLLM v1's policy) a step holds every running decode plus up to
``max_num_batched_tokens`` minus the decodes' tokens of prompt tokens: the next chunks of running prompts first,
then new requests, whose prompts may be cut into chunks of any length; ``ScheduledStep`` lists both parts.
New requests join between steps; finished ones leave and free their pages at once. When a step lacks a page, the
most recently admitted running sequence is preempted: its pages are freed and it goes back to the front of the
waiting queue, to be recomputed (its prompt plus the tokens generated so far are prefilled again) when pages free
up. Nothing is lost and nothing crashes; a request that could not fit even alone is refused when it is added.

Prefix caching (the block manager's): an admitted sequence starts from the longest cached prefix of its tokens
(``num_computed_tokens`` > 0) and prefills only the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools

import torch

from flashdecode.engine.kv_cache import BlockManager
from flashdecode.engine.sampling import SamplingParams


class RequestError(ValueError):
    """A request that can never run, with the request field to change (``param``: "prompt", "max_tokens", ...) and,
    for one that does not fit the context, ``code`` "context_length_exceeded" (the server answers 400 with both)."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started, read by the server's /metrics (vLLM's names). The scheduler counts
    tokens; a prefix cache adds the prompt tokens it looked up (``prefix_cache_queries``) and those it found cached
    (``prefix_cache_hits``) when it admits a request."""

    prompt_tokens: int = 0  # of each sequence, counted when its first token is sampled
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One completion: its tokens (prompt + generated), sampling params (n = 1), its own generator when sampled,
    and what the engine reports: the detokenised ``text``, per-token ``logprobs`` (when asked for), the finish
    reason ("stop" / "length" / "abort") and the stop reason (the stop string or stop token id that ended it).

    ``text`` is brought up to date by ``LLM.update_text(seq)`` (detokenisation is lazy).
    ``stop_ids`` end generation (EOS unless ignore_eos, and stop_token_ids); ``min_tokens_stop_ids`` are what the
    sampler masks while fewer than min_tokens tokens exist.
    """

    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, eos_token_ids=(), device="cpu",
                 index: int = 0):
        self.seq_id = next(Sequence._ids)
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.min_tokens_stop_ids = frozenset(self.stop_ids) if params.min_tokens else frozenset()
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        # K/V in the cache: positions [0, num_computed_tokens). While ``prefilling``, a step computes the chunk
        # [num_computed_tokens, num_computed_tokens + num_scheduled_tokens); afterwards one token per decode step
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.prefilling = False
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at the last admission
        self.text = ""
        self.detokenizer = None  # set by the engine when it has a tokenizer
        self.num_detokenized = 0  # output tokens the detokenizer has seen
        self.text_final = False  # text complete (finished and flushed, or cut at a stop string)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
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

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclasses.dataclass
class ScheduledStep:
    """One engine step: ``prefill`` sequences each compute their chunk (seq.num_scheduled_tokens tokens from
    seq.num_computed_tokens on); ``decode`` sequences one token each. Without chunked prefill one of them is empty."""

    prefill: list[Sequence]
    decode: list[Sequence]

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, chunked_prefill: bool = False):
        if chunked_prefill and max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"chunked prefill needs max_num_batched_tokens >= max_num_seqs (every running decode "
                             f"counts one token), got {max_num_batched_tokens} < {max_num_seqs}")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked_prefill = chunked_prefill
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: collections.deque[Sequence] = collections.deque()
        self.num_preemptions = 0
        self.stats = EngineStats()

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """RequestError (a ValueError) if a request could never run: an empty prompt, a prompt + max_tokens longer
        than max_model_len (refused, as vLLM does, rather than cut short), more pages than the whole pool (cached
        prefix pages do not count against it: unused ones are evicted on demand)."""
        if num_prompt_tokens < 1:
            raise RequestError("a prompt needs at least one token", "prompt")
        if num_prompt_tokens >= self.max_model_len:
            raise RequestError(f"prompt of {num_prompt_tokens} tokens does not fit max_model_len="
                               f"{self.max_model_len} (it needs room for at least one new token)", "prompt",
                               "context_length_exceeded")
        worst = num_prompt_tokens + max_tokens
        if worst > self.max_model_len:
            raise RequestError(f"this model's maximum context length (max_model_len) is {self.max_model_len} "
                               f"tokens, but {worst} were requested ({num_prompt_tokens} in the prompt, "
                               f"max_tokens={max_tokens} in the completion); shorten the prompt or lower max_tokens",
                               "max_tokens", "context_length_exceeded")
        if self.blocks.pages_for(worst) > self.blocks.num_pages:
            raise RequestError(f"request needs up to {self.blocks.pages_for(worst)} KV pages but the pool has "
                               f"{self.blocks.num_pages}; raise kv_cache_memory or lower max_tokens", "max_tokens")

    def add(self, seq: Sequence) -> None:
        """Queue a request. ValueError if it could never run (see ``check``)."""
        self.check(len(seq), seq.params.max_tokens)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_prefill(self) -> bool:
        """Whether some request waits or a running prompt is not fully computed (async decode must not run ahead)."""
        return bool(self.waiting) or any(s.prefilling for s in self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Without chunked prefill: the next step's sequences and whether it is a prefill."""
        step = self.schedule_step()
        return (step.prefill, True) if step.prefill else (step.decode, False)

    def schedule_step(self) -> ScheduledStep:
        """The next step. Without chunked prefill, a prefill of whole prompts has priority (new requests join
        asap), else every running sequence decodes. With it, see the module docstring."""
        if not self.chunked_prefill:
            prefill = self._admit(self.max_num_batched_tokens, chunked=False)
            return ScheduledStep(prefill, [] if prefill else self._schedule_running(0)[1])
        preemptions = self.num_preemptions
        prefill, decode = self._schedule_running(self.max_num_batched_tokens)
        if self.num_preemptions == preemptions:  # nobody was preempted: room for new requests
            budget = self.max_num_batched_tokens - len(decode) - sum(s.num_scheduled_tokens for s in prefill)
            prefill += self._admit(budget, chunked=True)
        return ScheduledStep(prefill, decode)

    def _admit(self, budget: int, chunked: bool) -> list[Sequence]:
        """Waiting sequences that fit the seats, the token budget (of tokens to compute, the cached prefix free;
        without chunking the first whole prompt is taken whatever its length) and the pool, in queue order."""
        batch = []
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            prefix = self.blocks.match_prefix(seq.token_ids)
            cached = prefix.num_tokens(self.blocks.page_size)
            todo = len(seq) - cached
            if chunked:
                todo = min(todo, budget)
            elif batch and todo > budget:
                break
            if not self.blocks.can_allocate(cached + todo, prefix):
                break
            self.blocks.allocate(seq.seq_id, cached + todo, prefix)
            if self.blocks.enable_prefix_caching:
                self.stats.prefix_cache_queries += len(seq)
                self.stats.prefix_cache_hits += cached
            self.waiting.popleft()
            seq.status, seq.prefilling = Status.RUNNING, True
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            seq.num_scheduled_tokens = todo
            self.running.append(seq)
            batch.append(seq)
            budget -= todo
        return batch

    def _schedule_running(self, budget: int) -> tuple[list[Sequence], list[Sequence]]:
        """Every running decode gets room for one more token, running prompts (chunked prefill) their next chunk
        within ``budget`` less the decodes; preempt from the back when pages run out. Returns (prefill, decode)."""
        budget -= sum(1 for s in self.running if not s.prefilling)
        for seq in self.running:
            if seq.prefilling:
                seq.num_scheduled_tokens = min(len(seq) - seq.num_computed_tokens, max(budget, 0))
                budget -= seq.num_scheduled_tokens
        scheduled = []
        while self.running:
            seq = self.running.popleft()
            # a decode step writes the K/V of the last token (position len - 1): room for len(seq) tokens
            need = seq.num_computed_tokens + seq.num_scheduled_tokens if seq.prefilling else len(seq)
            while not self.blocks.can_ensure(seq.seq_id, need):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.blocks.ensure(seq.seq_id, need)
                scheduled.append(seq)
        self.running.extend(scheduled)
        prefill = [s for s in scheduled if s.prefilling and s.num_scheduled_tokens]
        return prefill, [s for s in scheduled if not s.prefilling]

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and put it back at the front of the queue (it will be recomputed)."""
        self.blocks.free(seq.seq_id)
        seq.status, seq.prefilling, seq.num_computed_tokens = Status.WAITING, False, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def advance(self, seqs: list[Sequence]) -> None:
        """Count the K/V a step wrote for ``seqs`` (a prefill its chunk; a decode the token at len - 1) and
        register their newly full pages in the prefix cache."""
        for seq in seqs:
            if seq.finished:
                continue
            if seq.prefilling:
                seq.num_computed_tokens += seq.num_scheduled_tokens
                seq.prefilling = seq.num_computed_tokens < len(seq)
            else:
                seq.num_computed_tokens = len(seq)
            self.blocks.cache_full_pages(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def postprocess(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Count the step's K/V (``advance``), append each sequence's new token; finish (and free) the ones that
        hit a stop condition. A prefill row gets a token only from its last chunk."""
        self.advance(seqs)
        finished = []
        self.stats.generation_tokens += len(tokens)
        for seq, tok in zip(seqs, tokens):
            seq.token_ids.append(tok)
            if seq.num_generated == 1:
                self.stats.prompt_tokens += seq.num_prompt_tokens
            if tok in seq.stop_ids and seq.num_generated >= seq.params.min_tokens:
                self.finish(seq, "stop", None if tok not in seq.params.stop_token_ids else tok)
            elif seq.num_generated >= seq.params.max_tokens or len(seq) >= self.max_model_len:
                self.finish(seq, "length")
            if seq.finished:
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End ``seq`` now (a stop condition, or "abort"): its pages are free at once; waiting or running alike."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status, seq.finish_reason, seq.stop_reason = Status.FINISHED, reason, stop_reason
