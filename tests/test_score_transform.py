"""The score transform's host description (flashdecode/ops/score_transform.py): what build / build_for_decode make
of the options, the kernels' constants, and that every entry point (flash_attn, flash_attn_varlen, the paged
prefill, flash_decode, DecodePlan, flash_attn_with_kvcache) hands its launch the same transform for the same options.

The entry-point tests stop each call where it would launch (no kernel runs).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import flashdecode
from flashdecode import flash_attn_interface as fai
from flashdecode.ops import attention as attn_ops
from flashdecode.ops import checks, decode, decode_plan, paged_prefill, score_transform
from flashdecode.ops.score_transform import (ScoreTransform, build, build_for_decode, log2_scale_of, logit_scales_of,
                                             tanh_log2_scales_of)
from helpers import DEVICE

LOG2E = 1 / math.log(2)


def test_build_fills_in_the_options():
    t = build(64, False, None, (-1, -1), 0.0)
    assert t == ScoreTransform(scale=64 ** -0.5)
    assert (t.window_left, t.window_right, t.causal, t.alibi, t.sinks) == (-1, -1, False, False, False)
    causal = build(64, True, 0.5, (7, 3), 2.0, alibi=True, sinks=True)
    assert causal == ScoreTransform(scale=0.5, softcap=2.0, window_left=7, window_right=0, alibi=True, sinks=True)
    assert causal.causal and causal.kernel_window == (7, 0)
    assert build(64, False, None, (3, 2 ** 40), 0.0).window_right == 2 ** 31 - 1  # clamped: stays an i32
    assert build(64, False, None, checks.NO_WINDOW, 0.0).kernel_window == (0, 0)


def test_logit_scales_fold_log2e_once():
    """Without a softcap the scale carries log2(e); with one, tanh's argument is scale / softcap and the cap
    carries log2(e): the kernels' score is then softcap * tanh(scale * qk / softcap) * log2(e)."""
    assert logit_scales_of(0.25, 0.0) == pytest.approx((0.25 * LOG2E, 0.0), rel=1e-15)
    qk_scale, softcap_log2 = logit_scales_of(0.25, 30.0)
    assert qk_scale == pytest.approx(0.25 / 30.0, rel=1e-15) and softcap_log2 == pytest.approx(30.0 * LOG2E, rel=1e-15)
    t = build(16, False, 0.25, (-1, -1), 30.0)
    assert t.logit_scales == (qk_scale, softcap_log2)
    qk = 7.0  # the score the kernels compute from those constants, in natural units
    assert math.tanh(qk * qk_scale) * softcap_log2 / LOG2E == pytest.approx(30.0 * math.tanh(0.25 * qk / 30.0))


def test_gluon_scales_share_the_fold():
    """The Gluon launches' scalars: log2_scale_of is logit_scales_of's scale without a softcap; the backward's
    (softcap_scale, softcap_log2) give, in its exp2 tanh (kernels/gluon/score.py), softcap * tanh(scale * qk /
    softcap) in log2 units, the cap as logit_scales_of's; zeros without a softcap."""
    assert log2_scale_of(0.25) == logit_scales_of(0.25, 0.0)[0]
    assert tanh_log2_scales_of(0.25, 0.0) == (0.0, 0.0)
    softcap_scale, softcap_log2 = tanh_log2_scales_of(0.25, 30.0)
    assert softcap_log2 == logit_scales_of(0.25, 30.0)[1]
    qk = 7.0
    tanh = 1.0 - 2.0 / (2.0 ** (qk * softcap_scale) + 1.0)
    assert tanh * softcap_log2 / LOG2E == pytest.approx(30.0 * math.tanh(0.25 * qk / 30.0), rel=1e-12)


