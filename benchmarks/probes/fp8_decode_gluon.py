"""Probe: a hand-laid e4m3 decode stage 1 in Gluon - the 8-bit cache read as 16-bit pairs, no layout change.

The resolved 8-bit KV loop (Triton, kernels/decode.py) spends 982 SASS instructions a 128-key block per thread at b1
16/2 hd128: 449 convert e4m3 to 16 bits (PRMT, SHL, LOP3, and an HMUL2 per two V values), 90 are register moves,
and the converted V tile goes back through shared memory (16 STS.128 + 16 LDSM.T) because ldmatrix's transposing
load exists for 16-bit elements only; its four warps meet at 5 CTA barriers a block (docs/decisions.md, "8-bit
cache tiles"). This probe lays the loop out by hand:

- The K and V tiles (TMA, 128 keys x 128 bytes) are read as int16 pairs of neighbouring head-dim bytes, straight
  into the mma.sync operand layouts: K non-transposed, V transposed (ldmatrix.trans moves 2-byte units, so each
  thread receives two keys x two head dims in one register). One PRMT, one shift and one AND then give two fp16
  registers per 32-bit load: the even head dims' pair and the odd head dims' pair. So QK^T = q_even K_even^T +
  q_odd K_odd^T and O = [P V_even, P V_odd] interleaved: the same MMA count, no tile through shared memory twice.
- Each of the four warps owns 32 keys of every block with its own softmax state and output (3-D mma over the
  warps), so the loop has one CTA barrier a block (the stage's reuse) and the warps meet once per split.
- PV in fp16: the V codes are e4m3_bits' x * 2**-8; P * v_scale is scaled per warp by a power of two kept
  non-increasing over the split (so |P'| < 2**15), which the output's rescale carries - no per-value multiply.

A bare stage 1 (b1, contiguous cache, per-token-head scales, seqlen_q 1, group <= 16, hd128, any context: keys
past the length are masked) to learn whether the loop pays before it is built into the decode path. It checks
against the float64 reference (the FlashAttention rule's yardstick beside it) and times stage 1 against the
resolved flash_decode on the same caches (graphs, and its kernels by CUDA trace): fp8_keys_on_m's harness.
Result (H200, docs/decisions.md "8-bit cache tiles"; --two-d, e4m3_stage1_2d_kernel, is no better): 10x more
accurate than the resolved kernel and level with it (128k 27.5 vs 26.1-26.7 us, 32k 12.0 vs 12.2-12.4); with the
conversion, PV and rescale all removed (--ablate 7) still 23.4 / 10.5 us, above the bare 8-bit read's 17.5 / 6.0:
at b1 the split kernel's shape binds, not the loop.

    PYTHONPATH=. python -m benchmarks.probes.fp8_decode_gluon [--contexts 32768,65536,131072] [--splits 64,128]
    PYTHONPATH=. python -m benchmarks.probes.fp8_decode_gluon --sass   # sm_90 compile on the CPU: loop opcodes
"""

from __future__ import annotations

import argparse
import collections
import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

LOG2E = 1.4426950408889634
BLOCK_N = 128  # keys a stage holds (--block-n)
TWO_D = False  # e4m3_stage1_2d_kernel instead of the 3-D one (--two-d)
WARPS = 4


