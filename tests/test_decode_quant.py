"""Decode on 8-bit KV caches (float8_e4m3fn, symmetric int8) and append_kv's quantising writes.

flash_decode on an 8-bit cache is checked against the float64 reference on the DEQUANTISED cache (k_cache.float()
* k_scale) with the FlashAttention rule (3x for decode); the same-dtype baseline is the PyTorch reference in q's
dtype on the dequantised cache. The CPU interpreter runs fp16 q (its bf16 tl.dot is wrong).
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import flashdecode
from flashdecode import DecodePath
from flashdecode import reference as ref
from flashdecode.kernels.kv_quant import e4m3_bits, keys_operand, keys_tile, to_dot_dtype
from flashdecode.ops.decode import decode_config
from flashdecode.ops.kv_quant import QMAX, dequantize_cache
from helpers import DEVICE, HAS_CUDA, assert_fa_close, randn, run_sm90_compile_script
from quant_helpers import (check_on_dequantised, dequant, heads_major, paged_quant_cache, quantize_float_cache,
                           quant_step, to_8bit)

FP8, INT8 = torch.float8_e4m3fn, torch.int8


def _lens(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _quant_cache(gen, batch, max_seqlen, nheads_kv, headdim, dtype, granularity, lens=None):
    """K and V 8-bit caches with their scales; per-token scales past each sequence's length are NaN (never read).
    granularity "token-strided": per-token scales in a heads-major layout (_heads_major)."""
    out = []
    for _ in range(2):
        x = randn(batch, max_seqlen, nheads_kv, headdim, gen=gen) * 2.0
        cache, scale = quantize_float_cache(x, dtype, granularity.split("-")[0])
        if granularity.startswith("token") and lens is not None:
            for b, n in enumerate(lens):
                scale[b, n:] = float("nan")
        if granularity == "token-strided":
            scale = heads_major(scale)
        out += [cache, scale]
    return out


def _q(gen, batch, nheads, headdim, seqlen_q=1, dtype=torch.float16):
    shape = (batch, nheads, headdim) if seqlen_q == 1 else (batch, seqlen_q, nheads, headdim)
    return randn(*shape, gen=gen, dtype=dtype)


@pytest.mark.parametrize("dtype", [FP8, INT8])
@pytest.mark.parametrize("granularity", ["token", "token-strided", "head", "scalar"])
@pytest.mark.parametrize("group,seqlen_q,num_splits", [(1, 1, 1), (5, 2, 3), (8, 1, None), (1, 4, 2)])
def test_contiguous_matches_reference_on_the_dequantised_cache(gen, dtype, granularity, group, seqlen_q,
                                                              num_splits):
    lens = [37, 0, 50, 2] if seqlen_q == 1 else [37, 4, 50, 5]
    q = _q(gen, len(lens), 2 * group, 32, seqlen_q)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 52, 2, 32, dtype, granularity, lens)
    out, lse = flashdecode.flash_decode(q, kc, vc, _lens(lens), k_scale=ks, v_scale=vs, num_splits=num_splits,
                                        return_lse=True)
    check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens))


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("dtype,granularity", [(FP8, "token"), (INT8, "token"), (FP8, "token-strided"),
                                               (INT8, "head"), (FP8, "scalar")])
def test_paged_matches_reference(gen, page_size, dtype, granularity):
    lens = [40, 0, 23]
    q = _q(gen, len(lens), 5, 32)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 40, 1, 32, dtype, granularity, lens)
    kp, ksp, vp, vsp, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
    out, lse = flashdecode.flash_decode(q, kp, vp, _lens(lens), block_table=table, k_scale=ksp, v_scale=vsp,
                                        num_splits=2, return_lse=True)
    check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens))


def _persistent(config):
    path = DecodePath.UNSPLIT if config.num_splits == 1 else DecodePath.PERSISTENT
    return dataclasses.replace(config, path=path)


def _queue(config):
    if config.num_splits == 1:
        return config
    return dataclasses.replace(config, path=DecodePath.PERSISTENT_QUEUE, persistent_programs=3, persistent_slots=2)


def _device_splits(config):
    return dataclasses.replace(config, path=DecodePath.DEVICE_SPLIT_GRID)


def _device_splits_in_kernel_merge(config):
    """The 8-bit batches' resolved launch: the device-split grid without a merge kernel."""
    return dataclasses.replace(config, path=DecodePath.DEVICE_SPLIT_GRID, merge_in_kernel=True)


@pytest.mark.parametrize("tweak", [_persistent, _queue, _device_splits, _device_splits_in_kernel_merge])
@pytest.mark.parametrize("page_size", [None, 16])
def test_every_path(gen, tweak, page_size):
    """The persistent kernel (static shares, work queue) and the device-split grid on the 8-bit cache."""
    lens = [61, 5, 33]
    q = _q(gen, len(lens), 4, 32)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 64, 2, 32, FP8, "token", lens)
    kw = dict(k_scale=ks, v_scale=vs)
    table = None
    if page_size:
        kp, ksp, vp, vsp, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
        kw = dict(k_scale=ksp, v_scale=vsp)
    else:
        kp, vp = kc, vc
    config = tweak(decode_config(q, kp, vp, _lens(lens), block_table=table, num_splits=3, **kw))
    out, lse = flashdecode.flash_decode(q, kp, vp, _lens(lens), block_table=table, config=config, return_lse=True,
                                        **kw)
    check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens))


def test_plan_with_softcap_window_and_seqlen_q(gen):
    """DecodePlan(kv_dtype=int8) with softcap, a window and 3 new tokens per sequence, fp32 q."""
    lens = [45, 9]
    q = _q(gen, 2, 8, 32, seqlen_q=3, dtype=torch.float32)
    kc, ks, vc, vs = _quant_cache(gen, 2, 48, 2, 32, INT8, "token", lens)
    plan = flashdecode.DecodePlan(2, 8, 2, 32, max_seqlen_k=48, dtype=torch.float32, device=DEVICE, max_seqlen_q=3,
                                  kv_dtype=INT8, num_splits=2)
    kw = dict(softcap=5.0, window_size=(11, 0))
    out, lse = plan.run(q, kc, vc, _lens(lens), k_scale=ks, v_scale=vs, return_lse=True, **kw)
    check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens), **kw)


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
        check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens))


def _warp_split(config, block_n=32, num_warps=2):
    """config with the keys of each block split across the warps (quant_warp_split; the interpreter's resolved
    config leaves it off): block_n // num_warps keys a warp."""
    return dataclasses.replace(config, quant_warp_split=True, block_n=block_n, num_warps=num_warps)


@pytest.mark.parametrize("page_size", [None, 1, 3, 16, 64])
@pytest.mark.parametrize("dtype,granularity", [(FP8, "token"), (INT8, "token-strided"), (FP8, "head"),
                                               (INT8, "scalar")])
@pytest.mark.parametrize("tweak", [lambda c: c, _persistent, _device_splits_in_kernel_merge])
def test_warp_split_loop_matches_reference(gen, page_size, dtype, granularity, tweak):
    """quant_warp_split (kernels/decode_blocks.py _attend_blocks_warps) on every page layout and scale granularity:
    pages of 64 hold whole blocks, of 16 are gathered from the split's preload, of 1 and 3 read in the loop; a
    sequence of 0 keys, splits that end mid-block and a group padded to 16 rows."""
    lens = [70, 0, 33]
    q = _q(gen, len(lens), 10, 32)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 72, 2, 32, dtype, granularity, lens)
    kp, ksp, vp, vsp, table = kc, ks, vc, vs, None
    if page_size:
        kp, ksp, vp, vsp, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
    kw = dict(block_table=table, k_scale=ksp, v_scale=vsp)
    config = _warp_split(tweak(decode_config(q, kp, vp, _lens(lens), num_splits=2, **kw)))
    out, lse = flashdecode.flash_decode(q, kp, vp, _lens(lens), config=config, return_lse=True, **kw)
    check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens))


