"""Launcher of the warp-specialised Gluon attention forward (flashdecode.kernels.gluon.attn_fwd) on Hopper.

``gluon_supported`` says when the kernel applies; callers fall back to the Triton path otherwise. The launch
decisions live in one frozen config resolved from the head dim; ``config=`` overrides it (benchmarks, probes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch

from flashdecode.ops.checks import LOG2E, check_bool, check_tensor, resolve_scale

GLUON_HEAD_DIMS = (64, 128)
GLUON_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class GluonFwdConfig:
    """One launch of attn_fwd_ws_kernel: a tile is num_consumers * 64 query rows; key blocks of block_n rows flow
    through a ring of num_stages shared-memory slots; overlap = FA3's intra-warpgroup QK^T / softmax / PV overlap;
    pingpong = the two consumer warpgroups take turns issuing wgmma; persistent = one CTA per SM looping over tiles
    (else one CTA per tile); consumer_regs / producer_regs = per-thread register budgets of the worker partitions
    (setmaxnreg)."""

    num_consumers: int = 2
    block_n: int = 128
    num_stages: int = 2
    overlap: bool = False
    pingpong: bool = False
    persistent: bool = False
    consumer_regs: int = 240
    producer_regs: int = 24

    @property
    def block_m(self) -> int:
        return 64 * self.num_consumers


def resolve_gluon_config(headdim: int, causal: bool = False, seqlen_k: int = 0) -> GluonFwdConfig:
    """hd128: two stages of 128-key K/V (64 KiB each) beside a 128-row Q tile fill most of the 227 KiB of shared
    memory; hd64 tiles are half the size, so three stages fit with room to spare.

    Persistent CTAs only for short non-causal keys: there each tile is a few blocks, and a CTA that stays resident
    loads the next tile's first K/V blocks under the current tile's last ones and its epilogue (H100, 16 x 1k:
    +10-11% hd128, +6-12% hd64); at 16k keys it measured 1-7% slower at hd128. Causal launches stay one CTA per
    tile: the grid then runs the heaviest tiles first, while a static round robin over a persistent grid gave some
    CTAs far more work than others (16k causal hd128: ~400 vs 580-630 TFLOP/s)."""
    return GluonFwdConfig(num_stages=2 if headdim > 64 else 3, persistent=not causal and 0 < seqlen_k <= 2048)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _rows_view_ok(x: torch.Tensor) -> bool:
    """x (batch, seqlen, heads, headdim) can be read as a 2-D (batch * seqlen, heads * headdim) TMA view: unit dim
    stride, heads packed, batch rows follow seq rows, 16-byte aligned base and row stride."""
    b, s, h, d = x.shape
    st = x.stride()
    return (st[3] == 1 and st[2] == d and (b == 1 or st[0] == s * st[1]) and (st[1] * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0)


def gluon_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0, varlen: bool = False) -> bool:
    """Whether gluon_attention_forward computes this call: Hopper, fp16/bf16, head dim 64 or 128, no window, no
    softcap, fixed-length batches, non-empty sequences, TMA-viewable layouts (see _rows_view_ok)."""
    if varlen or softcap != 0.0 or tuple(window_size) != (-1, -1):
        return False
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return False
    if q.dtype not in GLUON_DTYPES or not (q.dtype == k.dtype == v.dtype) or not _is_hopper(q.device):
        return False
    if q.shape[-1] not in GLUON_HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape != k.shape:
        return False
    if q.shape[0] != k.shape[0] or k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        return False
    if q.shape[1] == 0 or k.shape[1] == 0:
        return False
    return all(_rows_view_ok(t) for t in (q, k, v))


def _descriptor(x: torch.Tensor, block_rows: int):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, s, h, d = x.shape
    rows = x.as_strided((b * s, h * d), (x.stride(1), 1))
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, d], dtype)
    return TensorDescriptor(rows, [b * s, h * d], [x.stride(1), 1], [block_rows, d], layout)


def gluon_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            softmax_scale: Optional[float] = None,
                            config: Optional[GluonFwdConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention forward on the Gluon kernel.

    q: (batch, seqlen_q, nheads, headdim), k/v: (batch, seqlen_k, nheads_kv, headdim), fp16/bf16 on an sm_90 GPU.
    Returns out (batch, seqlen_q, nheads, headdim) in q's dtype and lse (batch, nheads, seqlen_q) float32, natural
    log (-inf on rows that see no key). causal is bottom-right aligned. Raises ValueError where gluon_supported is
    False (callers check it first and take the Triton path)."""
    check_tensor("q", q, (4, ), GLUON_DTYPES)
    check_tensor("k", k, (4, ), GLUON_DTYPES)
    check_tensor("v", v, (4, ), GLUON_DTYPES)
    check_bool("causal", causal)
    if not gluon_supported(q, k, v, causal):
        raise ValueError("q, k, v: this call is outside the Gluon kernel's support (see gluon_supported); "
                         "use flashdecode.ops.attention")
    from flashdecode.kernels.gluon.attn_fwd import attn_fwd_ws_kernel

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    cfg = config or resolve_gluon_config(headdim, causal, seqlen_k)
    scale = resolve_scale(softmax_scale, headdim)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    num_tiles = math.ceil(seqlen_q / cfg.block_m) * batch * nheads
    grid = (min(num_tiles, _num_sms(q.device)) if cfg.persistent else num_tiles, )
    attn_fwd_ws_kernel[grid](
        _descriptor(q, 64), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n), out, lse, num_tiles,
        seqlen_q, seqlen_k, scale * LOG2E, NUM_HEADS=nheads, GROUP=nheads // nheads_kv, BLOCK_N=cfg.block_n,
        NUM_STAGES=cfg.num_stages, NUM_CONSUMERS=cfg.num_consumers, CAUSAL=causal, OVERLAP=cfg.overlap,
        PINGPONG=cfg.pingpong and cfg.num_consumers == 2, CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs, num_warps=4)
    return out, lse
