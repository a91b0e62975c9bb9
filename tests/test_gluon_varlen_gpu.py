"""flash_attn_varlen on the Gluon kernel (sm_90): ragged batches read through cu_seqlens on the device, against
the float64 reference with the FlashAttention rule - lengths 0 and 1, sequences shorter than a tile, more queries
than keys, GQA, causal or not, every config family the ragged resolver can return - and the dispatch itself (the
call reaches the ragged Gluon plan; what it cannot take goes to the Triton path)."""

import pytest
import torch

import flashdecode
from flashdecode.ops import gluon_attention, gluon_plan
from flashdecode.ops.gluon_attention import GluonFwdConfig, gluon_varlen_forward_into, resolve_gluon_varlen_config
from flashdecode.reference import attention_ref
from helpers import HAS_CUDA, assert_fa_close, max_err, needs_v_bound_opt_in

pytestmark = pytest.mark.gpu

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is built for sm_90 only")


def _ragged(lens_q, lens_k, h, hkv, d, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype, generator=gen)
    cu = [torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32) for lens in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1]


def _reference(q, k, v, lens_q, lens_k, causal):
    """Per-sequence float64 and same-dtype references: out (total_q, h, d), lse (h, total_q)."""
    outs, lses, sames = [], [], []
    oq = ok = 0
    for lq, lk in zip(lens_q, lens_k):
        qs, ks, vs = q[oq:oq + lq][None], k[ok:ok + lk][None], v[ok:ok + lk][None]
        ref, ref_lse = attention_ref(qs.double(), ks.double(), vs.double(), causal=causal)
        same, _ = attention_ref(qs, ks, vs, causal=causal)
        outs.append(ref[0]), lses.append(ref_lse[0]), sames.append(same[0])
        oq, ok = oq + lq, ok + lk
    return torch.cat(outs), torch.cat(lses, dim=-1), torch.cat(sames)


def _check(lens_q, lens_k, h, hkv, d, causal, dtype=torch.bfloat16, config=None, seed=0):
    q, k, v, cu_q, cu_k = _ragged(lens_q, lens_k, h, hkv, d, dtype, seed)
    out = torch.empty_like(q)
    lse = torch.empty(h, q.shape[0], device="cuda", dtype=torch.float32)
    took = gluon_varlen_forward_into(q, k, v, out, lse, cu_q, cu_k, max(lens_q), d ** -0.5,
                                     window_right=0 if causal else -1, config=config)
    assert took, "the ragged Gluon kernel did not take a supported call"
    ref, ref_lse, same = _reference(q, k, v, lens_q, lens_k, causal)
    assert_fa_close(out, ref, same, name="out")
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "rows without keys must give lse -inf"
    assert max_err(lse[finite], ref_lse[finite]) < 1e-3, "lse"
    assert (out.transpose(0, 1)[~finite] == 0).all(), "rows without keys must give out 0"


LENGTHS = [([128, 128], [128, 128]), ([1, 17, 200, 0, 1000], [1, 17, 200, 0, 1000]),
           ([300, 5, 777], [900, 5, 1200]), ([64, 129, 3], [1, 129, 2]), ([0, 0, 50], [10, 0, 50])]


@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", LENGTHS, ids=lambda x: "-".join(map(str, x[0])))
def test_gluon_varlen_matches_reference(lens, causal, d):
    _check(*lens, h=4, hkv=2, d=d, causal=causal, config=resolve_gluon_varlen_config(d, causal, 1024))


CONFIGS = [GluonFwdConfig(), GluonFwdConfig(overlap=True, split_release=True),
           GluonFwdConfig(persistent=True, q_buffers=2), GluonFwdConfig(persistent=True, q_buffers=2,
                                                                        tile_order="pairs"),
           GluonFwdConfig(num_consumers=3, consumer_regs=160, num_stages=3)]


@needs_hopper
@pytest.mark.parametrize("config,causal", [(c, causal) for c in CONFIGS for causal in (False, True)
                                           if not (causal and c.overlap)],  # overlap: resolved non-causal only
                         ids=str)
def test_gluon_varlen_every_config_family(config, causal):
    d = 64 if config.num_consumers == 3 else 128
    _check([700, 1, 0, 2000, 333], [700, 1, 0, 2000, 400], 8, 2, d, causal, torch.float16, config, seed=3)


# the last V blocks through the producer's bounded descriptors (run with FLASHDECODE_V_BOUND=1: helpers.py)
V_BOUND_CONFIGS = [GluonFwdConfig(v_bound=True), GluonFwdConfig(overlap=True, split_release=True, v_bound=True),
                   GluonFwdConfig(persistent=True, q_buffers=2, tile_order="pairs", v_bound=True)]


@needs_hopper
@needs_v_bound_opt_in
@pytest.mark.parametrize("config,causal", [(c, causal) for c in V_BOUND_CONFIGS for causal in (False, True)
                                           if not (causal and c.overlap)], ids=str)
