"""The Gluon (warp-specialised, sm_90) attention forward on the GPU: every feature it takes against the float64
reference with the FlashAttention rule, and the cases it must refuse (gluon_supported False, ValueError)."""

import dataclasses

import pytest
import torch

from flashdecode.ops.gluon_attention import gluon_attention_forward, gluon_supported, resolve_gluon_config
from flashdecode.reference import attention_ref
from helpers import HAS_CUDA, assert_fa_close, max_err, randn

pytestmark = pytest.mark.gpu

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(HAS_CUDA and not HOPPER, reason="the Gluon kernel is built for sm_90 only")


def _qkv(b, sq, sk, h, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (randn(b, sq, h, d, gen=gen, dtype=dtype), randn(b, sk, hkv, d, gen=gen, dtype=dtype),
            randn(b, sk, hkv, d, gen=gen, dtype=dtype))


def _check(q, k, v, causal, config=None):
    out, lse = gluon_attention_forward(q, k, v, causal=causal, config=config)
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    same, _ = attention_ref(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert_fa_close(out, ref, same, name="out")
    assert not torch.isnan(lse).any(), "lse has NaN"
    assert max_err(lse, ref_lse) < 1e-3, "lse"


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,sq,sk,h,hkv", [(2, 128, 128, 4, 4), (1, 333, 517, 4, 2), (2, 517, 333, 8, 2),
                                          (3, 1, 300, 4, 1), (1, 1000, 999, 2, 2)])
def test_gluon_forward_matches_reference(b, sq, sk, h, hkv, d, causal, dtype):
    _check(*_qkv(b, sq, sk, h, hkv, d, dtype, seed=sq * 7 + sk + d), causal)


@pytest.mark.xdist_group("gpu_bigmem")  # ~8 GB (float64 reference): gpu_check's bigmem part, 4 workers
@needs_hopper
def test_gluon_forward_resolved_long_causal_takes_lpt_lists():
    """Causal hd128 beyond PERSISTENT_MID_MAX_KEYS resolves to persistent CTAs with lpt tile lists (the default
    of long prefill): bottom-right causal with more queries than keys' blocks split unevenly, GQA."""
    cfg = resolve_gluon_config(128, True, 9000)
    assert cfg.tile_order == "lpt" and cfg.persistent
    _check(*_qkv(1, 9000, 9000, 4, 2, 128, torch.bfloat16, seed=11), True)
    _check(*_qkv(1, 8300, 9000, 2, 1, 128, torch.bfloat16, seed=12), True)


