"""The Gluon (warp-specialised, sm_90) attention backward on the GPU: dq, dk, dv against the float64 reference with
the FlashAttention rule for gradients (error <= 3x a same-dtype PyTorch implementation's), deterministic and
atomic dQ, GQA, odd lengths, causal bottom-right (rows that see no key), hd 64/128, fp16/bf16; bitwise
reproducibility of the deterministic mode; the dense backward's dispatch to it and its fallbacks."""

import dataclasses

import pytest
import torch

import flashdecode.ops.gluon_attention as ga
from flashdecode.ops.attention import flash_attn
from flashdecode.ops.gluon_attention import (gluon_attention_backward, gluon_attention_forward, gluon_bwd_supported,
                                             resolve_gluon_bwd_config)
from flashdecode.reference import attention_ref
from helpers import HAS_CUDA, assert_fa_close, randn

pytestmark = pytest.mark.gpu

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is built for sm_90 only")


def _inputs(b, sq, sk, h, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (randn(b, sq, h, d, gen=gen, dtype=dtype), randn(b, sk, hkv, d, gen=gen, dtype=dtype),
            randn(b, sk, hkv, d, gen=gen, dtype=dtype), randn(b, sq, h, d, gen=gen, dtype=dtype))


def _reference_grads(q, k, v, dout, causal, dtype):
    """(dq, dk, dv) of attention_ref run in dtype (float64: the reference; q's dtype: the same-dtype baseline)."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*leaves, causal=causal)
    out.backward(dout.to(dtype))
    return [x.grad for x in leaves]


def _check(q, k, v, dout, causal, deterministic=True, config=None):
    out, lse = gluon_attention_forward(q, k, v, causal=causal)
    scale = q.shape[-1] ** -0.5
    assert gluon_bwd_supported(q, k, v, dout, -1, 0 if causal else -1, 0.0, scale)
    grads = gluon_attention_backward(dout, q, k, v, out, lse, scale, causal, deterministic, config)
    ref64 = _reference_grads(q, k, v, dout, causal, torch.float64)
    same = _reference_grads(q, k, v, dout, causal, q.dtype)
    for name, g, g64, gs, x in zip(("dq", "dk", "dv"), grads, ref64, same, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert_fa_close(g, g64, gs, factor=3.0, atol=1e-4, name=name)
    return grads


CASES = [(2, 128, 128, 4, 4), (1, 333, 517, 4, 2), (2, 517, 333, 8, 2), (3, 1, 300, 4, 1), (1, 1000, 999, 2, 2),
         (1, 64, 1000, 2, 1)]


@needs_hopper
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,sq,sk,h,hkv", CASES)
def test_gluon_backward_matches_reference(b, sq, sk, h, hkv, d, causal, dtype, deterministic):
    _check(*_inputs(b, sq, sk, h, hkv, d, dtype, seed=sq * 7 + sk + d), causal, deterministic)


@needs_hopper
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,sq,sk,h,hkv", [(2, 517, 333, 8, 2), (1, 1000, 999, 2, 2)])
def test_gluon_backward_atomic_dq_ablation(b, sq, sk, h, hkv, d, causal, deterministic):
    """dq_tma=False: the consumers add dQ with vector atomics (the probe's ablation) - correct too."""
    cfg = dataclasses.replace(resolve_gluon_bwd_config(d), dq_tma=False)
    _check(*_inputs(b, sq, sk, h, hkv, d, torch.bfloat16, seed=sq + d), causal, deterministic, cfg)


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_backward_long_causal_gqa(d):
    """Many key blocks per head (the deterministic mode's semaphore chain over 32 blocks), GQA group of 4."""
    _check(*_inputs(1, 4096, 4096, 8, 2, d, torch.bfloat16, seed=d), True)


@needs_hopper
def test_gluon_backward_rows_without_keys():
    """Causal with seqlen_q > seqlen_k (bottom-right): the first 200 rows see no key -> their dq is exactly 0."""
    dq, dk, dv = _check(*_inputs(1, 300, 100, 2, 2, 128, torch.bfloat16, seed=3), True)
    assert torch.all(dq[:, :200] == 0)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_backward_deterministic_is_bitwise_reproducible(causal):
    q, k, v, dout = _inputs(2, 2048, 2048, 8, 4, 128, torch.bfloat16, seed=7)
    out, lse = gluon_attention_forward(q, k, v, causal=causal)
    first = gluon_attention_backward(dout, q, k, v, out, lse, 128 ** -0.5, causal, True)
    for _ in range(3):
        again = gluon_attention_backward(dout, q, k, v, out, lse, 128 ** -0.5, causal, True)
        for a, b_ in zip(first, again):
            assert torch.equal(a, b_)


@needs_hopper
@pytest.mark.parametrize("deterministic", [True, False])
def test_flash_attn_backward_dispatches_to_gluon(monkeypatch, deterministic):
    """flash_attn's autograd backward takes the Gluon kernel on a supported call (a strided, expanded dout is made
    contiguous first) and its gradients match the reference; a sliding window stays on the Triton path."""
    calls = []
    real = ga.gluon_attention_backward
    monkeypatch.setattr(ga, "gluon_attention_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, dout = _inputs(2, 300, 400, 4, 2, 128, torch.bfloat16, seed=1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flash_attn(*leaves, causal=True, deterministic=deterministic)
    out.backward(dout)
    assert calls, "the Gluon backward was not taken"
    ref64 = _reference_grads(q, k, v, dout, True, torch.float64)
    same = _reference_grads(q, k, v, dout, True, q.dtype)
    for name, x, g64, gs in zip(("dq", "dk", "dv"), leaves, ref64, same):
        assert_fa_close(x.grad, g64, gs, factor=3.0, atol=1e-4, name=name)
    calls.clear()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    flash_attn(*leaves, causal=False).sum().backward()  # dout: an expanded scalar (stride 0)
    assert calls
    calls.clear()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    flash_attn(*leaves, window_size=(64, 0)).sum().backward()
    assert not calls, "a windowed call must stay on the Triton backward"


def test_gluon_backward_refuses_what_it_cannot_take():
    """gluon_bwd_supported is False (the dispatch falls back) off sm_90, for fp32, head dims other than 64/128, a
    window or softcap, a non-positive scale, a dout of another shape or dtype."""
    dev = "cuda" if HAS_CUDA else "cpu"
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16, device=dev)
    ok = HOPPER
    assert gluon_bwd_supported(q, q, q, q, -1, -1, 0.0, 0.1) == ok
    assert not gluon_bwd_supported(q.float(), q.float(), q.float(), q.float(), -1, -1, 0.0, 0.1)
    q96 = torch.zeros(1, 8, 2, 96, dtype=torch.bfloat16, device=dev)
    assert not gluon_bwd_supported(q96, q96, q96, q96, -1, -1, 0.0, 0.1)
    assert not gluon_bwd_supported(q, q, q, q, 16, 0, 0.0, 0.1)
    assert not gluon_bwd_supported(q, q, q, q, -1, -1, 30.0, 0.1)
    assert not gluon_bwd_supported(q, q, q, q, -1, -1, 0.0, 0.0)
    assert not gluon_bwd_supported(q, q, q, q.half(), -1, -1, 0.0, 0.1)
    assert not gluon_bwd_supported(q, q, q, q[:, :4], -1, -1, 0.0, 0.1)
