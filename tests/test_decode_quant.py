"""Decode on 8-bit KV caches (float8_e4m3fn, symmetric int8) and append_kv's quantising writes.

flash_decode on an 8-bit cache is checked against the float64 reference on the DEQUANTISED cache (k_cache.float()
* k_scale) with the FlashAttention rule (3x for decode); the same-dtype baseline is the PyTorch reference in q's
dtype on the dequantised cache. The CPU interpreter runs fp16 q (its bf16 tl.dot is wrong).
"""

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import DecodePath
from flashdecode import reference as ref
from flashdecode.ops.decode import decode_config
from flashdecode.ops.kv_quant import QMAX, dequantize_cache
from helpers import DEVICE, assert_fa_close, randn

FP8, INT8 = torch.float8_e4m3fn, torch.int8


def _lens(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _to_8bit(x, scale, dtype):
    """x float (..., d) / scale (broadcast to x.shape[:-1]) -> saturated 8-bit, as append_kv writes it."""
    s = scale.expand(x.shape[:-1])[..., None]
    y = torch.where(s > 0, x.float() / s, torch.zeros_like(x.float())).clamp(-QMAX[dtype], QMAX[dtype])
    return (y.round() if dtype == INT8 else y).to(dtype)


def _quantize(x, dtype, granularity):
    """A float cache (B, S, H, D) -> (8-bit cache, float32 scale): per token and head ("token"), per kv head
    ("head") or one scale ("scalar"), each absmax / QMAX over what it covers."""
    amax = x.float().abs().amax(-1)
    if granularity == "head":
        amax = amax.amax((0, 1))
    elif granularity == "scalar":
        amax = amax.amax()
    scale = (amax / QMAX[dtype]).contiguous()
    return _to_8bit(x, scale, dtype), scale


def _quant_cache(gen, batch, max_seqlen, nheads_kv, headdim, dtype, granularity, lens=None):
    """K and V 8-bit caches with their scales; per-token scales past each sequence's length are NaN (never read)."""
    out = []
    for _ in range(2):
        x = randn(batch, max_seqlen, nheads_kv, headdim, gen=gen) * 2.0
        cache, scale = _quantize(x, dtype, granularity)
        if granularity == "token" and lens is not None:
            for b, n in enumerate(lens):
                scale[b, n:] = float("nan")
        out += [cache, scale]
    return out


def _dequant(cache, scale):
    return torch.nan_to_num(dequantize_cache(cache, scale), nan=0.0)


def _page(x, table, page_size, num_pages, fill):
    """Scatter a contiguous (B, S, ...) tensor into (num_pages, page_size, ...) pages per ``table``; other slots
    hold ``fill``."""
    b, pages_per_seq = table.shape
    padded = torch.full((b, pages_per_seq * page_size, *x.shape[2:]), fill, dtype=torch.float32, device=x.device)
    padded[:, :x.shape[1]] = x.float()
    pages = torch.full((num_pages, page_size, *x.shape[2:]), fill, dtype=torch.float32, device=x.device)
    pages[table.long().flatten()] = padded.view(b * pages_per_seq, page_size, *x.shape[2:])
    return pages.to(x.dtype)


def _paged(gen, kc, ks, vc, vs, page_size, extra_pages=2):
    """The 8-bit caches (and per-token scales) in randomly permuted pages, unused pages holding 3 (data) and NaN
    (scales)."""
    b, s = kc.shape[:2]
    pages_per_seq = -(-s // page_size)
    num_pages = b * pages_per_seq + extra_pages
    table = torch.randperm(num_pages, generator=gen)[: b * pages_per_seq].view(b, pages_per_seq)
    table = table.to(torch.int32).to(DEVICE)
    kp, vp = (_page(c, table, page_size, num_pages, 3.0) for c in (kc, vc))
    if ks.dim() == 3:
        ks, vs = (_page(x, table, page_size, num_pages, float("nan")) for x in (ks, vs))
    return kp, ks, vp, vs, table


def _check(out, lse, q, kc, ks, vc, vs, lens, **kw):
    """out / lse vs decode_ref on the dequantised contiguous cache (float64, and q's dtype as the baseline)."""
    k, v = _dequant(kc, ks), _dequant(vc, vs)
    o64, lse64 = ref.decode_ref(q.double(), k.double(), v.double(), lens, **kw)
    o_same, lse_same = ref.decode_ref(q, k.to(q.dtype), v.to(q.dtype), lens, **kw)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=2e-3)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=2e-3, name="lse")