ABLATIONS = [dict(num_consumers=1), dict(num_consumers=1, overlap=True), dict(overlap=False), dict(persistent=True),
             dict(block_n=64, num_stages=3)]


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("overrides", ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_gluon_forward_every_config(overrides, causal):
    """The configs the probe times are correct too (GQA, ragged lengths; 144 tiles > 132 SMs, so persistent CTAs
    take several tiles and the K/V ring runs across tiles)."""
    cfg = dataclasses.replace(resolve_gluon_config(128), **overrides)
    _check(*_qkv(2, 1100, 700, 8, 4, 128, torch.bfloat16, seed=5), causal, cfg)


# Candidates the probe times (benchmarks/probes/gluon_fwd.py VARIANTS): (head dim, overrides of the resolved config)
_THREE = dict(num_consumers=3, consumer_regs=160)
_BOTH = (torch.float16, torch.bfloat16)
_BF16 = (torch.bfloat16, )
# (head dim, overrides, dtypes): fp16 and bf16 where a configuration first appears
CANDIDATES = [(64, _THREE, _BOTH), (64, dict(_THREE, persistent=True, q_buffers=2, num_stages=4), _BF16),
              (64, dict(persistent=True, q_buffers=2), _BOTH), (64, dict(block_n=256, num_stages=2), _BF16),
              (64, dict(overlap=True), _BOTH), (128, dict(q_buffers=2, tile_order="pairs"), _BF16),
              (128, dict(persistent=True, q_buffers=2, tile_order="pairs"), _BF16),
              (64, dict(_THREE, q_buffers=2, tile_order="pairs"), _BF16),
              (128, dict(persistent=True, q_buffers=2, tile_order="lpt"), _BF16),
              (64, dict(_THREE, persistent=True, q_buffers=2, tile_order="lpt"), _BF16)]


def _candidate_params():
    for d, overrides, dtypes in CANDIDATES:
        for dtype in dtypes:
            for causal in (False, True):
                name = ",".join(f"{k}={v}" for k, v in overrides.items())
                yield pytest.param(d, overrides, causal, dtype, id=f"d{d}-{name}-causal={causal}-{str(dtype)[6:]}")


@needs_hopper
@pytest.mark.parametrize("d,overrides,causal,dtype", list(_candidate_params()))
def test_gluon_forward_candidates(d, overrides, causal, dtype):
    """Three consumer warpgroups (192-row tiles), two Q buffer sets, 256-key blocks, the overlapped loop at hd64,
    the pairs and lpt tile orders: the FlashAttention rule against float64, GQA, ragged lengths (seqlen_q >
    seqlen_k: causal rows without keys), 144 192-row tiles > 132 SMs so persistent CTAs loop (every tile must
    still be computed once; 192-row pairs: 9 query blocks, the middle one alone)."""
    cfg = dataclasses.replace(resolve_gluon_config(d), **overrides)
    _check(*_qkv(2, 1700, 1100, 8, 4, d, dtype, seed=7 + d), causal, cfg)


@needs_hopper
@pytest.mark.parametrize("persistent", [False, True])
def test_gluon_forward_tile_pairs_with_more_units_than_sms(persistent):
    """The pairs tile order where units outnumber the SMs (3 x 8 heads x 7 units of an odd 13 query blocks = 168
    > 132), so persistent CTAs loop over units, some of which have no second tile: every tile computed once, causal
    (with more queries than keys: rows without keys) and not."""
    cfg = dataclasses.replace(resolve_gluon_config(128), q_buffers=2, persistent=persistent, tile_order="pairs")
    for causal, seqlen_k in ((True, 1600), (True, 1000), (False, 900)):
        _check(*_qkv(3, 1600, seqlen_k, 8, 2, 128, torch.bfloat16, seed=11), causal, cfg)


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_forward_hd64_long_keys_on_three_consumers(causal, dtype):
    """hd64 with >= THREE_CONSUMERS_MIN_KEYS keys resolves to three consumer warpgroups (192-row tiles): vs the
    float64 reference with ragged query rows (1000 = 5 tiles + 40) and GQA."""
    from flashdecode.ops.gluon_attention import THREE_CONSUMERS_MIN_KEYS

    assert resolve_gluon_config(64, causal, THREE_CONSUMERS_MIN_KEYS).num_consumers == 3
    _check(*_qkv(1, 1000, THREE_CONSUMERS_MIN_KEYS + 3, 4, 2, 64, dtype, seed=3), causal)


@needs_hopper
def test_gluon_forward_rows_without_keys():
    """Causal with seqlen_q > seqlen_k (bottom-right): the first rows see no key -> out 0, lse -inf, no NaN."""
    q, k, v = _qkv(1, 300, 100, 2, 2, 128, torch.bfloat16, seed=3)
    out, lse = gluon_attention_forward(q, k, v, causal=True)
    assert torch.all(out[:, :200] == 0) and torch.all(torch.isinf(lse[:, :, :200]))
    _check(q, k, v, True)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_forward_packed_qkv_views(causal):
    """q, k, v as views of one packed (batch, seqlen, 3, heads, headdim) tensor: rows strided by 3 * heads *
    headdim, read in place through the TMA descriptors (no copy), output still (batch, seqlen, heads, headdim)."""
    gen = torch.Generator().manual_seed(11)
    qkv = randn(2, 300, 3, 4, 128, gen=gen, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert gluon_supported(q, k, v, causal)
    _check(q, k, v, causal)


@needs_hopper
def test_gluon_supported_refuses_what_it_cannot_take():
    q, k, v = _qkv(1, 64, 64, 2, 2, 128, torch.bfloat16, seed=1)
    assert gluon_supported(q, k, v, False)
    assert not gluon_supported(q.float(), k.float(), v.float(), False)
    assert not gluon_supported(q[..., :96], k[..., :96], v[..., :96], False)
    assert not gluon_supported(q, k, v, False, window_size=(8, 0))
    assert not gluon_supported(q, k, v, False, softcap=30.0)
    assert not gluon_supported(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False)
    with pytest.raises(ValueError, match="q, k, v"):
        gluon_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    with pytest.raises(TypeError, match="q"):
        gluon_attention_forward(q.float(), k, v)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_repeated_calls_launch_directly(causal):
    """After a launch key's first (JIT) call, calls with new tensors of the same key go to the compiled kernel's
    launcher directly (host descriptors from cached views); they compute the same as the JIT launch."""
    from flashdecode.ops import gluon_plan

    q, k, v = _qkv(2, 333, 517, 4, 2, 128, torch.bfloat16, seed=21)
    first, first_lse = gluon_attention_forward(q, k, v, causal=causal)
    for seed in (22, 23):
        q2, k2, v2 = _qkv(2, 333, 517, 4, 2, 128, torch.bfloat16, seed=seed)
        _check(q2, k2, v2, causal)
    again, again_lse = gluon_attention_forward(q.clone(), k.clone(), v.clone(), causal=causal)
    assert torch.equal(first, again) and torch.equal(first_lse, again_lse)
    plans = [p for key, p in gluon_plan.PLANS.items() if key[0] == q.shape and key[-2] == causal and p]
    assert plans and all(p.direct_launches >= 3 for p in plans)


@needs_hopper
def test_gluon_direct_launch_in_a_cuda_graph():
    """Direct launches capture into a CUDA graph (the TMA descriptors are kernel parameters, copied at capture)."""
    q, k, v = _qkv(1, 1000, 999, 2, 2, 64, torch.float16, seed=31)
    gluon_attention_forward(q, k, v, causal=True)  # the key's JIT launch, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = gluon_attention_forward(q, k, v, causal=True)
    q.copy_(randn(*q.shape, gen=torch.Generator().manual_seed(32), dtype=q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=True)
    same, _ = attention_ref(q, k, v, causal=True)
    assert_fa_close(out, ref, same, name="out")


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_dispatch_entry_matches_the_triton_forward(causal):
    """gluon_forward_if_supported returns what flashdecode's Triton forward returns (out like q, lse (batch, nheads,
    seqlen_q) natural log), within the FlashAttention rule, and None where the Gluon kernel does not apply."""
    from flashdecode.ops.attention import flash_attn
    from flashdecode.ops.gluon_attention import gluon_forward_if_supported

    q, k, v = _qkv(2, 517, 700, 8, 2, 128, torch.bfloat16, seed=41)
    got = gluon_forward_if_supported(q, k, v, 0.1, -1, 0 if causal else -1)
    assert got is not None
    out, lse = got
    tri, tri_lse = flash_attn(q, k, v, causal=causal, softmax_scale=0.1, return_lse=True)
    assert out.shape == tri.shape and lse.shape == tri_lse.shape and lse.dtype == tri_lse.dtype
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=causal, softmax_scale=0.1)
    same, _ = attention_ref(q, k, v, causal=causal, softmax_scale=0.1)
    assert_fa_close(out, ref, same, name="out")
    assert max_err(lse, ref_lse) < 1e-3 and max_err(lse, tri_lse.double()) < 1e-3
    assert gluon_forward_if_supported(q.float(), k.float(), v.float(), 0.1) is None
    assert gluon_forward_if_supported(q[..., :96], k[..., :96], v[..., :96], 0.1) is None
    assert gluon_forward_if_supported(q, k, v, 0.1, 16, 0) is None
    assert gluon_forward_if_supported(q, k, v, 0.1, softcap=20.0) is None
    assert gluon_forward_if_supported(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.1) is None


# ----------------------------------------------------------------------------------------------------------------
# e4m3 (FP8) inputs: the e4m3 kernel (attn_fwd_fp8_ws_kernel) behind flash_attn's FP8 forward
# ----------------------------------------------------------------------------------------------------------------

def _fp8_plans():
    """The e4m3 launch plans built so far (flash_attn's FP8 forwards that took the Gluon kernel)."""
    from flashdecode.ops import gluon_plan

    return [p for p in gluon_plan.PLANS.values() if p and p.fp8]


def _check_fp8_gluon(inputs, causal, config=None):
    """The e4m3 kernel (called directly with a config, so neither a fallback nor the gluon_pays rule can hide it)
    against the float64 reference on the dequantised inputs, with test_fp8_prefill's tolerance (2x the
    same-rounding PyTorch emulation + 2e-3)."""
    from flashdecode.ops.gluon_attention import gluon_fp8_forward_into, resolve_gluon_fp8_config
    from flashdecode.reference import attention_ref as ref64
    from test_fp8_prefill import dequantise, fp8_emulation

    q8, k8, v8, qd, kd, vd = inputs
    group = q8.shape[2] // k8.shape[2]
    q_rep = qd if qd.shape[1] == q8.shape[2] else qd.repeat_interleave(group, dim=1)
    qk_descale = q_rep * kd.repeat_interleave(group, dim=1)
    out = torch.empty(q8.shape, dtype=torch.bfloat16, device=q8.device)
    lse = torch.empty(q8.shape[0], q8.shape[2], q8.shape[1], dtype=torch.float32, device=q8.device)
    scale = q8.shape[-1] ** -0.5
    config = config or resolve_gluon_fp8_config(q8.shape[-1], causal, k8.shape[1])
    assert gluon_fp8_forward_into(q8, k8, v8, out, lse, qk_descale, vd, scale, -1, 0 if causal else -1,
                                  config=config), "the e4m3 Gluon kernel refused a call it should take"
    want, want_lse = ref64(dequantise(q8, qd), dequantise(k8, kd), dequantise(v8, vd), causal=causal)
    emulated = fp8_emulation(*(t.cpu() for t in inputs), causal=causal)
    assert_fa_close(out, want, emulated, factor=2.0, atol=2e-3, name="fp8 gluon out")
    assert not torch.isnan(lse).any(), "lse has NaN"
    assert max_err(lse, want_lse) <= 1e-3 * (1 + want_lse[torch.isfinite(want_lse)].abs().max().item())
    return out, lse


def _fp8(b, sq, sk, h, hkv, d, seed, **kw):
    from test_fp8_prefill import fp8_inputs

    return fp8_inputs(torch.Generator().manual_seed(seed), b, sq, sk, h, hkv, d, **kw)


@needs_hopper
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,sq,sk,h,hkv", [(2, 128, 128, 4, 4), (1, 333, 517, 4, 2), (2, 517, 333, 8, 2),
                                          (3, 1, 300, 4, 1), (1, 1000, 999, 2, 2), (1, 2048, 2048, 4, 1)])
