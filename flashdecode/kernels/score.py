"""The score transform of the Triton kernels, written once (the host's description: ops/score_transform.py).

Every kernel turns a raw dot product q.k of query position i and key position j into a score in log2 units (the
softmax then uses exp2; docs/architecture.md, "The score transform"):
    s = scale * q.k * log2(e)                                    without a softcap
    s = softcap * tanh(scale * q.k / softcap) * log2(e)          with one (SOFTCAP)
    s = s - slope * log2(e) * |i - j|                            with ALiBi, after the softcap (flash-attn's order)
    s = -inf where key j is not visible to row i                 (visible: key bounds, causal / window)
Positions are key-aligned (bottom-right: a query row sits at key position row + seqlen_k - seqlen_q). Sinks join
the softmax after the kernels (ops/sinks.py), so no kernel sees them.

The host hands the kernels two constants per call, ``logit_scales`` = (qk_scale, softcap_log2) from
ScoreTransform.logit_scales: without a softcap (scale * log2(e), 0), with one (scale / softcap, softcap * log2(e)).
The two kernel families apply them in their own floating-point association (each family's generated code is what
was measured; the forms differ in rounding, so one family adopting the other's is a change to measure on the GPU):
  - prefill (kernels/fwd.py, kernels/bwd.py, the paged prefill): logits_log2 (tanh's argument scaled per score),
    alibi_bias_log2 (the bias added), visible;
  - decode (kernels/decode_blocks.py): decode_logits_log2 (2 log2(e) folded into the scale once per program),
    decode_alibi_log2 (the penalty subtracted), decode_visible.
Both share tanh_of_log2_argument (the saturating tanh) and alibi_slope_log2 (the slopes in log2 units).
The backward's chain rule through the softcap is softcap_grad (tanh recovered from the capped scores).
"""

import triton
import triton.language as tl

from flashdecode.kernels.softmax_state import LOG2E

TWO_LOG2E = tl.constexpr(2.8853900817779268)  # 2 * log2(e): tanh(x) = 1 - 2 / (2**(2 log2(e) x) + 1)


@triton.jit
def tanh_of_log2_argument(y):
    """tanh(x) for y = 2 * log2(e) * x: 1 - 2 / (2**y + 1). Saturates to +-1 for huge |y| (exp2 gives inf or 0),
    never NaN."""
    return 1.0 - 2.0 / (tl.exp2(y) + 1.0)


@triton.jit
def tanh_saturating(x):
    """tanh(x), saturating (tanh_of_log2_argument)."""
    return tanh_of_log2_argument(x * TWO_LOG2E)


@triton.jit
def logits_log2(qk, qk_scale, softcap_log2, SOFTCAP: tl.constexpr):
    """The prefill kernels' scores: raw dot products qk (any shape) -> logits in log2 units, (qk_scale,
    softcap_log2) = the host's logit_scales: qk * qk_scale, or softcap_log2 * tanh(qk * qk_scale)."""
    if SOFTCAP:
        return tanh_saturating(qk * qk_scale) * softcap_log2
    else:
        return qk * qk_scale


@triton.jit
def decode_logits_log2(qk, score_scale, softcap_out, SOFTCAP: tl.constexpr):
    """The decode kernels' scores: logits_log2 with 2 log2(e) folded into tanh's argument scale (one multiply per
    score instead of two); (score_scale, softcap_out) = the host's logit_scales."""
    if SOFTCAP:
        return tanh_of_log2_argument(qk * (score_scale * 2.0 * LOG2E)) * softcap_out
    return qk * score_scale


@triton.jit
def softcap_grad(ds, s, softcap_log2, SOFTCAP: tl.constexpr):
    """The backward's chain rule through softcap * tanh(x / softcap): ds times 1 - tanh^2, tanh recovered from the
    capped scores s (log2 units, without the ALiBi bias) as s / softcap_log2."""
    if SOFTCAP:
        t = s * (1.0 / softcap_log2)
        return ds * (1.0 - t * t)
    else:
        return ds


@triton.jit
def alibi_slope_log2(alibi, batch, head, HAS_ALIBI: tl.constexpr, row_ok=None):
    """The ALiBi slope of (sequence batch, query head head) times log2(e) (the scores' units); 0.0 without ALiBi.
    alibi: (AlibiSlopes, (batch stride, head stride)): the fp32 slopes (batch stride 0: one slope per head); head
    is a scalar, or (ROWS,) query heads with row_ok (ROWS,): rows that are not ok read 0."""
    if HAS_ALIBI:
        slopes, strides = alibi
        ptrs = slopes + batch.to(tl.int64) * strides[0] + head * strides[1]
        if row_ok is None:
            return tl.load(ptrs).to(tl.float32) * LOG2E
        else:
            return tl.load(ptrs, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    else:
        return 0.0


@triton.jit
def alibi_bias_log2(q_pos, k_pos, alibi_slope):
    """The prefill kernels' ALiBi bias (flash-attn's), added to the scores: -slope * |q_pos - k_pos| (broadcast),
    q_pos the key-aligned query position, in the units of alibi_slope (alibi_slope_log2's, a scalar)."""
    return -alibi_slope * tl.abs(q_pos - k_pos).to(tl.float32)


@triton.jit
def decode_alibi_log2(s, q_pos, k_pos, alibi_log2):
    """The decode kernels' ALiBi: scores s minus slope * |q_pos - k_pos| (broadcast; alibi_log2 the rows' slopes
    from alibi_slope_log2, one per row): alibi_bias_log2's bias, subtracted per score."""
    return s - alibi_log2 * tl.abs(q_pos - k_pos).to(tl.float32)


@triton.jit
def visible(q_pos, k_pos, seqlen_k, window_left, window_right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Bool mask, broadcast of q_pos and k_pos: key k_pos exists (< seqlen_k) and lies in [q_pos - left,
    q_pos + right]. q_pos is the query's key-aligned position; causal is HAS_RIGHT with right = 0."""
    mask = k_pos < seqlen_k
    if HAS_RIGHT:
        mask = mask & (k_pos <= q_pos + window_right)
    if HAS_LEFT:
        mask = mask & (k_pos >= q_pos - window_left)
    return mask


@triton.jit
def decode_visible(q_pos, keys, end, window_left, WINDOW: tl.constexpr, KEYS_1D: tl.constexpr):
    """The decode kernels' mask: visible with right = 0 (decode is causal among its new rows), the split's end as
    the key bound and WINDOW as HAS_LEFT, in the decode loops' order (causal bound, key bound, window). keys: the
    block's key positions, (BLOCK_N,) with KEYS_1D (the mask is then (rows, BLOCK_N) for q_pos (rows, 1); the key
    bound is tested on the vector), else already broadcast against q_pos."""
    if KEYS_1D:
        mask = (keys[None, :] <= q_pos) & (keys < end)[None, :]
        if WINDOW:
            mask = mask & (keys[None, :] >= q_pos - window_left)
    else:
        mask = (keys <= q_pos) & (keys < end)
        if WINDOW:
            mask = mask & (keys >= q_pos - window_left)
    return mask
