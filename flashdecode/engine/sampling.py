"""SamplingParams (vLLM's names) and the sampler: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    temperature 0 means greedy (argmax). top_k 0 or -1 means no top-k cut; top_p 1.0 means no nucleus cut.
    seed: a request with a seed draws from its own generator, so its tokens do not depend on what it is batched with.
    Generation stops at max_new_tokens, or at an EOS token (included in the output) unless ignore_eos.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        self.stop_token_ids = tuple(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p exclude. logits float32 (vocab,) already divided by the temperature."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token if the mass strictly before it is < top_p (the top token is always kept)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           greedy_tokens: torch.Tensor | None = None) -> list[int]:
    """Pick one token per row. logits float32 (batch, vocab); one params/generator per row. Returns host ints.

    Greedy rows are one batched argmax (or ``greedy_tokens``, int64 (batch,), the argmax already computed on the
    device - the decode graph does it - so an all-greedy batch costs one small copy to the host); sampled rows
    draw with the exponential-race trick (argmax p / E, E ~ Exp(1)), which is a categorical draw from p using the
    row's own generator.
    """
    out = [0] * len(params)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        if greedy_tokens is not None:
            picked = greedy_tokens if len(greedy_rows) == len(params) else greedy_tokens[greedy_rows]
        elif len(greedy_rows) == len(params):
            picked = logits.argmax(-1)
        else:
            picked = logits[greedy_rows].argmax(-1)
        for i, tok in zip(greedy_rows, picked.tolist()):
            out[i] = tok
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = filter_logits(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=generators[i])
        out[i] = int((probs / noise).argmax().item())
    return out
