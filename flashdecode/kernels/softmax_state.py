"""The softmax-state algebra shared by every kernel: online-softmax steps, normalisation and log-sum-exp merges.

A *state* summarises attention over a set of keys for one query row. Two forms are used:
  - running (acc, m, l): acc = sum_j exp2(s_j - m) v_j (unnormalised, fp32), m = max_j s_j, l = sum_j exp2(s_j - m);
  - normalised (o, lse): o = acc / l, lse = m + log2(l).
All scores and lse values inside the kernels are in log2 units (log2(e) is folded into the softmax scale, so exp2
replaces exp); launchers convert to natural log at the boundary. An empty state is (0, -inf) and never produces NaN:
every shift by a maximum goes through ``safe_max`` so that exp2(-inf - -inf) is never evaluated.
"""

import triton
import triton.language as tl

# constexpr *instances* (not annotations), so that kernels in other modules may read them as globals on the GPU
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): natural-log lse * LOG2E = log2 lse
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): log2 lse * LN2 = natural-log lse


@triton.jit
def safe_max(m):
    """The shift used for exp2: m where finite, 0 where m = -inf (an empty row), so exp2(x - shift) stays defined."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def online_softmax_step(m_i, l_i, s):
    """One FlashAttention-2 step over a block of scores ``s`` (BLOCK_M, BLOCK_N), log2 units, -inf = masked.

    Returns (p, alpha, m_new, l_new): p = exp2(s - m_new) (0 at masked entries), alpha = exp2(m_i - m_new) rescales
    the old accumulator (the caller does acc = acc * alpha[:, None] + p @ v).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = safe_max(m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(s - shift[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def online_softmax_step_sum_tile(m_i, l_tile, s):
    """online_softmax_step with the row sums kept per column: l_tile (BLOCK_M, BLOCK_N) fp32 holds, per key column,
    the running sum of its p values (rescaled by every alpha like the accumulator), so that a row's l is
    tl.sum(l_tile, 1), taken once after the KV loop. Per block this costs one multiply-add per score instead of a
    row reduction, which (with warps split along the keys) crosses warps through shared memory and a barrier.
    Returns (p, alpha, m_new, l_tile_new)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = safe_max(m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(s - shift[:, None])
    return p, alpha, m_new, l_tile * alpha[:, None] + p


@triton.jit
def normalize_state(acc, m_i, l_i):
    """(acc, m, l) -> (o, lse2): o = acc / l (0 where l = 0), lse2 = m + log2(l) (-inf where l = 0)."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    return o, lse2


@triton.jit
def merge_two_states(o_a, lse_a, o_b, lse_b):
    """Merge two normalised states (o (R, D) fp32, lse2 (R,) log2 units). -inf on one side returns the other.

    lse = M + log2(2^(lse_a - M) + 2^(lse_b - M)), o = 2^(lse_a - lse) o_a + 2^(lse_b - lse) o_b, M = max(lse_a, lse_b).
    """
    m = tl.maximum(lse_a, lse_b)
    shift = safe_max(m)
    w_a = tl.exp2(lse_a - shift)
    w_b = tl.exp2(lse_b - shift)
    total = w_a + w_b
    empty = total == 0.0
    inv = 1.0 / tl.where(empty, 1.0, total)
    o = o_a * (w_a * inv)[:, None] + o_b * (w_b * inv)[:, None]
    lse = tl.where(empty, float("-inf"), shift + tl.log2(tl.where(empty, 1.0, total)))
    return o, lse


@triton.jit
def merge_many_step(acc, m_i, l_i, o_chunk, lse_chunk):
    """Fold a chunk of normalised states (o_chunk (R, N, D) fp32, lse_chunk (R, N) log2, -inf = empty) into a
    running (acc (R, D), m (R,), l (R,)) state; finish with ``normalize_state``. Empty states weigh exactly 0, but
    0 * NaN is NaN: load o_chunk with mask lse_chunk > -inf (other=0) so never-written partials are never read."""
    m_new = tl.maximum(m_i, tl.max(lse_chunk, 1))
    shift = safe_max(m_new)
    alpha = tl.exp2(m_i - shift)
    w = tl.exp2(lse_chunk - shift[:, None])  # (R, N)
    acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_chunk, 1)
    l_new = l_i * alpha + tl.sum(w, 1)
    return acc, m_new, l_new


@triton.jit
def fold_live_states(o_rows, lse_rows, offs_d, d_ok, row_ok, num_states, stride_os, stride_od, stride_ls,
                     ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, STATES_PAD: tl.constexpr,
                     LSE_LOG2: tl.constexpr, CACHE: tl.constexpr, TRIM: tl.constexpr):
    """Fold the normalised states 0 .. num_states - 1 of ROWS rows into one running state, for launches whose
    states are partly empty slots (the merge kernel's LIVE_ONLY, the split kernels' in-kernel merge).

    o_rows: (ROWS,) pointers to each row's state-0 output (any float dtype), stride_os between states, offs_d
    (BLOCK_D,) its head-dim columns (stride_od), d_ok (BLOCK_D,) their mask; lse_rows: (ROWS,) pointers to each
    row's state-0 lse (log2 if LSE_LOG2 else natural log; -inf = empty), stride_ls between states; row_ok (ROWS,)
    the rows' mask; STATES_PAD >= num_states, a power of two. CACHE: the loads' cache modifier (".cg" where other
    programs of the same launch wrote the states). TRIM: fold only up to the rows' last live slot (for slots that
    are mostly empty; the in-kernel merge's num_states is exact). Returns (acc (ROWS, BLOCK_D) fp32, shift (ROWS,),
    l (ROWS,)) for normalize_state.

    Latency, not bandwidth, is the cost (one program reads its rows' states), so every state's lse is read in one
    round trip first: it fixes each row's shift (its largest lse; 0 for a row without a live state, whose l is then
    0), the normaliser l = sum exp2(lse - shift), and with TRIM the live count. Then only the slots below the count
    are folded, BLOCK_S a step (one round trip a step), and an output is read only where its lse is live - an empty
    state's output may never have been written. The loop is not unrolled, so registers stay bounded by one step's
    tile. A NaN lse makes its row's l NaN (its result NaN, never a valid-looking value).
    State indices are 32-bit, so pass int64 strides wherever index x stride may pass 2**31: the persistent decode
    kernel inlines this at its register cap, and 64-bit indices (or TRIM) make it spill more (sm_90 compile,
    tests/test_decode.py).
    """
    n_all = tl.arange(0, STATES_PAD)
    all_ok = row_ok[:, None] & (n_all < num_states)[None, :]
    lse_all = tl.load(lse_rows[:, None] + n_all[None, :] * stride_ls, mask=all_ok, other=float("-inf"),
                      cache_modifier=CACHE).to(tl.float32)
    if not LSE_LOG2:
        lse_all = lse_all * LOG2E
    shift = safe_max(tl.max(lse_all, 1))
    l_i = tl.sum(tl.exp2(lse_all - shift[:, None]), 1)
    count = num_states
    if TRIM:
        count = tl.max(tl.max(tl.where(lse_all > float("-inf"), n_all[None, :] + 1, 0), 1), 0)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    offs_s = tl.arange(0, BLOCK_S)
    for n0 in range(0, count, BLOCK_S):
        n = n0 + offs_s
        lse = tl.load(lse_rows[:, None] + n[None, :] * stride_ls, mask=row_ok[:, None] & (n < count)[None, :],
                      other=float("-inf"), cache_modifier=CACHE).to(tl.float32)
        if not LSE_LOG2:
            lse = lse * LOG2E
        live = lse > float("-inf")
        o_ptrs = o_rows[:, None, None] + n[None, :, None] * stride_os + offs_d[None, None, :] * stride_od
        o = tl.load(o_ptrs, mask=live[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=CACHE)
        acc += tl.sum(tl.exp2(lse - shift[:, None])[:, :, None] * o.to(tl.float32), 1)
    return acc, shift, l_i