@pytest.mark.parametrize("page_size", [None, 16])
def test_warp_split_loop_with_every_score_option(gen, page_size):
    """quant_warp_split with 3 new tokens per sequence (causal among them), softcap, a window and ALiBi slopes,
    4 warps of 16 keys, one split and three."""
    lens = [90, 3, 41]
    q = _q(gen, len(lens), 4, 32, seqlen_q=3)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 96, 2, 32, FP8, "token", lens)
    kp, ksp, vp, vsp, table = kc, ks, vc, vs, None
    if page_size:
        kp, ksp, vp, vsp, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
    slopes = _alibi_slopes(gen, len(lens), 4)
    score = dict(softcap=4.0, window_size=(37, 0), alibi_slopes=slopes)
    kw = dict(block_table=table, k_scale=ksp, v_scale=vsp)
    for splits in (1, 3):
        config = _warp_split(decode_config(q, kp, vp, _lens(lens), num_splits=splits, **kw), 64, 4)
        out, lse = flashdecode.flash_decode(q, kp, vp, _lens(lens), config=config, return_lse=True, **kw, **score)
        check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens), **score)


@pytest.mark.parametrize("headdim,q_dtype,seqlen_q,group", [(40, torch.float16, 1, 8), (32, torch.float32, 4, 8),
                                                        (48, torch.float16, 2, 3)])
@pytest.mark.parametrize("page_size", [None, 16])
def test_warp_split_loop_odd_head_dims_and_row_blocks(gen, headdim, q_dtype, seqlen_q, group, page_size):
    """quant_warp_split with head dims padded to a power of two (40, 48), fp32 q, and 32 query rows a kv head
    (4 new tokens x a group of 8)."""
    lens = [70, 0, 33]
    q = _q(gen, len(lens), 2 * group, headdim, seqlen_q, dtype=q_dtype)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 72, 2, headdim, FP8, "token", lens)
    kp, ksp, vp, vsp, table = kc, ks, vc, vs, None
    if page_size:
        kp, ksp, vp, vsp, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
    kw = dict(block_table=table, k_scale=ksp, v_scale=vsp)
    config = _warp_split(decode_config(q, kp, vp, _lens(lens), num_splits=2, **kw))
    out, lse = flashdecode.flash_decode(q, kp, vp, _lens(lens), config=config, return_lse=True, **kw)
    check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens))


@pytest.mark.parametrize("page_size", [3, 16, 32])
def test_warp_split_loop_reads_bad_page_ids_as_absent_keys(gen, page_size, device_resident):
    """Ids -1, num_pages and 2**30 in a device-resident block table of an e4m3 cache under quant_warp_split (ids
    read in the loop, and one per block): no read outside the cache, and the result is the reference over the
    present keys only (packed to the front: one new token, no window, so their order does not matter)."""
    from test_decode import _corrupt_table

    lens = [70, 40, 57]
    q = _q(gen, len(lens), 8, 32)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 72, 2, 32, FP8, "token", lens)
    kp, ksp, vp, vsp, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
    bad, present = _corrupt_table(table, kp.shape[0], lens, page_size)
    kw = dict(block_table=bad, k_scale=ksp, v_scale=vsp)
    config = _warp_split(decode_config(q, kp, vp, _lens(lens), num_splits=2, **kw))
    out = flashdecode.flash_decode(q, kp, vp, _lens(lens), config=config, **kw)
    k, v = dequant(kc, ks), dequant(vc, vs)
    kk, vv, packed = torch.zeros_like(k), torch.zeros_like(v), []
    for b, n in enumerate(lens):
        idx = present[b, :n].nonzero().squeeze(1).to(k.device)
        kk[b, :idx.numel()], vv[b, :idx.numel()] = k[b, idx], v[b, idx]
        packed.append(idx.numel())
    o64 = ref.decode_ref(q.double(), kk.double(), vv.double(), _lens(packed))[0]
    o_same = ref.decode_ref(q, kk.to(q.dtype), vv.to(q.dtype), _lens(packed))[0]
    assert_fa_close(out, o64, o_same, factor=3.0, atol=2e-3)


def test_warp_split_is_refused_where_it_cannot_run(gen):
    """quant_warp_split on a 16-bit cache, or with fewer than 16 keys a warp: ValueError naming the field."""
    lens = _lens([20])
    q = _q(gen, 1, 2, 32)
    k = randn(1, 32, 2, 32, gen=gen, dtype=torch.float16)
    with pytest.raises(ValueError, match="quant_warp_split"):
        flashdecode.flash_decode(q, k, k, lens, config=_warp_split(decode_config(q, k, k, lens)))
    kc, ks, vc, vs = _quant_cache(gen, 1, 32, 2, 32, FP8, "token")
    config = decode_config(q, kc, vc, lens, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="quant_warp_split"):
        flashdecode.flash_decode(q, kc, vc, lens, k_scale=ks, v_scale=vs, config=_warp_split(config, 32, 4))


def test_float_cache_path_unchanged(gen):
    """A fp16 cache without scales gives exactly what it gave before (the KV_QUANT=0 kernels)."""
    q = _q(gen, 2, 4, 32)
    k, v = (randn(2, 40, 2, 32, gen=gen, dtype=torch.float16) for _ in range(2))
    out = flashdecode.flash_decode(q, k, v, _lens([40, 13]), num_splits=2)
    o64, _ = ref.decode_ref(q.double(), k.double(), v.double(), _lens([40, 13]))
    o_same, _ = ref.decode_ref(q, k, v, _lens([40, 13]))
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)


def _alibi_slopes(gen, batch, nheads):
    """(batch, nheads) fp32 ALiBi slopes, geometric per head and scaled per sequence."""
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / nheads) for i in range(nheads)])
    return (base[None, :] * (0.5 + torch.rand(batch, nheads, generator=gen))).to(DEVICE)


@pytest.mark.parametrize("page_size", [None, 16])
def test_alibi_and_batch_invariant_on_an_8bit_cache(gen, page_size):
    """k_scale / v_scale with alibi_slopes and batch_invariant=True in one call (flash_decode and a DecodePlan made
    batch-invariant for an e4m3 cache): vs the float64 reference with ALiBi on the dequantised cache, and a
    sequence's rows bitwise equal whether it runs in the batch or alone."""
    lens = [45, 3, 30]
    q = _q(gen, len(lens), 4, 32, seqlen_q=2)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 48, 2, 32, FP8, "token", lens)
    slopes = _alibi_slopes(gen, len(lens), 4)
    table = None
    kp, ksp, vp, vsp = kc, ks, vc, vs
    if page_size:
        kp, ksp, vp, vsp, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
    kw = dict(block_table=table, k_scale=ksp, v_scale=vsp, softcap=4.0, return_lse=True)
    out, lse = flashdecode.flash_decode(q, kp, vp, _lens(lens), alibi_slopes=slopes, batch_invariant=True, **kw)
    check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens), alibi_slopes=slopes, softcap=4.0)
    alone_kw = dict(kw, block_table=None if table is None else table[:1])
    if page_size is None:  # contiguous: the first sequence's cache rows and scales alone
        alone_kw.update(k_scale=ksp[:1], v_scale=vsp[:1])
    alone = flashdecode.flash_decode(q[:1], kp if page_size else kp[:1], vp if page_size else vp[:1],
                                     _lens(lens[:1]), alibi_slopes=slopes[:1], batch_invariant=True, **alone_kw)
    assert torch.equal(alone[0], out[:1]) and torch.equal(alone[1], lse[:1])
    plan = flashdecode.DecodePlan(len(lens), 4, 2, 32, max_seqlen_k=48, dtype=q.dtype, device=DEVICE,
                                  max_seqlen_q=2, kv_dtype=FP8, batch_invariant=True)
    run_out, run_lse = plan.run(q, kp, vp, _lens(lens), alibi_slopes=slopes, **kw)
    assert torch.equal(run_out, out) and torch.equal(run_lse, lse)


