"""Attention sinks (flashdecode.ops.sinks) against a float64 reference with the sink in the softmax denominator:
flash_attn / flash_attn_varlen (out, lse and gradients incl. d sinks vs torch autograd on the float64 reference),
flash_decode / DecodePlan, fully masked rows (out 0, no NaN) and bad input.

CPU (Triton interpreter): small fp16/fp32 shapes; the FlashAttention rule (2x out, 3x gradients and decode).
"""

from __future__ import annotations

import pytest
import torch

import flashdecode
from flashdecode import reference as ref
from flashdecode.ops import attention as attn_ops
from flashdecode.ops.attention import flash_attn_varlen_with_sinks, flash_attn_with_sinks
from flashdecode.ops.decode import flash_decode_with_sinks
from flashdecode.ops.sinks import apply_sinks
from helpers import DEVICE, KERNEL_DTYPES, assert_fa_close, randn


@pytest.fixture(autouse=True)
def _fixed_config(monkeypatch):
    """No autotuning on the GPU (fewer compilations): the module flag, or the environment variable read when a
    configuration is resolved, whichever this version of ops/attention.py uses."""
    monkeypatch.setattr(attn_ops, "AUTOTUNE", False, raising=False)
    monkeypatch.setenv("FLASHDECODE_AUTOTUNE", "0")


def sink_attention_ref(q, k, v, sinks, causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None):
    """Naive attention whose softmax has one more column per row: the head's sink logit (no value).
    q (b, sq, h, d), k/v (b, sk, hk, d), sinks (h,) -> out (b, sq, h, d) in q's dtype, lse (b, h, sq) including
    the sink. Differentiable (torch autograd) in every input."""
    b, sq, h, d = q.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    group = h // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = ref.visible_mask(sq, k.shape[1], causal, window_size, device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    sink_col = sinks.to(s.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
    full = torch.cat([s, sink_col], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.exp(full - lse.unsqueeze(-1))[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _sinks(gen, nheads, dtype=torch.float32):
    return randn(nheads, gen=gen, dtype=dtype, scale=2.0)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", [
    dict(sq=17, sk=17, h=4, hk=2, causal=True),
    dict(sq=5, sk=33, h=2, hk=2, causal=False, softcap=3.0),
    dict(sq=33, sk=9, h=4, hk=1, causal=True),  # rows with no key: out 0, lse = sink
    dict(sq=20, sk=20, h=2, hk=1, causal=False, window_size=(4, 2)),
])
def test_flash_attn_with_sinks_matches_reference(gen, dtype, case):
    b, d = 2, 32
    kw = {name: case[name] for name in ("causal", "softcap", "window_size") if name in case}
    q = randn(b, case["sq"], case["h"], d, gen=gen, dtype=dtype)
    k = randn(b, case["sk"], case["hk"], d, gen=gen, dtype=dtype)
    v = randn(b, case["sk"], case["hk"], d, gen=gen, dtype=dtype)
    sinks = _sinks(gen, case["h"])
    dout = randn(b, case["sq"], case["h"], d, gen=gen, dtype=dtype)

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = flash_attn_with_sinks(*leaves[:3], leaves[3], return_lse=True, **kw)
    out.backward(dout)
    ref64 = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    o64, lse64 = sink_attention_ref(*ref64, **kw)
    o64.backward(dout.double())
    same = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    o_same, lse_same = sink_attention_ref(*same, **kw)
    o_same.backward(dout)

    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, case["h"], case["sq"])
    assert_fa_close(out, o64, o_same)
    assert_fa_close(lse, lse64, lse_same.float(), name="lse", atol=1e-4)
    for name, x, x64, x_same in zip("qkv", leaves, ref64, same):
        assert_fa_close(x.grad, x64.grad, x_same.grad, factor=3.0, atol=1e-4, name=f"d{name}")
    assert leaves[3].grad.dtype == torch.float32
    assert_fa_close(leaves[3].grad, ref64[3].grad, same[3].grad, factor=3.0, atol=1e-4, name="dsinks")
    if case["sq"] > case["sk"] and case.get("causal"):  # rows above the diagonal see no key
        empty = out[:, : case["sq"] - case["sk"]]
        assert torch.equal(empty, torch.zeros_like(empty))
        assert torch.equal(lse[:, :, : case["sq"] - case["sk"]],
                           sinks.float().view(1, -1, 1).expand(b, -1, case["sq"] - case["sk"]))