@gluon.jit
def _e4m3_pairs_to_fp16(x):
    """(even, odd): int16 ``x`` holds two e4m3 codes (low byte: the even head dim) -> two fp16 tensors of x's layout
    holding each code times 2**-8 (kernels/kv_quant.e4m3_bits: sign to bit 15, exponent-mantissa to bits 13..7).
    Per 32-bit register (two int16): a sign-replicating PRMT picks the two low (high) bytes into the low bytes of two
    16-bit lanes, then one shift and one AND."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 e, o; prmt.b32 e, $2, 0, 0xA280; prmt.b32 o, $2, 0, 0xB391; shl.b32 e, e, 7; "
        "shl.b32 o, o, 7; and.b32 $0, e, 0xBF80BF80; and.b32 $1, o, 0xBF80BF80; }",
        "=r,=r,r", [x], dtype=(gl.float16, gl.float16), is_pure=True, pack=2)


@gluon.jit
def _pow2_exponent(x):
    """floor(log2(x)) of positive finite fp32 x, from its exponent bits (a subnormal or 0: -127)."""
    return ((x.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127


@gluon.jit
def _pow2(e):
    """2.0 ** e for int32 e in [-126, 127], as fp32 bits."""
    return ((e + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _softmax_step(s, m_i, AXIS: gl.constexpr):
    """(new row max, alpha = exp2(old - new), p = exp2(s - new)) of one online-softmax step over AXIS of the log2
    scores s; a row with no live key yet keeps max -inf and takes 0 as its shift (no NaN)."""
    m_new = gl.maximum(m_i, gl.max(s, AXIS))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, gl.exp2(m_i - m_use), gl.exp2(s - gl.expand_dims(m_use, AXIS))


@gluon.jit
def _key_scales(ks_ptr, vs_ptr, key, seqlen, stride_sk, kvh):
    """(k scales, v scales) fp32 of the keys ``key`` (any layout) of kv head kvh; 0 past the length."""
    ok = key < seqlen
    return (gl.load(ks_ptr + key * stride_sk + kvh, mask=ok, other=0.0),
            gl.load(vs_ptr + key * stride_sk + kvh, mask=ok, other=0.0))


@gluon.jit
def _load_kv_block(k_desc, v_desc, k_smem, v_smem, ready, j, row0, col0, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr):
    """TMA block j of the split (K and V, [BLOCK_N, D / 2] int16 each) into ring slot j % STAGES."""
    sj = j % STAGES
    mbarrier.expect(ready.index(sj), 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + j * BLOCK_N, col0], ready.index(sj), k_smem.index(sj))
    tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, col0], ready.index(sj), v_smem.index(sj))


@gluon.jit
def _start_kv_ring(k_desc, v_desc, split, kvh, seqlen, head_rows, head_cols, NUM_SPLITS: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The split's blocks and its K / V ring: (first block, block count, TMA row and column of its first key, the K
    and V slots, their barriers), the first STAGES - 1 blocks already on their way."""
    P: gl.constexpr = k_desc.block_type.shape[1]
    n_total = gl.cdiv(seqlen, BLOCK_N)
    per_split = gl.cdiv(n_total, NUM_SPLITS)
    b_lo = split * per_split
    row0 = kvh * head_rows + b_lo * BLOCK_N
    col0 = kvh * head_cols
    n_blk = gl.maximum(gl.minimum(per_split, n_total - b_lo), 0)
    k_smem = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, P], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, P], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
    for st in gl.static_range(STAGES - 1):
        if st < n_blk:
            _load_kv_block(k_desc, v_desc, k_smem, v_smem, ready, st, row0, col0, BLOCK_N, STAGES)
    return b_lo, n_blk, row0, col0, k_smem, v_smem, ready


