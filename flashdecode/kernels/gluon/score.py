"""The score transform of the Gluon kernels, written once (the host's description: ops/score_transform.py; the
Triton kernels': kernels/score.py).

The Gluon forward and backward turn a raw dot product q.k of query row i and key j into a score in log2 units
(exp2 throughout; docs/architecture.md, "The score transform"):
    s = q.k * qk_scale_log2                                      without a softcap, qk_scale_log2 = scale * log2(e)
    s = softcap * log2(e) * tanh(scale * q.k / softcap)          with one (SOFTCAP)
    tanh(x) = 1 - 2 / (2**y + 1), y = 2 * log2(e) * x            (tanh_of_log2_argument: saturates to +-1, no NaN)
    hidden keys: -inf in the forward's scores, P = 0 in the backward's (causal bottom-right, sliding window)
No ALiBi (the dispatch keeps ALiBi calls on the Triton kernels) and no sinks (a step after the kernels,
ops/sinks.py).

The host's constants, all from ops/score_transform.py:
  - forward (kernels/gluon/attn_fwd.py): qk_scale_log2 = scale * log2(e), or with a softcap (the paged kernel)
    (qk_scale_log2, softcap_log2) = logit_scales_of(scale, softcap) = (scale / softcap, softcap * log2(e)); the
    e4m3 kernel multiplies its tile's q_descale * k_descale into qk_scale_log2 on the device;
  - backward (kernels/gluon/attn_bwd.py): qk_scale_log2 = scale * log2(e) (the scores without a softcap and the
    shift by lse2) and, SOFTCAP, (softcap_scale, softcap_log2) = tanh_log2_scales_of(scale, softcap) =
    (2 * scale * log2(e) / softcap, softcap * log2(e)): tanh's exp2 argument scale folded on the host.
Each kernel keeps the floating-point association its generated code was measured with (they differ in the last
bits; moving one onto the other's is a change to measure on the GPU):
  - forward (fwd_softmax.RowMask.softcap): capped_scores_log2, tanh's argument (s * qk_scale_log2) * 2 log2(e),
    two multiplies per score;
  - backward (attn_bwd._bwd_step): capped_scores_and_tanh, tanh's argument s * softcap_scale, one multiply; the
    chain rule through the cap is softcap_grad (dS's factor P * (1 - tanh^2), tanh kept from the scores).

The masks stay with their kernels, because no shared form leaves both kernels' code as it is: the forward tests
each (row, key) of its (64, BLOCK_N) scores against the row's diagonal (fwd_softmax.RowMask.apply: key < len_k,
causal key <= row + diag, window -left <= key - (row + diag) <= right, the host passing an unbounded side as a
bound no distance reaches, ops/gluon_attention.paged_window_args), while the backward's consumers compute each
key's first and last visible query row once per key block (attn_bwd._bwd_consumer, window sides -1 = unbounded)
and compare the transposed (keys, queries) scores' rows with them (attn_bwd._bwd_step), which keeps the
per-element work to one or two compares at the consumers' 240-register limit. The tiles each kernel visits under
a window are their tile spaces' (fwd_tiles.TileSpace.coords, bwd_channels.key_block).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

TWO_LOG2E = gl.constexpr(2.8853900817779268)  # 2 * log2(e): tanh(x) = 1 - 2 / (2**(2 log2(e) x) + 1)


@gluon.jit
def tanh_of_log2_argument(y):
    """tanh(x) for y = 2 * log2(e) * x (any shape, fp32): 1 - 2 / (2**y + 1). +-1 for huge |y| (exp2 gives inf or
    0), never NaN from a finite y; NaN stays NaN."""
    return 1.0 - 2.0 / (gl.exp2(y) + 1.0)


@gluon.jit
def capped_scores_log2(s, qk_scale_log2, softcap_log2):
    """The forward's softcap: raw dot products s (any shape, fp32) -> softcap_log2 * tanh(s * qk_scale_log2), the
    capped scores in log2 units ((qk_scale_log2, softcap_log2) = the host's logit_scales_of(scale, softcap))."""
    return tanh_of_log2_argument(s * qk_scale_log2 * TWO_LOG2E) * softcap_log2


@gluon.jit
def capped_scores_and_tanh(s, softcap_scale, softcap_log2):
    """The backward's softcap: raw dot products s (any shape, fp32) -> (capped scores in log2 units, the tanh they
    came from, for softcap_grad); (softcap_scale, softcap_log2) = the host's tanh_log2_scales_of(scale, softcap)."""
    tanh = tanh_of_log2_argument(s * softcap_scale)
    return tanh * softcap_log2, tanh


@gluon.jit
def softcap_grad(p, tanh):
    """The chain rule through softcap * tanh(x / softcap): P (any shape, fp32) times 1 - tanh^2 (tanh from
    capped_scores_and_tanh), the factor dS = P * (dP - D) takes in place of P."""
    return p * (1.0 - tanh * tanh)
