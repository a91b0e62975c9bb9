"""FP8 quantisation of attention operands, with FA3's incoherent processing (a random-sign Hadamard rotation).

``quantize_fp8(x)`` turns a (batch, seqlen, nheads, headdim) tensor into float8_e4m3fn values and float32 descales
(the dequantised tensor is ``x_fp8.float() * descale`` broadcast over the dims the descale does not have).
``hadamard=True`` first rotates the head dim by R = diag(signs) H / sqrt(headdim), H the Sylvester Hadamard matrix
and ``signs`` random +-1 drawn from ``seed``. R is orthogonal, so rotating both q and k with the same seed leaves
QK^T unchanged in exact arithmetic while spreading a few large outliers over the whole head dim, which shrinks the
quantisation step of the rows that hold them (FlashAttention-3's incoherent processing). V is not rotated (PV would
change); rotate the output back with ``hadamard_rotate(o, seed, inverse=True)`` if you rotate V yourself.
"""

from __future__ import annotations

import functools

import torch

from flashdecode.ops import checks
from flashdecode.ops.util import cdiv

__all__ = ["quantize_fp8", "dequantize_fp8", "hadamard_rotate", "FP8_E4M3_MAX", "GRANULARITIES"]

FP8_E4M3_MAX = 448.0
GRANULARITIES = ("per_tensor", "per_head", "per_block")


@functools.lru_cache(maxsize=16)
def _rotation_cpu(headdim: int, seed: int) -> torch.Tensor:
    """R = diag(signs) H / sqrt(headdim), float64 (headdim, headdim), built once per (headdim, seed)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < headdim:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (headdim,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
    return signs[:, None] * h / headdim ** 0.5


def _check_power_of_two_headdim(headdim: int):
    if headdim < 1 or headdim & (headdim - 1):
        raise ValueError(f"hadamard=True needs a power-of-two head dim, got {headdim}")


def hadamard_rotate(x: torch.Tensor, seed: int = 0, *, inverse: bool = False) -> torch.Tensor:
    """x (..., headdim) -> x @ R (or x @ R^T with inverse=True), computed in float32 (float64 for float64 x), returned in x's dtype.

    The same ``seed`` gives the same R for every call, so rotating q and k alike keeps q @ k^T.
    """
    checks.check_tensor("x", x, range(1, 9), checks.FLOAT_DTYPES + (torch.float64,))
    checks.check_int("seed", seed, minimum=0)
    headdim = x.shape[-1]
    _check_power_of_two_headdim(headdim)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    r = _rotation_cpu(headdim, seed).to(device=x.device, dtype=compute)
    return (x.to(compute) @ (r.t() if inverse else r)).to(x.dtype)


def _amax(x: torch.Tensor, granularity: str, block_size: int) -> torch.Tensor:
    """Absolute maxima of x (batch, seqlen, nheads, headdim) float32 over each descale's group."""
    a = x.abs()
    if granularity == "per_tensor":
        return a.amax()
    if granularity == "per_head":  # (batch, nheads): FA3's descale layout
        return a.amax(dim=(1, 3))
    batch, seqlen, nheads, headdim = x.shape
    nblocks = cdiv(seqlen, block_size)
    padded = torch.nn.functional.pad(a, (0, 0, 0, 0, 0, nblocks * block_size - seqlen))
    return padded.view(batch, nblocks, block_size, nheads, headdim).amax(dim=(2, 4)).transpose(1, 2)


def _expand_descale(descale: torch.Tensor, shape, block_size: int) -> torch.Tensor:
    """descale as produced by quantize_fp8 -> broadcastable to (batch, seqlen, nheads, 1)."""
    if descale.dim() == 0:
        return descale
    if descale.dim() == 2:  # (batch, nheads)
        return descale[:, None, :, None]
    seqlen = shape[1]
    per_token = descale.repeat_interleave(block_size, dim=2)[:, :, :seqlen]  # (batch, nheads, seqlen)
    return per_token.transpose(1, 2)[..., None]


def quantize_fp8(x: torch.Tensor, *, hadamard: bool = False, seed: int = 0, granularity: str = "per_head",
                 block_size: int = 128):
    """Quantise x to float8_e4m3fn with float32 descales (absmax / 448 per group; an all-zero group gets descale 0).

    Args:
        x: (batch, seqlen, nheads, headdim) float16 / bfloat16 / float32.
        hadamard: rotate the head dim first (hadamard_rotate with ``seed``; head dim a power of two). Rotate the
            other operand of the product with the same seed.
        granularity: "per_head" -> descale (batch, nheads) (FA3's layout, what flash_attn's q/k/v_descale take);
            "per_tensor" -> descale (); "per_block" -> descale (batch, nheads, ceil(seqlen / block_size)).
    Returns:
        (x_fp8 (batch, seqlen, nheads, headdim) float8_e4m3fn, descale float32).
    """
    checks.check_tensor("x", x, (4,), checks.FLOAT_DTYPES)
    checks.check_bool("hadamard", hadamard)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    checks.check_int("block_size", block_size, minimum=1)
    xf = hadamard_rotate(x.float(), seed) if hadamard else x.float()
    descale = _amax(xf, granularity, block_size) / FP8_E4M3_MAX
    if not torch.isfinite(descale).all():
        raise ValueError("x holds NaN or inf values: they cannot be quantised")
    d = _expand_descale(descale, xf.shape, block_size)
    safe = torch.where(d > 0, d, torch.ones_like(d))
    xq = torch.where(d > 0, xf / safe, torch.zeros_like(xf)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return xq.to(torch.float8_e4m3fn), descale.to(torch.float32)


def dequantize_fp8(x_fp8: torch.Tensor, descale: torch.Tensor, *, block_size: int = 128,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize_fp8 (without undoing a Hadamard rotation): x_fp8 (batch, seqlen, nheads, headdim)
    float8_e4m3fn and its descale ((), (batch, nheads) or (batch, nheads, blocks)) -> ``dtype``."""
    checks.check_tensor("x_fp8", x_fp8, (4,), (torch.float8_e4m3fn,))
    checks.check_tensor("descale", descale, (0, 2, 3), (torch.float32,))
    return (x_fp8.float() * _expand_descale(descale, x_fp8.shape, block_size)).to(dtype)