@gluon.jit
def _enter_block(k_desc, v_desc, k_smem, v_smem, ready, i, n_blk, row0, col0, ks_ptr, vs_ptr, key_next, seqlen,
                 stride_sk, kvh, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Block i of the loop: once every warp has read block i - 1's slot, refill it with block i + STAGES - 1; load
    the next block's scales (keys ``key_next``: a block ahead of their use); wait for block i. Returns (block i's
    slot, the next block's k scales, its v scales)."""
    gl.thread_barrier()
    if i + STAGES - 1 < n_blk:
        _load_kv_block(k_desc, v_desc, k_smem, v_smem, ready, i + STAGES - 1, row0, col0, BLOCK_N, STAGES)
    ks_n, vs_n = _key_scales(ks_ptr, vs_ptr, key_next, seqlen, stride_sk, kvh)
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    return slot, ks_n, vs_n


@gluon.jit
def e4m3_stage1_kernel(q_ptr, k_desc, v_desc, ks_ptr, vs_ptr, o_ptr, lse_ptr, seqlen, score_scale_log2,
                       stride_qh, stride_sk, stride_oh, stride_os, head_rows, head_cols,
                       GROUP: gl.constexpr, D: gl.constexpr, NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, W: gl.constexpr, ABLATE: gl.constexpr = 0):
    """One (split, kv head): the split's keys of a b1 e4m3 cache -> o_ptr[h, split, :] (fp32, normalised) and
    lse_ptr[h, split] (log2 units) for the GROUP query heads of the kv head.

    q_ptr: (nheads, D) bf16; k_desc / v_desc: TMA descriptors over the cache's (seqlen, nheads_kv * D / 2) int16
    rows view (head_rows 0, head_cols D / 2), or over the (nheads_kv * seqlen, D / 2) rows of a head-major copy
    (head_rows seqlen, head_cols 0), [BLOCK_N, D / 2] blocks; ks_ptr / vs_ptr: (seqlen, nheads_kv) fp32
    per-token-head scales.
    ABLATE (timing only, wrong results): bit 1 no e4m3 conversion (the pairs' bits taken as fp16), bit 2 no output
    rescale, bit 4 no PV product (V not read from shared memory), bit 8 no q load (ones), bit 16 no merge of the
    warps (each stores its own state)."""
    split = gl.program_id(0)
    kvh = gl.program_id(1)
    N: gl.constexpr = BLOCK_N // W  # keys a warp owns in each block
    P: gl.constexpr = D // 2        # int16 pairs a key row holds
    M: gl.constexpr = 16            # mma rows (GROUP <= 16 query heads)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    op_a: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    op_b: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    rows_l: gl.constexpr = gl.SliceLayout(2, mma)                     # [W, M]
    keys_l: gl.constexpr = gl.SliceLayout(1, mma)                     # [W, N]
    warp_l: gl.constexpr = gl.SliceLayout(1, rows_l)                  # [W]
    blk: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 4, 8], [W, 1, 1], [2, 1, 0])

    b_lo, n_blk, row0, col0, k_smem, v_smem, ready = _start_kv_ring(
        k_desc, v_desc, split, kvh, seqlen, head_rows, head_cols, NUM_SPLITS, BLOCK_N, STAGES)

    # q: the kv head's GROUP rows (zeros below), scaled by a power of two into fp16's top binade, even / odd dims
    wq = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, blk)))
    mq = gl.arange(0, M, layout=gl.SliceLayout(0, gl.SliceLayout(2, blk)))
    pq = gl.arange(0, P, layout=gl.SliceLayout(0, gl.SliceLayout(1, blk)))
    q_off = (kvh * GROUP + mq[None, :, None]) * stride_qh + 2 * pq[None, None, :] + 0 * wq[:, None, None]
    q_ok = (mq[None, :, None] < GROUP) & (pq[None, None, :] < P) & (wq[:, None, None] < W)
    if ABLATE & 8:
        q_e = gl.full([W, M, P], 1.0, gl.float32, layout=blk)
        q_o = q_e
        amax = 1.0
    else:
        q_e = gl.load(q_ptr + q_off, mask=q_ok, other=0.0).to(gl.float32)
        q_o = gl.load(q_ptr + q_off + 1, mask=q_ok, other=0.0).to(gl.float32)
        amax = gl.maximum(gl.max(gl.max(gl.max(gl.abs(q_e), 2), 1), 0),
                          gl.max(gl.max(gl.max(gl.abs(q_o), 2), 1), 0))
    sh = gl.maximum(_pow2_exponent(amax) - 14, -126)
    down = _pow2(-sh)
    # scores: q_k . k_bits = (q * 2**-sh) . (k * 2**-8)
    s_scale = score_scale_log2 * _pow2(sh) * 256.0
    q_e = gl.convert_layout((q_e * down).to(gl.float16), op_a)
    q_o = gl.convert_layout((q_o * down).to(gl.float16), op_a)

    m_i = gl.full([W, M], float("-inf"), gl.float32, layout=rows_l)
    l_i = gl.zeros([W, M], gl.float32, layout=rows_l)
    f_cur = gl.full([W], 2.0 ** 100, gl.float32, layout=warp_l)  # P * v_scale * f_cur < 2**15 (non-increasing)
    acc_e = gl.zeros([W, M, P], gl.float32, layout=mma)
    acc_o = gl.zeros([W, M, P], gl.float32, layout=mma)

    wk = gl.arange(0, W, layout=gl.SliceLayout(1, keys_l))
    nk = gl.arange(0, N, layout=gl.SliceLayout(0, keys_l))
    key_in_blk = wk[:, None] * N + nk[None, :]
    key0 = b_lo * BLOCK_N + key_in_blk
    ks, vs = _key_scales(ks_ptr, vs_ptr, key0, seqlen, stride_sk, kvh)
    for i in range(n_blk):
        slot, ks_n, vs_n = _enter_block(k_desc, v_desc, k_smem, v_smem, ready, i, n_blk, row0, col0, ks_ptr, vs_ptr,
                                        key0 + (i + 1) * BLOCK_N, seqlen, stride_sk, kvh, BLOCK_N, STAGES)

        k_pairs = k_smem.index(slot).reshape([W, N, P]).permute([0, 2, 1]).load(op_b)
        if ABLATE & 1:
            k_e = k_pairs.to(gl.float16, bitcast=True)
            k_o = k_e
        else:
            k_e, k_o = _e4m3_pairs_to_fp16(k_pairs)
        s = mma_v2(q_e, k_e, gl.zeros([W, M, N], gl.float32, layout=mma))
        s = mma_v2(q_o, k_o, s)
        key = key0 + i * BLOCK_N
        s = gl.where(gl.expand_dims(key < seqlen, 1), s * gl.expand_dims(ks * s_scale, 1), float("-inf"))

        m_new, alpha, p = _softmax_step(s, m_i, 2)
        l_i = l_i * alpha + gl.sum(p, 2)
        m_i = m_new

        vmax = gl.convert_layout(gl.max(gl.abs(vs), 1), warp_l)
        f_blk = _pow2(14 - gl.maximum(_pow2_exponent(vmax), -100))
        f_new = gl.minimum(f_cur, f_blk)
        rescale = alpha * gl.expand_dims(f_new / f_cur, 1)
        f_cur = f_new
        vs_f = vs * gl.expand_dims(gl.convert_layout(f_cur, gl.SliceLayout(1, keys_l)), 1)
        pv = (p * gl.expand_dims(vs_f, 1)).to(gl.float16)
        pv = gl.convert_layout(pv, op_a)
        if ABLATE & 2 == 0:
            acc_e = acc_e * gl.expand_dims(rescale, 2)
            acc_o = acc_o * gl.expand_dims(rescale, 2)
        if ABLATE & 4 == 0:
            v_pairs = v_smem.index(slot).reshape([W, N, P]).load(op_b)
            if ABLATE & 1:
                v_e = v_pairs.to(gl.float16, bitcast=True)
                v_o = v_e
            else:
                v_e, v_o = _e4m3_pairs_to_fp16(v_pairs)
            acc_e = mma_v2(pv, v_e, acc_e)
            acc_o = mma_v2(pv, v_o, acc_o)
        ks = ks_n
        vs = vs_n

    if ABLATE & 16:  # every warp stores its own unmerged state over the same rows (timing only)
        wo = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))
        mo3 = gl.arange(0, M, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))
        po3 = gl.arange(0, P, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
        off3 = (kvh * GROUP + mo3[None, :, None]) * stride_oh + split * stride_os + 2 * po3[None, None, :] \
            + 0 * wo[:, None, None]
        ok3 = (mo3[None, :, None] < GROUP) & (po3[None, None, :] < P) & (wo[:, None, None] < W)
        gl.store(o_ptr + off3, acc_e, mask=ok3)
        gl.store(o_ptr + off3 + 1, acc_o, mask=ok3)
        return
    # the warps' states -> one (row) state; the V codes' 2**-8 and each warp's f_cur come back here
    m_row = gl.max(m_i, 0)
    m_row_use = gl.where(m_row == float("-inf"), 0.0, m_row)
    wscale = gl.exp2(m_i - gl.expand_dims(m_row_use, 0))
    l_row = gl.sum(l_i * wscale, 0)
    oscale = gl.expand_dims(wscale * gl.expand_dims(256.0 / f_cur, 1), 2)
    o_e = gl.sum(acc_e * oscale, 0)
    o_o = gl.sum(acc_o * oscale, 0)
    inv_l = gl.where(l_row > 0, 1.0 / l_row, 0.0)
    out_l: gl.constexpr = gl.SliceLayout(0, mma)
    mo = gl.arange(0, M, layout=gl.SliceLayout(1, out_l))
    po = gl.arange(0, P, layout=gl.SliceLayout(0, out_l))
    o_off = (kvh * GROUP + mo[:, None]) * stride_oh + split * stride_os + 2 * po[None, :]
    o_ok = (mo[:, None] < GROUP) & (po[None, :] < P)
    inv = gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, out_l)), 1)
    gl.store(o_ptr + o_off, o_e * inv, mask=o_ok)
    gl.store(o_ptr + o_off + 1, o_o * inv, mask=o_ok)
    lse = gl.where(l_row > 0, m_row_use + gl.log2(l_row), float("-inf"))
    lse = gl.convert_layout(lse, gl.SliceLayout(1, out_l))
    gl.store(lse_ptr + (kvh * GROUP + mo) * NUM_SPLITS + split, lse, mask=mo < GROUP)


