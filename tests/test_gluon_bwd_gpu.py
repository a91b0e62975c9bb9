"""The Gluon (warp-specialised, sm_90) attention backward on the GPU: dq, dk, dv against the float64 reference with
the FlashAttention rule for gradients (error <= 3x a same-dtype PyTorch implementation's), deterministic and
non-deterministic dQ, the atomic-dQ ablation, GQA, odd lengths, causal bottom-right (rows that see no key), hd
64/128, fp16/bf16; bitwise reproducibility of the deterministic mode; the dense backward's dispatch to it and its
fallbacks.

Every compiled variant costs seconds on the GPU machine, so the file keeps to a few: one head layout (4 query
heads on 2 kv heads: the head counts are kernel constants), each test loops over its shapes in one compile (the
lengths are not specialised on), and the backward's inputs out / lse come from the float64 reference, not the
forward kernel (8 backward variants in all; -k "not fp16 and not atomic" leaves 5)."""

import dataclasses

import pytest
import torch

import flashdecode.ops.attention_launch as attention_launch
import flashdecode.ops.gluon_backward as gb
from flashdecode.heuristics import resolve_gluon_bwd_config
from flashdecode.ops.attention import flash_attn, resolve_config
from flashdecode.ops.attention_config import config_id_of
from flashdecode.ops.gluon_backward import gluon_attention_backward, gluon_bwd_supported
from flashdecode.reference import attention_ref
from helpers import HAS_CUDA, assert_fa_close, randn

pytestmark = pytest.mark.gpu

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is built for sm_90 only")

H, HKV = 4, 2  # the one head layout (GQA group of 2)
# (batch, seqlen_q, seqlen_k): square, ragged both ways, one query row, bottom-right rows without keys (causal:
# the first 200 rows of 300 x 100), few queries against many keys
SHAPES = [(2, 128, 128), (1, 333, 517), (2, 517, 333), (3, 1, 300), (1, 1000, 999), (1, 300, 100), (1, 64, 1000)]


