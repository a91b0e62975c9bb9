"""flash_attn's host path on repeated calls (runs on the CPU interpreter and on the GPU): a plain dense call whose key
(shapes, strides, dtypes, devices, alignment, mask flags) was seen before goes straight to its ready forward in the
dense call cache - no tensor checks, no plan or configuration work, no autograd.Function unless a gradient can flow -
and computes what the general path computes; bad options still raise the general checks' errors after the key is
cached. Counts of Python-level calls, never timings."""

from __future__ import annotations

import pytest
import torch

import flashdecode
from flashdecode.ops import attention as attn_ops
from helpers import DEVICE, KERNEL_DTYPES, randn

SHAPE_Q, SHAPE_KV = (1, 19, 4, 32), (1, 23, 2, 32)


def _qkv(seed: int, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(seed)  # helpers.randn draws on the CPU
    q, k, v = (randn(*s, gen=gen, dtype=KERNEL_DTYPES[0]) for s in (SHAPE_Q, SHAPE_KV, SHAPE_KV))
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


@pytest.fixture
def spied(monkeypatch):
    """Records the general path's work: the tensor checks, the dense entry's construction, the launch-plan and
    configuration lookups, the autograd Function and the forward op's implementation."""
    work = []
    for owner, name in ((attn_ops, "_check_tensor_args"), (attn_ops, "_check_tensors_once"),
                        (attn_ops, "_config_for"), (attn_ops, "_fwd_plan"), (attn_ops, "_fwd_impl"),
                        (attn_ops._DenseCall, "__init__")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **kw: (work.append(_name),
                                                                                 _real(*a, **kw))[1])
    for function in (attn_ops._FlashAttnFunction, attn_ops._DenseCallFunction):
        monkeypatch.setattr(function, "apply", lambda *a, _apply=function.apply, _name=function.__name__:
                            (work.append(_name), _apply(*a))[1])
    return work


@pytest.mark.parametrize("causal", [False, True])
def test_repeated_call_goes_straight_to_its_ready_forward(spied, causal):
    q, k, v = _qkv(0)
    first = flashdecode.flash_attn(q, k, v, causal=causal)
    assert "__init__" in spied and not any("Function" in w for w in spied)  # the key's entry is built on its first call
    entry = attn_ops._DENSE_CALLS[attn_ops._dense_key(q, k, v, -1, 0 if causal else -1, 0.0, -1)]
    calls = entry.calls
    spied.clear()
    q2, k2, v2 = _qkv(1)  # new tensors, same key
    out, lse = flashdecode.flash_attn(q2, k2, v2, causal=causal, softmax_scale=0.2, return_lse=True)
    assert spied == [] and entry.calls == calls + 1
    # the general path (a window given as a list is checked and normalised there) computes the same
    general, general_lse = flashdecode.flash_attn(q2, k2, v2, causal=causal, softmax_scale=0.2, return_lse=True,
                                                  window_size=[-1, -1])
    assert "_check_tensors_once" in spied
    assert torch.equal(out, general) and torch.equal(lse, general_lse)
    assert torch.equal(first, flashdecode.flash_attn(q, k, v, causal=causal))


def test_flash_attn_interface_calls_take_the_cache(spied):
    """flash_attn_func passes its own (-1, -1) window and 0.0 softcap: still a plain call."""
    from flashdecode.flash_attn_interface import flash_attn_func

    q, k, v = _qkv(5)
    flash_attn_func(q, k, v, causal=True)
    spied.clear()
    flash_attn_func(q, k, v, causal=True)
    assert spied == []


def test_autograd_only_where_a_gradient_can_flow(spied):
    q, k, v = _qkv(2, requires_grad=True)
    flashdecode.flash_attn(q, k, v, causal=True)  # the key's first call
    spied.clear()
    with torch.no_grad():
        out = flashdecode.flash_attn(q, k, v, causal=True)
    assert spied == [] and not out.requires_grad
    out = flashdecode.flash_attn(q, k, v, causal=True)
    assert spied == ["_DenseCallFunction"] and out.requires_grad  # with the ready forward: nothing else runs
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    general = flashdecode.flash_attn(q, k, v, causal=True, window_size=[-1, -1])  # the general path
    assert "_FlashAttnFunction" in spied and torch.equal(out, general)
    for a, b in zip(grads, torch.autograd.grad(general, (q, k, v), dout)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(causal=1), TypeError, "causal"),
    (dict(deterministic=None), TypeError, "deterministic"),
    (dict(return_lse="yes"), TypeError, "return_lse"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(softmax_scale=True), TypeError, "softmax_scale"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
])
def test_bad_options_raise_after_the_key_is_cached(kwargs, error, match):
    q, k, v = _qkv(3)
    flashdecode.flash_attn(q, k, v)
    flashdecode.flash_attn(q, k, v)
    with pytest.raises(error, match=match):
        flashdecode.flash_attn(q, k, v, **kwargs)


def test_bad_tensors_miss_the_cache_and_raise():
    q, k, v = _qkv(4)
    flashdecode.flash_attn(q, k, v)
    with pytest.raises(TypeError, match="k has dtype"):
        flashdecode.flash_attn(q, k.float(), v)
    with pytest.raises(ValueError, match="batch"):
        flashdecode.flash_attn(q, torch.cat([k, k]), torch.cat([v, v]))
    with pytest.raises(ValueError, match="head dim"):
        flashdecode.flash_attn(q, k[..., :16], v[..., :16])