@gluon.jit
def e4m3_stage1_2d_kernel(q_ptr, k_desc, v_desc, ks_ptr, vs_ptr, o_ptr, lse_ptr, seqlen, score_scale_log2,
                          stride_qh, stride_sk, stride_oh, stride_os, head_rows, head_cols,
                          GROUP: gl.constexpr, D: gl.constexpr, NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, W: gl.constexpr):
    """e4m3_stage1_kernel's loop with 2-D tiles: the warps split the keys for QK^T and the head dims for PV (as the
    resolved Triton kernel does), so the row max and P cross the warps each block (Gluon's reductions and layout
    change) but the output needs no merge of the warps at the end. Same arguments and results."""
    split = gl.program_id(0)
    kvh = gl.program_id(1)
    P: gl.constexpr = D // 2
    M: gl.constexpr = 16
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, W], instr_shape=[16, 8])
    op_a: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    op_b: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    keys_l: gl.constexpr = gl.SliceLayout(0, mma)
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, W], [1, 0])

    b_lo, n_blk, row0, col0, k_smem, v_smem, ready = _start_kv_ring(
        k_desc, v_desc, split, kvh, seqlen, head_rows, head_cols, NUM_SPLITS, BLOCK_N, STAGES)

    mq = gl.arange(0, M, layout=gl.SliceLayout(1, blk))
    pq = gl.arange(0, P, layout=gl.SliceLayout(0, blk))
    q_off = (kvh * GROUP + mq[:, None]) * stride_qh + 2 * pq[None, :]
    q_ok = (mq[:, None] < GROUP) & (pq[None, :] < P)
    q_e = gl.load(q_ptr + q_off, mask=q_ok, other=0.0).to(gl.float32)
    q_o = gl.load(q_ptr + q_off + 1, mask=q_ok, other=0.0).to(gl.float32)
    amax = gl.maximum(gl.max(gl.max(gl.abs(q_e), 1), 0), gl.max(gl.max(gl.abs(q_o), 1), 0))
    sh = gl.maximum(_pow2_exponent(amax) - 14, -126)
    s_scale = score_scale_log2 * _pow2(sh) * 256.0
    q_e = gl.convert_layout((q_e * _pow2(-sh)).to(gl.float16), op_a)
    q_o = gl.convert_layout((q_o * _pow2(-sh)).to(gl.float16), op_a)

    m_i = gl.full([M], float("-inf"), gl.float32, layout=rows_l)
    l_t = gl.zeros([M, BLOCK_N], gl.float32, layout=mma)  # row sums kept per key column: no cross-warp sum a block
    acc_e = gl.zeros([M, P], gl.float32, layout=mma)
    acc_o = gl.zeros([M, P], gl.float32, layout=mma)
    key0 = b_lo * BLOCK_N + gl.arange(0, BLOCK_N, layout=keys_l)
    # one power of two for the split's P * v_scale (|P'| < 2**15): the largest v scale of its keys, found up front
    vmax_t = gl.zeros([BLOCK_N], gl.float32, layout=keys_l)
    for i in range(n_blk):
        key_v = key0 + i * BLOCK_N
        vmax_t = gl.maximum(vmax_t, gl.abs(gl.load(vs_ptr + key_v * stride_sk + kvh, mask=key_v < seqlen, other=0.0)))
    f_cur = _pow2(14 - gl.maximum(_pow2_exponent(gl.max(vmax_t, 0)), -100))
    ks, vs = _key_scales(ks_ptr, vs_ptr, key0, seqlen, stride_sk, kvh)
    for i in range(n_blk):
        slot, ks_n, vs_n = _enter_block(k_desc, v_desc, k_smem, v_smem, ready, i, n_blk, row0, col0, ks_ptr, vs_ptr,
                                        key0 + (i + 1) * BLOCK_N, seqlen, stride_sk, kvh, BLOCK_N, STAGES)

        k_e, k_o = _e4m3_pairs_to_fp16(k_smem.index(slot).permute([1, 0]).load(op_b))
        s = mma_v2(q_e, k_e, gl.zeros([M, BLOCK_N], gl.float32, layout=mma))
        s = mma_v2(q_o, k_o, s)
        key = key0 + i * BLOCK_N
        s = gl.where(gl.expand_dims(key < seqlen, 0), s * gl.expand_dims(ks * s_scale, 0), float("-inf"))
        m_new, alpha, p = _softmax_step(s, m_i, 1)
        l_t = l_t * gl.expand_dims(alpha, 1) + p
        m_i = m_new
        rescale = gl.expand_dims(alpha, 1)
        pv = gl.convert_layout((p * gl.expand_dims(vs * f_cur, 0)).to(gl.float16), op_a)
        v_e, v_o = _e4m3_pairs_to_fp16(v_smem.index(slot).load(op_b))
        acc_e = mma_v2(pv, v_e, acc_e * rescale)
        acc_o = mma_v2(pv, v_o, acc_o * rescale)
        ks = ks_n
        vs = vs_n

    l_i = gl.sum(l_t, 1)
    inv = gl.where(l_i > 0, 256.0 / (f_cur * l_i), 0.0)
    mo = gl.arange(0, M, layout=rows_l)
    po = gl.arange(0, P, layout=keys_l)
    o_off = (kvh * GROUP + mo[:, None]) * stride_oh + split * stride_os + 2 * po[None, :]
    o_ok = (mo[:, None] < GROUP) & (po[None, :] < P)
    gl.store(o_ptr + o_off, acc_e * gl.expand_dims(inv, 1), mask=o_ok)
    gl.store(o_ptr + o_off + 1, acc_o * gl.expand_dims(inv, 1), mask=o_ok)
    m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
    lse = gl.where(l_i > 0, m_use + gl.log2(l_i), float("-inf"))
    gl.store(lse_ptr + (kvh * GROUP + mo) * NUM_SPLITS + split, lse, mask=mo < GROUP)


