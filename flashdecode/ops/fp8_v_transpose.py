"""V^T for the FP8 (float8_e4m3fn) forwards: the 8-bit wgmma takes P V's B operand K-major (keys contiguous), so
both FP8 kernels read a transposed copy of V made by kernels/fp8_transpose.py (its cost: one read and one write of
v, 1/headdim of the attention's work per key; benchmarks/probes/gluon_fwd.py --fp8 times it)."""

from __future__ import annotations

import torch
import triton

from flashdecode.heuristics import cdiv

KEY_ORDERS = ("natural", "wgmma")  # wgmma: the Gluon e4m3 kernel's key order within each 32 (its _p_operand)
_BLOCK_KEYS = 64  # keys per program (a 64 x headdim byte tile)


def fp8_v_transposed(v: torch.Tensor, varlen: bool = False, key_order: str = "natural"):
    """A copy of v with the key dimension contiguous, padded with zeros to a multiple of 16 keys ("natural": the
    Triton FP8 kernel) or 32 ("wgmma": keys renumbered within each 32 as the Gluon e4m3 kernel's P columns are).

    v: dense (batch, keys, nheads_kv, headdim) or varlen (total_keys, nheads_kv, headdim), float8_e4m3fn, any
    strides. Returns (physical tensor: dense (batch, nheads_kv, headdim, keys_pad), varlen (nheads_kv, headdim,
    keys_pad), contiguous; its (batch, seq, head, dim) strides for the Triton kernel)."""
    if key_order not in KEY_ORDERS:
        raise ValueError(f"key_order must be one of {KEY_ORDERS}, got {key_order!r}")
    keys = v.shape[-3]
    align = 32 if key_order == "wgmma" else 16
    pad = cdiv(keys, align) * align
    if varlen:
        phys = torch.empty((v.shape[1], v.shape[2], pad), dtype=v.dtype, device=v.device)
        _launch(v[None], phys[None], keys, pad, key_order)
        return phys, (0, 1, phys.stride(0), phys.stride(1))
    phys = torch.empty((v.shape[0], v.shape[2], v.shape[3], pad), dtype=v.dtype, device=v.device)
    _launch(v, phys, keys, pad, key_order)
    return phys, (phys.stride(0), 1, phys.stride(1), phys.stride(2))


def _launch(v: torch.Tensor, phys: torch.Tensor, keys: int, pad: int, key_order: str) -> None:
    """phys (batch, nheads_kv, headdim, pad) = v (batch, keys, nheads_kv, headdim) transposed, zeros past keys."""
    from flashdecode.kernels.fp8_transpose import v_transpose_kernel

    if phys.numel() == 0:
        return
    d = v.shape[3]
    src, dst = v.view(torch.uint8), phys.view(torch.uint8)  # a byte move: no float8 arithmetic anywhere
    grid = (cdiv(pad, _BLOCK_KEYS), v.shape[2], v.shape[0])
    v_transpose_kernel[grid](src, dst, keys, pad, *src.stride(), *dst.stride()[:3], HEAD_DIM=d,
                             HEAD_DIM_P2=triton.next_power_of_2(d), BLOCK_S=_BLOCK_KEYS,
                             WGMMA_ORDER=key_order == "wgmma")