def test_gluon_varlen_v_bound_matches_reference(config, causal):
    _check([700, 1, 0, 2000, 333], [700, 1, 0, 2000, 400], 8, 2, 128, causal, torch.float16, config, seed=3)
    _check([64, 129, 3], [1, 129, 2], 4, 2, 64, causal, torch.bfloat16, config, seed=4)


def _public_call_on_gluon(lens, d, causal, seed):
    """flash_attn_varlen on a fresh bf16 ragged batch (8 / 2 heads, head dim d, equal query and key lengths):
    asserts that the call built a ragged Gluon plan and matches the reference. Returns (out (total, 8, d), the
    same call again as a function)."""
    q, k, v, cu_q, cu_k = _ragged(lens, lens, 8, 2, d, torch.bfloat16, seed=seed)
    before = {key for key in gluon_plan.PLANS if key[0] == "ragged"}

    def call():
        return flashdecode.flash_attn_varlen(q, k, v, cu_q, cu_k, max(lens), max(lens), causal=causal)
    out = call()
    new = [key for key in gluon_plan.PLANS if key[0] == "ragged" and key not in before]
    assert new and gluon_plan.PLANS[new[0]] is not gluon_plan.NOT_APPLICABLE
    ref, _, same = _reference(q, k, v, lens, lens, causal)
    assert_fa_close(out, ref, same, name="out")
    return out, call


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_dispatches_to_gluon(causal, monkeypatch):
    """With the dispatch switch on (heuristics.PREFILL_RAGGED_GLUON), the public call takes the ragged Gluon plan
    on sm_90 (hd128) and matches the reference, and its repeated (direct) launch gives the same bits."""
    from flashdecode import heuristics

    monkeypatch.setattr(heuristics, "PREFILL_RAGGED_GLUON", True)
    out, call = _public_call_on_gluon([100, 4000, 1, 2500], 128, causal, seed=5)
    assert torch.equal(out, call()), "the direct launch must give the first call's answer"


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_hd64_short_rows_take_gluon(causal):
    """Ragged hd64 batches of short sequences (mean well under gluon_pays's 1024 keys) take the Gluon kernel by
    default (heuristics.gluon_varlen_pays) with the config resolved at their mean length, and match the
    reference: sequences ending inside a key block, one of length 1, one empty."""
    _public_call_on_gluon([256, 200, 1, 0, 300, 129, 64, 256], 64, causal, seed=11)


@needs_hopper
def test_flash_attn_varlen_gluon_backward_matches_reference(monkeypatch):
    """Training through the ragged Gluon forward: the backward reads its out and lse (nheads, total_q)."""
    from flashdecode import heuristics

    monkeypatch.setattr(heuristics, "PREFILL_RAGGED_GLUON", True)
    lens = [300, 17, 1000]
    q, k, v, cu_q, cu_k = _ragged(lens, lens, 4, 2, 128, torch.bfloat16, seed=9)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = flashdecode.flash_attn_varlen(q, k, v, cu_q, cu_k, max(lens), max(lens), causal=True)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    grads = []
    for dtype in (torch.float64, q.dtype):  # the float64 reference and the same-dtype PyTorch one
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        ref = torch.cat([attention_ref(leaves[0][a:a + n][None], leaves[1][a:a + n][None], leaves[2][a:a + n][None],
                                       causal=True)[0][0] for a, n in zip(cu_q.tolist(), lens)])
        grads.append(torch.autograd.grad(ref, leaves, dout.to(dtype)))
    for name, got, want, same in zip(("dq", "dk", "dv"), (dq, dk, dv), *grads):
        assert_fa_close(got, want, same, factor=3.0, atol=1e-4, name=name)


@needs_hopper
def test_resolved_config_runs_the_default_kernel():
    """config=resolve_config(...) (and a replace of it) runs the kernel the call runs without config= - the Gluon
    forward on sm_90 - while backend="triton" pins the Triton kernel; both match the reference."""
    import dataclasses

    from flashdecode.ops import attention as attn_ops
    from flashdecode.ops import attention_config, attention_plans

    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(2, 300, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (8, 2, 2))
    resolved = attn_ops.resolve_config(q, k, v)
    assert resolved.backend == "gluon"
    ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=True)
    same, _ = attention_ref(q, k, v, causal=True)
    for config, gluon in ((None, True), (resolved, True), (dataclasses.replace(resolved, fwd_autotune=False), True),
                          (dataclasses.replace(resolved, backend="triton"), False)):
        out = flashdecode.flash_attn(q, k, v, causal=True, config=config)
        call = attention_plans._dense_call(q, k, v, -1, 0, 0.0, attention_config.config_id_of(config))
        assert (call.gluon is not None) == gluon, config
        assert_fa_close(out, ref, same, name="out")