def _descriptor(cache: torch.Tensor, head_major: bool = False):
    """TMA descriptor of an e4m3 cache (seqlen, nheads_kv, D) read as (seqlen, nheads_kv * D / 2) int16 rows, or of
    a head-major one (nheads_kv, seqlen, D) as (nheads_kv * seqlen, D / 2) rows."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    a, b, d = cache.shape
    pairs = cache.view(torch.int16)
    rows = pairs.reshape(a * b, d // 2) if head_major else pairs.reshape(a, b * d // 2)
    block = [BLOCK_N, d // 2]
    return TensorDescriptor(rows, list(rows.shape), [rows.stride(0), 1], block,
                            gl.NVMMASharedLayout.get_default_for(block, gl.int16))


def stage1(q, k, v, ks, vs, num_splits, out=None, stages=3, descs=None, ablate=0, head_major=False, maxnreg=None):
    """q (nheads, D) bf16; k, v (seqlen, nheads_kv, D) e4m3 ((nheads_kv, seqlen, D) if head_major); ks, vs
    (seqlen, nheads_kv) fp32. Returns (o, lse2): (nheads, num_splits, D) fp32 and (nheads, num_splits) in log2
    units."""
    nheads, d = q.shape
    seqlen, nheads_kv = (k.shape[1], k.shape[0]) if head_major else k.shape[:2]
    if out is None:
        out = (torch.empty(nheads, num_splits, d, device=q.device, dtype=torch.float32),
               torch.empty(nheads, num_splits, device=q.device, dtype=torch.float32))
    o, lse = out
    k_desc, v_desc = descs or (_descriptor(k, head_major), _descriptor(v, head_major))
    kernel, extra = (e4m3_stage1_2d_kernel, {}) if TWO_D else (e4m3_stage1_kernel, dict(ABLATE=ablate))
    kernel[(num_splits, nheads_kv)](
        q, k_desc, v_desc, ks, vs, o, lse, seqlen, d ** -0.5 * LOG2E, q.stride(0), ks.stride(0), o.stride(0),
        o.stride(1), seqlen if head_major else 0, 0 if head_major else d // 2, GROUP=nheads // nheads_kv, D=d,
        NUM_SPLITS=num_splits, BLOCK_N=BLOCK_N, STAGES=stages, W=WARPS, num_warps=WARPS, **extra,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    return o, lse


def sass_loop_opcodes(group: int = 8, stages: int = 3, ablate: int = 0, maxnreg: int | None = None) -> dict:
    """sm_90 compile on the CPU (Triton's ptxas): registers, spills, shared memory and the KV loop's opcodes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from benchmarks.probes.kernel_codegen import _cuobjdump, _resources, _sass_opcode

    desc = "tensordesc<i16[128, 64]," + repr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.int16)) + ">"
    sig = dict(q_ptr="*bf16", k_desc=desc, v_desc=desc, ks_ptr="*fp32", vs_ptr="*fp32", o_ptr="*fp32",
               lse_ptr="*fp32", seqlen="i32", score_scale_log2="fp32", stride_qh="i32", stride_sk="i32",
               stride_oh="i32", stride_os="i32", head_rows="i32", head_cols="i32", GROUP="constexpr",
               D="constexpr", NUM_SPLITS="constexpr",
               BLOCK_N="constexpr", STAGES="constexpr", W="constexpr", ABLATE="constexpr")
    consts = dict(GROUP=group, D=128, NUM_SPLITS=128, BLOCK_N=BLOCK_N, STAGES=stages, W=WARPS, ABLATE=ablate)
    if TWO_D:
        sig.pop("ABLATE")
        consts.pop("ABLATE")
    compiled = triton.compile(GluonASTSource(e4m3_stage1_2d_kernel if TWO_D else e4m3_stage1_kernel, sig,
                                             constexprs=consts),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=WARPS, **({"maxnreg": maxnreg} if maxnreg else {})))
    cubin = compiled.asm["cubin"]
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", _cuobjdump(cubin, "-sass"))
    addr = {int(a, 16): n for n, (a, _) in enumerate(ins)}
    loops = []  # the opcodes between each backward branch and its target
    for n, (a, text) in enumerate(ins):
        m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) <= int(a, 16):
            loops.append(collections.Counter(_sass_opcode(t) for _, t in ins[addr[int(m.group(1), 16)]:n + 1]))
    loop = max(loops, key=lambda c: c["HMMA.16816.F32"]) if loops else collections.Counter()
    res = _resources(cubin)
    return dict(resources=[f"REG:{res['REG']} STACK:{res['STACK']} SHARED:{res['SHARED']}"],
                loop_instructions=sum(loop.values()), loop=dict(loop.most_common()))


