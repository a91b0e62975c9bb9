"""The Gluon backward's row passes, plain Triton kernels (they run in the interpreter too): the preprocess that
writes D = rowsum(dO * O) and lse2 = lse * log2(e) into the padded row vectors the warp-specialised kernels
(kernels/gluon/attn_bwd.py) load without masks - dense (attn_bwd_prep_kernel) and ragged
(attn_bwd_varlen_prep_kernel) - and the ragged backward's copy of dQ out of its padded accumulator
(attn_bwd_varlen_dq_kernel)."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _delta_lse2(o_ptrs, do_ptrs, lse_ptrs, inside):
    """One block of rows of the preprocess: (D = rowsum(dO * O), lse2 = lse * log2(e) with +inf where lse = -inf -
    and on rows outside the sequence, where D is 0) from O / dO tiles and lse values at these pointers."""
    o = tl.load(o_ptrs, mask=inside[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=inside[:, None], other=0.0).to(tl.float32)
    lse = tl.load(lse_ptrs, mask=inside, other=float("-inf"))
    return tl.sum(o * do, 1), tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit(do_not_specialize=["seqlen_q"])
def attn_bwd_prep_kernel(Out, DO, Lse, Lse2, Delta, o_strides, do_strides, seqlen_q, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """The Gluon backward's preprocess (plain Triton: it runs in the interpreter too). Grid (cdiv(seqlen_q,
    BLOCK_M), NUM_HEADS, batch). Out, DO: (batch, seqlen_q, NUM_HEADS, HEAD_DIM) with (batch, seq, head, dim)
    strides o_strides / do_strides; Lse: (batch, NUM_HEADS, seqlen_q) float32 contiguous, natural log. Writes
    Delta = rowsum(dO * O) and Lse2 = Lse * log2(e) (+inf where Lse = -inf: P = 0 on rows that see no key) into
    (batch, NUM_HEADS, cdiv(seqlen_q, BLOCK_M) * BLOCK_M) float32 contiguous buffers, padding rows included
    (Delta 0, Lse2 +inf), so that attn_bwd_ws_kernel loads them without masks."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    inside = rows < seqlen_q
    o_ptrs = (Out + batch.to(tl.int64) * o_strides[0] + head * o_strides[2] + rows[:, None].to(tl.int64) * o_strides[1]
              + cols[None, :] * o_strides[3])
    do_ptrs = (DO + batch.to(tl.int64) * do_strides[0] + head * do_strides[2]
               + rows[:, None].to(tl.int64) * do_strides[1] + cols[None, :] * do_strides[3])
    bh = batch * NUM_HEADS + head
    delta, lse2 = _delta_lse2(o_ptrs, do_ptrs, Lse + bh.to(tl.int64) * seqlen_q + rows, inside)
    padded = bh.to(tl.int64) * (tl.num_programs(0) * BLOCK_M) + rows
    tl.store(Delta + padded, delta)
    tl.store(Lse2 + padded, lse2)


@triton.jit
def _ragged_rows(cu_q, BLOCK_M: tl.constexpr):
    """This program's query block of its sequence (grid (cdiv(max_seqlen_q, BLOCK_M), nheads, batch)): (rows within
    the sequence, inside = rows < its length, its first packed row, its first padded row - attn_bwd_ws_varlen_kernel's
    acc_row - and whether the block holds any row of the sequence)."""
    batch = tl.program_id(2)
    q_row = tl.load(cu_q + batch)
    len_q = tl.load(cu_q + batch + 1) - q_row
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc_row = (q_row + batch * (BLOCK_M + 3) + 3) // 4 * 4  # (gluon_backward.varlen_acc_row's formula)
    return rows, rows < len_q, q_row, acc_row, tl.program_id(0) * BLOCK_M < len_q


@triton.jit
def attn_bwd_varlen_prep_kernel(Out, DO, Lse, Lse2, Delta, cu_q, o_strides, do_strides, total_q, rows_pad,
                                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """attn_bwd_prep_kernel for a ragged batch (attn_bwd_ws_varlen_kernel's row vectors). Grid (cdiv(max_seqlen_q,
    BLOCK_M), nheads, batch); cu_q int32 (batch + 1,). Out, DO: (total_q, nheads, HEAD_DIM) with (row, head, dim)
    strides o_strides / do_strides; Lse: (nheads, total_q) float32 contiguous, natural log. Writes D and lse2 of
    sequence b's row r at column acc_row + r (see _ragged_rows) of (nheads, rows_pad) float32 contiguous Delta / Lse2,
    every row of the sequence's query blocks (those past its length: D 0, lse2 +inf)."""
    head = tl.program_id(1)
    rows, inside, q_row, acc_row, any_row = _ragged_rows(cu_q, BLOCK_M)
    if any_row:
        cols = tl.arange(0, HEAD_DIM)
        packed = (q_row + rows).to(tl.int64)
        o_ptrs = Out + packed[:, None] * o_strides[0] + head * o_strides[1] + cols[None, :] * o_strides[2]
        do_ptrs = DO + packed[:, None] * do_strides[0] + head * do_strides[1] + cols[None, :] * do_strides[2]
        delta, lse2 = _delta_lse2(o_ptrs, do_ptrs, Lse + head.to(tl.int64) * total_q + packed, inside)
        padded = head.to(tl.int64) * rows_pad + acc_row + rows
        tl.store(Delta + padded, delta)
        tl.store(Lse2 + padded, lse2)


@triton.jit
def attn_bwd_varlen_dq_kernel(DqAcc, Dq, cu_q, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                              BLOCK_M: tl.constexpr):
    """dQ of a ragged batch out of attn_bwd_ws_varlen_kernel's padded accumulator: Dq[cu_q[b] + r] =
    DqAcc[acc_row + r] (see _ragged_rows) in Dq's dtype. Grid (cdiv(max_seqlen_q, BLOCK_M), NUM_HEADS, batch); DqAcc
    (rows_pad, NUM_HEADS, HEAD_DIM) float32 and Dq (total_q, NUM_HEADS, HEAD_DIM), both contiguous."""
    head = tl.program_id(1)
    rows, inside, q_row, acc_row, any_row = _ragged_rows(cu_q, BLOCK_M)
    if any_row:
        cols = tl.arange(0, HEAD_DIM)[None, :]
        src = ((acc_row + rows).to(tl.int64) * NUM_HEADS + head) * HEAD_DIM
        dst = ((q_row + rows).to(tl.int64) * NUM_HEADS + head) * HEAD_DIM
        dq = tl.load(DqAcc + src[:, None] + cols, mask=inside[:, None])
        tl.store(Dq + dst[:, None] + cols, dq.to(Dq.dtype.element_ty), mask=inside[:, None])