def test_transforms_compare_by_their_options():
    """Equal options, equal transforms (hashable: a launch key may hold one); the derived constants are left
    out of the comparison and the repr."""
    a, b = build(32, True, 0.1, (4, -1), 1.5), build(32, True, 0.1, [4, 9], 1.5)
    assert a == b and hash(a) == hash(b) and "logit_scales" not in repr(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.scale = 1.0


def test_build_for_decode_checks_and_is_causal():
    t = build_for_decode(16, None, 0.0, (5, 9))
    assert t == ScoreTransform(scale=0.25, window_left=5, window_right=0)  # right is moot: causal
    for bad, error in (({"softcap": -1.0}, ValueError), ({"softcap": "1"}, TypeError),
                       ({"window_size": (-2, -1)}, ValueError), ({"window_size": 3}, TypeError),
                       ({"softmax_scale": float("nan")}, ValueError)):
        options = dict(softmax_scale=None, softcap=0.0, window_size=(-1, -1)) | bad
        with pytest.raises(error, match=next(iter(bad))):
            build_for_decode(16, **options)


# ------------------------------------------------------------------------------------------------------------------
# Every entry point: the transform its launch gets
# ------------------------------------------------------------------------------------------------------------------

class _Launched(Exception):
    """Raised where a call would launch, after its transform was recorded."""


@pytest.fixture
def launched(monkeypatch):
    """The ScoreTransform each call hands to its launch, recorded in a list instead of launching."""
    seen = []

    def stop(score):
        seen.append(score)
        raise _Launched

    monkeypatch.setattr(attn_ops, "attention", lambda *a, **k: stop(a[7]))
    monkeypatch.setattr(attn_ops, "attention_with_sinks", lambda *a, **k: stop(a[8]))
    monkeypatch.setattr(paged_prefill, "_forward", lambda *a, **k: stop(a[8]))
    monkeypatch.setattr(decode, "run_decode", lambda shape, *a, **k: stop(shape.score))
    monkeypatch.setattr(decode_plan, "run_decode", lambda shape, *a, **k: stop(shape.score))
    return seen


def _call(fn, *args, **kwargs):
    with pytest.raises(_Launched):
        fn(*args, **kwargs)


B, H, HK, D, SQ, SK = 1, 2, 1, 16, 3, 20


def _prefill_calls(options):
    """Dense, packed and paged calls of the same problem (SQ query rows against SK keys) with ``options``."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, s, h, D, generator=g).to(DEVICE) for s, h in ((SQ, H), (SK, HK), (SK, HK)))
    cu_q = torch.tensor([0, SQ], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, SK], dtype=torch.int32, device=DEVICE)
    pages = k.view(SK // 4, 4, HK, D)
    table = torch.arange(SK // 4, dtype=torch.int32, device=DEVICE)[None]
    seqused = torch.tensor([SK], dtype=torch.int32, device=DEVICE)
    return [
        (flashdecode.flash_attn, (q, k, v), options),
        (flashdecode.flash_attn_varlen, (q[0], k[0], v[0], cu_q, cu_k, SQ, SK), options),
        (flashdecode.flash_attn_varlen, (q[0], pages, pages, cu_q, None, SQ, SK),
         dict(options, block_table=table, seqused_k=seqused)),
    ]


OPTIONS = dict(causal=True, softmax_scale=0.3, window_size=(5, -1), softcap=4.0)


def test_prefill_entry_points_build_one_transform(launched):
    alibi = dict(OPTIONS, alibi_slopes=torch.tensor([0.5, 0.25], device=DEVICE))
    for fn, args, kwargs in _prefill_calls(alibi):
        _call(fn, *args, **kwargs)
    expected = ScoreTransform(scale=0.3, softcap=4.0, window_left=5, window_right=0, alibi=True)
    assert launched == [expected] * 3


def test_sinks_are_part_of_the_prefill_transform(launched):
    sinks = dict(OPTIONS, sinks=torch.zeros(H, device=DEVICE))
    for fn, args, kwargs in _prefill_calls(sinks):
        _call(fn, *args, **kwargs)
    assert launched == [ScoreTransform(scale=0.3, softcap=4.0, window_left=5, window_right=0, sinks=True)] * 3


def test_decode_entry_points_build_the_prefill_transform(launched):
    """flash_decode, DecodePlan.run and flash_attn_with_kvcache (one new token: the decode kernels) describe the
    causal call as flash_attn does (their sinks are a step after the kernels, so their launch's transform has
    none)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, D, generator=g).to(DEVICE)
    k_cache, v_cache = (torch.randn(B, 32, HK, D, generator=g).to(DEVICE) for _ in range(2))
    lens = torch.tensor([SK], dtype=torch.int32, device=DEVICE)
    slopes = torch.tensor([0.5, 0.25], device=DEVICE)
    options = dict(softmax_scale=0.3, window_size=(5, -1), softcap=4.0, alibi_slopes=slopes)
    _call(flashdecode.flash_decode, q, k_cache, v_cache, lens, **options)
    plan = flashdecode.DecodePlan(max_batch=B, nheads=H, nheads_kv=HK, headdim=D, max_seqlen_k=32,
                                  dtype=q.dtype, device=q.device)
    _call(plan.run, q, k_cache, v_cache, lens, **options)
    _call(fai.flash_attn_with_kvcache, q[:, None], k_cache, v_cache, cache_seqlens=lens, causal=True,
          softmax_scale=0.3, window_size=(5, -1), softcap=4.0, alibi_slopes=slopes)
    for fn, args, kwargs in _prefill_calls(dict(OPTIONS, alibi_slopes=slopes))[:1]:
        _call(fn, *args, **kwargs)
    assert len(launched) == 4 and launched[:3] == [launched[3]] * 3


def test_kvcache_checks_build_the_same_transform(monkeypatch):
    """flash_attn_with_kvcache's own checks describe the call with score_transform.build as the ops do."""
    built = []
    real = score_transform.build
    monkeypatch.setattr(score_transform, "build", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    q = torch.randn(B, 1, H, D, device=DEVICE)
    cache = torch.randn(B, 32, HK, D, device=DEVICE)
    lens = torch.tensor([SK], dtype=torch.int32, device=DEVICE)
    checked = fai._checked_kvcache_call(q, cache, cache, None, None, None, None, lens, None, None, None, 0.3, True,
                                        (5, -1), 4.0, False, None, 0, False)
    assert checked[-1] == built[0] == ScoreTransform(scale=0.3, softcap=4.0, window_left=5, window_right=0)


def test_decode_ops_default_window_is_checks_own():
    """One default window for every op: score_transform.build and the checks test it by identity, so a decode
    op's default must be checks.NO_WINDOW itself, not an equal tuple of its own."""
    import inspect

    from flashdecode.ops import checks, decode, decode_plan

    for fn in (decode.flash_decode, decode_plan.DecodePlan.run, decode_plan.DecodePlan._shape):
        params = inspect.signature(fn).parameters
        if "window_size" in params:
            assert params["window_size"].default is checks.NO_WINDOW, fn