def test_sinks_reach_the_8bit_cache(gen):
    """sinks= with k_scale / v_scale (flash_decode and DecodePlan.run go through ops/sinks.py, which forwards the
    scales): vs logaddexp(lse, sink) and out * exp(lse - lse') of the float64 reference on the dequantised cache."""
    lens = [37, 0, 20]
    q = _q(gen, len(lens), 4, 32)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 40, 2, 32, INT8, "token", lens)
    sinks = torch.randn(4, generator=gen).to(DEVICE)
    k, v = dequant(kc, ks), dequant(vc, vs)
    expected = []
    for dtype in (torch.float64, q.dtype):
        o, l_ = ref.decode_ref(q.to(dtype), k.to(dtype), v.to(dtype), _lens(lens))
        l_sink = torch.logaddexp(l_.double(), sinks.double()[None, :])
        expected.append(((o.double() * torch.exp(l_.double() - l_sink)[..., None]).to(dtype), l_sink))
    plan = flashdecode.DecodePlan(len(lens), 4, 2, 32, max_seqlen_k=40, dtype=q.dtype, device=DEVICE, kv_dtype=INT8)
    for call in (flashdecode.flash_decode, plan.run):
        out, lse = call(q, kc, vc, _lens(lens), k_scale=ks, v_scale=vs, sinks=sinks, return_lse=True)
        assert_fa_close(out, expected[0][0], expected[1][0], factor=3.0, atol=2e-3)
        assert_fa_close(lse, expected[0][1], expected[1][1], factor=3.0, atol=2e-3, name="lse")


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
    (dict(k_scale=torch.ones(2, 8, 3, device=DEVICE)), ValueError, "k_scale of shape"),
    (dict(v_scale=torch.ones(5, device=DEVICE)), ValueError, "v_scale of shape"),
    (dict(k_scale=torch.ones(2, 8, 2, dtype=torch.float16, device=DEVICE)), TypeError, "k_scale must be float32"),
    (dict(k_scale=[1.0]), TypeError, "k_scale must be a float32"),
    (dict(k_scale=torch.ones(2, 8, 2, device="meta")), ValueError, "k_scale is on"),
    (dict(v_scale=torch.ones((), device=DEVICE)), ValueError, "k_scale and v_scale must have the same"),
    (dict(v_cache=torch.zeros(2, 8, 2, 16, dtype=torch.int8, device=DEVICE)), TypeError, "same dtype"),
    (dict(q=torch.zeros(2, 4, 16, dtype=FP8, device=DEVICE)), TypeError, "q"),
])
def test_bad_quant_arguments(gen, overrides, err, match):
    with pytest.raises(err, match=match):
        _bad_call(gen, **overrides)


def test_scale_on_a_float_cache_is_refused(gen):
    q = _q(gen, 2, 4, 16)
    k = randn(2, 8, 2, 16, gen=gen, dtype=torch.float16)
    with pytest.raises(ValueError, match="k_scale is only for an 8-bit"):
        flashdecode.flash_decode(q, k, k, _lens([8, 3]), k_scale=torch.ones((), device=DEVICE),
                                 v_scale=torch.ones((), device=DEVICE))
    with pytest.raises(TypeError, match="kv_dtype"):
        flashdecode.DecodePlan(2, 4, 2, 16, max_seqlen_k=8, dtype=torch.float16, device=DEVICE,
                               kv_dtype=torch.bfloat16)
    plan = flashdecode.DecodePlan(2, 4, 2, 16, max_seqlen_k=8, dtype=torch.float16, device=DEVICE, kv_dtype=FP8)
    with pytest.raises(TypeError, match="kv_dtype"):
        plan.run(q, k, k, _lens([8, 3]))


# ----------------------------------------------------------------------------------------------------------------
# append_kv into an 8-bit cache
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [FP8, INT8])
@pytest.mark.parametrize("page_size", [None, 3])
def test_append_kv_per_token_round_trip(gen, dtype, page_size):
    """Per-token-head scales are written (absmax / QMAX; 0 for an all-zero token) and the dequantised cache is
    within the format's step of the new tokens; nothing else changes."""
    b, s, h, d = 2, 12, 2, 24
    new = randn(b, 5, h, d, gen=gen, dtype=torch.float16) * 3.0
    vnew = randn(b, 5, h, d, gen=gen, dtype=torch.float16)
    new[1, 2, 0] = 0.0
    lens = _lens([4, 7])
    kc = torch.full((b, s, h, d), 7, dtype=torch.float32, device=DEVICE).to(dtype)
    vc = kc.clone()
    ks, vs = torch.full((b, s, h), -1.0, device=DEVICE), torch.full((b, s, h), -1.0, device=DEVICE)
    table = None
    if page_size:
        table = torch.tensor([[3, 0, 5, 1], [2, 6, 4, 7]], dtype=torch.int32, device=DEVICE)
        kc, vc = (torch.full((8, page_size, h, d), 7, dtype=torch.float32, device=DEVICE).to(dtype) for _ in range(2))
        ks, vs = torch.full((8, page_size, h), -1.0, device=DEVICE), torch.full((8, page_size, h), -1.0, device=DEVICE)
    before = [x.clone() for x in (kc, vc, ks, vs)]
    flashdecode.append_kv(kc, vc, new, vnew, lens, table, k_scale=ks, v_scale=vs)
    if page_size:
        kc, vc = ref.contiguous_from_paged(kc, vc, table, s)
        ks, vs = (ref.contiguous_from_paged(x[..., None], x[..., None], table, s)[0][..., 0] for x in (ks, vs))
    for cache, scale, x in ((kc, ks, new), (vc, vs, vnew)):
        for bi, n in enumerate([4, 7]):
            got_scale = scale[bi, n:n + 5]
            want_scale = x[bi].float().abs().amax(-1) / QMAX[dtype]
            torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
            deq = dequantize_cache(cache[bi, n:n + 5], got_scale)
            err = (deq - x[bi].float()).abs()
            assert (err <= quant_step(dtype, got_scale[..., None])(x[bi].float())).all()
            assert (scale[bi, :n] == -1).all() and (scale[bi, n + 5:] == -1).all()
            assert (cache[bi, :n].float() == 7).all() and (cache[bi, n + 5:].float() == 7).all()
    assert ks[1, 9, 0] == 0 and (kc[1, 9, 0].float() == 0).all()  # the all-zero token
    if not page_size:
        assert not any(torch.equal(a, bb) for a, bb in zip(before, (kc, vc, ks, vs)))