def _inputs(b, sq, sk, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (randn(b, sq, H, d, gen=gen, dtype=dtype), randn(b, sk, HKV, d, gen=gen, dtype=dtype),
            randn(b, sk, HKV, d, gen=gen, dtype=dtype), randn(b, sq, H, d, gen=gen, dtype=dtype))


def _reference_grads(q, k, v, dout, causal, dtype):
    """(dq, dk, dv) of attention_ref run in dtype (float64: the reference; q's dtype: the same-dtype baseline)."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*leaves, causal=causal)
    out.backward(dout.to(dtype))
    return [x.grad for x in leaves]


def _assert_grads(grads, q, k, v, dout, causal, what):
    ref64 = _reference_grads(q, k, v, dout, causal, torch.float64)
    same = _reference_grads(q, k, v, dout, causal, q.dtype)
    for name, g, g64, gs, x in zip(("dq", "dk", "dv"), grads, ref64, same, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{what} {name}"
        assert_fa_close(g, g64, gs, factor=3.0, atol=1e-4, name=f"{what} {name}")


def _forward(q, k, v, causal):
    """(out in q's dtype, lse float32) from the float64 reference: the backward's inputs without compiling the
    forward kernel for every length class."""
    out, lse = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    return out.to(q.dtype), lse.float()


def _check(q, k, v, dout, causal, deterministic=True, config=None):
    out, lse = _forward(q, k, v, causal)
    scale = q.shape[-1] ** -0.5
    assert gluon_bwd_supported(q, k, v, dout, -1, 0 if causal else -1, 0.0, scale)
    grads = gluon_attention_backward(dout, q, k, v, out, lse, scale, causal, deterministic, config)
    _assert_grads(grads, q, k, v, dout, causal, f"{tuple(q.shape)} x {tuple(k.shape)} causal={causal}")
    return grads


def _check_shapes(d, causal, dtype=torch.bfloat16, deterministic=True, config=None, shapes=SHAPES):
    for b, sq, sk in shapes:
        grads = _check(*_inputs(b, sq, sk, d, dtype, seed=sq * 7 + sk + d), causal, deterministic, config)
        if causal and sq > sk:  # bottom-right: rows that see no key get exactly zero dq
            assert torch.all(grads[0][:, :sq - sk] == 0)


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_backward_matches_reference(d, causal):
    """The default: deterministic, dQ by TMA reduce-add; every shape in SHAPES; bf16."""
    _check_shapes(d, causal)


@needs_hopper
def test_gluon_backward_nondeterministic():
    _check_shapes(128, True, deterministic=False, shapes=SHAPES[1:3] + SHAPES[5:6])


@needs_hopper
def test_gluon_backward_fp16():
    _check_shapes(128, True, dtype=torch.float16, shapes=SHAPES[1:3] + SHAPES[5:6])


@needs_hopper
def test_gluon_backward_atomic_dq_ablation():
    """dq_tma=False: the consumers add dQ with vector atomics (the probe's ablation) - correct too."""
    cfg = dataclasses.replace(resolve_gluon_bwd_config(128), dq_tma=False)
    _check_shapes(128, True, config=cfg, shapes=SHAPES[1:3] + SHAPES[5:6])


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_backward_long_and_bitwise_reproducible(causal):
    """4k tokens (32 key blocks per head: the deterministic order's semaphore chain; causal launches the key blocks
    last to first) match the reference, and three more runs are bitwise equal."""
    q, k, v, dout = _inputs(1, 4096, 4096, 128, torch.bfloat16, seed=7)
    first = _check(q, k, v, dout, causal)
    out, lse = _forward(q, k, v, causal)
    for _ in range(3):
        again = gluon_attention_backward(dout, q, k, v, out, lse, 128 ** -0.5, causal, True)
        assert all(torch.equal(a, b_) for a, b_ in zip(first, again))


@needs_hopper
def test_gluon_backward_repeats_a_key_without_the_jit_and_records_a_new_layout():
    """The launch cache of the dense backward (gb._launch_sites): a key's second call launches both kernels
    directly (no JIT launch) with bitwise-equal gradients; a dout of other strides (a new key) goes through the JIT
    once and still matches the reference."""
    prep_site, bwd_site = gb._launch_sites()
    q, k, v, dout = _inputs(2, 517, 333, 128, torch.bfloat16, seed=21)
    first = _check(q, k, v, dout, True)
    jit = prep_site.jit_launches + bwd_site.jit_launches
    out, lse = _forward(q, k, v, True)
    again = gluon_attention_backward(dout, q, k, v, out, lse, 128 ** -0.5, True, True)
    assert prep_site.jit_launches + bwd_site.jit_launches == jit
    assert all(torch.equal(a, b_) for a, b_ in zip(first, again))
    # the same values in rows padded by 8 elements (still a TMA rows view): dout's strides differ, so does the key
    b, sq, h, d = dout.shape
    padded = torch.zeros(b, sq, h * d + 8, dtype=dout.dtype, device=dout.device)
    padded[..., :h * d] = dout.reshape(b, sq, h * d)
    strided = padded[..., :h * d].view(b, sq, h, d)
    assert strided.stride() != dout.stride() and torch.equal(strided, dout)
    _check(q, k, v, strided, True)
    assert prep_site.jit_launches + bwd_site.jit_launches == jit + 2


@pytest.mark.xdist_group("gpu_bigmem")  # ~6 GB (float64 reference): gpu_check's bigmem part, 4 workers
@needs_hopper
def test_gluon_backward_tail_heavy_first():
    """tail_heavy_first (causal, deterministic): the grid's last (batch, kv head) walks its query blocks last to
    first, every step masked, with the earlier key blocks adding dQ first; the other heads as by default. The
    gradients match the reference on every shape (ragged, rows without keys, one query row) and at 4k tokens
    over two batches (32 key blocks a head: the ascending semaphore chain), and repeated runs are bitwise equal."""
    for d in (64, 128):
        cfg = dataclasses.replace(resolve_gluon_bwd_config(d), tail_heavy_first=True)
        _check_shapes(d, True, config=cfg)
    cfg = dataclasses.replace(resolve_gluon_bwd_config(128), tail_heavy_first=True)
    q, k, v, dout = _inputs(2, 4096, 4096, 128, torch.bfloat16, seed=11)
    first = _check(q, k, v, dout, True, config=cfg)
    out, lse = _forward(q, k, v, True)
    for _ in range(2):
        again = gluon_attention_backward(dout, q, k, v, out, lse, 128 ** -0.5, True, True, cfg)
        assert all(torch.equal(a, b_) for a, b_ in zip(first, again))


class _ReachedTriton(Exception):
    pass


def _stop_at_triton(*args, **kwargs):
    raise _ReachedTriton


@needs_hopper
def test_flash_attn_backward_dispatches_to_gluon(monkeypatch):
    """flash_attn's autograd backward takes the Gluon kernel on a supported call, deterministic or not (an expanded
    dout, stride 0, is made contiguous first), and its gradients match the reference; a config= pinned to backend
    "triton" stays on the Triton kernels (as the forward's dispatch)."""
    calls = []
    real = gb.gluon_attention_backward
    monkeypatch.setattr(gb, "gluon_attention_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, dout = _inputs(2, 517, 333, 128, torch.bfloat16, seed=1)
    for deterministic in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        flash_attn(*leaves, causal=True, deterministic=deterministic).backward(dout)
        assert calls, "the Gluon backward was not taken"
        _assert_grads([x.grad for x in leaves], q, k, v, dout, True, f"flash_attn deterministic={deterministic}")
        calls.clear()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    flash_attn(*leaves, causal=True).sum().backward()
    assert calls
    _assert_grads([x.grad for x in leaves], q, k, v, torch.ones_like(dout), True, "flash_attn sum()")
    calls.clear()
    # a config pinned to backend "triton" keeps the Triton kernels: the backward goes past the Gluon dispatch to the
    # Triton path's
    # preprocess (stopped there, so that no Triton kernel compiles in this file)
    monkeypatch.setattr(attention_launch, "_bwd_delta", _stop_at_triton)
    out, lse = _forward(q, k, v, True)
    with pytest.raises(_ReachedTriton):
        attention_launch._bwd_impl(dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 128 ** -0.5, -1, 0,
                                   0.0, True, config_id_of(dataclasses.replace(resolve_config(q, k, v),
                                                                               backend="triton")))
    assert not calls


def test_gluon_backward_refuses_what_it_cannot_take():
    """gluon_bwd_supported / gluon_backward_if_supported (the dispatch's test) refuse off sm_90, fp32, head dims
    other than 64/128, a sliding window, softcap, a non-positive scale, a dout of another shape or dtype."""
    dev = "cuda" if HAS_CUDA else "cpu"
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16, device=dev)
    assert gluon_bwd_supported(q, q, q, q, -1, -1, 0.0, 0.1) == HOPPER
    assert gluon_bwd_supported(q, q, q, q, -1, 0, 0.0, 0.1) == HOPPER
    assert not gluon_bwd_supported(q.float(), q.float(), q.float(), q.float(), -1, -1, 0.0, 0.1)
    q96 = torch.zeros(1, 8, 2, 96, dtype=torch.bfloat16, device=dev)
    assert not gluon_bwd_supported(q96, q96, q96, q96, -1, -1, 0.0, 0.1)
    assert not gluon_bwd_supported(q, q, q, q, 16, 0, 0.0, 0.1)
    assert gb.gluon_backward_if_supported(q, q, q, q, q, None, 0.1, 16, 0) is None
    assert not gluon_bwd_supported(q, q, q, q, -1, -1, 30.0, 0.1)
    assert not gluon_bwd_supported(q, q, q, q, -1, -1, 0.0, 0.0)
    assert not gluon_bwd_supported(q, q, q, q.half(), -1, -1, 0.0, 0.1)
    assert not gluon_bwd_supported(q, q, q, q[:, :4], -1, -1, 0.0, 0.1)
