"""The Gluon attention backward (flashdecode.kernels.gluon.attn_bwd) on Hopper: which dense calls it takes, and
its launch (a preprocess of the padded lse / delta rows, then the warp-specialised dK / dV / dQ kernel). The launch
config is heuristics.resolve_gluon_bwd_config's GluonBwdConfig.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdecode.config import GluonBwdConfig
from flashdecode.heuristics import resolve_gluon_bwd_config
from flashdecode.ops.checks import LOG2E, interpreting
from flashdecode.ops.gluon_attention import supported_problem
from flashdecode.ops.gluon_plan import rows_view
from flashdecode.ops.util import aligned16, cdiv, is_hopper, rows_layout_ok

__all__ = ["gluon_bwd_supported", "gluon_attention_backward", "gluon_backward_if_supported"]


def gluon_bwd_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                        window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                        scale: float = 1.0) -> bool:
    """Whether gluon_attention_backward computes this dense call: the forward's conditions (gluon_supported: sm_90,
    fp16/bf16, head dim 64/128, TMA-viewable layouts at 16-byte aligned addresses), no window (causal allowed), no
    softcap, a positive softmax scale (the kernel divides lse by it), and dout in q's shape, dtype and a
    TMA-viewable layout, not in the CPU interpreter."""
    if softcap != 0.0 or window_left != -1 or window_right not in (-1, 0) or not scale > 0.0 or interpreting():
        return False
    if not isinstance(dout, torch.Tensor) or dout.shape != q.shape or dout.dtype != q.dtype:
        return False
    if dout.device != q.device or not rows_layout_ok(dout) or dout.data_ptr() % 16 != 0:
        return False
    return supported_problem(q, k, v) and aligned16(q, k, v)


def gluon_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool = False,
                             deterministic: bool = True,
                             config: Optional[GluonBwdConfig] = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of exact attention on the Gluon backward kernel, for a call gluon_bwd_supported accepts.

    q, dout, out: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), fp16/bf16 on an
    sm_90 GPU; lse: (batch, nheads, seqlen_q) float32, natural log (the forward's); scale: the softmax scale; causal
    bottom-right aligned. Returns dq, dk, dv contiguous like q, k, v in their dtype. deterministic: the dQ additions
    happen in one fixed order (bitwise reproducible); otherwise in arrival order (fp32 atomics)."""
    from flashdecode.kernels.gluon.attn_bwd import attn_bwd_prep_kernel, attn_bwd_ws_kernel

    cfg = config or resolve_gluon_bwd_config(q.shape[-1])
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    num_m = cdiv(seqlen_q, cfg.block_m)
    # Padded row vectors (see attn_bwd_prep_kernel): the backward loads them without masks.
    lse2 = torch.empty((batch, nheads, num_m * cfg.block_m), dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse2)
    attn_bwd_prep_kernel[(num_m, nheads, batch)](out, dout, lse.contiguous(), lse2, delta, out.stride(),
                                                 dout.stride(), seqlen_q, NUM_HEADS=nheads, HEAD_DIM=headdim,
                                                 BLOCK_M=cfg.block_m, num_warps=4)
    dq_acc = torch.zeros((batch, seqlen_q, nheads, headdim), dtype=torch.float32, device=q.device)
    sem = torch.zeros((batch, nheads, num_m, 2) if deterministic else (1, ), dtype=torch.int32, device=q.device)
    dk = torch.empty((batch, seqlen_k, nheads_kv, headdim), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    d = headdim
    descs = (_block_descriptor(q, [cfg.block_m, d]), _block_descriptor(dout, [cfg.block_m, d]),
             _row_tile_descriptor(lse2, cfg.block_m), _row_tile_descriptor(delta, cfg.block_m),
             _block_descriptor(k, [cfg.block_n, d]), _block_descriptor(v, [cfg.block_n, d]),
             _block_descriptor(k, [cfg.block_n, d // 2]),
             _block_descriptor(dq_acc, [cfg.block_m, d // 2]))
    grid = (cdiv(seqlen_k, cfg.block_n), nheads_kv, batch)
    with torch.cuda.device(q.device):
        attn_bwd_ws_kernel[grid](*descs, dk, dv, dq_acc, sem, seqlen_q, seqlen_k, scale * LOG2E,
                                 scale, NUM_HEADS=nheads, GROUP=nheads // nheads_kv, BLOCK_N=cfg.block_n,
                                 NUM_STAGES=cfg.num_stages, CAUSAL=causal, DETERMINISTIC=deterministic,
                                 DQ_TMA=cfg.dq_tma, CONSUMER_REGS=cfg.consumer_regs,
                                 PRODUCER_REGS=cfg.producer_regs,
                                 TAIL_HEAVY_FIRST=cfg.tail_heavy_first_for(causal, deterministic),
                                 num_warps=4)
    return dq_acc.to(q.dtype), dk, dv


def _block_descriptor(x: torch.Tensor, block: list):
    """TensorDescriptor of x's rows view (see rows_view) with TMA block [rows, cols] (the backward also reads K
    in column halves)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shape, strides = rows_view(x)
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[x.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(x.as_strided(shape, strides), shape, strides, block, layout)


def _row_tile_descriptor(rows: torch.Tensor, block_m: int):
    """TensorDescriptor of a padded (batch, nheads, num_m * block_m) float32 row vector read as (batch * nheads *
    num_m, block_m) tiles of one row, unswizzled: the backward's producer loads each step's lse2 / delta with
    its Q / dO."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shape = [rows.numel() // block_m, block_m]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(rows.view(shape), shape, [block_m, 1], [1, block_m], layout)


def gluon_backward_if_supported(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, scale: float, window_left: int = -1,
                                window_right: int = -1, softcap: float = 0.0,
                                deterministic: bool = True) -> Optional[tuple]:
    """The backward on the Gluon kernel where it applies, else None (take the Triton path). For
    flashdecode.ops.attention's dense backward, with its normalised options (window_right 0 = causal), on calls
    without an explicit config= (as the forward's dispatch: a config keeps the Triton kernels). Shapes as
    gluon_attention_backward's; a dout that TMA cannot read (autograd may hand an expanded or strided one) is
    made contiguous first.

    Measured (H100, bf16, hd128, 16k tokens, benchmarks/probes/gluon_bwd.py): the backward alone 528 / 499
    TFLOP/s non-causal / causal against the Triton backward's 427 / 416 and cuDNN's 517 / 518."""
    if interpreting() or not isinstance(q, torch.Tensor) or not is_hopper(q.device):
        return None
    if isinstance(dout, torch.Tensor) and dout.dim() == 4 and not (rows_layout_ok(dout)
                                                                   and dout.data_ptr() % 16 == 0):
        dout = dout.contiguous()
    if not gluon_bwd_supported(q, k, v, dout, window_left, window_right, softcap, scale):
        return None
    return gluon_attention_backward(dout, q, k, v, out, lse, scale, window_right == 0, deterministic)