@pytest.mark.parametrize("dtype", [FP8, INT8])
def test_append_kv_with_given_scales_saturates(gen, dtype):
    """A per-kv-head scale (and a scalar) is read, not written: x / scale saturates at +-QMAX."""
    new = randn(1, 6, 2, 16, gen=gen, dtype=torch.float32)
    new[0, 0, 1, 3] = 1e4
    new[0, 1, 0, 2] = -1e4
    for scale in (torch.tensor([0.01, 0.02], device=DEVICE), torch.tensor(0.015, device=DEVICE)):
        kc = torch.zeros(1, 8, 2, 16, dtype=dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        given = scale.clone()
        flashdecode.append_kv(kc, vc, new, new, _lens([1]), k_scale=scale, v_scale=scale)
        assert torch.equal(scale, given)
        s = scale.expand(2)
        assert kc[0, 1, 1, 3].float() == QMAX[dtype] and kc[0, 2, 0, 2].float() == -QMAX[dtype]
        expect = to_8bit(new[0], s, dtype).float()
        got = kc[0, 1:7].float()
        assert ((got - expect).abs() <= (1 if dtype == INT8 else expect.abs() * 2.0**-3 + 2.0**-6)).all()
        assert (kc[0, 0].float() == 0).all() and (kc[0, 7].float() == 0).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NaN arithmetic
def test_append_kv_nonfinite_token_stays_local(gen):
    """A NaN and an inf new token get non-finite scales and read back as NaN; every other token's data and scale
    is exactly what it would be without them."""
    new = randn(2, 4, 2, 16, gen=gen, dtype=torch.float16)
    clean = new.clone()
    new[0, 1, 0, 5] = float("nan")
    new[1, 2, 1, 0] = float("inf")
    caches = []
    for x in (new, clean):
        kc = torch.zeros(2, 6, 2, 16, dtype=FP8, device=DEVICE)
        vc = torch.zeros_like(kc)
        ks, vs = torch.zeros(2, 6, 2, device=DEVICE), torch.zeros(2, 6, 2, device=DEVICE)
        flashdecode.append_kv(kc, vc, x, x, _lens([1, 2]), k_scale=ks, v_scale=vs)
        caches.append((kc.float(), ks))
    (kc, ks), (kc0, ks0) = caches
    bad = torch.zeros(2, 6, 2, dtype=torch.bool, device=DEVICE)
    bad[0, 2, 0] = bad[1, 4, 1] = True
    assert not torch.isfinite(ks[bad]).any()
    assert dequantize_cache(kc[0, 2, 0], ks[0, 2, 0]).isnan().all()
    assert torch.equal(ks[~bad], ks0[~bad]) and torch.equal(kc[~bad], kc0[~bad])


def test_append_then_decode_int8_paged(gen):
    """append_kv's per-token quantisation feeds flash_decode on a paged int8 cache (varlen new tokens)."""
    h, d, ps = 2, 32, 4
    lens0 = [3, 9]
    new = [randn(n, h, d, gen=gen, dtype=torch.float16) for n in (14, 6)]
    table = torch.tensor([[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]], dtype=torch.int32, device=DEVICE)
    kc = torch.zeros(10, ps, h, d, dtype=INT8, device=DEVICE)
    vc = torch.zeros_like(kc)
    ks, vs = torch.zeros(10, ps, h, device=DEVICE), torch.zeros(10, ps, h, device=DEVICE)
    packed = torch.cat(new)
    cu = torch.tensor([0, 14, 20], dtype=torch.int32, device=DEVICE)
    flashdecode.append_kv(kc, vc, packed, packed * 0.5, _lens(lens0), table, cu_seqlens_new=cu, k_scale=ks,
                          v_scale=vs)
    lens = _lens([17, 15])
    q = _q(gen, 2, 4, d)
    out, lse = flashdecode.flash_decode(q, kc, vc, lens, block_table=table, k_scale=ks, v_scale=vs,
                                        return_lse=True)
    kcc, vcc = ref.contiguous_from_paged(kc, vc, table)
    ksc, vsc = (ref.contiguous_from_paged(x[..., None], x[..., None], table)[0][..., 0] for x in (ks, vs))
    check_on_dequantised(out, lse, q, kcc, ksc, vcc, vsc, lens)


def test_append_kv_bad_scales(gen):
    new = randn(1, 2, 2, 16, gen=gen, dtype=torch.float16)
    kc = torch.zeros(1, 4, 2, 16, dtype=FP8, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale is required"):
        flashdecode.append_kv(kc, kc.clone(), new, new, _lens([0]))
    with pytest.raises(ValueError, match="writes per token"):
        flashdecode.append_kv(kc, kc.clone(), new, new, _lens([0]), k_scale=torch.zeros(1, 4, 1, device=DEVICE),
                              v_scale=torch.zeros(1, 4, 1, device=DEVICE))
    fc = torch.zeros(1, 4, 2, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="v_scale is only for an 8-bit"):
        flashdecode.append_kv(fc, fc.clone(), new, new, _lens([0]), v_scale=torch.zeros((), device=DEVICE))


@triton.jit
def _keys_operand_kernel(Q, QK, UNSCALE, M: tl.constexpr, D: tl.constexpr, QUANT_CONVERT: tl.constexpr = 0):
    offs = tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :]
    q_k, unscale = keys_operand(tl.load(Q + offs), QUANT_CONVERT)
    tl.store(QK + offs, q_k.to(tl.float32))
    tl.store(UNSCALE, unscale)


@pytest.mark.parametrize("magnitude", [0.0, 1e-30, 1e-3, 1.0, 3e4, 1e30])
def test_bf16_q_becomes_an_exact_fp16_keys_operand(magnitude):
    """kv_quant.keys_operand: a bf16 q tile scaled by a power of two into fp16 (the e4m3 K tile's dot dtype) stands
    for q exactly, whatever its magnitude (entries over ~2**-28 of the largest, here all), and never overflows."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(16, 32, generator=g) * magnitude).to(torch.bfloat16)
    q[0, 0] = magnitude  # (one entry at the magnitude itself, bf16-rounded)
    q = q.to(DEVICE)
    q_k = torch.empty(16, 32, device=DEVICE)
    unscale = torch.empty(1, device=DEVICE)
    _keys_operand_kernel[(1,)](q, q_k, unscale, 16, 32)
    assert torch.isfinite(q_k).all() and q_k.abs().max() < 2.0**15
    assert torch.equal((q_k.double() * unscale.double()), q.double())
    if magnitude:
        assert q_k.abs().max() >= 2.0**14


# ----------------------------------------------------------------------------------------------------------------
# e4m3 tiles to 16 bits by integer bit operations (kv_quant.e4m3_bits, DecodeConfig.quant_convert)
# ----------------------------------------------------------------------------------------------------------------

_NAN_CODES = (0x7F, 0xFF)


def _all_e4m3_codes():
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)


@triton.jit
def _e4m3_bits_kernel(X, Y, N: tl.constexpr, ASM: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, e4m3_bits(tl.load(X + offs), Y.dtype.element_ty, ASM))


@pytest.mark.parametrize("asm", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype,shift", [(torch.float16, 8), (torch.bfloat16, 120)])
def test_e4m3_bits_is_exact_for_every_code(asm, dtype, shift):
    """All 256 e4m3 codes: e4m3_bits gives torch's float8_e4m3fn -> float value times 2**-shift exactly, signed
    zeros, subnormals (0x01..0x07) and +-448 included; the two NaN codes read as NaN."""
    codes = _all_e4m3_codes().to(DEVICE)
    y = torch.empty(256, dtype=dtype, device=DEVICE)
    _e4m3_bits_kernel[(1,)](codes, y, 256, asm)
    want = codes.double() * 2.0 ** -shift
    assert torch.isnan(want[list(_NAN_CODES)]).all()
    torch.testing.assert_close(y.double(), want, rtol=0, atol=0, equal_nan=True)
    # the sign bit survives on zero, and subnormal codes stay distinct values
    assert torch.equal(torch.signbit(y[[0x00, 0x80]]).cpu(), torch.tensor([False, True]))
    assert (y[1:8].double() * 2.0 ** shift).tolist() == [m * 2.0 ** -9 for m in range(1, 8)]
    assert y[0x7E].double() * 2.0 ** shift == 448.0 and y[0xFE].double() * 2.0 ** shift == -448.0


@triton.jit
def _dot_operand_kernel(X, Y, N: tl.constexpr, KEYS: tl.constexpr, QUANT_CONVERT: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    if KEYS:
        y = keys_tile(x, Y.dtype.element_ty, QUANT_CONVERT)
    else:
        y = to_dot_dtype(x, Y.dtype.element_ty, False, QUANT_CONVERT)
    tl.store(Y + offs, y)


_GPU_CONVERT = pytest.param(2, marks=pytest.mark.gpu)  # packed PTX (inline asm: the GPU only; the gpu mark skips it
#                                                       on the CPU, conftest)


@pytest.mark.parametrize("convert", [0, 1, _GPU_CONVERT])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_v_operand_is_the_e4m3_value(convert, dtype):
    """kv_quant.to_dot_dtype (the V tile): every finite code becomes its exact value in fp16 / bf16 with either
    conversion (bit operations: the packed multiply by 2**8 / 2**120 takes subnormals to their normal values; on the
    GPU this checks that HMUL2 keeps bf16 / fp16 subnormal inputs)."""
    codes = _all_e4m3_codes().to(DEVICE)
    y = torch.empty(256, dtype=dtype, device=DEVICE)
    _dot_operand_kernel[(1,)](codes, y, 256, False, convert)
    finite = torch.ones(256, dtype=torch.bool)
    finite[list(_NAN_CODES)] = False
    assert torch.equal(y[finite].double(), codes[finite].double())
    _assert_nan_codes_read_nan(y, convert)


def _assert_nan_codes_read_nan(y, convert):
    """The e4m3 NaN codes (0x7F, 0xFF) read as NaN: by the bit operations everywhere, by the conversion instructions
    on the GPU (the CPU interpreter's own e4m3 conversion reads them as +-480)."""
    if convert != 0 or HAS_CUDA:
        assert torch.isnan(y[list(_NAN_CODES)]).all()


@pytest.mark.parametrize("convert,shift", [(0, 0), (1, 8), pytest.param(2, 8, marks=pytest.mark.gpu)])
def test_k_operand_and_its_unscale(convert, shift):
    """kv_quant.keys_tile against fp16 holds each finite code's value times 2**-shift (bit operations: 2**-8), and
    keys_operand's unscale carries exactly that factor back (fp16 q, and bf16 q scaled into fp16)."""
    codes = _all_e4m3_codes().to(DEVICE)
    y = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _dot_operand_kernel[(1,)](codes, y, 256, True, convert)
    finite = torch.ones(256, dtype=torch.bool)
    finite[list(_NAN_CODES)] = False
    assert torch.equal(y[finite].double() * 2.0 ** shift, codes[finite].double())
    _assert_nan_codes_read_nan(y, convert)
    for q_dtype in (torch.float16, torch.bfloat16):
        q = torch.full((16, 32), 1.5, dtype=q_dtype, device=DEVICE)
        q_k = torch.empty(16, 32, device=DEVICE)
        unscale = torch.empty(1, device=DEVICE)
        _keys_operand_kernel[(1,)](q, q_k, unscale, 16, 32, convert)
        assert torch.equal(q_k.double() * unscale.double() * 2.0 ** -shift, q.double())


@pytest.mark.gpu
def test_int8_k_operand_by_packed_ptx():
    """kv_quant.keys_tile with quant_convert 2 takes int8 K tiles to fp16 by the magic-number PTX (int8_to_fp16):
    every code exactly."""
    codes = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8).to(DEVICE)
    y = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _dot_operand_kernel[(1,)](codes, y, 256, True, 2)
    assert torch.equal(y.double(), codes.double())


def _all_codes_cache(gen, batch, seqlen, nheads_kv, headdim):
    """An e4m3 cache (B, S, H, D) of random finite codes (subnormals, zeros, +-448 included) and per-token scales
    over 2**-10 .. 2**4 (the values stay within fp16, q's dtype here), a quarter of them 0."""
    codes = torch.randint(0, 256, (batch, seqlen, nheads_kv, headdim), generator=gen, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] -= 1  # NaN codes -> +-448
    codes[:, :, :, :4] = torch.tensor([0x01, 0x87, 0x7E, 0xFE])  # a subnormal of each sign, +-448 in every row
    cache = codes.to(torch.uint8).view(FP8)
    scale = torch.exp2(torch.randint(-10, 5, (batch, seqlen, nheads_kv), generator=gen).float())
    scale *= torch.rand(batch, seqlen, nheads_kv, generator=gen) + 0.5
    scale[torch.rand(batch, seqlen, nheads_kv, generator=gen) < 0.25] = 0.0
    return cache.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("page_size", [None, 16])
def test_decode_on_every_code_with_either_conversion(gen, page_size):
    """flash_decode on caches of every finite e4m3 code with per-token scales (some 0), quant_convert 0 (conversion
    instructions), 1 (Triton bit operations) and, where kernels are compiled, 2 (packed PTX bit operations: the
    GPU's resolution; the interpreter's is 1) forced through config=: each vs the float64 reference (3x rule), and
    all bitwise equal (the bit operations' powers of two come back exactly)."""
    lens = [70, 0, 33]
    q = _q(gen, len(lens), 4, 32)
    kc, ks = _all_codes_cache(gen, len(lens), 72, 2, 32)
    vc, vs = _all_codes_cache(gen, len(lens), 72, 2, 32)
    kw, table, kp, vp = dict(k_scale=ks, v_scale=vs), None, kc, vc
    if page_size:
        kp, ksp, vp, vsp, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
        kw = dict(k_scale=ksp, v_scale=vsp)
    config = decode_config(q, kp, vp, _lens(lens), block_table=table, num_splits=2, **kw)
    compiled = DEVICE.type == "cuda"
    assert config.quant_convert == (2 if compiled else 1)
    results = []
    for convert in (0, 1, 2) if compiled else (0, 1):
        out, lse = flashdecode.flash_decode(q, kp, vp, _lens(lens), block_table=table, return_lse=True,
                                            config=dataclasses.replace(config, quant_convert=convert), **kw)
        check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens))
        results.append((out, lse))
    for out, lse in results[1:]:
        assert torch.equal(results[0][0], out) and torch.equal(results[0][1], lse)


