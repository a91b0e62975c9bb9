"""A pytest plugin for the CPU: flash_attn's dispatch as on an sm_90 GPU, to find tests that assume the Triton path.

On an H100 flash_attn sends the dense forward (hd128; hd64 from GLUON_HD64_MIN_KEYS keys), the ragged forward and
the dense backward (hd64 / hd128 at any length) to the Gluon kernels, which the interpreter cannot run; and
resolve_config names backend "gluon" there. This plugin stands float32 torch math in for those kernels wherever
ops/gluon_attention.py's rules would take them, and makes resolve_config name "gluon", so that a test which
spies on the Triton launches, compares the Triton path with the default one bit for bit, or relies on a resolved
config keeping Triton fails here as it would on the GPU:

    TRITON_INTERPRET=1 PYTHONPATH=.:tests python -m pytest -p sm90_dispatch tests/test_attention.py ...

(The test_flash_attn_host_path cases with a ``hopper`` fixture fake the Gluon launches themselves: they fail under
this plugin and are not evidence.) Not loaded by the suite; the FP8 Gluon forward is left to the Triton path."""
import dataclasses

import pytest
import torch


def _ref_dense(q, k, v, scale, causal):
    from flashdecode import reference as ref
    out, lse = ref.attention_ref(q.float(), k.float(), v.float(), causal=causal, softmax_scale=scale)
    return out.to(q.dtype), lse.float()


def _dense_grads(q, k, v, dout, scale, causal):
    """dq, dk, dv of softmax(scale q k^T) v in float32 by the textbook formulas (no autograd: this runs inside
    traced backward graphs too)."""
    from flashdecode import reference as ref
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qf, kf, vf, do = (x.float() for x in (q, k, v, dout))
    ke, ve = kf.repeat_interleave(g, dim=2), vf.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, ke) * scale
    mask = ref.visible_mask(sq, sk, causal, (-1, -1), device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    p = p / torch.where(l > 0, l, torch.ones_like(l))
    o = torch.einsum("bhqk,bkhd->bqhd", p, ve)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, ve)
    delta = (do * o).sum(-1).transpose(1, 2)[..., None]  # (b, h, sq, 1)
    ds = p * (dp - delta)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    dk = dk.view(b, sk, hk, g, d).sum(3)
    dv = dv.view(b, sk, hk, g, d).sum(3)
    return dq, dk, dv


@pytest.fixture(autouse=True)
def _sm90_dispatch(monkeypatch):
    from flashdecode.ops import attention as attn
    from flashdecode.ops import gluon_attention as ga
    from flashdecode import heuristics, reference as ref

    monkeypatch.setattr(ga, "interpreting", lambda device=None: False)
    monkeypatch.setattr(ga, "_is_hopper", lambda device: True)
    ga._PLANS.clear()
    attn._DENSE_CALLS.clear()

    class Plan:
        def __init__(self, causal):
            self.causal = causal

    def plan_for(q, k, v, causal, config):
        if q.dtype == ga.FP8_DTYPE or not ga._supported_problem(q, k, v):
            return ga._NOT_APPLICABLE
        if config is None and not ga.gluon_pays(q.shape[-1], k.shape[1]):
            return ga._NOT_APPLICABLE
        return Plan(causal)
    monkeypatch.setattr(ga, "_plan_for", plan_for)

    def run_plan(plan, q, k, v, scale, need_lse=True, ptrs=None):
        out, lse = _ref_dense(q, k, v, scale, plan.causal)
        return out.contiguous(), (lse.contiguous() if need_lse else None)
    monkeypatch.setattr(ga, "run_plan", run_plan)

    def varlen_into(q, k, v, out, lse, cu_q, cu_k, max_q, scale, wl=-1, wr=-1, softcap=0.0, config=None):
        if softcap != 0.0 or wl != -1 or wr not in (-1, 0) or not heuristics.PREFILL_RAGGED_GLUON:
            return False
        batch = cu_q.numel() - 1
        if batch <= 0 or not ga._supported_problem(q[None], k[None], v[None]):
            return False
        if not ga.gluon_varlen_pays(q.shape[-1]):
            return False
        o, l = ref.attention_varlen_ref(q.float(), k.float(), v.float(), cu_q, cu_k, causal=wr == 0,
                                        softmax_scale=scale)
        out.copy_(o.to(out.dtype))
        lse.copy_(l.float())
        return True
    monkeypatch.setattr(ga, "gluon_varlen_forward_into", varlen_into)
    monkeypatch.setattr(ga, "gluon_fp8_forward_into", lambda *a, **kw: False)

    def backward(dout, q, k, v, out, lse, scale, wl=-1, wr=-1, softcap=0.0, deterministic=True):
        if softcap != 0.0 or wl != -1 or wr not in (-1, 0) or not scale > 0.0:
            return None
        if not ga._supported_problem(q, k, v) or not ga._aligned16(q, k, v):
            return None
        grads = _dense_grads(q, k, v, dout, scale, wr == 0)
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
    monkeypatch.setattr(ga, "gluon_backward_if_supported", backward)

    real_resolve = attn.resolve_config

    def resolve(*a, **kw):
        return dataclasses.replace(real_resolve(*a, **kw), backend="gluon")
    monkeypatch.setattr(attn, "resolve_config", resolve)
    yield
    ga._PLANS.clear()
    attn._DENSE_CALLS.clear()
