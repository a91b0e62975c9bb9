"""FP8 attention's V transpose: V (keys, dim) rows -> V^T (dim, keys) rows, keys padded with zeros.

The 8-bit wgmma reads its B operand K-major only; in O += P V the reduction (K) dimension is the key, so the FP8
forwards (the Triton kernel and the Gluon one) read V^T, with one row per (sequence, kv head, dim) and the keys
contiguous. This pass moves bytes only (the caller passes uint8 views of the e4m3 tensors): each program loads a
(BLOCK_S keys, HEAD_DIM) tile with the head dim contiguous (coalesced) and stores its transpose with the keys
contiguous (coalesced; Triton transposes the tile through shared memory). A strided torch copy instead reads one
byte per 32-byte sector along the key. Columns past the keys are written as zeros, so no padding byte is ever an
e4m3 NaN.

WGMMA_ORDER renumbers the keys within each 32 the way the Gluon e4m3 kernel renumbers P's columns (see p_operand
in kernels/gluon/fwd_softmax.py): column 32 ch + 16 jh + 4 c + 2 jl + e holds key 32 ch + 16 jh + 8 jl + 2 c + e.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _source_keys(cols, WGMMA_ORDER: tl.constexpr):
    """The key each V^T column holds: itself, or (WGMMA_ORDER) its key under the e4m3 kernel's renumbering."""
    if WGMMA_ORDER:
        c = (cols >> 2) & 3
        jl = (cols >> 1) & 1
        return (cols & ~15) | (jl << 3) | (c << 1) | (cols & 1)
    return cols


@triton.jit
def v_transpose_kernel(V, VT, seqlen, keys_pad, stride_vb, stride_vs, stride_vh, stride_vd, stride_tb, stride_th,
                       stride_td, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_S: tl.constexpr,
                       WGMMA_ORDER: tl.constexpr):
    """Grid (cdiv(keys_pad, BLOCK_S), nheads_kv, batch); BLOCK_S a multiple of 32.

    V: (batch, seqlen, nheads_kv, HEAD_DIM) uint8, any strides (stride_v*); VT: (batch, nheads_kv, HEAD_DIM,
    keys_pad) uint8 with a unit column stride (stride_t* for batch, head, dim). HEAD_DIM_P2 = HEAD_DIM rounded up
    to a power of two (the tile's width; columns past HEAD_DIM are masked)."""
    pid_s = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    cols = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    keys = _source_keys(cols, WGMMA_ORDER)  # a permutation of the block's own columns
    dims = tl.arange(0, HEAD_DIM_P2)
    src = (V + batch * stride_vb + head * stride_vh + keys[:, None].to(tl.int64) * stride_vs
           + dims[None, :] * stride_vd)
    tile = tl.load(src, mask=(keys[:, None] < seqlen) & (dims[None, :] < HEAD_DIM), other=0)
    dst = VT + batch * stride_tb + head * stride_th + dims[:, None] * stride_td + cols[None, :]
    tl.store(dst, tl.trans(tile), mask=(dims[:, None] < HEAD_DIM) & (cols[None, :] < keys_pad))