def test_quant_convert_is_resolved_in_one_place(monkeypatch):
    """heuristics.decode_quant_convert: packed PTX with K converted after its layout change on a GPU, Triton
    integer ops in the interpreter, the conversion instructions (K after) with DECODE_QUANT_BIT_CONVERT off;
    resolve_decode_config and batch_invariant_config both take it, and a config with another quant_convert is
    refused naming the field."""
    from flashdecode import heuristics
    from flashdecode.config import check_decode_config

    hopper = heuristics.DecodeDevice(num_sms=132, interpret=False, hopper=True, pdl=True)
    cpu = heuristics.DecodeDevice(num_sms=1, interpret=True, hopper=False, pdl=False)
    assert heuristics.decode_quant_convert(hopper) == dict(quant_v_convert_first=True, quant_convert=2,
                                                           quant_k_convert_first=False)
    assert heuristics.decode_quant_convert(cpu) == dict(quant_v_convert_first=False, quant_convert=1,
                                                        quant_k_convert_first=False)
    problem = heuristics.DecodeProblem(batch=1, grid_batch=1, seqlen_q=1, group=8, nheads_kv=2, headdim=128,
                                       elem_bytes=1, page_size=16, capacity=32768, window_left=-1,
                                       live_keys=32768)
    assert heuristics.resolve_decode_config(problem, hopper).quant_convert == 2
    assert heuristics.batch_invariant_config(problem, hopper).quant_convert == 2
    monkeypatch.setattr(heuristics, "DECODE_QUANT_BIT_CONVERT", False)
    config = heuristics.resolve_decode_config(problem, hopper)
    assert config.quant_convert == 0 and not config.quant_k_convert_first and config.quant_v_convert_first
    with pytest.raises(ValueError, match="quant_convert"):
        check_decode_config(dataclasses.replace(heuristics.resolve_decode_config(problem, hopper), quant_convert=3))


# ----------------------------------------------------------------------------------------------------------------
# GPU: bf16 q, hd128, the tiles the resolver gives 8-bit caches (V converted before shared memory)
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,page_size,granularity,seqlen_q", [
    (FP8, None, "token", 1), (FP8, 16, "token", 1), (FP8, 1, "token", 2), (FP8, 16, "scalar", 1),
    (FP8, 128, "token-strided", 1), (INT8, None, "head", 2), (INT8, 16, "token", 1)])
def test_gpu_8bit_cache_production_tiles(gen, dtype, page_size, granularity, seqlen_q):
    """Long ragged lengths on the GPU's own config (128-key tiles at 8 warps on hd128, V converted to bf16 before
    its shared-memory stage, e4m3 by packed PTX bit operations): flash_decode and a DecodePlan vs the float64
    reference on the dequantised cache; the other conversions give bitwise the same output on e4m3 (and pass the
    reference on int8)."""
    lens = [5003, 0, 777, 129]
    q = _q(gen, len(lens), 16, 128, seqlen_q, dtype=torch.bfloat16)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), max(lens), 2, 128, dtype, granularity, lens)
    kw = dict(k_scale=ks, v_scale=vs)
    table = None
    kp, vp = kc, vc
    if page_size:
        kp, ksp, vp, vsp, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
        kw = dict(k_scale=ksp, v_scale=vsp)
    config = decode_config(q, kp, vp, _lens(lens), block_table=table, **kw)
    assert config.quant_v_convert_first and config.block_n * 128 <= 16384 and config.quant_convert == 2
    out, lse = flashdecode.flash_decode(q, kp, vp, _lens(lens), block_table=table, return_lse=True, **kw)
    check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens))
    # the conversion instructions (0) and the Triton bit operations (1) with K converted after its layout change,
    # as the resolved packed PTX (2): e4m3 gives the same bits (the same fp16 QK^T operands up to powers of two).
    # K converted first (an option: on the H100 its outputs were not bitwise equal to these) and int8 (K goes to
    # fp16 only with 2, bf16 otherwise) are checked against the reference.
    assert not config.quant_k_convert_first
    for convert, k_first in ((0, False), (1, False), (0, True), (2, True)):
        changed = dataclasses.replace(config, quant_convert=convert, quant_k_convert_first=k_first)
        out_c, lse_c = flashdecode.flash_decode(q, kp, vp, _lens(lens), block_table=table, return_lse=True,
                                                config=changed, **kw)
        if dtype == FP8 and not k_first:
            assert torch.equal(out_c, out) and torch.equal(lse_c, lse), (convert, k_first)
        else:
            check_on_dequantised(out_c, lse_c, q, kc, ks, vc, vs, _lens(lens))
    plan = flashdecode.DecodePlan(len(lens), 16, 2, 128, max_seqlen_k=max(lens), max_seqlen_q=seqlen_q,
                                  dtype=torch.bfloat16, device=q.device, kv_dtype=dtype)
    out_p, lse_p = plan.run(q, kp, vp, _lens(lens), block_table=table, return_lse=True, **kw)
    check_on_dequantised(out_p, lse_p, q, kc, ks, vc, vs, _lens(lens))


# ----------------------------------------------------------------------------------------------------------------
# sm_90 compile (Triton's ptxas, no GPU)
# ----------------------------------------------------------------------------------------------------------------

