"""Log-sum-exp merges of attention states: Flash-Decoding's stage 2 and the public merge_states primitives.

Rows are addressed with two indices (r_outer, r_inner) - e.g. (batch * seqlen_q, head) - and explicit strides, so
the split-KV partial buffer (batch, seqlen_q, nheads, splits, headdim) and any (..., nheads, headdim) tensor are
read in place. Inputs are normalised states (o, lse); LSE_LOG2 says whether the input lse is in log2 units (our
own partials) or natural log (user tensors). Outputs: o in O_OUT's dtype, lse natural log fp32.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashdecode.kernels.softmax_state import (LN2, LOG2E, fold_live_states, merge_many_step, merge_two_states,
                                               normalize_state)


@triton.jit
def merge_many_kernel(
    O_IN, LSE_IN, O_OUT, LSE_OUT, num_states, num_inner,
    stride_io, stride_ii, stride_in, stride_id,
    stride_lio, stride_lii, stride_lin,
    stride_oo, stride_oi, stride_od,
    stride_loo, stride_loi,
    HEADDIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    LSE_LOG2: tl.constexpr, USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr = False,
    SKIP_EMPTY: tl.constexpr = False, LIVE_ONLY: tl.constexpr = False, STATES_PAD: tl.constexpr = 1,
):
    """Merge ``num_states`` states per row. Grid (num_outer, cdiv(num_inner, BLOCK_R), head-dim chunks): program
    (., ., c) merges head-dim columns [c * BLOCK_D, (c + 1) * BLOCK_D) (one chunk when BLOCK_D covers HEADDIM; more
    chunks spread a small merge over more SMs); chunk 0 writes the lse.

    O_IN[r_o, r_i, n, :] (any float dtype), LSE_IN[r_o, r_i, n] fp32; -inf marks an empty state whose O_IN may be
    garbage (it weighs exactly 0). The states are folded BLOCK_S at a time with the online rescaling of
    ``merge_many_step``.
    USE_PDL: launched as a programmatic dependent launch; wait for the producer's writes (inline asm, GPU only),
    then let the next kernel (e.g. the next decode call's stage 1, itself a dependent launch that waits for this
    one to finish) be scheduled early.
    EARLY_TRIGGER (with USE_PDL): let the next kernel launch before this one's wait, i.e. while the producer still
    runs. Safe for a next kernel that waits (gdc_wait) before it reads: it then waits for this kernel, and this one
    for the producer. It gives that kernel's pre-wait prologue (decode stage 1's L2 prefetch) more time.
    SKIP_EMPTY (batch-invariant decode): a step whose BLOCK_S states are empty in every row of the program leaves
    the running state exactly as it was (selected, not recomputed: the fold would give acc * exp2(0) + 0, which
    turns -0.0 into +0.0 and trusts exp2(0) to be exactly 1), so trailing empty states - however many the launch
    has - change no bit of the result; with BLOCK_S fixed by the caller the states are folded in the same steps
    in the same order whatever num_states is.
    LIVE_ONLY (STATES_PAD: num_states padded to a power of two): for launches whose states are mostly empty slots
    (the device-split grid's NUM_SPLITS slots a row, of which a sequence uses its device-chosen few, slots 0 ..
    count - 1). Every state's lse is read in one round trip first; they fix each row's shift and normaliser, and
    the program's live count (its rows' last live slot + 1); then only slots below the count are folded, BLOCK_S
    at a time, and o is read only where its lse is live. So a program's cost follows the live states, not the
    slots, and its tile holds BLOCK_S states, not all of them: more rows a program (softmax_state.fold_live_states).
    """
    if USE_PDL:
        if EARLY_TRIGGER:
            gdc_launch_dependents()
        gdc_wait()
        if not EARLY_TRIGGER:
            gdc_launch_dependents()
    # int64 indices: any strides are allowed, so index x stride may pass 2**31 (big or permuted tensors)
    r_outer = tl.program_id(0).to(tl.int64)
    r_inner = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d_chunk = tl.program_id(2)
    r_ok = r_inner < num_inner
    offs_s = tl.arange(0, BLOCK_S).to(tl.int64)
    offs_d = (d_chunk * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    d_ok = offs_d < HEADDIM
    o_base = O_IN + r_outer * stride_io + r_inner[:, None, None] * stride_ii + offs_d[None, None, :] * stride_id
    lse_base = LSE_IN + r_outer * stride_lio + r_inner[:, None] * stride_lii

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    if LIVE_ONLY:
        # the fold's state indices are 32-bit: 64-bit strides keep index x stride exact
        o_rows = O_IN + r_outer * stride_io + r_inner * stride_ii
        lse_rows = LSE_IN + r_outer * stride_lio + r_inner * stride_lii
        acc, m_i, l_i = fold_live_states(o_rows, lse_rows, offs_d, d_ok, r_ok, num_states,
                                         tl.cast(stride_in, tl.int64), stride_id, tl.cast(stride_lin, tl.int64),
                                         BLOCK_R, BLOCK_S, BLOCK_D, STATES_PAD, LSE_LOG2, "", True)
    else:
        for n0 in range(0, num_states, BLOCK_S):
            n = n0 + offs_s
            lse_ok = r_ok[:, None] & (n < num_states)[None, :]
            lse = tl.load(lse_base + n[None, :] * stride_lin, mask=lse_ok, other=float("-inf")).to(tl.float32)
            if not LSE_LOG2:
                lse = lse * LOG2E
            # o is loaded beside lse (not behind it: one memory round trip, not two); empty states' o may be
            # garbage (never written), so it is zeroed after the load.
            o = tl.load(o_base + n[None, :, None] * stride_in, mask=lse_ok[:, :, None] & d_ok[None, None, :],
                        other=0.0)
            o = tl.where((lse > float("-inf"))[:, :, None], o.to(tl.float32), 0.0)
            if SKIP_EMPTY:
                acc_n, m_n, l_n = merge_many_step(acc, m_i, l_i, o, lse)
                # a step is empty when every lse is -inf; a NaN lse is live (max may skip NaN on the GPU)
                live = tl.max(tl.max((lse != float("-inf")).to(tl.int32), 1), 0) > 0
                acc = tl.where(live, acc_n, acc)
                m_i = tl.where(live, m_n, m_i)
                l_i = tl.where(live, l_n, l_i)
            else:
                acc, m_i, l_i = merge_many_step(acc, m_i, l_i, o, lse)
    # Each state is already normalised, so (acc, m, l) is exactly a running state over the union of their keys.
    o, lse2 = normalize_state(acc, m_i, l_i)
    out_ptrs = O_OUT + r_outer * stride_oo + r_inner[:, None] * stride_oi + offs_d[None, :] * stride_od
    tl.store(out_ptrs, o.to(O_OUT.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    if d_chunk == 0:  # (a branch, not a mask: Triton 3.9's interpreter refuses a mask of int1 scalar & vector)
        tl.store(LSE_OUT + r_outer * stride_loo + r_inner * stride_loi, lse2 * LN2, mask=r_ok)


@triton.jit
def merge_two_kernel(
    O_A, LSE_A, O_B, LSE_B, O_OUT, LSE_OUT, num_inner,
    stride_ao, stride_ai, stride_ad, stride_lao, stride_lai,
    stride_bo, stride_bi, stride_bd, stride_lbo, stride_lbi,
    stride_oo, stride_oi, stride_od, stride_loo, stride_loi,
    HEADDIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Two-way merge of natural-log states, rows (r_outer, r_inner). Grid (num_outer, cdiv(num_inner, BLOCK_R))."""
    r_outer = tl.program_id(0).to(tl.int64)
    r_inner = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # int64: see merge_many_kernel
    r_ok = r_inner < num_inner
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = offs_d < HEADDIM
    lse_a = tl.load(LSE_A + r_outer * stride_lao + r_inner * stride_lai, mask=r_ok, other=float("-inf"))
    lse_b = tl.load(LSE_B + r_outer * stride_lbo + r_inner * stride_lbi, mask=r_ok, other=float("-inf"))
    lse_a = lse_a.to(tl.float32) * LOG2E
    lse_b = lse_b.to(tl.float32) * LOG2E
    mask_a = (lse_a > float("-inf"))[:, None] & d_ok[None, :]
    mask_b = (lse_b > float("-inf"))[:, None] & d_ok[None, :]
    o_a = tl.load(O_A + r_outer * stride_ao + r_inner[:, None] * stride_ai + offs_d[None, :] * stride_ad,
                  mask=mask_a, other=0.0).to(tl.float32)
    o_b = tl.load(O_B + r_outer * stride_bo + r_inner[:, None] * stride_bi + offs_d[None, :] * stride_bd,
                  mask=mask_b, other=0.0).to(tl.float32)
    o, lse2 = merge_two_states(o_a, lse_a, o_b, lse_b)
    out_ptrs = O_OUT + r_outer * stride_oo + r_inner[:, None] * stride_oi + offs_d[None, :] * stride_od
    tl.store(out_ptrs, o.to(O_OUT.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    tl.store(LSE_OUT + r_outer * stride_loo + r_inner * stride_loi, lse2 * LN2, mask=r_ok)
