"""SamplingParams (vLLM's names and meanings) and the batched device sampler.

The sampler takes one step's float32 logits (batch, vocab) and the scheduled sequences, applies the logits
processors (repetition / presence / frequency penalties, min_tokens), picks one token per row (greedy rows by
argmax, sampled rows by temperature + min_p + top-k + top-p and a draw from the row's own generator) and gathers the
requested log-probabilities. Everything runs on the logits' device; the host reads the results once, at the end
(the one sync per engine step the engine has anyway). Per-row settings reach the device as small host tensors
(copies, not syncs).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence as Seq

import torch

from flashdecode.ops.checks import check_int

# a temperature below this is treated as greedy: 1/T would overflow float32 logits (vLLM uses the same bound)
GREEDY_TEMPERATURE = 1e-5
DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20


def _check_float(name: str, value, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float:
    """A finite real number in [lo, hi] (or (lo, hi] with lo_open); ValueError/TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a finite float, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")
    return value


def _check_optional_int(name: str, value, minimum: int, maximum: int | None = None) -> int | None:
    return None if value is None else check_int(name, value, minimum, maximum)


@dataclasses.dataclass
class SamplingParams:
    """How to generate for one prompt (vLLM's names and meanings).

    n: completions per prompt. max_tokens: most new tokens (``max_new_tokens`` is an alias; default 16).
    min_tokens: EOS and stop_token_ids are masked (and stop strings ignored) until this many tokens exist.
    temperature: 0 (or below 1e-5) = greedy; top_k (0 or -1 = off), top_p (1 = off), min_p (0 = off).
    seed: the request draws from its own generator, so its tokens do not depend on what it is batched with
    (completion i of n uses seed + i).
    stop: strings matched on the detokenised output across token boundaries; generation ends before the match,
    which is not part of the text (unless include_stop_str_in_output). stop_token_ids: extra stop tokens (kept in
    token_ids like EOS). ignore_eos: do not stop at EOS.
    repetition_penalty (1 = off; > 1 discourages tokens of the prompt and output), presence_penalty and
    frequency_penalty (0 = off; in [-2, 2], on output tokens) as in vLLM / OpenAI.
    logprobs: the sampled token's log-probability plus the top ``logprobs`` of each generated position;
    prompt_logprobs: the same for the prompt positions. Log-probabilities are of the model's raw distribution.
    The engine's default temperature is 0 (greedy); the HTTP server uses the OpenAI default of 1.
    """

    n: int = 1
    max_tokens: int | None = None
    max_new_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Seq[str] | None = None
    stop_token_ids: Seq[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        self.n = check_int("n", self.n, 1)
        if (self.max_tokens is not None and self.max_new_tokens is not None
                and self.max_tokens != self.max_new_tokens):
            raise ValueError(f"max_tokens={self.max_tokens} and its alias max_new_tokens={self.max_new_tokens} "
                             f"disagree; give one")
        name = "max_tokens" if self.max_tokens is not None or self.max_new_tokens is None else "max_new_tokens"
        value = next((v for v in (self.max_tokens, self.max_new_tokens) if v is not None), DEFAULT_MAX_TOKENS)
        self.max_tokens = self.max_new_tokens = check_int(name, value, 1)
        self.min_tokens = check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        self.temperature = _check_float("temperature", self.temperature, 0.0)
        self.top_p = _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        self.top_k = check_int("top_k", self.top_k, -1)
        self.min_p = _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            self.seed = check_int("seed", self.seed)
        self.stop = self._stop_strings(self.stop)
        self.stop_token_ids = tuple(check_int("stop_token_ids", t, 0) for t in (self.stop_token_ids or ()))
        for flag in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty, 0.0, lo_open=True)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.logprobs = _check_optional_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self.prompt_logprobs = _check_optional_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)

    @staticmethod
    def _stop_strings(stop) -> tuple[str, ...]:
        if stop is None:
            return ()
        stops = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise TypeError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        return tuple(stops)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def stop_holdback(self) -> int:
        """Characters a stream keeps back: a stop string may still complete across the next tokens."""
        return max((len(s) for s in self.stop), default=1) - 1

    def for_choice(self, index: int) -> "SamplingParams":
        """Completion ``index`` of n: one completion with its own seed (seed + index)."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


@dataclasses.dataclass
class SampleResult:
    """One step's picks, on the host: ``tokens`` one int per row; ``logprobs`` per row None or a dict
    token id -> log-probability (the sampled token first, then the top-k); ``ranks`` the sampled token's rank."""

    tokens: list[int]
    logprobs: list[dict[int, float] | None]
    ranks: list[int | None]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p exclude. logits float32 (vocab,) already divided by the temperature."""
    k = torch.tensor([top_k if 0 < top_k < logits.shape[-1] else logits.shape[-1]], device=logits.device)
    p = torch.tensor([top_p], device=logits.device)
    return _top_k_top_p(logits[None], k, p)[0]


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Rows of float32 logits (m, vocab); k int64 (m,) tokens kept (vocab = off); p float32 (m,) nucleus mass
    (1 = off). A token is kept if its rank < k and the mass strictly before it (in the top-k renormalised
    distribution) is < p; the top token is always kept."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = (mass_before >= p[:, None]) | torch.isinf(sorted_logits)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _host(values, dtype, device) -> torch.Tensor:
    """A small per-row tensor built on the host and copied to ``device`` without a sync (from pinned memory: a
    copy from pageable memory would wait for the stream)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def apply_penalties(logits: torch.Tensor, rows: list[int], seqs) -> None:
    """vLLM's repetition (prompt + output tokens, divide positive logits / multiply negative ones), frequency
    (times the output count) and presence (output tokens present) penalties, in place on ``logits[rows]``."""
    device, vocab = logits.device, logits.shape[-1]
    r_out, t_out, r_all, t_all = [], [], [], []
    for j, i in enumerate(rows):
        seq = seqs[i]
        out = seq.token_ids[seq.num_prompt_tokens:]
        r_out += [j] * len(out)
        t_out += out
        r_all += [j] * len(seq.token_ids)
        t_all += seq.token_ids
    counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
    counts.index_put_((_host(r_out, torch.int64, device), _host(t_out, torch.int64, device)),
                      torch.ones(len(t_out), device=device), accumulate=True)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    seen[_host(r_all, torch.int64, device), _host(t_all, torch.int64, device)] = True
    params = [seqs[i].params for i in rows]
    rep = _host([[p.repetition_penalty] for p in params], torch.float32, device)
    freq = _host([[p.frequency_penalty] for p in params], torch.float32, device)
    pres = _host([[p.presence_penalty] for p in params], torch.float32, device)
    idx = _host(rows, torch.int64, device)
    x = logits[idx]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts - pres * (counts > 0).float()
    logits[idx] = x