_QUANT_COMPILE_SCRIPT = r'''
import re
import sys
from flashdecode.kernels.append_kv import append_kv_kernel
from flashdecode.kernels.decode import decode_persistent_kernel, decode_split_kernel
sys.path.insert(0, "tests")
from helpers import compile_for_sm90, sass_opcodes, spilled_bytes
from flashdecode import heuristics

# the tile an 8-bit cache resolves to at hd128 (heuristics.decode_quant_tile: 128 keys, 4 warps), and the tiny tile
# of short gathered splits (64 keys, 4 warps). At 4 warps the 128-key tile holds 128 converted values per thread:
# stage 1 keeps it without spills; the persistent kernel (more live state per work item) spills a few bytes, which
# PERSISTENT_SPILL_BUDGET bounds (two such programs per SM still beat one of 8 warps: docs/decisions.md, "8-bit
# cache tiles").
PERSISTENT_SPILL_BUDGET = 128
problem = heuristics.DecodeProblem(batch=1, grid_batch=1, seqlen_q=1, group=8, nheads_kv=2, headdim=128,
                                   elem_bytes=1, page_size=16, capacity=32768, window_left=-1, live_keys=32768)
BLOCK_N, WARPS = heuristics.decode_quant_tile(problem, 128)
assert (BLOCK_N, WARPS) == (128, 4) and heuristics.decode_quant_tile(problem, 64) == (64, 4)
common = dict(SEQLEN_Q=1, GROUP=8, NUM_M_BLOCKS=1, HEADDIM=128, BLOCK_M=16, BLOCK_D=128, MIN_CHUNK=128,
              SOFTCAP=False, WINDOW=False, DOT_PRECISION="tf32", USE_TMA=False, USE_PDL=False, PDL_WAIT=False,
              OFFS_32=True, V_CONVERT_FIRST=True, QUANT_CONVERT=2,
              K_CONVERT_FIRST=True)


def assert_bit_conversion(kernel, what):
    """e4m3 tiles reach 16 bits without sm_90's conversion instructions (QUANT_CONVERT 2: PRMT / shift / LOP3, one
    packed HMUL2 per two V values)."""
    ops = sass_opcodes(kernel)
    conversions = [o for o in ops if o.startswith(("F2FP.F16.E4M3", "F2F.BF16.F16"))]
    assert not conversions and "PRMT" in ops and "HMUL2.BF16_V2" in ops, (what, conversions[:4])


def assert_16_byte_kv_copies(kernel, what, ids_in_loop=False):
    """K / V reach shared memory in 16-byte cp.async pieces (1-byte elements: 16 per copy; the 4-byte copies are the
    float32 scales; with ids_in_loop the block-table reads of the loop are pipelined too, in other sizes) and no
    8-bit tile is read back from it byte by byte (V_CONVERT_FIRST)."""
    ptx = kernel.asm["ptx"]
    sizes = set(re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (0x\w+)", ptx))
    assert (ids_in_loop or sizes <= {"0x10", "0x4"}) and "0x10" in sizes, (what, sizes)
    assert "ld.shared.b8" not in ptx and "ld.shared.u8" not in ptx, (what, "byte-wise shared loads")


# stage 1 (split grid) on e4m3 and int8 caches, per-token scales and one per head, contiguous and pages of 16
for kv, quant, page, preload in [("fp8e4nv", 3, 0, 0), ("fp8e4nv", 3, 16, 64), ("fp8e4nv", 2, 16, 64),
                                 ("i8", 1, 16, 64), ("i8", 3, 1, 0), ("i8", 2, 1, 0)]:
    types = dict(Q="*bf16", K=f"*{kv}", V=f"*{kv}", K_RAW=f"*{kv}", V_RAW=f"*{kv}", SEQLENS="*i32",
                 BLOCK_TABLE="*i32", O="*fp32", LSE="*fp32", score_scale="fp32", softcap_out="fp32",
                 K_SCALE="*fp32", V_SCALE="*fp32")
    consts = dict(common, BLOCK_N=BLOCK_N, NUM_SPLITS=16, PAGE_SIZE=page, FINAL=False, PRELOAD_PAGES=preload,
                  MERGE_SPLITS=16, KV_QUANT=quant, PREFETCH_KEYS=0, LINE_ELEMS=64, NUM_LINES=2,
                  DEVICE_SPLITS=False, SPLIT_SLOTS=0, BATCH_PAD=1, MAX_SPLIT_KEYS=0, KV_PROGRAMS=1,
                  SPEC_PAGES=False)
    kernel = compile_for_sm90(decode_split_kernel, types, consts, 5 if page == 1 else 3, WARPS)
    assert "async_copy_global_to_local" in kernel.asm["ttgir"], (kv, page, "8-bit loads not pipelined")
    assert spilled_bytes(kernel) == 0, (kv, quant, page, "spills")
    assert_16_byte_kv_copies(kernel, (kv, quant, page), ids_in_loop=page > 0 and preload == 0)
    if kv == "fp8e4nv":
        assert_bit_conversion(kernel, (quant, page))
    if page == 16:  # the tiny tile of short gathered splits, at its 4 warps
        kernel = compile_for_sm90(decode_split_kernel, types, dict(consts, BLOCK_N=64), 3, 4)
        assert spilled_bytes(kernel) == 0, (kv, quant, page, "64-key tile spills")
# ALiBi on an e4m3 cache (the bias after the k scale and the softcap): still pipelined, contiguous and paged
for page, preload in [(0, 0), (16, 64)]:
    types.update(K="*fp8e4nv", V="*fp8e4nv", K_RAW="*fp8e4nv", V_RAW="*fp8e4nv", ALIBI_SLOPES="*fp32")
    consts.update(PAGE_SIZE=page, PRELOAD_PAGES=preload, KV_QUANT=3, ALIBI=True, SOFTCAP=True)
    kernel = compile_for_sm90(decode_split_kernel, types, consts, 3, WARPS)
    assert "async_copy_global_to_local" in kernel.asm["ttgir"], (page, "8-bit + ALiBi loads not pipelined")
    assert spilled_bytes(kernel) == 0, (page, "8-bit + ALiBi + softcap spills")
# the persistent kernel, e4m3 per-token scales, pages of 128
types = dict(Q="*bf16", K="*fp8e4nv", V="*fp8e4nv", SEQLENS="*i32", BLOCK_TABLE="*i32", O="*fp32", LSE="*fp32",
             O_FINAL="*bf16", LSE_FINAL="*fp32", TICKETS="*i32", QUEUE="*i32", score_scale="fp32",
             softcap_out="fp32", K_SCALE="*fp32", V_SCALE="*fp32")
consts = dict(common, GROUP=4, NHEADS_KV=8, BLOCK_N=BLOCK_N, NUM_SPLITS=16, PAGE_SIZE=128, PRELOAD_PAGES=0,
              BATCH_PAD=64, MERGE_M=4, MERGE_SPLITS=16, MERGE_BLOCK_S=4, KV_QUANT=3, MAX_SPLIT_KEYS=0,
              DYNAMIC=False, SLOTS_PER_PROGRAM=1, QUEUE_SPLITS=0, QUEUE_FULL_FRACTION=0.5, QUEUE_SPLIT_COST=0.03)
kernel = compile_for_sm90(decode_persistent_kernel, types, consts, 3, WARPS)
assert "async_copy_global_to_local" in kernel.asm["ttgir"], "persistent 8-bit loads not pipelined"
assert spilled_bytes(kernel) <= PERSISTENT_SPILL_BUDGET, ("persistent 8-bit kernel spills", spilled_bytes(kernel))
assert_16_byte_kv_copies(kernel, "persistent")
assert_bit_conversion(kernel, "persistent")
# append_kv quantising bf16 rows into e4m3 / int8 with written per-token scales
for kv in ("fp8e4nv", "i8"):
    types = dict(K_NEW="*bf16", V_NEW="*bf16", K_CACHE=f"*{kv}", V_CACHE=f"*{kv}", SEQLENS="*i32", CU_NEW="*i32",
                 BLOCK_TABLE="*i32", K_SCALE="*fp32", V_SCALE="*fp32")
    compile_for_sm90(append_kv_kernel, types, dict(HEADDIM=128, BLOCK_T=32, BLOCK_D=128, PAGE_SIZE=16,
                                                   VARLEN=True, QUANT=2, QMAX=448.0 if kv == "fp8e4nv" else 127.0), 1)
print("compiled")
'''