def _q(gen, batch, nheads, headdim, seqlen_q=1, dtype=torch.float16):
    shape = (batch, nheads, headdim) if seqlen_q == 1 else (batch, seqlen_q, nheads, headdim)
    return randn(*shape, gen=gen, dtype=dtype)


@pytest.mark.parametrize("dtype", [FP8, INT8])
@pytest.mark.parametrize("granularity", ["token", "head", "scalar"])
@pytest.mark.parametrize("group,seqlen_q,num_splits", [(1, 1, 1), (5, 2, 3), (8, 1, None)])
def test_contiguous_matches_reference_on_the_dequantised_cache(gen, dtype, granularity, group, seqlen_q,
                                                              num_splits):
    lens = [37, 0, 50, 2] if seqlen_q == 1 else [37, 2, 50, 2]
    q = _q(gen, len(lens), 2 * group, 32, seqlen_q)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 52, 2, 32, dtype, granularity, lens)
    out, lse = flashdecode.flash_decode(q, kc, vc, _lens(lens), k_scale=ks, v_scale=vs, num_splits=num_splits,
                                        return_lse=True)
    _check(out, lse, q, kc, ks, vc, vs, _lens(lens))


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("dtype,granularity", [(FP8, "token"), (INT8, "token"), (INT8, "head"), (FP8, "scalar")])
def test_paged_matches_reference(gen, page_size, dtype, granularity):
    lens = [40, 0, 23]
    q = _q(gen, len(lens), 5, 32)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 40, 1, 32, dtype, granularity, lens)
    kp, ksp, vp, vsp, table = _paged(gen, kc, ks, vc, vs, page_size)
    out, lse = flashdecode.flash_decode(q, kp, vp, _lens(lens), block_table=table, k_scale=ksp, v_scale=vsp,
                                        num_splits=2, return_lse=True)
    _check(out, lse, q, kc, ks, vc, vs, _lens(lens))


def _persistent(config):
    path = DecodePath.UNSPLIT if config.num_splits == 1 else DecodePath.PERSISTENT
    return dataclasses.replace(config, path=path)


def _queue(config):
    if config.num_splits == 1:
        return config
    return dataclasses.replace(config, path=DecodePath.PERSISTENT_QUEUE, persistent_programs=3, persistent_slots=2)


def _device_splits(config):
    return dataclasses.replace(config, path=DecodePath.DEVICE_SPLIT_GRID)


@pytest.mark.parametrize("tweak", [_persistent, _queue, _device_splits])
@pytest.mark.parametrize("page_size", [None, 16])
def test_every_path(gen, tweak, page_size):
    """The persistent kernel (static shares, work queue) and the device-split grid on the 8-bit cache."""
    lens = [61, 5, 33]
    q = _q(gen, len(lens), 4, 32)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 64, 2, 32, FP8, "token", lens)
    kw = dict(k_scale=ks, v_scale=vs)
    table = None
    if page_size:
        kp, ksp, vp, vsp, table = _paged(gen, kc, ks, vc, vs, page_size)
        kw = dict(k_scale=ksp, v_scale=vsp)
    else:
        kp, vp = kc, vc
    config = tweak(decode_config(q, kp, vp, _lens(lens), block_table=table, num_splits=3, **kw))
    out, lse = flashdecode.flash_decode(q, kp, vp, _lens(lens), block_table=table, config=config, return_lse=True,
                                        **kw)
    _check(out, lse, q, kc, ks, vc, vs, _lens(lens))


def test_plan_with_softcap_window_and_seqlen_q(gen):
    """DecodePlan(kv_dtype=int8) with softcap, a window and 3 new tokens per sequence, fp32 q."""
    lens = [45, 9]
    q = _q(gen, 2, 8, 32, seqlen_q=3, dtype=torch.float32)
    kc, ks, vc, vs = _quant_cache(gen, 2, 48, 2, 32, INT8, "token", lens)
    plan = flashdecode.DecodePlan(2, 8, 2, 32, max_seqlen_k=48, dtype=torch.float32, device=DEVICE, max_seqlen_q=3,
                                  kv_dtype=INT8, num_splits=2)
    kw = dict(softcap=5.0, window_size=(11, 0))
    out, lse = plan.run(q, kc, vc, _lens(lens), k_scale=ks, v_scale=vs, return_lse=True, **kw)
    _check(out, lse, q, kc, ks, vc, vs, _lens(lens), **kw)


