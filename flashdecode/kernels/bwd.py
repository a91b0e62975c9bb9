"""FlashAttention backward in Triton: FA-2's split into a dK/dV pass and a dQ pass, P recomputed from the saved lse.

With P = exp(S - lse), D_i = rowsum(dO_i * O_i) (computed by the launcher), dP = dO V^T and dS = P * (dP - D):
    dV = P^T dO,   dK = scale * dS^T Q,   dQ = scale * dS K
(soft-capping multiplies dS by 1 - tanh^2). Neither pass uses atomics, so gradients are bitwise deterministic:
  * attn_bwd_dkdv_kernel: one program per (KV block, batch * kv head) holds K, V and loops over the Q blocks of
    every query head of its GQA group (the group sum happens in registers);
  * attn_bwd_dq_kernel: one program per (Q block, batch * head) holds Q, dO and loops over KV blocks;
  * or both in one launch (FUSED_DQ): program j of a kv head runs the dK/dV program of KV block j, then the dQ
    programs of Q block j (attn_bwd_dkdv_program / attn_bwd_dq_program are the two bodies); SPLIT_DKDV gives dV and
    dK their own programs (one fp32 accumulator each: 128-key tiles at head dim 256 without spilling).
The preprocess also writes lse in log2 units (+inf on rows with no key), so the backward loops only load it; inside
the unmasked blocks every row exists and sees a key, so lse and D load without masks.
Opt-in non-deterministic mode (ATOMIC_DQ, FA2/FA3's choice): the dK/dV program also computes dQ += dS K for every
Q block it visits and adds it into an fp32 buffer with atomics, so the dQ pass (and its recomputation of Q K^T and
dO V^T: 3 of the 7 matmuls) disappears; the order of the fp32 additions varies run to run.
Both loops skip blocks outside the causal/window band and mask only the edge blocks (segments as in fwd.py).
USE_TMA (Hopper): the streamed and held tiles move through device-side tensor descriptors bounded by the sequence
(zero-filled outside, so no row masks on loads), and ATOMIC_DQ adds each dQ tile with one bulk TMA reduction
(cp.reduce.async.bulk) instead of per-element atomics. The interpreter has no descriptor reduction: the launcher
uses pointer atomics there.
Rows with lse = -inf (no visible key) get P = 0, hence zero gradients.
HAS_ALIBI: P is recomputed with the forward's ALiBi bias (a constant: the gradient formulas are unchanged; the
softcap's chain rule still reads the capped logits without the bias).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashdecode.kernels.dot import dot
from flashdecode.kernels.fwd import (clamp_segments, head_base, kv_segments, load_rows, lse_row_base, sequence_bounds,
                                     sequence_descriptor)
from flashdecode.kernels.score import alibi_bias_log2, alibi_slope_log2, logits_log2, softcap_grad, visible


@triton.jit
def load_lse_log2(lse_ptrs, rows, nrows, CHECK_ROWS: tl.constexpr):
    """lse in log2 units from attn_bwd_delta_kernel's Lse2 (+inf on rows with no key, so that P = exp2(S - lse) is
    exactly 0 there); rows out of range read +inf too. CHECK_ROWS=False: every row is in range (no mask)."""
    if CHECK_ROWS:
        return tl.load(lse_ptrs, mask=rows < nrows, other=float("inf"))
    else:
        return tl.load(lse_ptrs)


@triton.jit
def q_segments(n_start, seqlen_q, seqlen_k, window_left, window_right,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Q loop bounds for the KV block starting at key n_start: (lo, full_lo, full_hi, hi), multiples of BLOCK_M
    except hi. [lo, full_lo): the causal / right-window edge (masked); [full_lo, full_hi): Q blocks whose rows all
    see every key of the block (unmasked); [full_hi, hi): left-window edge and the ragged Q tail (masked)."""
    diag = seqlen_k - seqlen_q
    lo = 0
    full_lo = 0
    hi = seqlen_q
    full_hi = (seqlen_q // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:  # row i sees key j iff j <= i + diag + right
        lo = (tl.maximum(n_start - diag - window_right, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(n_start + BLOCK_N - 1 - diag - window_right, 0), BLOCK_M) * BLOCK_M
    if HAS_LEFT:  # row i sees key j iff j >= i + diag - left
        hi = tl.maximum(tl.minimum(n_start + BLOCK_N - diag + window_left, seqlen_q), 0)
        full_hi = tl.minimum((tl.maximum(n_start - diag + window_left + 1, 0) // BLOCK_M) * BLOCK_M, full_hi)
    # a ragged last KV block needs the key-bounds mask everywhere
    full_hi = tl.where(n_start + BLOCK_N <= seqlen_k, full_hi, 0)
    return clamp_segments(lo, full_lo, full_hi, hi)


# ----------------------------------------------------------------------------------------------------------------
# Preprocess: D = rowsum(dO * O)
# ----------------------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["seqlen_q", "total_q"])
def attn_bwd_delta_kernel(
    Out, DO, Delta, cu_seqlens_q, Lse, Lse2,
    o_strides, do_strides, delta_strides, lse_strides,
    seqlen_q, total_q,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Grid (cdiv(max_seqlen_q, BLOCK_M), nheads, batch). Out, DO like Q; Delta fp32 laid out like lse:
    D_i = sum_d dO_id * O_id in fp32, without materialising fp32 copies of O and dO. Also Lse2 = lse * log2(e),
    +inf where lse = -inf (Lse, Lse2 fp32 with lse_strides), which the backward kernels load unconverted.
    *_strides as attn_fwd_kernel's."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q = sequence_bounds(batch, cu_seqlens_q, seqlen_q, total_q, IS_VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if pid_m * BLOCK_M >= seqlen_q:
        return
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    o = load_rows(head_base(Out, o_strides, batch, q_start, head) + offs_m[:, None] * o_strides[1]
                  + offs_d[None, :] * o_strides[3], offs_m, seqlen_q, d_mask, True, HEAD_DIM == HEAD_DIM_PAD)
    do = load_rows(head_base(DO, do_strides, batch, q_start, head) + offs_m[:, None] * do_strides[1]
                   + offs_d[None, :] * do_strides[3], offs_m, seqlen_q, d_mask, True, HEAD_DIM == HEAD_DIM_PAD)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(lse_row_base(Delta, delta_strides, batch, head, q_start) + offs_m, delta, mask=offs_m < seqlen_q)
    lse = tl.load(lse_row_base(Lse, lse_strides, batch, head, q_start) + offs_m, mask=offs_m < seqlen_q,
                  other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(lse_row_base(Lse2, lse_strides, batch, head, q_start) + offs_m, lse2, mask=offs_m < seqlen_q)


# ----------------------------------------------------------------------------------------------------------------
# dK / dV
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, q_desc, do_desc, dq_desc,
                        q_strides, do_strides, dq_strides, start, end, k_pos, offs_m, offs_d, d_mask, seqlen_q,
                        seqlen_k, diag, window_left, window_right, scales, alibi_slope,
                        MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                        SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr, PART: tl.constexpr,
                        HAS_ALIBI: tl.constexpr = False):
    """Accumulate one query head's Q blocks [start, end) into dk, dv (BLOCK_N, HEAD_DIM_PAD) fp32, transposed
    form: S^T = K Q^T (BLOCK_N, BLOCK_M). ATOMIC_DQ: also add dS K (unscaled) of each Q block into the fp32
    buffer at dq_base with atomics. PART: 0 = both, 1 = dV only (2 of the 4 matmuls), 2 = dK only (3 of 4).
    *_strides and scales as attn_bwd_dkdv_kernel's (the sequence and head-dim strides are read here)."""
    stride_qs, stride_qd = q_strides[1], q_strides[3]
    stride_dos, stride_dod = do_strides[1], do_strides[3]
    stride_dqs, stride_dqd = dq_strides[1], dq_strides[3]
    qk_scale, softcap_log2 = scales[0], scales[1]
    q_ptrs = q_base + start.to(tl.int64) * stride_qs + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    do_ptrs = do_base + start.to(tl.int64) * stride_dos + offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod
    dq_ptrs = dq_base + start.to(tl.int64) * stride_dqs + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        if USE_TMA:
            q = q_desc.load([start_m, 0])
        else:
            q = load_rows(q_ptrs, rows, seqlen_q, d_mask, MASKED, EVEN_D)
        lse2 = load_lse_log2(lse_base + rows, rows, seqlen_q, MASKED)  # unmasked: rows < seqlen_q
        s_t = logits_log2(dot(k, tl.trans(q), input_precision=DOT_PRECISION), qk_scale, softcap_log2, SOFTCAP)
        if HAS_ALIBI:
            p_t = tl.exp2(s_t + alibi_bias_log2((rows + diag)[None, :], k_pos[:, None], alibi_slope) - lse2[None, :])
        else:
            p_t = tl.exp2(s_t - lse2[None, :])
        if MASKED:
            vis = visible((rows + diag)[None, :], k_pos[:, None], seqlen_k, window_left, window_right,
                          HAS_LEFT, HAS_RIGHT)
            p_t = tl.where(vis, p_t, 0.0)
        if USE_TMA:
            do = do_desc.load([start_m, 0])
        else:
            do = load_rows(do_ptrs, rows, seqlen_q, d_mask, MASKED, EVEN_D)
        if PART != 2:
            dv = dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        if PART != 1:
            if MASKED:
                delta = tl.load(delta_base + rows, mask=rows < seqlen_q, other=0.0)
            else:
                delta = tl.load(delta_base + rows)
            dp_t = dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = softcap_grad(p_t * (dp_t - delta[None, :]), s_t, softcap_log2, SOFTCAP).to(q.dtype)
            dk = dot(ds_t, q, dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:
            dq = dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION)
            if USE_TMA:  # rows past the sequence and padded columns fall outside the descriptor: dropped
                dq_desc.atomic_add([start_m, 0], dq)
            elif MASKED:
                tl.atomic_add(dq_ptrs, dq, mask=(rows[:, None] < seqlen_q) & d_mask[None, :], sem="relaxed")
            elif EVEN_D:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, mask=d_mask[None, :], sem="relaxed")
            dq_ptrs += BLOCK_M * stride_dqs
        q_ptrs += BLOCK_M * stride_qs
        do_ptrs += BLOCK_M * stride_dos
    return dk, dv


@triton.jit
def attn_bwd_dkdv_program(
    Q, K, V, DO, Lse, Delta, DK, DV, DQ, strides,
    batch, head_kv, group_size, q_start, seqlen_q, k_start, seqlen_k, n_start,
    scales, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr,
    PART: tl.constexpr, AlibiSlopes, alibi_batch_stride, HAS_ALIBI: tl.constexpr,
):
    """dK, dV of the BLOCK_N keys from n_start (< seqlen_k) of one (sequence, kv head): holds K, V and loops over
    the Q blocks of every query head of the GQA group. Arguments as attn_bwd_dkdv_kernel; q_start / k_start: first
    packed row of the sequence (0 when dense). PART 1 / 2: only dV / only dK (one fp32 accumulator)."""
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, dq_strides, lse_strides, delta_strides = \
        strides
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    k_base = head_base(K, k_strides, batch, k_start, head_kv)
    v_base = head_base(V, v_strides, batch, k_start, head_kv)
    if USE_TMA:
        k = sequence_descriptor(k_base, seqlen_k, k_strides[1], HEAD_DIM, BLOCK_N, HEAD_DIM_PAD).load([n_start, 0])
        v = sequence_descriptor(v_base, seqlen_k, v_strides[1], HEAD_DIM, BLOCK_N, HEAD_DIM_PAD).load([n_start, 0])
    else:
        k = load_rows(k_base + offs_n[:, None] * k_strides[1] + offs_d[None, :] * k_strides[3], offs_n, seqlen_k,
                      d_mask, True, EVEN_D)
        v = load_rows(v_base + offs_n[:, None] * v_strides[1] + offs_d[None, :] * v_strides[3], offs_n, seqlen_k,
                      d_mask, True, EVEN_D)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    diag = seqlen_k - seqlen_q
    lo, full_lo, full_hi, hi = q_segments(n_start, seqlen_q, seqlen_k, window_left, window_right,
                                          BLOCK_N, BLOCK_M, HAS_LEFT, HAS_RIGHT)
    for g in range(group_size):  # GQA: sum over the query heads that read this kv head, in registers
        head = head_kv * group_size + g
        q_base = head_base(Q, q_strides, batch, q_start, head)
        do_base = head_base(DO, do_strides, batch, q_start, head)
        lse_base = lse_row_base(Lse, lse_strides, batch, head, q_start)
        delta_base = lse_row_base(Delta, delta_strides, batch, head, q_start)
        dq_base = head_base(DQ, dq_strides, batch, q_start, head)
        alibi_slope = alibi_slope_log2((AlibiSlopes, (alibi_batch_stride, 1)), batch, head, HAS_ALIBI)
        if USE_TMA:
            q_desc = sequence_descriptor(q_base, seqlen_q, q_strides[1], HEAD_DIM, BLOCK_M, HEAD_DIM_PAD)
            do_desc = sequence_descriptor(do_base, seqlen_q, do_strides[1], HEAD_DIM, BLOCK_M, HEAD_DIM_PAD)
            if ATOMIC_DQ:
                dq_desc = sequence_descriptor(dq_base, seqlen_q, dq_strides[1], HEAD_DIM, BLOCK_M, HEAD_DIM_PAD)
            else:
                dq_desc = dq_base
        else:
            q_desc = q_base
            do_desc = do_base
            dq_desc = dq_base
        dk, dv = attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, q_desc, do_desc,
                                     dq_desc, q_strides, do_strides, dq_strides, full_lo, full_hi, offs_n, offs_m,
                                     offs_d, d_mask, seqlen_q, seqlen_k, diag, window_left, window_right, scales,
                                     alibi_slope, False, EVEN_D, HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_M,
                                     ATOMIC_DQ, USE_TMA, PART, HAS_ALIBI)
        if HAS_RIGHT:  # causal diagonal / right window edge, after the unmasked blocks
            dk, dv = attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, q_desc,
                                         do_desc, dq_desc, q_strides, do_strides, dq_strides, lo, full_lo, offs_n,
                                         offs_m, offs_d, d_mask, seqlen_q, seqlen_k, diag, window_left,
                                         window_right, scales, alibi_slope, True, EVEN_D, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                                         DOT_PRECISION, BLOCK_M, ATOMIC_DQ, USE_TMA, PART, HAS_ALIBI)
        dk, dv = attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, q_desc, do_desc,
                                     dq_desc, q_strides, do_strides, dq_strides, full_hi, hi, offs_n, offs_m,
                                     offs_d, d_mask, seqlen_q, seqlen_k, diag, window_left, window_right, scales,
                                     alibi_slope, True, EVEN_D, HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_M,
                                     ATOMIC_DQ, USE_TMA, PART, HAS_ALIBI)

    out_mask = (offs_n[:, None] < seqlen_k) & d_mask[None, :]
    dk_base = head_base(DK, dk_strides, batch, k_start, head_kv)
    dv_base = head_base(DV, dv_strides, batch, k_start, head_kv)
    if PART != 1:
        tl.store(dk_base + offs_n[:, None] * dk_strides[1] + offs_d[None, :] * dk_strides[3],
                 (dk * scales[2]).to(DK.dtype.element_ty), mask=out_mask)
    if PART != 2:
        tl.store(dv_base + offs_n[:, None] * dv_strides[1] + offs_d[None, :] * dv_strides[3],
                 dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k", "window_left", "window_right"])
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, DQ, cu_seqlens, AlibiSlopes, strides,
    group_size, seqlen_q, seqlen_k, total_q, total_k,
    scales, window_left, window_right, alibi_batch_stride,
    bucket_q, bucket_k,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ATOMIC_DQ: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    FUSED_DQ: tl.constexpr = False, BLOCK_M2: tl.constexpr = 64, BLOCK_N2: tl.constexpr = 64,
    SPLIT_DKDV: tl.constexpr = False, HAS_ALIBI: tl.constexpr = False,
):
    """Grid (cdiv(max_seqlen_k, BLOCK_N), nheads_kv, batch). Shapes and strides as attn_fwd_kernel; DO like Q; Lse
    (attn_bwd_delta_kernel's Lse2: log2 units, +inf on rows with no key) and Delta (fp32, D = rowsum(dO * O)) like
    the forward's lse; DK, DV like K, V. ATOMIC_DQ: DQ is a zeroed fp32 buffer like Q that receives sum_j dS_j K_j
    (times sm_scale later) by atomic adds; otherwise DQ is unused.

    FUSED_DQ (the deterministic backward in one launch; DQ like Q, the output): grid (max(cdiv(max_seqlen_k,
    BLOCK_N), cdiv(max_seqlen_q, BLOCK_M2)), nheads_kv, batch); program j first computes dK, dV of KV block j, then
    dQ of Q block j (BLOCK_M2 rows, keys stepped by BLOCK_N2) for each query head of the group. Pairing block j
    with block j balances causal work: KV block j sees the Q blocks from j on, Q block j the KV blocks up to j, so
    with seqlen_q == seqlen_k every program visits about the same number of tiles (in two launches the programs
    run 1 to n tiles, and each launch ends on its own tail). Still no atomics: every element has one writer.

    SPLIT_DKDV (deterministic only; large head dims): two programs per KV block (axis 0 twice as long), one
    accumulating dV (S, dV: 2 matmuls), the other dK (S, dP, dK: 3), so each holds one fp32 accumulator instead of
    two and affords twice the KV rows without spilling (5 matmuls per KV block instead of 4). With FUSED_DQ,
    program p pairs KV block p // 2 with Q block p (BLOCK_M2 = BLOCK_N / 2 keeps causal work balanced).

    cu_seqlens: (cu_seqlens_q, cu_seqlens_k). strides: (q_strides, k_strides, v_strides, do_strides, dk_strides,
    dv_strides, dq_strides, lse_strides, delta_strides), each as attn_fwd_kernel's *_strides. scales: (qk_scale,
    softcap_log2, sm_scale) as score.logits_log2 and the gradients take them. AlibiSlopes, alibi_batch_stride,
    HAS_ALIBI: as attn_fwd_kernel's. (The lengths and window stay separate arguments: Triton specialises the
    elements of a tuple whatever do_not_specialize says.)"""
    cu_seqlens_q, cu_seqlens_k = cu_seqlens
    pid_n = tl.program_id(0)
    head_kv = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q = sequence_bounds(batch, cu_seqlens_q, seqlen_q, total_q, IS_VARLEN)
    k_start, seqlen_k = sequence_bounds(batch, cu_seqlens_k, seqlen_k, total_k, IS_VARLEN)
    if SPLIT_DKDV:
        n_start = (pid_n // 2) * BLOCK_N
        if n_start < seqlen_k:
            # the part (1: dV, 2: dK) is a constexpr, so that each compiles a loop with one accumulator: one call
            # per part, identical but for it
            if pid_n % 2 == 0:
                attn_bwd_dkdv_program(
                    Q, K, V, DO, Lse, Delta, DK, DV, DQ, strides, batch, head_kv, group_size, q_start, seqlen_q,
                    k_start, seqlen_k, n_start, scales, window_left, window_right, HEAD_DIM, HEAD_DIM_PAD,
                    HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_N, BLOCK_M, False, USE_TMA, 1,
                    AlibiSlopes, alibi_batch_stride, HAS_ALIBI)
            else:
                attn_bwd_dkdv_program(
                    Q, K, V, DO, Lse, Delta, DK, DV, DQ, strides, batch, head_kv, group_size, q_start, seqlen_q,
                    k_start, seqlen_k, n_start, scales, window_left, window_right, HEAD_DIM, HEAD_DIM_PAD,
                    HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_N, BLOCK_M, False, USE_TMA, 2,
                    AlibiSlopes, alibi_batch_stride, HAS_ALIBI)
    else:
        n_start = pid_n * BLOCK_N
        if n_start < seqlen_k:
            attn_bwd_dkdv_program(
                Q, K, V, DO, Lse, Delta, DK, DV, DQ, strides, batch, head_kv, group_size, q_start, seqlen_q,
                k_start, seqlen_k, n_start, scales, window_left, window_right, HEAD_DIM, HEAD_DIM_PAD, HAS_LEFT,
                HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_N, BLOCK_M, ATOMIC_DQ, USE_TMA, 0, AlibiSlopes,
                alibi_batch_stride, HAS_ALIBI)
    if FUSED_DQ:
        q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, dq_strides, lse_strides, \
            delta_strides = strides
        m_start = pid_n * BLOCK_M2
        if m_start < seqlen_q:
            for g in range(group_size):
                attn_bwd_dq_program(
                    Q, K, V, DO, Lse, Delta, DQ, q_strides, k_strides, v_strides, do_strides, dq_strides,
                    lse_strides, delta_strides, batch, head_kv * group_size + g, head_kv, q_start, seqlen_q,
                    k_start, seqlen_k, m_start, scales[0], scales[1], scales[2], window_left, window_right,
                    HEAD_DIM, HEAD_DIM_PAD, HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_M2, BLOCK_N2, USE_TMA,
                    AlibiSlopes, alibi_batch_stride, HAS_ALIBI)


# ----------------------------------------------------------------------------------------------------------------
# dQ
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, stride_ks, stride_kd, stride_vs,
                      stride_vd, start, end, q_pos, offs_n, offs_d, d_mask, seqlen_k, window_left, window_right,
                      qk_scale, softcap_log2, alibi_slope,
                      MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                      SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                      USE_TMA: tl.constexpr, HAS_ALIBI: tl.constexpr = False):
    """Accumulate KV blocks [start, end) into dq (BLOCK_M, HEAD_DIM_PAD) fp32 (unscaled: times sm_scale later)."""
    k_ptrs = k_base + start.to(tl.int64) * stride_ks + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_ptrs = v_base + start.to(tl.int64) * stride_vs + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            k = k_desc.load([start_n, 0])
        else:
            k = load_rows(k_ptrs, cols, seqlen_k, d_mask, MASKED, EVEN_D)
        s = logits_log2(dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale, softcap_log2, SOFTCAP)
        if HAS_ALIBI:
            p = tl.exp2(s + alibi_bias_log2(q_pos[:, None], cols[None, :], alibi_slope) - lse2[:, None])
        else:
            p = tl.exp2(s - lse2[:, None])
        if MASKED:
            vis = visible(q_pos[:, None], cols[None, :], seqlen_k, window_left, window_right, HAS_LEFT, HAS_RIGHT)
            p = tl.where(vis, p, 0.0)
        if USE_TMA:
            v = v_desc.load([start_n, 0])
        else:
            v = load_rows(v_ptrs, cols, seqlen_k, d_mask, MASKED, EVEN_D)
        dp = dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = softcap_grad(p * (dp - delta[:, None]), s, softcap_log2, SOFTCAP)
        dq = dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return dq


@triton.jit
def attn_bwd_dq_program(
    Q, K, V, DO, Lse, Delta, DQ,
    q_strides, k_strides, v_strides, do_strides, dq_strides, lse_strides, delta_strides,
    batch, head, head_kv, q_start, seqlen_q, k_start, seqlen_k, m_start,
    qk_scale, softcap_log2, sm_scale, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
    AlibiSlopes, alibi_batch_stride, HAS_ALIBI: tl.constexpr,
):
    """dQ of the BLOCK_M query rows from m_start (< seqlen_q) of one (sequence, query head): holds Q, dO and loops
    over the visible KV blocks of kv head head_kv. Arguments as attn_bwd_dq_kernel."""
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_base = head_base(Q, q_strides, batch, q_start, head)
    do_base = head_base(DO, do_strides, batch, q_start, head)
    k_base = head_base(K, k_strides, batch, k_start, head_kv)
    v_base = head_base(V, v_strides, batch, k_start, head_kv)
    if USE_TMA:
        q = sequence_descriptor(q_base, seqlen_q, q_strides[1], HEAD_DIM, BLOCK_M, HEAD_DIM_PAD).load([m_start, 0])
        do = sequence_descriptor(do_base, seqlen_q, do_strides[1], HEAD_DIM, BLOCK_M, HEAD_DIM_PAD).load([m_start, 0])
        k_desc = sequence_descriptor(k_base, seqlen_k, k_strides[1], HEAD_DIM, BLOCK_N, HEAD_DIM_PAD)
        v_desc = sequence_descriptor(v_base, seqlen_k, v_strides[1], HEAD_DIM, BLOCK_N, HEAD_DIM_PAD)
    else:
        q = load_rows(q_base + offs_m[:, None] * q_strides[1] + offs_d[None, :] * q_strides[3], offs_m, seqlen_q,
                      d_mask, True, EVEN_D)
        do = load_rows(do_base + offs_m[:, None] * do_strides[1] + offs_d[None, :] * do_strides[3], offs_m,
                       seqlen_q, d_mask, True, EVEN_D)
        k_desc = k_base
        v_desc = v_base
    lse2 = load_lse_log2(lse_row_base(Lse, lse_strides, batch, head, q_start) + offs_m, offs_m, seqlen_q, True)
    delta = tl.load(lse_row_base(Delta, delta_strides, batch, head, q_start) + offs_m, mask=offs_m < seqlen_q,
                    other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    alibi_slope = alibi_slope_log2((AlibiSlopes, (alibi_batch_stride, 1)), batch, head, HAS_ALIBI)
    q_pos = offs_m + (seqlen_k - seqlen_q)
    lo, full_lo, full_hi, hi = kv_segments(m_start, seqlen_q, seqlen_k, window_left, window_right,
                                           BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if HAS_LEFT:
        dq = attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, k_strides[1], k_strides[3],
                               v_strides[1], v_strides[3], lo, full_lo, q_pos, offs_n, offs_d, d_mask, seqlen_k,
                               window_left, window_right, qk_scale, softcap_log2, alibi_slope, True, EVEN_D, HAS_LEFT,
                               HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_N, USE_TMA, HAS_ALIBI)
    dq = attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, k_strides[1], k_strides[3],
                           v_strides[1], v_strides[3], full_lo, full_hi, q_pos, offs_n, offs_d, d_mask, seqlen_k,
                           window_left, window_right, qk_scale, softcap_log2, alibi_slope, False, EVEN_D, HAS_LEFT,
                           HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_N, USE_TMA, HAS_ALIBI)
    dq = attn_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, k_strides[1], k_strides[3],
                           v_strides[1], v_strides[3], full_hi, hi, q_pos, offs_n, offs_d, d_mask, seqlen_k,
                           window_left, window_right, qk_scale, softcap_log2, alibi_slope, True, EVEN_D, HAS_LEFT,
                           HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_N, USE_TMA, HAS_ALIBI)
    dq_base = head_base(DQ, dq_strides, batch, q_start, head)
    tl.store(dq_base + offs_m[:, None] * dq_strides[1] + offs_d[None, :] * dq_strides[3],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=(offs_m[:, None] < seqlen_q) & d_mask[None, :])


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k", "window_left", "window_right"])
def attn_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, cu_seqlens_q, cu_seqlens_k, AlibiSlopes,
    q_strides, k_strides, v_strides, do_strides, dq_strides, lse_strides, delta_strides,
    group_size, seqlen_q, seqlen_k, total_q, total_k,
    scales, window_left, window_right, alibi_batch_stride,
    bucket_q, bucket_k,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr = False, HAS_ALIBI: tl.constexpr = False,
):
    """Grid (cdiv(max_seqlen_q, BLOCK_M), nheads, batch). Shapes and scales as attn_bwd_dkdv_kernel; DQ like Q."""
    qk_scale, softcap_log2, sm_scale = scales[0], scales[1], scales[2]
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    q_start, seqlen_q = sequence_bounds(batch, cu_seqlens_q, seqlen_q, total_q, IS_VARLEN)
    k_start, seqlen_k = sequence_bounds(batch, cu_seqlens_k, seqlen_k, total_k, IS_VARLEN)
    if HAS_RIGHT:  # causal-like: the last Q blocks have the most keys; start them first (load balance)
        pid_m = tl.num_programs(0) - 1 - pid_m
    m_start = pid_m * BLOCK_M
    if m_start < seqlen_q:
        attn_bwd_dq_program(
            Q, K, V, DO, Lse, Delta, DQ, q_strides, k_strides, v_strides, do_strides, dq_strides, lse_strides,
            delta_strides, batch, head, head // group_size, q_start, seqlen_q, k_start, seqlen_k, m_start,
            qk_scale, softcap_log2, sm_scale, window_left, window_right,
            HEAD_DIM, HEAD_DIM_PAD, HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_M, BLOCK_N, USE_TMA,
            AlibiSlopes, alibi_batch_stride, HAS_ALIBI)
