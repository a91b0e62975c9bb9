"""The score transform of an attention call, described once on the host (its kernel halves: kernels/score.py for
the Triton kernels, kernels/gluon/score.py for the Gluon ones).

Every op turns its options (softmax_scale, softcap, causal, window_size, alibi_slopes, sinks) into one frozen
ScoreTransform: flash_attn / flash_attn_varlen and the paged prefill with ``build`` after their option checks,
flash_decode / DecodePlan with ``build_for_decode`` (always causal among the new rows), flash_attn_with_kvcache for
its own checks. The launches read the kernels' constants from it (``logit_scales``: the one place that folds
log2(e) into the scale and the softcap, logit_scales_of) and the mask flags; the sinks step (ops/sinks.py) runs where
``sinks`` says. The Gluon launches take their scalars from the same functions: log2_scale_of, logit_scales_of (the
paged forward's softcap) and tanh_log2_scales_of (the ragged backward's softcap).
Masks are bottom-right aligned everywhere: query row i of a sequence with seqlen_q rows and seqlen_k keys sits at
key position i + seqlen_k - seqlen_q. docs/architecture.md, "The score transform", describes it once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashdecode.ops import checks

__all__ = ["ScoreTransform", "build", "build_for_decode", "log2_scale_of", "logit_scales_of", "tanh_log2_scales_of"]

_INT32_MAX = 2 ** 31 - 1  # window bounds are clamped to it: a huge window means "unbounded", and stays an i32


def log2_scale_of(scale: float) -> float:
    """scale * log2(e): the scores' scale in log2 units without a softcap (the kernels use exp2). The Gluon
    forward's and backward's qk_scale_log2 (kernels/gluon/score.py)."""
    return scale * checks.LOG2E


def logit_scales_of(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, softcap_log2), the Triton kernels' ``logit_scales`` (kernels/score.py logits_log2 and
    decode_logits_log2): without a softcap the scale carries log2(e) (scores = q.k * scale * log2(e)); with one
    the scale feeds tanh's argument (scale / softcap) and the cap carries log2(e). The hot paths call this with
    their per-call scale; everything else reads ScoreTransform.logit_scales."""
    if softcap > 0.0:
        return scale / softcap, softcap * checks.LOG2E
    return log2_scale_of(scale), 0.0


def tanh_log2_scales_of(scale: float, softcap: float) -> tuple[float, float]:
    """(softcap_scale, softcap_log2), the Gluon backward's softcap constants (kernels/gluon/score.py
    capped_scores_and_tanh): tanh's exp2 argument per raw score, 2 * scale * log2(e) / softcap (folded here, where
    logit_scales_of leaves scale / softcap for the kernel to double), and the cap softcap * log2(e), as in
    logit_scales_of; (0.0, 0.0) without a softcap."""
    if softcap > 0.0:
        return 2.0 * scale * checks.LOG2E / softcap, softcap * checks.LOG2E
    return 0.0, 0.0


@dataclass(frozen=True)
class ScoreTransform:
    """What happens to the scores q.k of one call, in the kernels' order: scale, softcap, ALiBi bias, masks; then
    the sinks step after the kernels.

    scale: the softmax scale (natural units; headdim ** -0.5 unless given). softcap: > 0 caps the scaled scores at
    softcap * tanh(s / softcap), 0 = off. window_left / window_right: keys [i - left, i + right] of key-aligned
    row i are visible, -1 = unbounded; window_right 0 is causal. alibi: the bias -slope * |i - j| joins after the
    softcap (the slopes travel as a tensor beside the transform). sinks: per-head sink logits join the softmax
    denominator after the kernels (ops/sinks.py; no kernel sees them)."""

    scale: float
    softcap: float = 0.0
    window_left: int = -1
    window_right: int = -1
    alibi: bool = False
    sinks: bool = False
    # what the launches pass, computed once here: (qk_scale, softcap_log2) (logit_scales_of) and the window as
    # the kernels take it, (left, right) with 0 where unbounded (their HAS_LEFT / HAS_RIGHT flags say whether a
    # bound applies)
    logit_scales: tuple = field(init=False, repr=False, compare=False)
    kernel_window: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "logit_scales", logit_scales_of(self.scale, self.softcap))
        object.__setattr__(self, "kernel_window", (max(self.window_left, 0), max(self.window_right, 0)))

    @property
    def causal(self) -> bool:
        return self.window_right == 0


def build(headdim: int, causal: bool, softmax_scale, window_size, softcap, *, alibi: bool = False,
          sinks: bool = False) -> ScoreTransform:
    """The transform of checked options (checks.check_attention_options ran): the default scale filled in, the
    window clamped to int32 (a huge window is unbounded), causal as window right 0."""
    scale = headdim ** -0.5 if softmax_scale is None else float(softmax_scale)
    if window_size is checks.NO_WINDOW:
        left, right = -1, -1
    else:
        left, right = min(int(window_size[0]), _INT32_MAX), min(int(window_size[1]), _INT32_MAX)
    return ScoreTransform(scale=scale, softcap=float(softcap), window_left=left, window_right=0 if causal else right,
                          alibi=alibi, sinks=sinks)


def build_for_decode(headdim: int, softmax_scale, softcap, window_size, *, alibi: bool = False) -> ScoreTransform:
    """flash_decode's options checked (softcap, window, scale, in that order; ValueError / TypeError naming the
    argument) and described: the decode kernels are causal among the new rows, so the window's right bound is
    moot (0). Sinks are flash_decode's step after the kernels (sinks False here: a decode call's checked shape is
    kept for calls with and without them)."""
    softcap = checks.check_softcap(softcap)
    window = checks.check_window(window_size)
    checks.check_softmax_scale(softmax_scale)
    return build(headdim, True, softmax_scale, window, softcap, alibi=alibi)
