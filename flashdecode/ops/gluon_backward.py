"""The Gluon attention backward (flashdecode.kernels.gluon.attn_bwd) on Hopper: which dense calls it takes, and
its launch (a preprocess of the padded lse / delta rows, then the warp-specialised dK / dV / dQ kernel). The launch
config is heuristics.resolve_gluon_bwd_config's GluonBwdConfig. The ragged (varlen) form - the same kernel's
partitions over a batch packed along the tokens, each CTA reading its sequence from cu_seqlens on the device, with
sliding windows and softcap besides - is gluon_varlen_backward, taken by flash_attn_varlen's backward while
heuristics.PREFILL_RAGGED_GLUON_BWD is on.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from flashdecode import heuristics
from flashdecode.config import GluonBwdConfig
from flashdecode.heuristics import resolve_gluon_bwd_config
from flashdecode.ops.checks import interpreting
from flashdecode.ops.gluon_attention import supported_problem
from flashdecode.ops.gluon_plan import rows_view
from flashdecode.ops.launch_cache import LaunchSite, ensure_triton_allocator, tensor_key
from flashdecode.ops.score_transform import log2_scale_of, tanh_log2_scales_of
from flashdecode.ops.util import aligned16, cdiv, is_hopper, rows_layout_ok

__all__ = ["gluon_bwd_supported", "gluon_attention_backward", "gluon_backward_if_supported",
           "gluon_varlen_bwd_supported", "gluon_varlen_backward", "varlen_acc_row", "varlen_rows_pad"]


def gluon_bwd_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                        window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                        scale: float = 1.0) -> bool:
    """Whether gluon_attention_backward computes this dense call: the forward's conditions (gluon_supported: sm_90,
    fp16/bf16, head dim 64/128, TMA-viewable layouts at 16-byte aligned addresses), no window (causal allowed), no
    softcap, a positive softmax scale (the kernel divides lse by it), and dout in q's shape, dtype and a
    TMA-viewable layout, not in the CPU interpreter."""
    if not _options_supported(window_left, window_right, softcap, scale):
        return False
    return _dout_supported(q, dout) and supported_problem(q, k, v) and aligned16(q, k, v)


def _options_supported(window_left: int, window_right: int, softcap: float, scale: float,
                       ragged: bool = False) -> bool:
    """The score options the Gluon backward has: causal or none, no softcap (ragged launches: any sliding window
    and a positive softcap too), a positive scale (the kernel divides lse by it), off the CPU interpreter."""
    if not ragged and not (window_left == -1 and window_right in (-1, 0) and softcap == 0.0):
        return False
    return softcap >= 0.0 and scale > 0.0 and not interpreting()


def _dout_supported(q: torch.Tensor, dout) -> bool:
    """dout in q's shape, dtype and device, TMA-viewable (util.rows_layout_ok, 3-D: as one sequence) at a 16-byte
    aligned address."""
    if not isinstance(dout, torch.Tensor) or dout.shape != q.shape or dout.dtype != q.dtype:
        return False
    rows = dout if dout.dim() == 4 else dout[None]
    return dout.device == q.device and rows_layout_ok(rows) and dout.data_ptr() % 16 == 0


def gluon_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool = False,
                             deterministic: bool = True,
                             config: Optional[GluonBwdConfig] = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of exact attention on the Gluon backward kernel, for a call gluon_bwd_supported accepts.

    q, dout, out: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), fp16/bf16 on an
    sm_90 GPU; lse: (batch, nheads, seqlen_q) float32, natural log (the forward's); scale: the softmax scale; causal
    bottom-right aligned. Returns dq, dk, dv contiguous like q, k, v in their dtype. deterministic: the dQ additions
    happen in one fixed order (bitwise reproducible); otherwise in arrival order (fp32 atomics). A NaN or inf in
    one batch element reaches only that element's gradients (cfg.seq_bounded, see GluonBwdConfig)."""
    cfg = config or resolve_gluon_bwd_config(q.shape[-1])
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    num_m = cdiv(seqlen_q, cfg.block_m)
    lse = lse.contiguous()
    # what both launches specialise on (the buffers made here are fresh, hence aligned): their launch-cache key
    key = (tensor_key(q), tensor_key(k), tensor_key(v), tensor_key(dout), tensor_key(out), tensor_key(lse), cfg,
           causal, deterministic)
    prep_site, bwd_site = _launch_sites()
    # Padded row vectors (see attn_bwd_prep_kernel): the backward loads them without masks.
    lse2 = torch.empty((batch, nheads, num_m * cfg.block_m), dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse2)
    prep_site.launch(key, (num_m, nheads, batch),
                     (out, dout, lse, lse2, delta, out.stride(), dout.stride(), seqlen_q),
                     lambda: dict(NUM_HEADS=nheads, HEAD_DIM=headdim, BLOCK_M=cfg.block_m, num_warps=4), q.device)
    dq_acc = torch.zeros((batch, seqlen_q, nheads, headdim), dtype=torch.float32, device=q.device)
    sem = torch.zeros((batch, nheads, num_m, 2) if deterministic else (1, ), dtype=torch.int32, device=q.device)
    dk = torch.empty((batch, seqlen_k, nheads_kv, headdim), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    descs = _descriptors(q, dout, k, v, dq_acc, cfg, _row_tile_descriptor(lse2, cfg.block_m),
                         _row_tile_descriptor(delta, cfg.block_m))
    grid = (cdiv(seqlen_k, cfg.block_n), nheads_kv, batch)
    # a tile past its batch element would read the next one's rows: there the kernel makes descriptors that end at
    # the element (SEQ_BOUNDED); elsewhere it gets no pointers and compiles as without the option
    bounded = cfg.seq_bounded_for(batch, seqlen_q, seqlen_k)
    if bounded:
        ensure_triton_allocator()  # (the kernel makes its per-element descriptors in a global scratch)
    bwd_site.launch(key, grid, (*descs, dk, dv, dq_acc, sem, seqlen_q, seqlen_k, log2_scale_of(scale), scale,
                                *((q, dout, k, v) if bounded else (None, ) * 4)),
                    lambda: dict(SEQ_BOUNDED=bounded, **_constexprs(cfg, nheads, nheads_kv, causal, deterministic),
                                 num_warps=4), q.device)
    return dq_acc.to(q.dtype), dk, dv


@functools.lru_cache(maxsize=None)
def _launch_sites() -> tuple:
    """The launch-cache sites (ops/launch_cache.py) of the dense backward's preprocess and kernel: a call key's
    first launch goes through Triton's JIT, later ones straight to the compiled kernel's launcher (no binder, no
    specialisation hashing). Made on first use (the Gluon import)."""
    from flashdecode.kernels.gluon.attn_bwd import attn_bwd_ws_kernel
    from flashdecode.kernels.gluon.bwd_rows import attn_bwd_prep_kernel

    return LaunchSite(attn_bwd_prep_kernel, "gluon bwd prep"), LaunchSite(attn_bwd_ws_kernel, "gluon bwd")


def _descriptors(q, dout, k, v, dq_acc, cfg: GluonBwdConfig, lse_desc, delta_desc) -> tuple:
    """The kernel's eight descriptors: Q and dO in [block_m, headdim] blocks, the lse2 / delta row tiles given,
    K and V in [block_n, headdim] blocks, K in column halves (the atomic variant's), dq_acc in [block_m, headdim //
    2] blocks (the TMA reduce-adds')."""
    d = q.shape[-1]
    return (_block_descriptor(q, [cfg.block_m, d]), _block_descriptor(dout, [cfg.block_m, d]), lse_desc, delta_desc,
            _block_descriptor(k, [cfg.block_n, d]), _block_descriptor(v, [cfg.block_n, d]),
            _block_descriptor(k, [cfg.block_n, d // 2]), _block_descriptor(dq_acc, [cfg.block_m, d // 2]))


def _constexprs(cfg: GluonBwdConfig, nheads: int, nheads_kv: int, causal: bool, deterministic: bool) -> dict:
    """The kernel's compile-time arguments for a launch of cfg."""
    return dict(NUM_HEADS=nheads, GROUP=nheads // nheads_kv, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
                CAUSAL=causal, DETERMINISTIC=deterministic, DQ_TMA=cfg.dq_tma, CONSUMER_REGS=cfg.consumer_regs,
                PRODUCER_REGS=cfg.producer_regs, TAIL_HEAVY_FIRST=cfg.tail_heavy_first_for(causal, deterministic))


def _block_descriptor(x: torch.Tensor, block: list):
    """TensorDescriptor of x's rows view (see rows_view) with TMA block [rows, cols] (the backward also reads K
    in column halves)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shape, strides = rows_view(x)
    return TensorDescriptor(x.as_strided(shape, strides), shape, strides, block,
                            _shared_layout(block[0], block[1], x.dtype))


@functools.lru_cache(maxsize=None)
def _shared_layout(rows: int, cols: int, dtype: torch.dtype):
    """The default NVMMA shared layout of a [rows, cols] TMA block of dtype (fp16 / bf16 / fp32): made once per
    block, not per descriptor (Gluon's get_default_for costs microseconds a call)."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl_dtype)


def _row_tile_descriptor(rows: torch.Tensor, block_m: int):
    """TensorDescriptor of a padded (batch, nheads, num_m * block_m) float32 row vector read as (batch * nheads *
    num_m, block_m) tiles of one row, unswizzled: the backward's producer loads each step's lse2 / delta with
    its Q / dO."""
    shape = [rows.numel() // block_m, block_m]
    return _row_vector_descriptor(rows.view(shape), block_m)


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


# ----------------------------------------------------------------------------------------------------------------
# Ragged (varlen) batches: flash_attn_varlen's backward on the same partitions (attn_bwd_ws_varlen_kernel)
# ----------------------------------------------------------------------------------------------------------------


def varlen_acc_row(q_row: int, seq: int, block_m: int) -> int:
    """Sequence seq's first row in the ragged backward's dQ accumulator and lse2 / delta row vectors, its first
    packed row being q_row: q_row + seq * (block_m + 3) rounded up to 4. At least block_m slack rows follow each
    sequence (a query block's tile past its sequence reads and adds there, not on the next sequence's rows), and
    every row tile starts 16-byte aligned (the innermost coordinate of the kernel's TMA loads of the row vectors:
    an unaligned one faults, "illegal instruction"). The kernels compute the same on the device
    (kernels/gluon/bwd_channels.py seq_rows, kernels/gluon/bwd_rows.py _ragged_rows)."""
    return cdiv(q_row + seq * (block_m + 3), 4) * 4


def varlen_rows_pad(total_q: int, batch: int, block_m: int) -> int:
    """Rows of the ragged backward's dQ accumulator and lse2 / delta row vectors: past the last sequence's query
    blocks (varlen_acc_row of a sequence after it), a multiple of 4 (a row vector's 16-byte TMA row stride)."""
    return varlen_acc_row(total_q, batch, block_m)


def gluon_varlen_bwd_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, window_left: int = -1,
                               window_right: int = -1, softcap: float = 0.0, scale: float = 1.0) -> bool:
    """Whether gluon_varlen_backward computes this ragged call: gluon_bwd_supported's conditions on the packed
    tensors (q / dout (total_q, nheads, headdim), k / v (total_k, nheads_kv, headdim), each read as one sequence)
    and int32 cu_seqlens_q / cu_seqlens_k of one length >= 2 on q's device; sliding windows and softcap too."""
    if not _options_supported(window_left, window_right, softcap, scale, ragged=True):
        return False
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        return False
    for cu in (cu_seqlens_q, cu_seqlens_k):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
            return False
    if cu_seqlens_q.shape[0] < 2 or cu_seqlens_k.shape != cu_seqlens_q.shape:
        return False
    return (_dout_supported(q, dout) and supported_problem(q[None], k[None], v[None])
            and aligned16(q, k, v))


def gluon_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                          window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                          deterministic: bool = True,
                          config: Optional[GluonBwdConfig] = None) -> Optional[tuple]:
    """flash_attn_varlen's backward on the ragged Gluon kernel where it applies (config given: where it applies;
    config None: only while heuristics.PREFILL_RAGGED_GLUON_BWD is on): (dq, dk, dv); else None having touched
    nothing (take the Triton path). For flashdecode.ops.attention's backward, after its argument checks, with its
    normalised options ((-1, 0) = causal, bottom-right aligned per sequence; other windows (left, right), -1
    unbounded, on the kernel's WINDOW variant; softcap > 0 on its SOFTCAP variant).

    q, dout, out: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim), fp16/bf16 on sm_90, packed
    along the tokens; lse (nheads, total_q) float32, natural log (the forward's); cu_seqlens_q / cu_seqlens_k
    int32 (batch + 1,) on q's device (read there: no host sync); max_seqlen_q / max_seqlen_k >= every sequence's
    query / key count (they size the grid). Returns dq, dk, dv contiguous like q, k, v in their dtype (rows that
    no sequence holds are left unwritten, as the Triton kernels leave them). deterministic: the dQ additions
    happen in one fixed order (bitwise reproducible), as in gluon_attention_backward. A dout that TMA cannot read
    (autograd may hand an expanded one) is made contiguous first."""
    if config is None and not heuristics.PREFILL_RAGGED_GLUON_BWD:
        return None
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not is_hopper(q.device):
        return None
    if max_seqlen_q <= 0 or max_seqlen_k <= 0:
        return None
    if isinstance(dout, torch.Tensor) and dout.dim() == 3 and not _dout_supported(q, dout):
        dout = dout.contiguous()
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    if not gluon_varlen_bwd_supported(q, k, v, dout, cu_seqlens_q, cu_seqlens_k, window_left, window_right,
                                      softcap, scale):
        return None
    return _varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                            (window_left, window_right), softcap, deterministic,
                            config or resolve_gluon_bwd_config(q.shape[-1]))


def _varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, scale, window: tuple,
                     softcap: float, deterministic, cfg: GluonBwdConfig):
    """gluon_varlen_backward's launches: the preprocess into the padded row vectors, the kernel, dQ out of its
    padded accumulator (attn_bwd_varlen_dq_kernel). window: (left, right), (-1, 0) causal; softcap 0.0: off."""
    from flashdecode.kernels.gluon.attn_bwd import attn_bwd_ws_varlen_kernel
    from flashdecode.kernels.gluon.bwd_rows import attn_bwd_varlen_dq_kernel, attn_bwd_varlen_prep_kernel

    total_q, nheads, headdim = q.shape
    nheads_kv = k.shape[1]
    batch = cu_q.shape[0] - 1
    left, right = window
    sliding = not (left == -1 and right in (-1, 0))  # the kernel's WINDOW (causal = its own flag otherwise)
    causal = right == 0 and not sliding
    num_m = cdiv(max_seqlen_q, cfg.block_m)
    rows_pad = varlen_rows_pad(total_q, batch, cfg.block_m)
    lse2 = torch.empty((nheads, rows_pad), dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse2)
    row_grid = (num_m, nheads, batch)
    attn_bwd_varlen_prep_kernel[row_grid](out, dout, lse.contiguous(), lse2, delta, cu_q, out.stride(),
                                          dout.stride(), total_q, rows_pad, HEAD_DIM=headdim, BLOCK_M=cfg.block_m,
                                          num_warps=4)
    dq_acc = torch.zeros((rows_pad, nheads, headdim), dtype=torch.float32, device=q.device)
    sem = torch.zeros((batch, nheads, num_m, 2) if deterministic else (1, ), dtype=torch.int32, device=q.device)
    dk = torch.empty((k.shape[0], nheads_kv, headdim), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    descs = _descriptors(q, dout, k, v, dq_acc, cfg, _row_vector_descriptor(lse2, cfg.block_m),
                         _row_vector_descriptor(delta, cfg.block_m))
    grid = (cdiv(max_seqlen_k, cfg.block_n), nheads_kv, batch)
    with torch.cuda.device(q.device):
        if cfg.seq_bounded:
            ensure_triton_allocator()  # (the kernel makes its per-sequence descriptors in a global scratch)
        attn_bwd_ws_varlen_kernel[grid](*descs, dk, dv, dq_acc, sem, max_seqlen_q, max_seqlen_k, log2_scale_of(scale),
                                        scale, cu_q, cu_k, q, dout, k, v, left, right,
                                        *tanh_log2_scales_of(scale, softcap), SEQ_BOUNDED=cfg.seq_bounded,
                                        WINDOW=sliding, SOFTCAP=softcap > 0.0,
                                        **_constexprs(cfg, nheads, nheads_kv, causal, deterministic), num_warps=4)
    dq = torch.empty((total_q, nheads, headdim), dtype=q.dtype, device=q.device)
    attn_bwd_varlen_dq_kernel[row_grid](dq_acc, dq, cu_q, NUM_HEADS=nheads, HEAD_DIM=headdim, BLOCK_M=cfg.block_m,
                                        num_warps=4)
    return dq, dk, dv


def _row_vector_descriptor(rows: torch.Tensor, block_m: int):
    """TensorDescriptor of a 2-D float32 contiguous tensor read in (1, block_m) tiles, unswizzled: the dense
    backward's (batch * nheads * num_m, block_m) lse2 / delta tiles, or the ragged one's (nheads, rows_pad) row
    vectors, where a tile starts at any row of a head."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(rows, list(rows.shape), [rows.shape[1], 1], [1, block_m], layout)