def test_flash_attn_varlen_with_sinks_matches_reference(gen):
    dtype, h, hk, d = torch.float16, 4, 2, 32
    lens_q, lens_k = [3, 0, 11], [7, 5, 11]
    cu_q = torch.tensor([0, 3, 3, 14], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 7, 12, 23], dtype=torch.int32, device=DEVICE)
    q = randn(14, h, d, gen=gen, dtype=dtype)
    k = randn(23, hk, d, gen=gen, dtype=dtype)
    v = randn(23, hk, d, gen=gen, dtype=dtype)
    sinks = _sinks(gen, h)
    dout = randn(14, h, d, gen=gen, dtype=dtype)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = flash_attn_varlen_with_sinks(*leaves[:3], cu_q, cu_k, 11, 11, leaves[3], causal=True,
                                            return_lse=True)
    out.backward(dout)
    assert lse.shape == (h, 14)

    def per_sequence(xs):
        """The reference per sequence (dense), concatenated like varlen, and its gradients."""
        qx, kx, vx, sx = xs
        outs, lses = [], []
        for i in range(3):
            o, l = sink_attention_ref(qx[None, cu_q[i]:cu_q[i + 1]], kx[None, cu_k[i]:cu_k[i + 1]],
                                      vx[None, cu_k[i]:cu_k[i + 1]], sx, causal=True)
            outs.append(o[0])
            lses.append(l[0])
        o = torch.cat(outs)
        o.backward(dout.to(o.dtype))
        return o, torch.cat(lses, -1)

    ref64 = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    o64, lse64 = per_sequence(ref64)
    same = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    o_same, lse_same = per_sequence(same)
    assert_fa_close(out, o64, o_same)
    assert_fa_close(lse, lse64, lse_same.float(), name="lse", atol=1e-4)
    for name, x, x64, x_same in zip(["dq", "dk", "dv", "dsinks"], leaves, ref64, same):
        assert_fa_close(x.grad, x64.grad, x_same.grad, factor=3.0, atol=1e-4, name=name)


@pytest.mark.parametrize("paged", [False, True])
def test_flash_decode_with_sinks_matches_reference(gen, paged):
    dtype, b, h, hk, d, cap = torch.float16, 3, 4, 2, 32, 40
    q = randn(b, h, d, gen=gen, dtype=dtype)
    k = randn(b, cap, hk, d, gen=gen, dtype=dtype)
    v = randn(b, cap, hk, d, gen=gen, dtype=dtype)
    lens = torch.tensor([37, 0, 5], dtype=torch.int32, device=DEVICE)  # 0: only the sink -> out 0
    sinks = _sinks(gen, h)
    kw = {}
    k_in, v_in = k, v
    if paged:
        k_in, v_in, kw["block_table"] = ref.paged_from_contiguous(k, v, 8, extra_pages=2, generator=gen)
    out, lse = flash_decode_with_sinks(q, k_in, v_in, lens, sinks, return_lse=True, num_splits=3, **kw)

    def reference(qx, kx, vx, sx):
        outs, lses = [], []
        for i, n in enumerate(lens.tolist()):
            o, l = sink_attention_ref(qx[i:i + 1, None], kx[i:i + 1, :n], vx[i:i + 1, :n], sx)
            outs.append(o[0, 0])
            lses.append(l[0, :, 0])
        return torch.stack(outs), torch.stack(lses)

    o64, lse64 = reference(q.double(), k.double(), v.double(), sinks.double())
    o_same, lse_same = reference(q, k, v, sinks)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)
    assert_fa_close(lse, lse64, lse_same.float(), factor=3.0, atol=1e-4, name="lse")
    assert torch.equal(out[1], torch.zeros_like(out[1]))

    plan = flashdecode.DecodePlan(b, h, hk, d, max_seqlen_k=cap, dtype=dtype, device=DEVICE)
    out_plan = flash_decode_with_sinks(q, k_in, v_in, lens, sinks, plan=plan, **kw)
    assert_fa_close(out_plan, o64, o_same, factor=3.0, atol=1e-4, name="out (plan)")
    buffer = torch.full_like(q, float("nan"))
    assert flash_decode_with_sinks(q, k_in, v_in, lens, sinks, out=buffer, num_splits=1, **kw) is buffer
    assert_fa_close(buffer, o64, o_same, factor=3.0, atol=1e-4, name="out=")