def test_quant_kernels_compile_for_hopper_without_a_gpu():
    """The 8-bit variants of stage 1 (e4m3 / int8, per-token and per-head scales, contiguous and paged), the
    persistent kernel and append_kv's quantising writes compile for sm_90 with Triton's ptxas at the tiles the
    resolver gives 8-bit caches: K/V loads still software-pipelined in 16-byte pieces, V converted before shared
    memory (no byte-wise reads of it), stage 1 without spills and the persistent kernel within its small spill
    budget, e4m3 tiles converted by bit operations (no F2FP.F16.E4M3 / F2F.BF16.F16 left)."""
    run_sm90_compile_script(_QUANT_COMPILE_SCRIPT)


def test_scale_layouts_pick_the_kernel_mode():
    """KV_QUANT 3 for per-token scales laid out like the cache without its head dim (offsets from K's), 2 for other
    per-token layouts, 1 for one scale per kv head or one scalar."""
    from flashdecode.ops.kv_quant import kv_quant_kernel_args, resolve_kv_quant

    cache = torch.zeros(3, 8, 2, 16, dtype=FP8)
    dense = torch.ones(3, 8, 2)
    for scale, mode in ((dense, 3), (heads_major(dense), 2), (torch.ones(3, 1, 2), 2), (torch.ones(2), 1),
                        (torch.ones(()), 1)):
        quant = resolve_kv_quant(torch.float16, cache, cache, scale, scale)
        assert kv_quant_kernel_args(quant, cache)["KV_QUANT"] == mode, (tuple(scale.shape), scale.stride())


# ----------------------------------------------------------------------------------------------------------------
# DecodeConfig.max_registers: a register cap for stage 1, so that two 8-warp programs of an 8-bit cache share an SM
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [DecodePath.SPLIT_GRID, DecodePath.PERSISTENT])
def test_register_cap_reaches_the_launch_and_keeps_the_result(gen, path):
    """config.max_registers becomes the stage-1 launch's maxnreg (none at 0) and changes no result: e4m3 cache with
    per-token scales, split grid and persistent kernel, vs the float64 reference on the dequantised cache."""
    from flashdecode.ops.decode_launch import _register_cap

    lens = [61, 5, 33]
    q = _q(gen, len(lens), 4, 32)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 64, 2, 32, FP8, "token", lens)
    config = decode_config(q, kc, vc, _lens(lens), num_splits=3, k_scale=ks, v_scale=vs)
    assert config.max_registers == 0 and _register_cap(config) == {}  # the resolution leaves it to ptxas
    capped = dataclasses.replace(config, path=path, max_registers=128)
    assert _register_cap(capped) == {"maxnreg": 128}
    out, lse = flashdecode.flash_decode(q, kc, vc, _lens(lens), config=capped, return_lse=True, k_scale=ks,
                                        v_scale=vs)
    check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens))


@pytest.mark.parametrize("value,err", [(8, ValueError), (256, ValueError), (-1, ValueError), (True, TypeError),
                                       (128.0, TypeError)])