def test_gluon_fp8_forward_matches_reference(b, sq, sk, h, hkv, d, causal):
    _check_fp8_gluon(_fp8(b, sq, sk, h, hkv, d, seed=sq * 7 + sk + d), causal)


FP8_ABLATIONS = [dict(num_consumers=1), dict(persistent=True), dict(num_stages=2), dict(num_stages=4),
                 dict(block_n=256, num_stages=2), dict(block_n=256, num_stages=2, persistent=True, q_buffers=2)]


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("overrides", FP8_ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_gluon_fp8_forward_every_config(overrides, causal):
    """The e4m3 configs the probe times (GQA, ragged lengths, 144 tiles > 132 SMs: persistent CTAs loop)."""
    from flashdecode.ops.gluon_attention import resolve_gluon_fp8_config

    cfg = dataclasses.replace(resolve_gluon_fp8_config(128), **overrides)
    _check_fp8_gluon(_fp8(2, 1100, 700, 8, 4, 128, seed=5), causal, cfg)


@needs_hopper
def test_gluon_fp8_rows_without_keys_zero_descales_and_per_head_q_descale():
    """Causal seqlen_q > seqlen_k: empty rows give 0 and -inf; an all-zero head (descale 0) and v_descale 0 give
    no NaN; q_descale per query head; a negative k_descale (a sign flip) still gives the right row max."""
    inputs = _fp8(2, 300, 100, 4, 2, 128, seed=3, q_per_head=True)
    q8, k8, v8, qd, kd, vd = inputs
    q8[0, :, 0] = 0
    qd[0, 0] = 0.0
    kd[1, 0] = -kd[1, 0]
    v8[1, :, 1] = 0
    vd[1, 1] = 0.0
    out, lse = _check_fp8_gluon(inputs, True)
    assert torch.all(out[:, :200] == 0) and torch.all(torch.isinf(lse[:, :, :200]))
    assert torch.all(out[1, :, 2:] == 0)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_fp8_takes_the_gluon_kernel(causal):
    """flash_attn with e4m3 inputs and descales dispatches to the e4m3 Gluon kernel (a plan is built and launched
    directly on repeated calls), with test_fp8_prefill's checks (return_lse, GQA)."""
    from test_fp8_prefill import check_fp8

    inputs = _fp8(2, 1500, 1500, 8, 2, 128, seed=51 + causal)
    before = {id(p) for p in _fp8_plans()}
    for _ in range(3):
        check_fp8(*inputs, causal=causal)
    new = [p for p in _fp8_plans() if id(p) not in before]
    assert new and all(p.compiled is not None for p in new), "flash_attn's FP8 forward did not take the Gluon kernel"
    assert all(p.direct_launches >= 2 for p in new)
    # fallbacks: a window, softcap and varlen stay on the Triton kernel and still match the reference
    check_fp8(*inputs, window_size=(100, 0), softcap=5.0)