def test_apply_sinks_without_keys_or_sink_is_finite():
    """lse = -inf rows stay 0 with a finite sink; a -inf sink is "no sink" and leaves results unchanged."""
    out = torch.zeros(2, 3, 2, 4)
    out[0] = 1.0
    lse = torch.full((2, 2, 3), float("-inf"))
    lse[0] = 0.5
    o_new, lse_new = apply_sinks(out, lse, torch.tensor([0.0, float("-inf")]), "dense")
    assert not torch.isnan(o_new).any() and not torch.isnan(lse_new).any()
    assert torch.equal(o_new[1], torch.zeros_like(o_new[1]))
    assert torch.equal(o_new[0, :, 1], out[0, :, 1]) and torch.equal(lse_new[0, 1], lse[0, 1])
    assert torch.allclose(o_new[0, :, 0], torch.full((3, 4), torch.sigmoid(torch.tensor(0.5)).item()))
    assert torch.equal(lse_new[1, 1], lse[1, 1])  # -inf with -inf sink: stays -inf


def test_bad_sinks_raise_naming_the_argument(gen):
    q = randn(1, 4, 2, 16, gen=gen, dtype=torch.float16)
    with pytest.raises(ValueError, match="sinks"):
        flash_attn_with_sinks(q, q, q, torch.zeros(3, device=DEVICE))
    with pytest.raises(TypeError, match="sinks"):
        flash_attn_with_sinks(q, q, q, [0.0, 0.0])
    with pytest.raises(TypeError, match="sinks"):
        flash_attn_with_sinks(q, q, q, torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="layout"):
        apply_sinks(q, torch.zeros(1, 2, 4), torch.zeros(2), "bhsd")


def test_public_ops_take_sinks(gen):
    """flash_attn / flash_attn_varlen / flash_decode / DecodePlan.run(sinks=...) are the ops/sinks.py wrappers."""
    q = randn(2, 9, 4, 16, gen=gen, dtype=torch.float16)
    k = randn(2, 9, 2, 16, gen=gen, dtype=torch.float16)
    v = randn(2, 9, 2, 16, gen=gen, dtype=torch.float16)
    sinks = _sinks(gen, 4)
    dense = flashdecode.flash_attn(q, k, v, causal=True, sinks=sinks)
    assert torch.equal(dense, flash_attn_with_sinks(q, k, v, sinks, causal=True))
    cu = torch.tensor([0, 9, 18], dtype=torch.int32, device=DEVICE)
    packed = flashdecode.flash_attn_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 9, 9,
                                           causal=True, sinks=sinks)
    assert torch.equal(packed.view_as(q), dense)
    lens = torch.tensor([9, 4], dtype=torch.int32, device=DEVICE)
    decoded = flashdecode.flash_decode(q[:, 0], k, v, lens, num_splits=2, sinks=sinks)
    assert torch.equal(decoded, flash_decode_with_sinks(q[:, 0], k, v, lens, sinks, num_splits=2))
    plan = flashdecode.DecodePlan(2, 4, 2, 16, max_seqlen_k=9, dtype=torch.float16, device=DEVICE)
    planned = flashdecode.DecodePlan.run(plan, q[:, 0], k, v, lens, sinks=sinks)
    assert torch.equal(planned, flash_decode_with_sinks(q[:, 0], k, v, lens, sinks, plan=plan))
    with pytest.raises(ValueError, match="sinks cannot be combined"):
        flashdecode.flash_attn(q, k, v, sinks=sinks, alibi_slopes=torch.ones(4, device=DEVICE))