def test_bad_register_cap(gen, value, err):
    q = _q(gen, 1, 4, 32)
    kc, ks, vc, vs = _quant_cache(gen, 1, 16, 2, 32, FP8, "token")
    config = dataclasses.replace(decode_config(q, kc, vc, _lens([16]), k_scale=ks, v_scale=vs), max_registers=value)
    with pytest.raises(err, match="max_registers"):
        flashdecode.flash_decode(q, kc, vc, _lens([16]), config=config, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("path", [DecodePath.UNSPLIT, DecodePath.SPLIT_GRID, DecodePath.PERSISTENT])
@pytest.mark.parametrize("cache", ["e4m3", "fp16"])
def test_softmax_sum_tile_keeps_the_result(gen, path, cache):
    """config.softmax_sum_tile (row sums per key column, summed after the KV loops) on an e4m3 cache with per-token
    scales and on a fp16 cache: 2 new tokens, a softcap and a window (the masked loop and fully masked blocks), vs
    the float64 reference (on the dequantised cache)."""
    lens = [61, 5, 33]
    q = _q(gen, len(lens), 4, 32, seqlen_q=2)
    kc, ks, vc, vs = _quant_cache(gen, len(lens), 64, 2, 32, FP8, "token", lens)
    kw = dict(softcap=5.0, window_size=(19, 0))
    if cache == "fp16":
        kc, vc = dequant(kc, ks).half(), dequant(vc, vs).half()
        ks = vs = torch.ones(kc.shape[:-1], device=DEVICE)  # the float reference below: the same cache
        scales = {}
    else:
        scales = dict(k_scale=ks, v_scale=vs)
    splits = 1 if path is DecodePath.UNSPLIT else 3
    config = decode_config(q, kc, vc, _lens(lens), num_splits=splits, window_size=kw["window_size"], **scales)
    config = dataclasses.replace(config, path=path, softmax_sum_tile=True)
    out, lse = flashdecode.flash_decode(q, kc, vc, _lens(lens), config=config, return_lse=True, **kw, **scales)
    if cache == "fp16":
        kc, vc = kc.float(), vc.float()
    check_on_dequantised(out, lse, q, kc, ks, vc, vs, _lens(lens), **kw)


_REGISTER_CAP_SCRIPT = r'''
import re
import sys
from flashdecode.kernels.decode import decode_split_kernel
sys.path.insert(0, "tests")
from helpers import _cuobjdump, compile_for_sm90, registers


def spills_in_loops(kernel):
    """The local-memory (spill) instructions of the kernel's SASS that lie inside a loop (between a backward
    branch's target and the branch)."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", _cuobjdump(kernel, "-sass"))
    code = [(int(a, 16), text) for a, text in lines]
    loops = [(int(m.group(1), 16), a) for a, text in code for m in [re.search(r"BRA (0x[0-9a-f]+)", text)]
             if m and int(m.group(1), 16) < a]
    return [text for a, text in code if re.search(r"\b(LDL|STL)", text) and any(lo <= a <= hi for lo, hi in loops)]


# stage 1 as an e4m3 cache with per-token scales resolves at b1 16/2 hd128 32k keys (128-key tiles, 8 warps): 178
# registers, so one program per SM; under a 128-register cap two share one (65536 registers, 2 x 108 KiB of shared
# memory)
types = dict(Q="*bf16", K="*fp8e4nv", V="*fp8e4nv", K_RAW="*fp8e4nv", V_RAW="*fp8e4nv", SEQLENS="*i32",
             BLOCK_TABLE="*i32", O="*fp32", LSE="*fp32", score_scale="fp32", softcap_out="fp32", K_SCALE="*fp32",
             V_SCALE="*fp32")
consts = dict(SEQLEN_Q=1, GROUP=8, NUM_M_BLOCKS=1, HEADDIM=128, BLOCK_M=16, BLOCK_N=128, BLOCK_D=128, MIN_CHUNK=128,
              SOFTCAP=False, WINDOW=False, DOT_PRECISION="tf32", USE_TMA=False, USE_PDL=True, PDL_WAIT=True,
              OFFS_32=True, V_CONVERT_FIRST=True, QUANT_CONVERT=2, K_CONVERT_FIRST=False, NUM_SPLITS=64,
              PAGE_SIZE=0, FINAL=False, PRELOAD_PAGES=0, MERGE_SPLITS=64, KV_QUANT=3, PREFETCH_KEYS=128,
              LINE_ELEMS=128, NUM_LINES=1, DEVICE_SPLITS=False, SPLIT_SLOTS=0, BATCH_PAD=1, MAX_SPLIT_KEYS=0,
              KV_PROGRAMS=1, SPEC_PAGES=False)
free = compile_for_sm90(decode_split_kernel, types, consts, 3, 8)
capped = compile_for_sm90(decode_split_kernel, types, consts, 3, 8, maxnreg=128)
assert registers(free) > 128 and registers(capped) <= 128, (registers(free), registers(capped))
# (ptxas may keep a value or two of the epilogue in local memory, stored before the KV loops: none in them)
assert not spills_in_loops(capped), spills_in_loops(capped)[:4]
assert "async_copy_global_to_local" in capped.asm["ttgir"], "8-bit loads not pipelined under the cap"
assert 2 * capped.metadata.shared <= 227 * 1024, capped.metadata.shared


def loop_barriers(kernel):
    """Barriers (BAR.SYNC) per iteration of the kernel's first KV loop (the unmasked one)."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", _cuobjdump(kernel, "-sass"))
    code = [(int(a, 16), text) for a, text in lines]
    lo, hi = next((int(m.group(1), 16), a) for a, text in code for m in [re.search(r"BRA (0x[0-9a-f]+)", text)]
                  if m and int(m.group(1), 16) < a)
    return sum("BAR.SYNC" in text for a, text in code if lo <= a <= hi)


# softmax_sum_tile: the row sums per key column, no cross-warp sum per block (8 warps along the keys): fewer barriers
summed = compile_for_sm90(decode_split_kernel, types, dict(consts, SUM_TILE=True), 3, 8)
assert loop_barriers(summed) < loop_barriers(free), (loop_barriers(summed), loop_barriers(free))
assert not spills_in_loops(summed), "the sum tile spills"
print("compiled")
'''


def test_register_cap_and_sum_tile_compile_for_hopper():
    """Under max_registers=128 the 8-warp e4m3 stage 1 (as resolved at b1 16/2 hd128) compiles for sm_90 to <= 128
    registers without spills in its KV loops and still pipelined (without the cap ptxas takes more than 128), and two
    programs' shared memory fits an SM: the occupancy the cap is for. With softmax_sum_tile its KV loop has fewer
    barriers per block (sm_90, Triton 3.6: 8 -> 5) and no spills. (GPU timing: fp8_decode --sweep, rows r128 and
    sumtile.)"""
    run_sm90_compile_script(_REGISTER_CAP_SCRIPT)


_WARP_SPLIT_SCRIPT = r'''
import re
import sys
from flashdecode.kernels.decode import decode_persistent_kernel, decode_split_kernel
sys.path.insert(0, "tests")
from helpers import _cuobjdump, compile_for_sm90, spilled_bytes


def first_loop(kernel):
    """The SASS lines of the kernel's first loop (the first backward branch's range: the unmasked KV loop)."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", _cuobjdump(kernel, "-sass"))
    code = [(int(a, 16), text) for a, text in lines]
    lo, hi = next((int(m.group(1), 16), a) for a, text in code for m in [re.search(r"BRA (0x[0-9a-f]+)", text)]
                  if m and int(m.group(1), 16) < a)
    return [text for a, text in code if lo <= a <= hi]


# the persistent kernel as the Llama-3-8B shape resolves on an e4m3 cache with per-token scales (32 / 8 heads,
# hd128, 128-key tiles, 4 warps, 3 stages, row sums per key column), shared loop vs keys split across the warps
types = dict(Q="*bf16", K="*fp8e4nv", V="*fp8e4nv", SEQLENS="*i32", BLOCK_TABLE="*i32", O="*fp32", LSE="*fp32",
             O_FINAL="*bf16", LSE_FINAL="*fp32", TICKETS="*i32", QUEUE="*i32", score_scale="fp32",
             softcap_out="fp32", K_SCALE="*fp32", V_SCALE="*fp32")
consts = dict(SEQLEN_Q=1, GROUP=4, NUM_M_BLOCKS=1, HEADDIM=128, BLOCK_M=16, BLOCK_N=128, BLOCK_D=128,
              MIN_CHUNK=128, SOFTCAP=False, WINDOW=False, DOT_PRECISION="tf32", USE_TMA=False, USE_PDL=False,
              PDL_WAIT=False, OFFS_32=True, V_CONVERT_FIRST=True, QUANT_CONVERT=2, K_CONVERT_FIRST=False,
              NHEADS_KV=8, NUM_SPLITS=16, PAGE_SIZE=0, PRELOAD_PAGES=0, BATCH_PAD=16, MERGE_M=4, MERGE_SPLITS=16,
              MERGE_BLOCK_S=4, KV_QUANT=3, MAX_SPLIT_KEYS=0, DYNAMIC=False, SUM_TILE=True)
for page, preload in [(0, 0), (128, 0), (128, 64), (16, 64)]:
    shared = compile_for_sm90(decode_persistent_kernel, types, dict(consts, PAGE_SIZE=page, PRELOAD_PAGES=preload),
                              3, 4)
    split = compile_for_sm90(decode_persistent_kernel, types, dict(consts, PAGE_SIZE=page, PRELOAD_PAGES=preload,
                                                                   TILE_WARPS=4), 3, 4)
    barriers = [sum("BAR.SYNC" in t for t in first_loop(k)) for k in (shared, split)]
    assert barriers[1] < barriers[0], (page, "barriers per block, shared / split", barriers)
    assert "async_copy_global_to_local" in split.asm["ttgir"], (page, "warp-split 8-bit loads not pipelined")
    if page == 0:  # (paged, ptxas keeps a few values of the 255-register loop in local memory: 6-7 per block)
        assert not any(re.search(r"\b(LDL|STL)", t) for t in first_loop(split)), "spills in the loop"
    assert 2 * split.metadata.shared <= 227 * 1024, (page, "two programs an SM", split.metadata.shared)
    print(page, "barriers", barriers, "spilled", spilled_bytes(split), "shared", split.metadata.shared)
# stage 1 as 8-bit batches resolve it: the device-split grid (two programs an SM's worth of items) with the keys
# split across the warps and no merge kernel (one-split sequences write their results, the last split merges)
types = dict(Q="*bf16", K="*fp8e4nv", V="*fp8e4nv", K_RAW="*fp8e4nv", V_RAW="*fp8e4nv", SEQLENS="*i32",
             BLOCK_TABLE="*i32", O="*fp32", LSE="*fp32", score_scale="fp32", softcap_out="fp32", K_SCALE="*fp32",
             V_SCALE="*fp32", ALIBI_SLOPES="*fp32")
grid = dict(consts, FINAL=False, PREFETCH_KEYS=0, DEVICE_SPLITS=True, SPLIT_SLOTS=264, BATCH_PAD=16,
            KV_PROGRAMS=8, NUM_SPLITS=33, MERGE_SPLITS=64, MERGE_BLOCK_S=4, SPEC_PAGES=False, TILE_WARPS=4,
            ALIBI=False)
loops = []
for in_kernel in (False, True):
    kernel = compile_for_sm90(decode_split_kernel, types, dict(grid, IN_KERNEL_MERGE=in_kernel), 3, 4)
    assert "async_copy_global_to_local" in kernel.asm["ttgir"], "device-split warp-split stage 1 not pipelined"
    assert 2 * kernel.metadata.shared <= 227 * 1024, ("two programs an SM", kernel.metadata.shared)
    assert ("atom" in kernel.asm["ptx"]) == in_kernel, "only the in-kernel merge draws tickets"
    loop = first_loop(kernel)
    loops.append((len(loop), sum(bool(re.search(r"\b(LDL|STL)", t)) for t in loop)))
    print("device grid, in-kernel merge", in_kernel, "loop, spill ops", loops[-1], "spilled", spilled_bytes(kernel))
# the merge epilogue leaves the KV loop as it was (ptxas keeps 3 values of its 255-register loop in local memory
# either way)
assert loops[1][0] <= 1.02 * loops[0][0] and loops[1][1] <= max(loops[0][1], 4), loops
# stage 1 of the split grid with every score option on pages of 16 (gathered ids) compiles too
consts = dict(consts, SEQLEN_Q=2, SOFTCAP=True, WINDOW=True, ALIBI=True, PAGE_SIZE=16, PRELOAD_PAGES=64,
              FINAL=False, PREFETCH_KEYS=0, DEVICE_SPLITS=False, KV_PROGRAMS=1, SPEC_PAGES=False, TILE_WARPS=4)
kernel = compile_for_sm90(decode_split_kernel, types, consts, 3, 4)
assert "async_copy_global_to_local" in kernel.asm["ttgir"], "warp-split stage 1 with score options not pipelined"
print("compiled")
'''


def test_warp_split_compiles_for_hopper_with_fewer_barriers():
    """quant_warp_split compiles for sm_90 (Triton 3.6's ptxas) at the tiles the Llama-3-8B shape resolves on an
    e4m3 cache (the persistent kernel, 128-key blocks, 4 warps, 3 stages; contiguous, pages of 128 with and without
    their ids preloaded, pages of 16): fewer CTA barriers per block than the shared loop (contiguous 5 -> 2), K/V
    loads still pipelined, no spills in the contiguous loop, two programs' shared memory within an SM; stage 1 on
    the device-split grid as 8-bit batches resolve it, with and without the in-kernel merge (the same KV loop);
    stage 1 with softcap, window and ALiBi compiles too. (GPU timing: fp8_decode --sweep; docs/decisions.md, "8-bit cache
    tiles".)"""
    run_sm90_compile_script(_WARP_SPLIT_SCRIPT)