def main() -> int:
    from benchmarks.probes.fp8_keys_on_m import _time_resolved, b1_points, merge

    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--splits", default="64,128")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--ablate", default="", help="timing-only ABLATE masks (e4m3_stage1_kernel), e.g. 1,2,4,7")
    ap.add_argument("--head-major", action="store_true",
                    help="also a head-major copy of the cache (nheads_kv, seqlen, D): contiguous TMA boxes")
    ap.add_argument("--block-n", type=int, default=BLOCK_N, help="keys a pipeline stage holds (64: 16 a warp)")
    ap.add_argument("--two-d", action="store_true", help="e4m3_stage1_2d_kernel (no merge of the warps)")
    ap.add_argument("--maxnreg", type=int, default=0, help="a register cap (168: three CTAs an SM at 2 stages)")
    ap.add_argument("--sass", action="store_true")
    args = ap.parse_args()
    # the probe's two module knobs, read by stage1, _descriptor and sass_loop_opcodes
    globals().update(BLOCK_N=args.block_n, TWO_D=args.two_d)
    if args.sass:
        for ablate in [0] + [int(a) for a in args.ablate.split(",") if a]:
            print(dict(ablate=ablate, **sass_loop_opcodes(stages=int(args.stages.split(",")[0]), ablate=ablate,
                                                          maxnreg=args.maxnreg or None)), flush=True)
        return 0
    for ctx, (q, k, v, ks, vs), ref, bf16_err in b1_points(args.contexts, "cuda"):
        for splits in [int(s) for s in args.splits.split(",")]:
            for stages in [int(s) for s in args.stages.split(",")]:
                out = stage1(q, k, v, ks, vs, splits, stages=stages, maxnreg=args.maxnreg)
                err = (merge(*out).double() - ref).abs().max().item()
                row = dict(context=ctx, splits=splits, stages=stages, max_err=err, bf16_torch_err=bf16_err)
                if not args.check_only:
                    row["us"] = _time_stage1(q, k, v, ks, vs, splits, stages, maxnreg=args.maxnreg)
                print(row, flush=True)
                for ablate in [int(a) for a in args.ablate.split(",") if a]:
                    print(dict(context=ctx, splits=splits, stages=stages, ablate=ablate,
                               us=_time_stage1(q, k, v, ks, vs, splits, stages, ablate, maxnreg=args.maxnreg)),
                          flush=True)
                if args.head_major:
                    kh, vh = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
                    err = (merge(*stage1(q, kh, vh, ks, vs, splits, stages=stages, head_major=True)).double()
                           - ref).abs().max().item()
                    for ablate in [0] + [int(a) for a in args.ablate.split(",") if a]:
                        print(dict(context=ctx, splits=splits, stages=stages, head_major=True, ablate=ablate,
                                   max_err=err, us=_time_stage1(q, kh, vh, ks, vs, splits, stages, ablate, True)),
                              flush=True)
        if not args.check_only:
            print(dict(context=ctx, resolved=_time_resolved(q, k, v, ks, vs, ref)), flush=True)
    return 0


def _time_stage1(q, k, v, ks, vs, splits, stages, ablate=0, head_major=False, maxnreg=0):
    """CUDA-graph us per stage-1 call over copies of the cache rotated beyond L2."""
    from flashdecode.timing import cuda_graph_time_us, rotation_count

    sets = [(q, k.clone(), v.clone(), ks.clone(), vs.clone()) for _ in range(rotation_count(2 * k.numel()))]
    descs = [(_descriptor(s[1], head_major), _descriptor(s[2], head_major)) for s in sets]
    kw = dict(stages=stages, ablate=ablate, head_major=head_major, maxnreg=maxnreg)
    outs = [stage1(*s, splits, descs=dd, **kw) for s, dd in zip(sets, descs)]
    return cuda_graph_time_us([lambda s=s, o=o, dd=dd: stage1(*s, splits, out=o, descs=dd, **kw)
                               for s, o, dd in zip(sets, outs, descs)])


if __name__ == "__main__":
    raise SystemExit(main())
