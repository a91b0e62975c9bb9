"""Rotary position embedding, rotate-half form (HF Llama / Qwen2), with rope scaling default/linear/llama3/dynamic.

cos/sin are computed in float32 like HF (inv_freq * position, then cos/sin) and cast to the activation dtype before
the rotation, so fp32 results match HF to rounding. For the static scalings a (max_positions, head_dim) table is
precomputed once and indexed by position (graph-safe). "dynamic" (NTK) depends on the sequence length: the base
grows once a sequence is longer than max_position_embeddings, so it is computed per token from ``rope_lens`` (the
length the token's sequence had in its forward: the prompt length in prefill, position + 1 in decode - what HF
computes with its KV cache).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flashdecode.engine.config import RopeConfig


def base_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """float32 (head_dim // 2,): theta ** (-2i / head_dim), computed exactly as HF does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, short kept, smooth in between."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig, max_position_embeddings: int, max_positions: int, device):
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.max_position_embeddings = max_position_embeddings  # HF's dynamic formula uses the config value
        inv_freq = base_inv_freq(head_dim, rope.theta, device=device)
        if rope.rope_type == "linear":
            inv_freq = inv_freq / rope.factor
        elif rope.rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, rope)
        self.dynamic = rope.rope_type == "dynamic"
        if not self.dynamic:
            pos = torch.arange(max_positions, device=device, dtype=torch.int64).float()
            freqs = pos[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos_table", emb.cos(), persistent=False)  # (max_positions, head_dim) fp32
            self.register_buffer("sin_table", emb.sin(), persistent=False)

    def _dynamic_cos_sin(self, positions: torch.Tensor, rope_lens: torch.Tensor):
        """NTK-aware base growth per token: base * (factor * len / max_pos - (factor - 1)) ** (d / (d - 2))."""
        d, factor, max_pos = self.head_dim, self.rope.factor, self.max_position_embeddings
        lens = torch.clamp(rope_lens.float(), min=float(max_pos))
        base = self.rope.theta * ((factor * lens / max_pos) - (factor - 1)) ** (d / (d - 2))  # (tokens,)
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d
        inv_freq = 1.0 / (base[:, None] ** exponents[None, :])
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope_lens: torch.Tensor | None):
        """q (tokens, nheads, head_dim), k (tokens, nheads_kv, head_dim), positions int64 (tokens,) -> rotated q, k."""
        if self.dynamic:
            if rope_lens is None:
                raise ValueError("dynamic rope scaling needs rope_lens (the sequence length of every token)")
            cos, sin = self._dynamic_cos_sin(positions, rope_lens)
        else:
            cos, sin = self.cos_table[positions], self.sin_table[positions]
        cos, sin = cos.to(q.dtype)[:, None, :], sin.to(q.dtype)[:, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    @property
    def has_table(self) -> bool:
        """Static scaling: cos/sin come from a position table (what the fused rope kernel reads)."""
        return not self.dynamic