def mask_stops_before_min_tokens(logits: torch.Tensor, rows: list[int], seqs) -> None:
    """Rows that have fewer than min_tokens outputs cannot pick EOS or a stop token id (in place)."""
    r, t = [], []
    vocab = logits.shape[-1]
    for i in rows:  # an EOS id from a config can lie past the vocabulary: it can never be sampled anyway
        ids = sorted(tok for tok in seqs[i].min_tokens_stop_ids if tok < vocab)
        r += [i] * len(ids)
        t += ids
    if t:
        logits[_host(r, torch.int64, logits.device), _host(t, torch.int64, logits.device)] = float("-inf")


def _sample_rows(logits: torch.Tensor, rows: list[int], seqs) -> torch.Tensor:
    """Temperature, min_p, top-k, top-p, then a categorical draw per row from its own generator (the exponential
    race: argmax p / E with E ~ Exp(1) is a draw from p). Returns int64 (len(rows),) on the device."""
    device, vocab = logits.device, logits.shape[-1]
    params = [seqs[i].params for i in rows]
    x = logits[_host(rows, torch.int64, device)] / _host([[p.temperature] for p in params], torch.float32, device)
    if any(p.min_p > 0 for p in params):
        probs = x.softmax(-1)
        floor = _host([[p.min_p] for p in params], torch.float32, device) * probs.amax(-1, keepdim=True)
        x = x.masked_fill(probs < floor, float("-inf"))
    if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
        k = _host([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, device)
        x = _top_k_top_p(x, k, _host([p.top_p for p in params], torch.float32, device))
    probs = x.softmax(-1)
    noise = torch.empty_like(probs)
    for j, i in enumerate(rows):
        noise[j].exponential_(generator=seqs[i].generator)
    return (probs / noise).argmax(-1)


def draw_tokens(logits: torch.Tensor, seqs, greedy_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of float32 ``logits`` (batch, vocab) as they stand (no penalties or masks applied here),
    on the device and without a host sync: the argmax for greedy rows (``greedy_tokens`` int64 (batch,) where the
    device already has it), a draw from the row's own generator for sampled rows. Returns int64 (len(seqs),)
    (``greedy_tokens[:n]`` itself when every row is greedy)."""
    n = len(seqs)
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not sampled and greedy_tokens is not None:
        return greedy_tokens[:n]
    tokens = logits.argmax(-1) if greedy_tokens is None else greedy_tokens[:n].clone()
    if sampled:
        tokens[_host(sampled, torch.int64, logits.device)] = _sample_rows(logits, sampled, seqs)
    return tokens


def sample(logits: torch.Tensor, seqs, greedy_tokens: torch.Tensor | None = None) -> SampleResult:
    """Pick one token per row of float32 ``logits`` (batch, vocab) for the scheduled ``seqs`` (one per row: their
    ``params``, ``generator``, ``token_ids``, ``num_prompt_tokens`` and ``min_tokens_stop_ids`` are read).

    ``greedy_tokens`` int64 (batch,): the argmax already computed on the device (the decode graph does it), used
    for greedy rows whose logits no processor changes - an all-greedy plain batch costs one small copy to the host.
    """
    n = len(seqs)
    params = [s.params for s in seqs]
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    min_tok = [i for i, s in enumerate(seqs) if s.num_generated < s.params.min_tokens and s.min_tokens_stop_ids]
    want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw = logits
    if penalised or min_tok:
        logits = logits.clone()
        if penalised:
            apply_penalties(logits, penalised, seqs)
        if min_tok:
            mask_stops_before_min_tokens(logits, min_tok, seqs)
        greedy_tokens = None
    tokens = draw_tokens(logits, seqs, greedy_tokens)
    host = [tokens]
    if want_lp:
        idx = _host(want_lp, torch.int64, logits.device)
        lp = torch.log_softmax(raw[idx], dim=-1)
        chosen = lp.gather(-1, tokens[idx][:, None])
        rank = (lp > chosen).sum(-1) + 1
        top = torch.topk(lp, max(params[i].logprobs for i in want_lp), dim=-1)
        host += [chosen[:, 0], rank, top.values, top.indices]
    host = _to_host(host)
    token_list = host[0].tolist()
    logprobs: list[dict[int, float] | None] = [None] * n
    ranks: list[int | None] = [None] * n
    if want_lp:
        chosen, rank, top_v, top_i = (h.tolist() for h in host[1:])
        for j, i in enumerate(want_lp):
            k = params[i].logprobs
            entry = {token_list[i]: chosen[j]}
            for tok, val in zip(top_i[j][:k], top_v[j][:k]):
                entry.setdefault(tok, val)
            logprobs[i], ranks[i] = entry, rank[j]
    return SampleResult(token_list, logprobs, ranks)


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy device tensors to the host behind one synchronisation."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors]
    out = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return out


def prompt_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[dict[int, float] | None]:
    """vLLM's prompt_logprobs: None for the first token, then for each later prompt token a dict token id ->
    log-probability (the actual token first, then the top ``k``). logits float32 (len, vocab) of the prompt."""
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nxt = torch.tensor(token_ids[1:], dtype=torch.int64, device=lp.device)
    actual = lp.gather(-1, nxt[:, None])[:, 0].tolist()
    top_v, top_i = (x.tolist() for x in torch.topk(lp, k, dim=-1)) if k else ([[]] * len(actual),) * 2
    out: list[dict[int, float] | None] = [None]
    for tok, val, tv, ti in zip(token_ids[1:], actual, top_v, top_i):
        entry = {tok: val}
        for t, v in zip(ti, tv):
            entry.setdefault(t, v)
        out.append(entry)
    return out