def test_zero_scales_and_saturation(gen):
    """All-zero tokens (scale 0) read back as zeros; +-448 / +-127 codes at the format's limits."""
    lens = [30, 17]
    q = _q(gen, 2, 2, 16)
    for dtype in (FP8, INT8):
        kc, ks, vc, vs = _quant_cache(gen, 2, 32, 1, 16, dtype, "token", lens)
        ks[:, ::3] = 0.0
        vs[:, 1::4] = 0.0
        kc[:, 5], vc[:, 6] = QMAX[dtype], -QMAX[dtype]
        out, lse = flashdecode.flash_decode(q, kc, vc, _lens(lens), k_scale=ks, v_scale=vs, return_lse=True)
        _check(out, lse, q, kc, ks, vc, vs, _lens(lens))


def test_float_cache_path_unchanged(gen):
    """A fp16 cache without scales gives exactly what it gave before (the KV_QUANT=0 kernels)."""
    q = _q(gen, 2, 4, 32)
    k, v = (randn(2, 40, 2, 32, gen=gen, dtype=torch.float16) for _ in range(2))
    out = flashdecode.flash_decode(q, k, v, _lens([40, 13]), num_splits=2)
    o64, _ = ref.decode_ref(q.double(), k.double(), v.double(), _lens([40, 13]))
    o_same, _ = ref.decode_ref(q, k, v, _lens([40, 13]))
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------

def _bad_call(gen, **overrides):
    q = _q(gen, 2, 4, 16)
    kc, ks, vc, vs = _quant_cache(gen, 2, 8, 2, 16, FP8, "token")
    kw = dict(q=q, k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs)
    kw.update(overrides)
    return flashdecode.flash_decode(kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache"), _lens([8, 3]), **kw)


@pytest.mark.parametrize("overrides,err,match", [
    (dict(k_scale=None), ValueError, "k_scale is required"),
    (dict(v_scale=None), ValueError, "v_scale is required"),
    (dict(k_scale=torch.ones(2, 8, 3)), ValueError, "k_scale of shape"),
    (dict(v_scale=torch.ones(5)), ValueError, "v_scale of shape"),
    (dict(k_scale=torch.ones(2, 8, 2, dtype=torch.float16)), TypeError, "k_scale must be float32"),
    (dict(k_scale=[1.0]), TypeError, "k_scale must be a float32"),
    (dict(k_scale=torch.ones(2, 8, 2, device="meta")), ValueError, "k_scale is on"),
    (dict(v_scale=torch.ones(())), ValueError, "k_scale and v_scale must have the same"),
    (dict(v_cache=torch.zeros(2, 8, 2, 16, dtype=torch.int8)), TypeError, "same dtype"),
    (dict(q=torch.zeros(2, 4, 16, dtype=FP8)), TypeError, "q"),
])
def test_bad_quant_arguments(gen, overrides, err, match):
    with pytest.raises(err, match=match):
        _bad_call(gen, **overrides)


def test_scale_on_a_float_cache_is_refused(gen):
    q = _q(gen, 2, 4, 16)
    k = randn(2, 8, 2, 16, gen=gen, dtype=torch.float16)
    with pytest.raises(ValueError, match="k_scale is only for an 8-bit"):
        flashdecode.flash_decode(q, k, k, _lens([8, 3]), k_scale=torch.ones(()), v_scale=torch.ones(()))
    with pytest.raises(TypeError, match="kv_dtype"):
        flashdecode.DecodePlan(2, 4, 2, 16, max_seqlen_k=8, dtype=torch.float16, device=DEVICE,
                               kv_dtype=torch.bfloat16)
    plan = flashdecode.DecodePlan(2, 4, 2, 16, max_seqlen_k=8, dtype=torch.float16, device=DEVICE, kv_dtype=FP8)
    with pytest.raises(TypeError, match="kv_dtype"):
        plan.run(q, k, k, _lens([8, 3]))
