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
