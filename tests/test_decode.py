"""flash_decode against the float64 reference (reference.decode_ref) with the FlashAttention rule (3x for decode).

CPU (interpreter) tests use small shapes that still cross several 16-key blocks, splits and pages; the GPU adds
bf16, long contexts (100k+), the production tile sizes and CUDA-graph capture/replay.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import flashdecode
from flashdecode import DecodePath
from flashdecode import reference as ref
from flashdecode.ops.decode import decode_config
from flashdecode.kernels.decode_schedule import device_split_counts, split_range
from helpers import (DEVICE, KERNEL_DTYPES, assert_fa_close, grid, pack_present_keys, randn,
                     run_sm90_compile_script)


def _lens(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _make(gen, batch, max_seqlen, nheads, nheads_kv, headdim, dtype, seqlen_q=1):
    shape_q = (batch, nheads, headdim) if seqlen_q == 1 else (batch, seqlen_q, nheads, headdim)
    q = randn(*shape_q, gen=gen, dtype=dtype)
    k = randn(batch, max_seqlen, nheads_kv, headdim, gen=gen, dtype=dtype)
    v = randn(batch, max_seqlen, nheads_kv, headdim, gen=gen, dtype=dtype)
    return q, k, v


def _assert_matches_reference(out, lse, q, k, v, lens):
    """out / lse of a decode call on q and the contiguous k, v (its paged copy holds the same keys) vs the float64
    reference, with the FlashAttention rule at 3x."""
    o64, lse64 = ref.decode_ref(q.double(), k.double(), v.double(), lens)
    o_same, lse_same = ref.decode_ref(q, k, v, lens)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-4, name="lse")


def _tweaked(config, tweak):
    """A resolved DecodeConfig changed by ``tweak``: a dict of fields, or a function of the config."""
    return tweak(config) if callable(tweak) else dataclasses.replace(config, **tweak)


def _decode(q, kc, vc, lens, table=None, tweak=None, **kw):
    """flash_decode, with the DecodeConfig it resolves changed by ``tweak`` (config=) where given."""
    if tweak is not None:
        resolved = decode_config(q, kc, vc, lens, block_table=table, num_splits=kw.get("num_splits"),
                                 window_size=kw.get("window_size", (-1, -1)), max_seqlen_k=kw.get("max_seqlen_k"))
        kw["config"] = _tweaked(resolved, tweak)
    return flashdecode.flash_decode(q, kc, vc, lens, block_table=table, **kw)


def _plan(q, kc, vc, lens, *args, table=None, tweak=None, **kw):
    """DecodePlan(*args, **kw), with the DecodeConfig it resolves for these tensors changed by ``tweak``."""
    plan = flashdecode.DecodePlan(*args, **kw)
    if tweak is None:
        return plan
    config = _tweaked(plan.config_for(q, kc, vc, lens, block_table=table), tweak)
    return flashdecode.DecodePlan(*args, **dict(kw, num_splits=config.num_splits), config=config)


def _check(q, k, v, lens, *, page_size=None, gen=None, tweak=None, **kw):
    """Run flash_decode (contiguous, or paged via a random page permutation; its config changed by ``tweak``) and
    compare out and lse with the float64 reference under the FlashAttention rule; returns (out, lse)."""
    ref_kw = {name: kw[name] for name in ("softmax_scale", "softcap", "window_size") if name in kw}
    if page_size is None:
        out, lse = _decode(q, k, v, lens, tweak=tweak, return_lse=True, **kw)
    else:
        kp, vp, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=2, generator=gen)
        out, lse = _decode(q, kp, vp, lens, table, tweak=tweak, return_lse=True, **kw)
    o64, lse64 = ref.decode_ref(q.double(), k.double(), v.double(), lens, **ref_kw)
    o_same, lse_same = ref.decode_ref(q, k, v, lens, **ref_kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == lse64.shape and lse.dtype == torch.float32
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-4, name="lse")
    return out, lse


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_ragged_lengths_including_zero(gen, dtype, num_splits):
    q, k, v = _make(gen, 6, 70, 4, 2, 64, dtype)
    lens = _lens([0, 1, 15, 17, 70, 33])
    out, lse = _check(q, k, v, lens, num_splits=num_splits)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))


@pytest.mark.parametrize("page_size", [1, 3, 8, 16, 64, 256])
def test_paged_random_permutation(gen, page_size):
    # lengths at page boundaries +-1 (and at 16-key block boundaries) plus a short one
    p = page_size
    lens = [max(p - 1, 0), p, p + 1, 2 * p + 1 if p < 64 else 5]
    q, k, v = _make(gen, len(lens), max(lens), 4, 2, 64, torch.float16)
    _check(q, k, v, _lens(lens), page_size=page_size, gen=gen, num_splits=3)


@pytest.mark.parametrize("page_size,window", [(4, -1), (8, -1), (16, 5), (32, -1)])
def test_page_ids_read_beside_the_length(gen, page_size, window):
    """spec_pages: a split's page ids read beside its length, for the range a first (pre-wait on the GPU) read of
    the length gives, then kept or read again; same results, empty sequences and windows included. (Here both
    reads see the same length, so the ids are always kept; the GPU graph test with lengths written by the kernel
    before stage 1 covers a length that changes across the wait.)"""
    lens = [page_size * 5 + 1, 0, page_size - 1, 3 * page_size]
    q, k, v = _make(gen, len(lens), max(lens), 4, 2, 64, torch.float16)
    _check(q, k, v, _lens(lens), page_size=page_size, gen=gen, num_splits=3, window_size=(window, -1),
           tweak=dict(spec_pages=True))


@triton.jit
def _stale_range_of_another_length(SEQLENS, b, split, num_splits, capacity, window_left,
                                   SEQLEN_Q: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                                   WINDOW: tl.constexpr, SPLIT_KEYS: tl.constexpr = 0):
    """Stands in for kernels.decode_schedule.stale_split_range: the split's range for capacity - length (another length in
    the cache's range, as a length rewritten across the PDL wait would be), so that the page ids read beside the
    length are for the wrong pages and must be read again."""
    seqlen = tl.load(SEQLENS + b)
    other = tl.maximum(tl.minimum(capacity - seqlen, capacity), 0)
    return split_range(other, split, window_left, SEQLEN_Q, num_splits, BLOCK_N, MIN_CHUNK, WINDOW, SPLIT_KEYS)


@pytest.mark.parametrize("page_size", [8, 32])
def test_page_ids_read_again_when_the_length_changed(gen, monkeypatch, page_size):
    """spec_pages when the length read before the wait differs from the one after it (forced here by a stand-in
    for the pre-wait read, the one kernel function replaced): the guessed ids cover other pages, are dropped and
    read again; results stay exact."""
    from flashdecode.kernels import decode as kernels_decode

    monkeypatch.setattr(kernels_decode, "stale_split_range", _stale_range_of_another_length)  # as the kernel sees it
    lens = [page_size * 5 + 1, 0, page_size - 1, 3 * page_size, page_size * 6]
    q, k, v = _make(gen, len(lens), max(lens), 4, 2, 64, torch.float16)
    _check(q, k, v, _lens(lens), page_size=page_size, gen=gen, num_splits=3, tweak=dict(spec_pages=True))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16, 64])
def test_forced_splits_agree(gen, num_splits):
    """Any split count (also more splits than keys) gives the reference result, and the same result as one split."""
    q, k, v = _make(gen, 2, 40, 4, 1, 64, torch.float16)
    lens = _lens([40, 5])
    out, lse = _check(q, k, v, lens, num_splits=num_splits)
    out1, lse1 = flashdecode.flash_decode(q, k, v, lens, num_splits=1, return_lse=True)
    torch.testing.assert_close(out, out1, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, lse1, atol=1e-4, rtol=0)


@pytest.mark.parametrize("nheads,nheads_kv", [(2, 2), (4, 2), (5, 1), (12, 2), (8, 1), (16, 1)])
def test_gqa_group_sizes(gen, nheads, nheads_kv):
    q, k, v = _make(gen, 2, 37, nheads, nheads_kv, 64, torch.float16)
    _check(q, k, v, _lens([37, 20]), num_splits=2)


@pytest.mark.parametrize("headdim", [64, 80, 96, 128, 256])
def test_head_dims(gen, headdim):
    q, k, v = _make(gen, 2, 33, 4, 2, headdim, torch.float16)
    _check(q, k, v, _lens([33, 18]), num_splits=2)


def test_fp32_ieee(gen):
    q, k, v = _make(gen, 2, 50, 6, 2, 80, torch.float32)
    _check(q, k, v, _lens([50, 31]), num_splits=3)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_softcap_and_scale(gen, softcap):
    q, k, v = _make(gen, 2, 40, 4, 2, 64, torch.float16)
    q = q * 4  # large logits: capping matters
    _check(q, k, v, _lens([40, 9]), num_splits=2, softcap=softcap, softmax_scale=0.3)


@pytest.mark.parametrize("seqlen_q", [2, 3, 4])
@pytest.mark.parametrize("page_size", [None, 3, 8])
def test_multi_token_causal(gen, seqlen_q, page_size):
    """Speculative verification: seqlen_q new tokens, causal among themselves; also lengths < seqlen_q."""
    q, k, v = _make(gen, 3, 45, 6, 2, 64, torch.float16, seqlen_q=seqlen_q)
    _check(q, k, v, _lens([45, 17, seqlen_q - 1]), page_size=page_size, gen=gen, num_splits=3)


@pytest.mark.parametrize("window_left", [0, 5, 20])
def test_sliding_window(gen, window_left):
    q, k, v = _make(gen, 2, 60, 4, 2, 64, torch.float16, seqlen_q=2)
    _check(q, k, v, _lens([60, 11]), num_splits=2, window_size=(window_left, -1))


def test_garbage_past_length_never_leaks(gen):
    """Cache slots past cache_seqlens (and unused pages) may hold NaN/inf: they must not reach the output."""
    q, k, v = _make(gen, 2, 50, 4, 2, 64, torch.float16)
    lens = _lens([21, 40])
    for b, n in enumerate([21, 40]):
        k[b, n:] = float("nan")
        v[b, n:] = float("inf")
    for num_splits in (1, 4):
        out = flashdecode.flash_decode(q, k, v, lens, num_splits=num_splits)
        assert torch.isfinite(out).all()
    o_clean, _ = ref.decode_ref(q.double(), torch.nan_to_num(k.double()), torch.nan_to_num(v.double()), lens)
    torch.testing.assert_close(out.double(), o_clean, atol=3e-3, rtol=0)


def test_heuristic_splits_and_out_argument(gen):
    q, k, v = _make(gen, 2, 64, 4, 2, 64, torch.float16)
    lens = _lens([64, 30])
    out = torch.empty_like(q)
    res = flashdecode.flash_decode(q, k, v, lens, out=out, max_seqlen_k=64)
    assert res.data_ptr() == out.data_ptr()
    o64, _ = ref.decode_ref(q.double(), k.double(), v.double(), lens)
    o_same, _ = ref.decode_ref(q, k, v, lens)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)


@pytest.mark.parametrize("page_size", [None, 16])
def test_plan_fixed_grid_with_changing_lengths(gen, page_size):
    """A DecodePlan sized once (fixed split count) stays exact when lengths and block tables change."""
    q, k, v = _make(gen, 3, 64, 4, 2, 64, torch.float16)
    plan = flashdecode.DecodePlan(4, 4, 2, 64, max_seqlen_k=64, dtype=torch.float16, device=DEVICE, num_splits=4)
    kp = vp = table = None
    if page_size:
        kp, vp, table = ref.paged_from_contiguous(k, v, page_size, generator=gen)
    for lengths in ([64, 3, 0], [1, 64, 40]):
        lens = _lens(lengths)
        if page_size:
            out, lse = plan.run(q, kp, vp, lens, block_table=table, return_lse=True)
        else:
            out, lse = flashdecode.flash_decode(q, k, v, lens, plan=plan, return_lse=True)
        _assert_matches_reference(out, lse, q, k, v, lens)


# ----------------------------------------------------------------------------------------------------------------
# Block tables on the device are not validated (no sync): ids outside [0, num_pages) read as absent keys
# ----------------------------------------------------------------------------------------------------------------

def _corrupt_table(table, num_pages, lens, page_size):
    """Put the bad ids -1, num_pages and 2**30 into live pages of a block table (sequence b gets bad id b % 3 in
    pages 0 and, where it has one, 2); returns the corrupted table and a (batch, max_len) mask of the keys that are
    still present."""
    bad = table.clone()
    max_len = max(lens)
    present = torch.ones(len(lens), max_len, dtype=torch.bool)
    for b, n in enumerate(lens):
        for page in (0, 2):
            if page * page_size < n:
                bad[b, page] = (-1, num_pages, 2**30)[b % 3]
                present[b, page * page_size:(page + 1) * page_size] = False
    return bad, present


def _reference_without(q, k, v, lens, present):
    """decode_ref over only the present keys (one new token, no window: the order of keys does not matter, so the
    present ones are packed to the front). Returns (out float64, out in q's dtype)."""
    kp, vp, packed = pack_present_keys(k, v, lens, present)
    plens = _lens(packed)
    return ref.decode_ref(q.double(), kp.double(), vp.double(), plens)[0], ref.decode_ref(q, kp, vp, plens)[0]


@pytest.mark.parametrize("page_size,tweak", [(1, None), (3, None), (8, None), (16, None), (32, None),
                                             (32, dict(use_tma=True, block_n=32)), (16, "persistent")])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_page_ids_outside_the_pool_read_as_absent_keys(gen, page_size, tweak, num_splits, device_resident):
    """Ids -1, num_pages and 2**30 in a device-resident block table: no crash, no read outside the cache (2**30
    must not wrap onto page 0), and the result equals the reference with those pages' keys left out (every path:
    ids read in the loop, gathered from the preload, one per block, TMA, the persistent kernel)."""
    lens = [70, 40, 57, 1]
    q, k, v = _make(gen, len(lens), max(lens), 4, 2, 64, torch.float16)
    kp, vp, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=2, generator=gen)
    bad, present = _corrupt_table(table, kp.shape[0], lens, page_size)
    if tweak == "persistent":
        def tweak(config):
            path = DecodePath.UNSPLIT if config.num_splits == 1 else DecodePath.PERSISTENT
            return dataclasses.replace(config, path=path)
    out = _decode(q, kp, vp, _lens(lens), bad, tweak=tweak, num_splits=num_splits)
    o64, o_same = _reference_without(q, k, v, lens, present)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)


def test_page_ids_outside_the_pool_through_a_plan(gen, device_resident):
    """The same through a DecodePlan on the device-split grid (split counts chosen on the device)."""
    lens = [90, 33, 61]
    q, k, v = _make(gen, len(lens), max(lens), 4, 2, 64, torch.float32)
    kp, vp, table = ref.paged_from_contiguous(k, v, 32, generator=gen)
    bad, present = _corrupt_table(table, kp.shape[0], lens, 32)

    def device_split_grid(config):
        return dataclasses.replace(config, path=DecodePath.DEVICE_SPLIT_GRID)

    plan = _plan(q, kp, vp, _lens(lens), 3, 4, 2, 64, table=bad, tweak=device_split_grid, max_seqlen_k=90,
                 dtype=torch.float32, device=DEVICE, num_splits=4)
    out = plan.run(q, kp, vp, _lens(lens), block_table=bad)
    o64, o_same = _reference_without(q, k, v, lens, present)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,error,word", [
    (lambda q, k, v: dict(cache_seqlens=torch.tensor([16, 3], dtype=torch.int64, device=DEVICE)), TypeError,
     "cache_seqlens"),
    (lambda q, k, v: dict(cache_seqlens=torch.tensor([17, 3], dtype=torch.int32)), ValueError, "cache_seqlens"),
    (lambda q, k, v: dict(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE)), ValueError,
     "cache_seqlens"),
    (lambda q, k, v: dict(k_cache=k.float()), TypeError, "k_cache"),
    (lambda q, k, v: dict(v_cache=v[:, :8]), ValueError, "v_cache"),
    (lambda q, k, v: dict(k_cache=k[..., :32].contiguous(), v_cache=v[..., :32].contiguous()), ValueError, "head dim"),
    (lambda q, k, v: dict(q=q[:, :3]), ValueError, "multiple"),
    (lambda q, k, v: dict(q=q.int()), TypeError, "q"),
    (lambda q, k, v: dict(block_table=torch.zeros(2, 1, dtype=torch.int64, device=DEVICE)), TypeError,
     "block_table"),
    (lambda q, k, v: dict(block_table=torch.zeros(3, 1, dtype=torch.int32, device=DEVICE)), ValueError,
     "block_table"),
    (lambda q, k, v: dict(out=torch.empty_like(q[:1])), ValueError, "out"),
    (lambda q, k, v: dict(num_splits=0), ValueError, "num_splits"),
])
def test_bad_input_names_the_argument(gen, change, error, word):
    q, k, v = _make(gen, 2, 16, 4, 2, 64, torch.float16)
    args = dict(k_cache=k, v_cache=v, cache_seqlens=_lens([16, 3]))
    args.update(change(q, k, v))
    q = args.pop("q", q)
    with pytest.raises(error, match=word):
        flashdecode.flash_decode(q, args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_seqlens"), **args)


def test_host_lengths_larger_than_paged_capacity(gen):
    q, k, v = _make(gen, 2, 16, 4, 2, 64, torch.float16)
    kp, vp, table = ref.paged_from_contiguous(k, v, 4, generator=gen)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashdecode.flash_decode(q, kp, vp, torch.tensor([17, 1], dtype=torch.int32), block_table=table.cpu())


def test_plan_rejects_mismatched_q(gen):
    q, k, v = _make(gen, 3, 16, 4, 2, 64, torch.float16)
    plan = flashdecode.DecodePlan(2, 4, 2, 64, max_seqlen_k=16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="plan"):
        plan.run(q, k, v, _lens([1, 2, 3]))
    with pytest.raises(ValueError, match="nheads"):
        flashdecode.DecodePlan(2, 5, 2, 64, max_seqlen_k=16)


# ----------------------------------------------------------------------------------------------------------------
# GPU: bf16, long contexts, production tiles, CUDA graphs
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.xdist_group("gpu_bigmem")  # big tensors: gpu_check's bigmem part, 4 workers
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,page_size", [(torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, 1),
                                             (torch.bfloat16, 16), (torch.bfloat16, 64), (torch.bfloat16, 256)])
def test_gpu_long_ragged(gen, dtype, page_size):
    lens = [100_003, 0, 4097, 257]
    q, k, v = _make(gen, len(lens), max(lens), 16, 2, 128, dtype)
    _check(q, k, v, _lens(lens), page_size=page_size, gen=gen)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim,nheads,nheads_kv", [(64, 32, 8), (80, 40, 8), (96, 42, 6), (128, 28, 4),
                                                      (256, 16, 1), (128, 64, 4), (256, 32, 8), (80, 16, 16)])
def test_gpu_shapes(gen, headdim, nheads, nheads_kv):
    """Every head dim and GQA group sizes 1, 5, 7, 16 (one compile per case: the pairs, not the product)."""
    lens = [3000, 129, 1]
    q, k, v = _make(gen, len(lens), max(lens), nheads, nheads_kv, headdim, torch.bfloat16, seqlen_q=1)
    _check(q, k, v, _lens(lens))


_PERSISTENT_PATHS = (DecodePath.PERSISTENT, DecodePath.PERSISTENT_QUEUE)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,headdim,nheads,nheads_kv,page_size,seqlen_q", [
    (torch.bfloat16, 128, 32, 8, None, 1), (torch.bfloat16, 128, 32, 8, 128, 1), (torch.float16, 64, 32, 8, 256, 1),
    (torch.bfloat16, 256, 16, 8, None, 1), (torch.bfloat16, 96, 48, 8, None, 3), (torch.float32, 128, 32, 8, None, 1)])
def test_gpu_batch_runs_as_one_persistent_launch(gen, dtype, headdim, nheads, nheads_kv, page_size,
                                                 seqlen_q):
    """With more (batch, kv head) pairs than half the SMs (and at most the SMs) the default is the persistent
    kernel (device-side split counts, in-kernel merge): one launch, no merge kernel. A plan sized for the batch,
    lengths mixed (one long sequence, empty and one-token ones) then uniform, contiguous and block-multiple pages,
    every head dim class and dtype."""
    batch = 12  # 96 (batch, kv head) pairs: between half the H100's SMs and all of them
    q, k, v = _make(gen, batch, 9000, nheads, nheads_kv, headdim, dtype, seqlen_q=seqlen_q)
    kc, vc, table = (k, v, None) if page_size is None else ref.paged_from_contiguous(k, v, page_size, generator=gen)
    plan = flashdecode.DecodePlan(batch, nheads, nheads_kv, headdim, max_seqlen_k=9000, dtype=dtype,
                                  device=DEVICE, max_seqlen_q=seqlen_q)
    config = plan.config_for(q, kc, vc, _lens([8] * batch), block_table=table)
    assert config.path in _PERSISTENT_PATHS, "96 pairs on the H100: the persistent launch is the default"
    for lengths in ([9000, 0, seqlen_q] + [300 + 37 * i for i in range(batch - 3)], [3000] * batch):
        lens = _lens(lengths)
        out, lse = plan.run(q, kc, vc, lens, block_table=table, return_lse=True)
        _assert_matches_reference(out, lse, q, k, v, lens)
        assert torch.all(plan._tickets == 0)


@pytest.mark.xdist_group("gpu_bigmem")
@pytest.mark.gpu
@pytest.mark.parametrize("page_size,extra_seqs", [(None, 3), (16, 3), (8, 3), (16, 0), (64, 3), (1, 0), (3, 3)])
def test_gpu_batches_take_the_work_queue(gen, page_size, extra_seqs):
    """Beyond one (batch, kv head) pair per SM (extra_seqs > 0), and for pages smaller than a block (gathered page
    ids, or pages of 1-7 keys whose ids the KV loop reads) from 3/4 of that, the persistent kernel draws work items
    from its queue: mixed lengths (one long sequence among empty, one-token and short ones), then uniform, through a
    plan; the queue is left at zero."""
    from flashdecode import heuristics

    batch = heuristics.num_sms(torch.device(DEVICE)) // 8 + extra_seqs  # 8 kv heads: 0 or 24 pairs beyond the SMs
    q, k, v = _make(gen, batch, 12_000, 32, 8, 128, torch.bfloat16)
    kc, vc, table = (k, v, None) if page_size is None else ref.paged_from_contiguous(k, v, page_size, generator=gen)
    plan = flashdecode.DecodePlan(batch, 32, 8, 128, max_seqlen_k=12_000, dtype=torch.bfloat16, device=DEVICE)
    config = plan.config_for(q, kc, vc, _lens([8] * batch), block_table=table)
    assert config.path is DecodePath.PERSISTENT_QUEUE, "more pairs than SMs on Hopper: the work queue"
    for lengths in ([12_000, 0, 1] + [200 + 61 * i for i in range(batch - 3)], [2500] * batch):
        lens = _lens(lengths)
        out, lse = plan.run(q, kc, vc, lens, block_table=table, return_lse=True)
        _assert_matches_reference(out, lse, q, k, v, lens)
        assert torch.all(plan._tickets == 0), "tickets and queue must be left at zero"


@pytest.mark.xdist_group("gpu_bigmem")
@pytest.mark.gpu
@pytest.mark.parametrize("batch,page_size", [(6, None), (8, None), (8, 64), (8, 256)])
def test_gpu_batches_below_half_the_sms_run_persistent(gen, batch, page_size):
    """Contiguous caches with a third to a half of the SMs' worth of (batch, kv head) pairs (Llama 32/8, b6 / b8)
    run the persistent kernel with static shares, pages that are multiples of the few-pairs 64-key tiles from 0.45
    of them (b8) with its work queue: mixed lengths (one long among empty, one-token and short ones), then uniform,
    through a plan; no merge kernel; tickets and queue left at zero."""
    q, k, v = _make(gen, batch, 12_000, 32, 8, 128, torch.bfloat16)
    kc, vc, table = (k, v, None) if page_size is None else ref.paged_from_contiguous(k, v, page_size, generator=gen)
    plan = flashdecode.DecodePlan(batch, 32, 8, 128, max_seqlen_k=12_000, dtype=torch.bfloat16, device=DEVICE)
    config = plan.config_for(q, kc, vc, _lens([8] * batch), block_table=table)
    queue = config.path is DecodePath.PERSISTENT_QUEUE
    assert config.path in _PERSISTENT_PATHS and queue == (page_size is not None) and config.block_n == 64
    for lengths in ([12_000, 0, 1] + [200 + 61 * i for i in range(batch - 3)], [2500] * batch):
        lens = _lens(lengths)
        out, lse = plan.run(q, kc, vc, lens, block_table=table, return_lse=True)
        _assert_matches_reference(out, lse, q, k, v, lens)
        assert torch.all(plan._tickets == 0), "tickets and queue must be left at zero"


@pytest.mark.xdist_group("gpu_bigmem")
@pytest.mark.gpu
@pytest.mark.parametrize("batch,page_size", [(2, None), (4, None), (5, None), (4, 16), (8, 16), (4, 64), (4, 1)])
def test_gpu_device_split_grid(gen, batch, page_size):
    """Llama 32/8 at b2-b8 (16-64 pairs, the split grid) through a plan sized for the worst mix, with each
    sequence's split count chosen on the device (DEVICE_SPLITS where heuristics turn it on; forced here): mixed
    lengths (one long among empty, one-token and short ones), then uniform; contiguous, gathered (16), block-
    multiple (64) and 1-key pages (whose ids do not fit the preload: the fixed-count split grid)."""
    q, k, v = _make(gen, batch, 12_000, 32, 8, 128, torch.bfloat16)
    kc, vc, table = (k, v, None) if page_size is None else ref.paged_from_contiguous(k, v, page_size, generator=gen)
    lens0 = _lens([8] * batch)

    def device_split_grid(config):
        fits = page_size != 1  # 1-key pages at 12k keys: a whole sequence's ids do not fit the preload
        return dataclasses.replace(config, path=DecodePath.DEVICE_SPLIT_GRID if fits else config.path)

    plan = _plan(q, kc, vc, lens0, batch, 32, 8, 128, table=table, tweak=device_split_grid, max_seqlen_k=12_000,
                 dtype=torch.bfloat16, device=DEVICE)
    for lengths in ([12_000, 0, 1] + [200 + 61 * i for i in range(batch - 3)], [2500] * batch):
        lens = _lens(lengths[:batch])
        out, lse = plan.run(q, kc, vc, lens, block_table=table, return_lse=True)
        _assert_matches_reference(out, lse, q, k, v, lens)


@pytest.mark.gpu
@pytest.mark.parametrize("context", [100, 512, 4096])
def test_gpu_short_gathered_splits_take_8_kib_tiles(gen, context):
    """Batch 1, page 16, splits of <= 64 keys: 32-key tiles (two pages per block) through the plan, correct."""
    q, k, v = _make(gen, 1, context, 16, 2, 128, torch.bfloat16)
    kp, vp, table = ref.paged_from_contiguous(k, v, 16, extra_pages=3, generator=gen)
    plan = flashdecode.DecodePlan(1, 16, 2, 128, max_seqlen_k=context, dtype=torch.bfloat16, device=DEVICE)
    split_keys = -(-context // plan.num_splits)
    assert plan.config_for(q, kp, vp, _lens([context]), block_table=table).block_n == 32 or split_keys > 64
    for n in (context, context - 17, 1):
        lens = _lens([n])
        out, lse = plan.run(q, kp, vp, lens, block_table=table, return_lse=True)
        _assert_matches_reference(out, lse, q, k, v, lens)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q", [2, 4])
def test_gpu_multi_token_softcap_window(gen, seqlen_q):
    lens = [5000, 300, 3]
    q, k, v = _make(gen, 3, max(lens), 32, 8, 128, torch.bfloat16, seqlen_q=seqlen_q)
    _check(q, k, v, _lens(lens), page_size=16, gen=gen, softcap=30.0)
    _check(q, k, v, _lens(lens), window_size=(1000, -1))


def _replay_with(graph, static_out, q, k, v, lens, new_lens, kc, vc, table, gen):
    """Write new_lens into the captured lens, move every page of a paged cache (new contents of the same
    block_table tensor), replay, and check static_out against the reference on the contiguous k, v."""
    lens.copy_(_lens(new_lens))
    if table is not None:
        perm = torch.randperm(kc.shape[0], generator=gen).to(DEVICE)
        new_k, new_v = torch.empty_like(kc), torch.empty_like(vc)
        new_k[perm], new_v[perm] = kc, vc
        kc.copy_(new_k)
        vc.copy_(new_v)
        table.copy_(perm[table.long()].to(torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    o64, _ = ref.decode_ref(q.double(), k.double(), v.double(), lens)
    o_same, _ = ref.decode_ref(q, k, v, lens)
    assert_fa_close(static_out, o64, o_same, factor=3.0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,use_pdl", [(None, False), (16, False), (None, True), (64, True)])
def test_gpu_cuda_graph_replay_with_changed_lengths(gen, page_size, use_pdl):
    """Capture once with a plan, then change cache_seqlens and block_table contents and replay (also with the merge
    as a programmatic dependent launch)."""
    lens0 = [9000, 17, 4000, 0]
    q, k, v = _make(gen, 4, 9000, 32, 8, 128, torch.bfloat16)
    plan = flashdecode.DecodePlan(4, 32, 8, 128, max_seqlen_k=9000, dtype=torch.bfloat16, device=DEVICE,
                                  use_pdl=use_pdl)
    lens = _lens(lens0)
    table = None
    kc, vc = k, v
    if page_size:
        kc, vc, table = ref.paged_from_contiguous(k, v, page_size, generator=gen)
    static_out = plan.run(q, kc, vc, lens, block_table=table)  # warm-up / compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = plan.run(q, kc, vc, lens, block_table=table)
    for new_lens in ([1, 9000, 2, 5000], [8191, 8192, 8193, 1]):
        _replay_with(graph, static_out, q, k, v, lens, new_lens, kc, vc, table, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,page_size", [(1, None), (4, None), (4, 16), (12, 128), (40, None)])
def test_gpu_plain_flash_decode_captured_and_replayed_with_changed_lengths(gen, batch, page_size):
    """A decode step calling plain flash_decode (no plan, no num_splits, no max_seqlen_k) is captured in a CUDA
    graph: no host sync inside (the split count comes from the cache capacity), workspace from the per-device pool
    sized by the eager warm-up; replays with changed lengths and moved pages stay exact (batch 1 / 4: split grids,
    12 / 40: the persistent paths on Hopper)."""
    cap = 6000
    q, k, v = _make(gen, batch, cap, 32, 8, 128, torch.bfloat16)
    kc, vc, table = (k, v, None) if page_size is None else ref.paged_from_contiguous(k, v, page_size, generator=gen)
    lens = _lens([cap] + [37 * (i + 1) for i in range(batch - 1)])
    flashdecode.flash_decode(q, kc, vc, lens, block_table=table)  # eager: compiles, sizes the pool
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flashdecode.flash_decode(q, kc, vc, lens, block_table=table)
    for new_lens in ([1] + [cap - i for i in range(batch - 1)], [0] * (batch - 1) + [cap], [cap // 2] * batch):
        _replay_with(graph, static_out, q, k, v, lens, new_lens, kc, vc, table, gen)


class _UnreadableLengths(torch.Tensor):
    """cache_seqlens whose values must not be read on the host (as under CUDA-graph capture)."""

    def to(self, *args, **kwargs):
        raise AssertionError("the lengths were read on the host")


def test_captured_call_sizes_splits_from_the_capacity_without_reading_lengths(gen):
    """Host side of a captured plain call: the split policy takes the cache capacity (the lengths are not read),
    max_seqlen_k still bounds it; the resolved config lets the device reduce the splits (device-split grid at a
    batch with few pairs on the GPU's rules); the workspace pool hands out views of buffers an eager call sized."""
    from flashdecode import heuristics as hx
    from flashdecode.ops import checks
    from flashdecode.ops.decode_policy import _DecodeShape, choose_live_keys
    from flashdecode.ops.decode_workspace import _Workspace

    q, k, v = _make(gen, 4, 300, 4, 2, 64, torch.float16)
    lens = _lens([300, 5, 0, 40]).as_subclass(_UnreadableLengths)
    shape = _DecodeShape(q, k, v, lens, None, None, 0.0, (-1, -1))
    assert choose_live_keys(shape, lens, None, None, in_capture=True) == (300, None)
    assert choose_live_keys(shape, lens, None, 100, in_capture=True) == (100, None)
    if checks.host_resident(lens):  # eager: host-resident lengths are read; device ones never are
        with pytest.raises(AssertionError, match="read on the host"):
            choose_live_keys(shape, lens, None, None, in_capture=False)
    else:
        assert choose_live_keys(shape, lens, None, None, in_capture=False) == (300, None)
    gpu = hx.DecodeDevice(num_sms=132, interpret=False, hopper=False, pdl=False)
    problem = hx.DecodeProblem(batch=4, grid_batch=4, seqlen_q=1, group=4, nheads_kv=8, headdim=128, elem_bytes=2,
                               page_size=0, capacity=12000, window_left=-1, live_keys=12000)
    config = hx.resolve_decode_config(problem, gpu)
    assert config.num_splits > 1 and config.path is DecodePath.DEVICE_SPLIT_GRID
    pool = _Workspace(torch.device("cpu"))
    pool.reserve((4, 1, 32, 8, 128), 40)
    o_ptr, lse_ptr, t_ptr = pool.o.data_ptr(), pool.lse.data_ptr(), pool.tickets.data_ptr()
    partial_o, partial_lse, tickets = pool.take((2, 1, 32, 8, 128), 20)
    assert (partial_o.data_ptr(), partial_lse.data_ptr(), tickets.data_ptr()) == (o_ptr, lse_ptr, t_ptr)
    assert partial_o.shape == (2, 1, 32, 8, 128) and partial_lse.shape == (2, 1, 32, 8) and tickets.numel() == 20
    assert torch.all(pool.tickets == 0)


def test_captured_call_path_is_exact(gen, monkeypatch):
    """flash_decode's capture branch (split count from the capacity, workspace from the pool) run in the
    interpreter by declaring the stream captured: exact for lengths far below the capacity, repeatedly."""
    from flashdecode.ops import decode as ops_decode

    monkeypatch.setattr(ops_decode, "capturing", lambda device: True)  # the one fact the CPU cannot produce
    q, k, v = _make(gen, 3, 200, 4, 2, 64, torch.float16)
    for lengths in ([200, 3, 0], [1, 17, 90]):
        lens = _lens(lengths)
        out, lse = flashdecode.flash_decode(q, k, v, lens, return_lse=True)
        _assert_matches_reference(out, lse, q, k, v, lens)


@pytest.mark.gpu
@pytest.mark.parametrize("variant,page_size", [
    (dict(use_pdl=True, pdl_wait=True), None), (dict(use_pdl=True, pdl_wait=True), 16),
    (dict(use_pdl=True, pdl_wait=True, prefetch_blocks=4, merge_early_trigger=True), None),
    (dict(use_pdl=True, pdl_wait=True, prefetch_blocks=4, merge_early_trigger=True), 16),
    (dict(use_pdl=True, pdl_wait=True, prefetch_blocks=2, merge_early_trigger=True, block_n=64), 3),
    (dict(use_pdl=True, pdl_wait=True, prefetch_blocks=1, spec_pages=True), 64),
    (dict(use_pdl=True, pdl_wait=True, prefetch_blocks=1, spec_pages=True, block_n=64, use_tma=False), 16),
    (dict(use_pdl=True, pdl_wait=True, path=DecodePath.PERSISTENT), None),
    (dict(use_pdl=True, pdl_wait=True, path=DecodePath.PERSISTENT, persistent_programs=264), 128)])
def test_gpu_graph_replay_right_after_a_producer_kernel(gen, variant, page_size):
    """Stage 1 launched as a programmatic dependent (pdl_wait) must wait for the kernel before it: in one graph,
    three decode calls on one plan, each right after kernels that write its q and lengths; eager warm-up too."""
    q_all, k, v = _make(gen, 4, 9000, 16, 2, 128, torch.bfloat16)
    qs = [randn(*q_all.shape, gen=gen, dtype=torch.bfloat16) for _ in range(3)]
    lens_src = [_lens(x) for x in ([9000, 5, 3000, 0], [1, 8192, 129, 4097], [4000, 4000, 9000, 17])]
    kc, vc, table = (k, v, None) if page_size is None else ref.paged_from_contiguous(k, v, page_size, generator=gen)
    plan = _plan(qs[0], kc, vc, lens_src[0], 4, 16, 2, 128, table=table, tweak=variant, max_seqlen_k=9000,
                 dtype=torch.bfloat16, device=DEVICE)
    q_static, lens_static = torch.empty_like(qs[0]), torch.empty_like(lens_src[0])
    outs = [torch.empty_like(q) for q in qs]

    def calls():
        for q, lens, out in zip(qs, lens_src, outs):
            torch.add(q, 0.0, out=q_static)  # kernels, not copies: PDL orders kernel after kernel
            torch.add(lens, 0, out=lens_static)
            plan.run(q_static, kc, vc, lens_static, block_table=table, out=out)

    def check():
        for q, lens, out in zip(qs, lens_src, outs):
            o64, _ = ref.decode_ref(q.double(), k.double(), v.double(), lens)
            o_same, _ = ref.decode_ref(q, k, v, lens)
            assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)

    calls()  # eager (also compiles outside the capture)
    torch.cuda.synchronize()
    check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for out in outs:
        out.fill_(float("nan"))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    check()


@pytest.mark.parametrize("page_size", [None, 16, 32])
def test_tma_path(gen, page_size):
    """The tensor-descriptor (TMA) path, forced on (the interpreter runs host descriptors too); NaN in unused
    slots must not leak through whole-block TMA reads."""
    q, k, v = _make(gen, 3, 70, 8, 2, 64, torch.float16, seqlen_q=2)
    lens = _lens([70, 17, 33])
    for b, n in enumerate([70, 17, 33]):
        v[b, n:] = float("nan")
    kc, vc, table = (k, v, None) if page_size is None else ref.paged_from_contiguous(k, v, page_size, generator=gen)
    for num_splits in (1, 3):
        # TMA boxes never straddle a page: tiles of 16 keys divide every page size here (a GPU resolves larger)
        tma = dict(use_tma=True) if page_size is None else dict(use_tma=True, block_n=16)
        out = _decode(q, kc, vc, lens, table, tweak=tma, num_splits=num_splits)
        o64, _ = ref.decode_ref(q.double(), k.double().nan_to_num(), v.double().nan_to_num(), lens)
        o_same, _ = ref.decode_ref(q, k.nan_to_num(), v.nan_to_num(), lens)
        assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)


def test_tma_override_rejected_where_the_cache_cannot_take_it(gen):
    """config.use_tma on a cache that is not dense in (rows, kv heads x head dim) raises naming config.use_tma."""
    q, k, v = _make(gen, 2, 40, 4, 2, 64, torch.float16)
    ks, vs = k[:, ::2], v[:, ::2]  # every other key: rows no longer consecutive
    lens = _lens([20, 7])
    config = dataclasses.replace(decode_config(q, ks, vs, lens, num_splits=2), use_tma=True)
    with pytest.raises(ValueError, match="config.use_tma"):
        flashdecode.flash_decode(q, ks, vs, lens, config=config)


def test_small_page_ids_preloaded_and_deeper_pipeline_for_table_reads(gen):
    """Pages of 1, 2 or 4 keys preload one id per key (gathered like 8-key pages; pages of 3 keys cannot: they
    straddle blocks), sized to a split's keys without the straddling page of block-multiple pages; where the loop
    reads the block table instead, long splits get table_read_extra_stages more pipeline stages, short ones and
    preloaded ids none (heuristics' decode geometry, with the interpreter's 16-key tiles and 256 ids)."""
    from flashdecode import heuristics as hx

    def problem(page_size):
        return hx.DecodeProblem(batch=2, grid_batch=2, seqlen_q=1, group=2, nheads_kv=2, headdim=64, elem_bytes=2,
                                page_size=page_size, capacity=512, window_left=-1, live_keys=512)

    # the interpreter's geometry whatever device runs the test (a GPU resolves larger tiles)
    interpreter = hx.DecodeDevice(num_sms=hx.DEFAULT_NUM_SMS, interpret=True, hopper=False, pdl=False)
    config = dataclasses.replace(hx.resolve_decode_config(dataclasses.replace(problem(0), num_splits=4), interpreter),
                                 preload_key_ids=True, table_read_extra_stages=2, table_read_min_split_blocks=8)
    assert config.block_n == 16

    # (16-key pages are block multiples here: a split may start mid-page, so 128 keys span 9 pages -> 16)
    for page_size, splits, ids in [(1, 4, 128), (2, 4, 64), (4, 2, 64), (8, 4, 16), (16, 4, 16)]:
        preload = hx.decode_preload_pages(problem(page_size), hx.PageIdPreload.of(config), splits)
        assert preload == ids, (page_size, preload)
        assert hx.decode_pipeline_stages(problem(page_size), config, preload, 512 // splits) == config.num_stages
    assert hx.decode_preload_pages(problem(3), hx.PageIdPreload.of(config), 4) == 0
    long_split, short_split = 8 * config.block_n, 8 * config.block_n - 1
    assert hx.decode_pipeline_stages(problem(3), config, 0, long_split) == config.num_stages + 2
    assert hx.decode_pipeline_stages(problem(3), config, 0, short_split) == config.num_stages
    assert hx.decode_pipeline_stages(problem(0), config, 0, long_split) == config.num_stages
    q, k, v = _make(gen, 2, 512, 4, 2, 64, torch.float16)
    for num_splits in (1, 3):
        _check(q, k, v, _lens([512, 100]), page_size=1, gen=gen, num_splits=num_splits,
               tweak=dict(preload_key_ids=True, table_read_extra_stages=2, table_read_min_split_blocks=8))


@pytest.mark.parametrize("page_size", [1, 3, 32])
def test_paged_without_block_table_preload(gen, page_size):
    """Long splits whose page ids do not fit in registers read the block table inside the loop: same results."""
    q, k, v = _make(gen, 3, 70, 4, 2, 64, torch.float16, seqlen_q=2)
    _check(q, k, v, _lens([70, 32, 33]), page_size=page_size, gen=gen, num_splits=2,
           tweak=dict(preload_pages_max=0, preload_gather_max=0))


@pytest.mark.parametrize("d_chunks,max_rows", [(2, 0), (4, 1)])
def test_merge_in_head_dim_chunks(gen, d_chunks, max_rows):
    """merge_d_chunks / merge_max_rows: stage 2 as head-dim slices, and as one row per program, gives the same
    result (GQA, ragged, paged)."""
    q, k, v = _make(gen, 3, 90, 8, 2, 64, torch.float16)
    _check(q, k, v, _lens([90, 0, 33]), page_size=16, gen=gen, num_splits=3,
           tweak=dict(merge_d_chunks=d_chunks, merge_max_rows=max_rows))


def test_round3_config_rules():
    """Tile policy, round 3: L2 prefetch with few (batch, kv head) pairs on Hopper; the merge's early trigger only
    for splits of <= 2 blocks; 16 KiB tiles at batch for gathered pages in short splits only (on the split grid:
    the Hopper work queue keeps 32 KiB)."""
    from flashdecode import heuristics as hx

    for hopper in (False, True):
        dev = hx.DecodeDevice(num_sms=132, interpret=False, hopper=hopper, pdl=hopper)

        def choice(kv_pairs, page_size=0, split_keys=None):  # 8 kv heads x batch, hd128 bf16
            p = hx.DecodeProblem(batch=kv_pairs, grid_batch=kv_pairs, seqlen_q=1, group=1, nheads_kv=1,
                                 headdim=128, elem_bytes=2, page_size=page_size, capacity=1 << 17, window_left=-1,
                                 live_keys=1 << 17)
            return hx._stage1_choice(p, dev, split_keys)

        assert choice(2).prefetch_blocks == (1 if hopper else 0)
        assert choice(128).prefetch_blocks == 0
        assert choice(2, split_keys=64).merge_early_trigger == hopper
        assert choice(2, split_keys=128).merge_early_trigger == hopper
        assert not choice(2, split_keys=256).merge_early_trigger
        assert not choice(2).merge_early_trigger  # split length unknown
        # 96 pairs: below the work queue's 3/4 of the SMs (which keeps 128-key tiles)
        assert choice(96, page_size=16, split_keys=512).block_n == 64
        assert choice(128, page_size=16, split_keys=512).block_n == (128 if hopper else 64)
        assert choice(96, page_size=16, split_keys=8192).block_n == 128
        for page_size in (0, 64, 4):
            assert choice(96, page_size=page_size, split_keys=512).block_n == 128


# ----------------------------------------------------------------------------------------------------------------
# The persistent paths (Hopper's default at batch; forced here): split counts chosen on the device, a fixed grid
# of programs looping over work items, the merge in-kernel
# ----------------------------------------------------------------------------------------------------------------

@pytest.fixture(params=[(3, False), (16, False), (3, True)], ids=["3programs", "16programs", "3dynamic"])
def persistent(request):
    """A config tweak onto the persistent path with 3 programs (several items each, mostly one split per sequence)
    or 16 (several splits per sequence), or 3 programs taking items from the work queue (PERSISTENT_QUEUE, 4 slots
    per program: more splits, and the device rule that splits equal lengths, kernels.decode_schedule queue_split_ways). One
    split stays UNSPLIT (as resolved)."""
    from flashdecode import heuristics

    programs, dynamic = request.param

    def tweak(config):
        if config.num_splits == 1:
            return config
        path = DecodePath.PERSISTENT_QUEUE if dynamic else DecodePath.PERSISTENT
        return dataclasses.replace(config, path=path, persistent_programs=programs, persistent_slots=4,
                                   queue_splits=heuristics.DECODE_QUEUE_MAX_SPLITS)
    return tweak


def _block_multiple_page(batch, nheads, nheads_kv, headdim, dtype, pages_per_block):
    """A page size that is pages_per_block x the stage-1 block_n of this shape (16 keys on the CPU, 64-128 on the
    GPU); None: contiguous."""
    if pages_per_block is None:
        return None
    q = torch.empty(batch, nheads, headdim, dtype=dtype, device=DEVICE)
    k = torch.empty(batch, 8, nheads_kv, headdim, dtype=dtype, device=DEVICE)
    lens = torch.full((batch,), 8, dtype=torch.int32, device=DEVICE)
    return decode_config(q, k, k, lens, num_splits=2).block_n * pages_per_block


@triton.jit
def _split_counts_kernel(SEQLENS, OUT, batch, programs, KVP: tl.constexpr, BATCH_PAD: tl.constexpr,
                         QUEUE_SPLITS: tl.constexpr, QUEUE_FULL_FRACTION: tl.constexpr,
                         QUEUE_SPLIT_COST: tl.constexpr):
    offs = tl.arange(0, BATCH_PAD)
    in_batch = offs < batch
    lens = tl.load(SEQLENS + offs, mask=in_batch, other=0)
    splits = device_split_counts(lens, in_batch, programs, programs, KVP, 16, 128, 0, QUEUE_SPLITS,
                                  QUEUE_FULL_FRACTION, QUEUE_SPLIT_COST)
    tl.store(OUT + offs, splits, mask=in_batch)


def _device_splits(lens, queue_splits, programs=132, kvp=8):
    from flashdecode import heuristics

    out = torch.zeros(len(lens), dtype=torch.int32, device=DEVICE)
    _split_counts_kernel[(1,)](_lens(lens), out, len(lens), programs, KVP=kvp,
                               BATCH_PAD=triton.next_power_of_2(len(lens)), QUEUE_SPLITS=queue_splits,
                               QUEUE_FULL_FRACTION=heuristics.DECODE_QUEUE_FULL_FRACTION,
                               QUEUE_SPLIT_COST=heuristics.DECODE_QUEUE_SPLIT_COST)
    return out.tolist()


def test_queue_splits_equal_lengths_only_where_the_last_round_would_idle():
    """The work queue's split counts (kernels/decode_schedule.py queue_split_ways) on 132 programs, 8 kv heads: 17 equal
    sequences (136 pairs: a second round of 4 items) split 4 ways, also padded to a bucket of 32 with one-token
    rows; 32 or 64 (last rounds of 124 / 116 items) and 16 (one round) not at all; one 128k sequence among 31 of
    1k keeps the programs' share (13 splits); without the rule 17 sequences run unsplit."""
    from flashdecode import heuristics

    ways = heuristics.DECODE_QUEUE_MAX_SPLITS
    assert _device_splits([8192] * 17, ways) == [4] * 17
    assert _device_splits([8192] * 17 + [1] * 15, ways) == [4] * 17 + [1] * 15
    for batch in (16, 32, 64):
        assert _device_splits([8192] * batch, ways) == [1] * batch, batch
    assert _device_splits([131072] + [1024] * 31, ways) == [13] + [1] * 31
    assert _device_splits([0] * 5, ways) == [1] * 5
    assert _device_splits([8192] * 17, 0) == [1] * 17


DEVICE_SPLIT_TWEAKS = [(3, False), (40, False), (3, True), (40, True)]


def _device_split_id(case):
    slots, in_kernel = case
    return f"{slots}slots" + ("-in-kernel-merge" if in_kernel else "")


@pytest.fixture(params=DEVICE_SPLIT_TWEAKS, ids=_device_split_id)
def device_splits(request):
    """A config tweak onto the DEVICE_SPLIT_GRID path with 3 work-item slots (short sequences share them: one split
    each) or 40 (a long sequence takes many splits); the merge kernel reading live slots only, as resolved, or no
    merge kernel (merge_in_kernel: one-split sequences write their results, the last split merges). One split stays
    UNSPLIT."""
    slots, in_kernel = request.param

    def tweak(config):
        if config.num_splits == 1:
            return config
        return dataclasses.replace(config, path=DecodePath.DEVICE_SPLIT_GRID, device_split_slots=slots,
                                   merge_live_only=True, merge_in_kernel=in_kernel)
    return tweak


# each tweak with each layout on a GPU; on the CPU each layout with both slot counts and both merges (8 of 16 cases)
@pytest.mark.parametrize("device_splits, page_size", [
    pytest.param((slots, in_kernel), page, id=f"{_device_split_id((slots, in_kernel))}-{page}")
    for slots, in_kernel, page in grid([3, 40], [False, True], [None, 3, 8, 32])], indirect=["device_splits"])
def test_device_splits_ragged_and_paged(gen, device_splits, page_size):
    """A plan's policy split count (sized for the worst mix) with each sequence's count chosen on the device:
    ragged lengths (a long one, an empty one, one token, short ones), then equal ones; contiguous, pages whose ids
    the loop reads (3), gathered preloaded ids (8 < block_n 16 on the CPU) and block-multiple pages (32)."""
    q, k, v = _make(gen, 5, 300, 4, 2, 64, torch.float32)
    kc, vc, table = (k, v, None) if page_size is None else ref.paged_from_contiguous(k, v, page_size, generator=gen)
    plan = _plan(q, kc, vc, _lens([300] * 5), 5, 4, 2, 64, table=table, tweak=device_splits, max_seqlen_k=300,
                 dtype=torch.float32, device=DEVICE)
    assert plan.num_splits > 4
    assert plan.config_for(q, kc, vc, _lens([1] * 5), block_table=table).path is DecodePath.DEVICE_SPLIT_GRID
    for lengths in ([300, 0, 1, 47, 130], [200] * 5):
        lens = _lens(lengths)
        out, lse = plan.run(q, kc, vc, lens, block_table=table, return_lse=True)
        _assert_matches_reference(out, lse, q, k, v, lens)


def test_device_splits_with_new_tokens_window_and_softcap(gen, device_splits):
    """The device-split grid with several new tokens per sequence (row blocks per kv head), a sliding window (live
    keys start past 0) and softcap, through flash_decode's policy count: every combination exact."""
    lens = _lens([250, 3, 0, 120])
    q, k, v = _make(gen, 4, 250, 8, 2, 64, torch.float32, seqlen_q=3)
    assert decode_config(q, k, v, lens).num_splits > 1
    _check(q, k, v, lens, page_size=8, gen=gen, softcap=20.0, tweak=device_splits)
    _check(q, k, v, lens, window_size=(150, -1), tweak=device_splits)


def test_device_splits_in_kernel_merge_with_row_blocks(gen):
    """merge_in_kernel with several row blocks per kv head (32 query heads a kv head x 3 new tokens = 96 rows: blocks
    of 64 and 32): each (sequence, kv head, row block) draws its own tickets, and a plan run twice (the tickets left
    at zero by the first) still matches the reference; contiguous and pages of 8."""
    from flashdecode import heuristics as hx

    assert hx.decode_block_m(32 * 3) < 32 * 3
    q, k, v = _make(gen, 3, 200, 64, 2, 32, torch.float32, seqlen_q=3)

    def tweak(config):
        if config.num_splits == 1:
            return config
        return dataclasses.replace(config, path=DecodePath.DEVICE_SPLIT_GRID, device_split_slots=24,
                                   merge_live_only=True, merge_in_kernel=True)
    for page_size in (None, 8):
        kc, vc, table = (k, v, None) if page_size is None else ref.paged_from_contiguous(k, v, page_size,
                                                                                          generator=gen)
        plan = _plan(q, kc, vc, _lens([200] * 3), 3, 64, 2, 32, table=table, tweak=tweak, max_seqlen_k=200,
                     dtype=torch.float32, device=DEVICE, max_seqlen_q=3)
        config = plan.config_for(q, kc, vc, _lens([200] * 3), block_table=table)
        assert config.merge_in_kernel and config.path is DecodePath.DEVICE_SPLIT_GRID
        for lengths in ([200, 0, 77], [150, 200, 5]):
            lens = _lens(lengths)
            out, lse = plan.run(q, kc, vc, lens, block_table=table, return_lse=True)
            _assert_matches_reference(out, lse, q, k, v, lens)
            assert torch.all(plan._tickets == 0), "tickets must be left at zero"


def test_device_split_grid_only_for_a_policy_count_at_batch():
    """The resolver takes the device-split grid (where its tile rule allows it: few pairs, contiguous here) only
    for the policy's split count at batch > 1: a caller's count, or one sequence, runs the plain split grid."""
    from flashdecode import heuristics as hx

    dev = hx.DecodeDevice(num_sms=132, interpret=False, hopper=False, pdl=False)

    def path(batch, **kw):
        p = hx.DecodeProblem(batch=batch, grid_batch=batch, seqlen_q=1, group=4, nheads_kv=8, headdim=128,
                             elem_bytes=2, page_size=0, capacity=12000, window_left=-1, live_keys=12000, **kw)
        return hx.resolve_decode_config(p, dev).path

    assert path(4) is DecodePath.DEVICE_SPLIT_GRID  # 32 pairs, the policy's count
    p4 = hx.DecodeProblem(batch=4, grid_batch=4, seqlen_q=1, group=4, nheads_kv=8, headdim=128, elem_bytes=2,
                          page_size=0, capacity=12000, window_left=-1, live_keys=12000)
    assert not hx.resolve_decode_config(p4, dev).merge_live_only  # (the 8-bit grid's merge only)
    assert path(4, num_splits=7) is DecodePath.SPLIT_GRID
    assert path(4, num_splits=7, device_may_reduce_splits=True) is DecodePath.DEVICE_SPLIT_GRID  # a plan's policy
    assert path(1) is DecodePath.SPLIT_GRID
    assert path(2) is DecodePath.SPLIT_GRID  # 16 pairs: below DECODE_DEVICE_SPLITS_MIN_PAIRS


def test_device_split_grid_override_rejected_where_the_preload_cannot_hold_a_sequence(gen):
    """DEVICE_SPLIT_GRID with pages smaller than a block whose whole-sequence ids outgrow the preload raises,
    naming config.path (the device may give a sequence one split)."""
    q, k, v = _make(gen, 2, 300, 4, 2, 64, torch.float32)
    kp, vp, table = ref.paged_from_contiguous(k, v, 8, generator=gen)
    lens = _lens([300, 20])
    config = dataclasses.replace(decode_config(q, kp, vp, lens, block_table=table, num_splits=4),
                                 path=DecodePath.DEVICE_SPLIT_GRID, preload_gather_max=16)
    with pytest.raises(ValueError, match="config.path"):
        flashdecode.flash_decode(q, kp, vp, lens, block_table=table, config=config)


@pytest.mark.parametrize("pages_per_block", [None, 1, 2])
def test_persistent_ragged_and_paged(gen, persistent, pages_per_block):
    page_size = _block_multiple_page(4, 4, 2, 64, torch.float16, pages_per_block)
    n = max(90, 2 * (page_size or 0) + 37)  # several pages per sequence on the GPU's larger blocks too
    q, k, v = _make(gen, 4, n, 4, 2, 64, torch.float16)
    _check(q, k, v, _lens([n, 0, n // 3, 5]), page_size=page_size, gen=gen, num_splits=4, tweak=persistent)


@pytest.mark.parametrize("page_size,key_ids", [(1, False), (1, True), (3, False)])
def test_persistent_key_pages(gen, persistent, page_size, key_ids):
    """Pages of 1-7 keys on the persistent path (heuristics.DECODE_QUEUE_KEY_PAGES): page ids read per key in the
    KV loop, or (1-, 2-, 4-key pages with preload_key_ids) gathered from a split's preload, bounding the splits."""
    from flashdecode import heuristics as hx

    lens = [150, 3, 61, 0, 17]
    q, k, v = _make(gen, len(lens), max(lens), 4, 2, 64, torch.float16)
    kp, vp, table = ref.paged_from_contiguous(k, v, page_size, generator=gen)
    config = persistent(dataclasses.replace(decode_config(q, kp, vp, _lens(lens), block_table=table, num_splits=4),
                                            preload_key_ids=key_ids))
    problem = hx.DecodeProblem(batch=5, grid_batch=5, seqlen_q=1, group=2, nheads_kv=2, headdim=64, elem_bytes=2,
                               page_size=page_size, capacity=table.shape[1] * page_size, window_left=-1,
                               live_keys=150)
    assert (hx.decode_persistent_preload(problem, hx.PageIdPreload.of(config), config.num_splits)[0] > 0) == key_ids
    _check(q, k, v, _lens(lens), page_size=page_size, gen=gen, num_splits=4,
           tweak=lambda c: persistent(dataclasses.replace(c, preload_key_ids=key_ids)))


def test_persistent_plan_runs_fewer_sequences_than_its_max_batch(gen, persistent):
    """A plan sized for 5 sequences serving 2 (the engine's graph buckets): the persistent kernel's items cover only
    the live batch, the outputs of the 2 are exact."""
    q, k, v = _make(gen, 2, 80, 4, 2, 64, torch.float16)
    lens = _lens([80, 33])
    plan = _plan(q, k, v, lens, 5, 4, 2, 64, tweak=persistent, max_seqlen_k=80, dtype=torch.float16, device=DEVICE,
                 num_splits=4)
    out, lse = plan.run(q, k, v, lens, return_lse=True)
    _assert_matches_reference(out, lse, q, k, v, lens)
    assert torch.all(plan._tickets == 0)


@pytest.mark.parametrize("tight", [True, False], ids=["preload-per-split", "preload-whole-sequence"])
def test_persistent_gathered_pages_bound_their_splits(gen, persistent, tight):
    """Pages smaller than a block on the persistent path. With a preload limit that holds one of 6 splits' page ids
    but not a whole sequence's, the device gives long sequences enough splits (MAX_SPLIT_KEYS) to stay within the
    preload; with 256 a whole sequence fits (the tile size, and so the limit, differs between the CPU and the GPU)."""
    from flashdecode import heuristics as hx

    lens = [200, 3, 100, 0]
    q, k, v = _make(gen, len(lens), max(lens), 4, 2, 64, torch.float16)
    kp, vp, table = ref.paged_from_contiguous(k, v, 8, generator=gen)
    problem = hx.DecodeProblem(batch=4, grid_batch=4, seqlen_q=1, group=2, nheads_kv=2, headdim=64, elem_bytes=2,
                               page_size=8, capacity=table.shape[1] * 8, window_left=-1, live_keys=200)
    config = persistent(dataclasses.replace(decode_config(q, kp, vp, _lens(lens), block_table=table, num_splits=6),
                                            preload_gather_max=256))
    loose = hx.decode_persistent_preload(problem, hx.PageIdPreload.of(config), config.num_splits)
    assert loose[0] > 0 and loose[1] == 0
    limit = loose[0] // 2 if tight else 256  # too few for a whole sequence, enough for a 6th
    if tight:
        bounded = hx.decode_persistent_preload(
            problem, hx.PageIdPreload.of(dataclasses.replace(config, preload_gather_max=limit)), config.num_splits)
        assert bounded[0] > 0 and bounded[1] > 0, bounded
    _check(q, k, v, _lens(lens), page_size=8, gen=gen, num_splits=6,
           tweak=lambda c: persistent(dataclasses.replace(c, preload_gather_max=limit)))


def test_persistent_gqa_multi_token_window_softcap(gen, persistent):
    q, k, v = _make(gen, 2, 70, 8, 1, 64, torch.float32, seqlen_q=3)
    _check(q, k, v, _lens([70, 20]), num_splits=6, softcap=20.0, window_size=(24, 0), tweak=persistent)


@pytest.mark.parametrize("pages_per_block", [None, 1])
def test_persistent_plan_mixed_then_uniform(gen, persistent, pages_per_block):
    """One plan, lengths that change the device's split counts between runs: a long sequence among short ones
    (many splits), then equal lengths (one split each), then one empty: split slots left over from an earlier run
    must never reach the merge."""
    page_size = _block_multiple_page(3, 4, 2, 64, torch.float16, pages_per_block)
    n = max(96, 3 * (page_size or 0))
    q, k, v = _make(gen, 3, n, 4, 2, 64, torch.float16)
    kp = vp = table = None
    if page_size:
        kp, vp, table = ref.paged_from_contiguous(k, v, page_size, generator=gen)
    plan = _plan(q, kp if page_size else k, vp if page_size else v, _lens([n] * 3), 3, 4, 2, 64, table=table,
                 tweak=persistent, max_seqlen_k=n, dtype=torch.float16, device=DEVICE, num_splits=6)
    for lengths in ([n, 2, 5], [40, 40, 40], [0, n, 1]):
        lens = _lens(lengths)
        out, lse = plan.run(q, kp if page_size else k, vp if page_size else v, lens, block_table=table,
                            return_lse=True)
        _assert_matches_reference(out, lse, q, k, v, lens)
        assert torch.all(plan._tickets == 0), "every run leaves the merge tickets at zero"


def test_prefetch_shape_stays_within_a_split():
    """Stage 1's pre-wait L2 prefetch covers prefetch_blocks blocks but never more than a split can hold (rounded
    to a power of two), in whole 128-byte lines of a head-dim row; off (0 keys) unless configured."""
    from flashdecode import heuristics as hx

    def problem(capacity, headdim=128, elem_bytes=2):
        return hx.DecodeProblem(batch=1, grid_batch=1, seqlen_q=1, group=8, nheads_kv=2, headdim=headdim,
                                elem_bytes=elem_bytes, page_size=0, capacity=capacity, window_left=-1,
                                live_keys=capacity)

    dev = hx.DecodeDevice(num_sms=132, interpret=False, hopper=True, pdl=True)
    config = dataclasses.replace(hx.resolve_decode_config(problem(32768), dev), block_n=64, prefetch_blocks=4)
    assert hx.decode_prefetch_shape(problem(32768), config, 64) == (256, 64, 2)  # 512-key splits: 4 blocks
    assert hx.decode_prefetch_shape(problem(4096), config, 64) == (64, 64, 2)  # 64-key splits: one block
    # 160 bytes: two lines, the second clamped to the row by the kernel
    assert hx.decode_prefetch_shape(problem(4096, 80, 4), config, 64) == (64, 32, 4)
    assert hx.decode_prefetch_shape(problem(4096), dataclasses.replace(config, prefetch_blocks=0), 64)[0] == 0


_HOPPER_COMPILE_SCRIPT = r'''
import sys
from flashdecode.kernels.decode import decode_persistent_kernel, decode_split_kernel
from flashdecode.kernels.merge import merge_many_kernel
sys.path.insert(0, "tests")
from helpers import compile_for_sm90, spilled_bytes


def compile_stage1(page, tma, preload, num_stages=3, **consts):
    """decode_split_kernel for sm_90 with bf16 hd128 tiles; ``consts`` override the defaults below."""
    kv = f"tensordesc<bf16[{consts.get('BLOCK_N', 128)}, 128]>" if tma else "*bf16"  # box = one block
    types = dict(Q="*bf16", K=kv, V=kv, K_RAW="*bf16", V_RAW="*bf16", SEQLENS="*i32", BLOCK_TABLE="*i32",
                 O="*fp32", LSE="*fp32", score_scale="fp32", softcap_out="fp32", ALIBI_SLOPES="*fp32")
    consts = dict(dict(SEQLEN_Q=1, GROUP=8, NUM_M_BLOCKS=1, HEADDIM=128, BLOCK_M=16, BLOCK_N=128, BLOCK_D=128,
                       NUM_SPLITS=16, MIN_CHUNK=128, PAGE_SIZE=page, SOFTCAP=False, WINDOW=False, FINAL=False,
                       DOT_PRECISION="tf32", USE_TMA=tma, USE_PDL=False, PDL_WAIT=False, PRELOAD_PAGES=preload,
                       MERGE_SPLITS=16,
                       PREFETCH_KEYS=0, LINE_ELEMS=64, NUM_LINES=2, DEVICE_SPLITS=False,
                       SPLIT_SLOTS=0, BATCH_PAD=1, MAX_SPLIT_KEYS=0, KV_PROGRAMS=1, OFFS_32=False, SPEC_PAGES=False,
                       ALIBI=False),
                  **consts)
    kernel = compile_for_sm90(decode_split_kernel, types, consts, num_stages)
    ttgir = kernel.asm["ttgir"]
    assert ("async_tma_copy" in ttgir) if tma else ("async_copy_global_to_local" in ttgir), (page, "not pipelined")
    return kernel


for page, tma, preload, pdl, block_n in [(0, True, 0, True, 128), (16, False, 64, False, 128), (256, True, 8, False, 128),
                                        (3, False, 0, False, 128), (0, True, 0, True, 64), (16, False, 16, True, 64)]:
    ptx = compile_stage1(page, tma, preload, SEQLEN_Q=2, SOFTCAP=True, USE_PDL=pdl, PDL_WAIT=pdl,
                         BLOCK_N=block_n).asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == pdl, "PDL_WAIT: stage 1 must wait for the previous kernel"
# L2 prefetch: issued before the PDL wait, its length / block-table reads bypass L1 (.cg), no spills
# ids read from the block table in the loop: with 5 stages K / V are double-buffered (3 left them single-buffered,
# every block waiting for all copies in flight); preloaded key ids of 1-key pages double-buffer at 3
for page, tma, preload, block_n, stages in [(1, False, 0, 64, 5), (3, False, 0, 128, 5), (128, True, 0, 128, 5),
                                            (1, False, 1024, 64, 3)]:
    ttgir = compile_stage1(page, tma, preload, BLOCK_N=block_n, NUM_SPLITS=64, num_stages=stages).asm["ttgir"]
    assert f"memdesc<2x{block_n}x128xbf16" in ttgir, (page, preload, stages, "K/V not double-buffered")
for page, tma, preload, block_n in [(0, True, 0, 64), (16, False, 64, 64), (0, True, 0, 128), (3, False, 0, 128)]:
    kernel = compile_stage1(page, tma, preload, USE_PDL=True, PDL_WAIT=True, BLOCK_N=block_n,
                            PREFETCH_KEYS=256, LINE_ELEMS=64, NUM_LINES=2)
    ptx = kernel.asm["ptx"]
    assert 0 <= ptx.find("prefetch.global.L2") < ptx.find("griddepcontrol.wait"), "prefetch must precede the wait"
    assert "ld.global.cg" in ptx and spilled_bytes(kernel) == 0
# OFFS_32 (32-bit offsets into caches below 2**31 elements): the page-16 gathers' offsets stop being 64-bit
# products (20 mul.lo.s64 with int64 offsets, 4 left outside the KV loop), nothing spills
muls = {}
for offs_32 in (False, True):
    kernel = compile_stage1(16, False, 64, BLOCK_N=64, MIN_CHUNK=64, OFFS_32=offs_32)
    muls[offs_32] = kernel.asm["ptx"].count("mul.lo.s64")
    assert spilled_bytes(kernel) == 0
assert muls[True] * 4 <= muls[False], ("OFFS_32: 64-bit offset math left", muls)
# SPEC_PAGES: the split's page ids load beside its length right after the wait (both before the first branch,
# which depends on the length), not behind it; no spills
for page, tma, preload in [(16, False, 64), (64, True, 16)]:
    ids_beside_length = {}
    for spec in (False, True):
        kernel = compile_stage1(page, tma, preload, USE_PDL=True, PDL_WAIT=True, BLOCK_N=64, MIN_CHUNK=64,
                                NUM_SPLITS=64, PREFETCH_KEYS=64, OFFS_32=True, SPEC_PAGES=spec)
        ptx = kernel.asm["ptx"]
        after_wait = ptx[ptx.find("griddepcontrol.wait"):]
        ids_beside_length[spec] = after_wait[:after_wait.find("bra")].count("ld.global.b32")
        assert spilled_bytes(kernel) == 0, ("SPEC_PAGES spills", page, spec)
    assert ids_beside_length == {False: 1, True: 2}, (page, ids_beside_length)
# DEVICE_SPLITS (split counts from all lengths, one program per work item): still pipelined, no spills, the
# prefetch (which places the item with lengths read .cg) before the wait
for page, tma, preload, block_n in [(0, True, 0, 64), (64, True, 16, 64), (16, False, 64, 64)]:
    kernel = compile_stage1(page, tma, preload, USE_PDL=True, PDL_WAIT=True, BLOCK_N=block_n, MIN_CHUNK=64,
                            GROUP=4, DEVICE_SPLITS=True, SPLIT_SLOTS=132, BATCH_PAD=8, KV_PROGRAMS=8,
                            PREFETCH_KEYS=64)
    ptx = kernel.asm["ptx"]
    assert 0 <= ptx.find("prefetch.global.L2") < ptx.find("griddepcontrol.wait"), "prefetch must precede the wait"
    assert spilled_bytes(kernel) == 0, ("device splits spill", page)
# PERSISTENT (one launch: the KV loops nested in the work-item loop, then the ticket merge over 2048-value steps, as
# the launcher configures it): loads still pipelined; contiguous caches spill nothing, block-multiple pages (whose
# page-id reads keep a few more registers live at the 255 cap) at most 16 bytes (8 at 4 rows x 4 splits per step)
# DYNAMIC: the work queue's relaxed draws and the acq_rel count of finished programs
for page, block_n, group, merge_block_s, dynamic in [(0, 128, 4, 4, False), (0, 128, 8, 2, False),
                                                     (0, 64, 4, 4, False), (256, 128, 4, 4, False),
                                                     (128, 128, 4, 4, False), (0, 128, 4, 4, True),
                                                     (128, 128, 4, 4, True)]:
    kv = f"tensordesc<bf16[{block_n}, 128]>"
    types = dict(Q="*bf16", K=kv, V=kv, SEQLENS="*i32", BLOCK_TABLE="*i32", O="*fp32", LSE="*fp32",
                 O_FINAL="*bf16", LSE_FINAL="*fp32", TICKETS="*i32", QUEUE="*i32", score_scale="fp32",
                 softcap_out="fp32")
    consts = dict(SEQLEN_Q=1, GROUP=group, NUM_M_BLOCKS=1, NHEADS_KV=8, HEADDIM=128, BLOCK_M=16, BLOCK_N=block_n,
                  BLOCK_D=128, NUM_SPLITS=16, MIN_CHUNK=block_n, PAGE_SIZE=page, SOFTCAP=False,
                  WINDOW=False, DOT_PRECISION="tf32", USE_TMA=True, USE_PDL=True, PDL_WAIT=True,
                  PRELOAD_PAGES=0, BATCH_PAD=64, MERGE_M=group, MERGE_SPLITS=16, MERGE_BLOCK_S=merge_block_s,
                  MAX_SPLIT_KEYS=0, DYNAMIC=dynamic, QUEUE_SPLITS=4 if dynamic else 0,
                  OFFS_32=False, ALIBI=False)
    kernel = compile_for_sm90(decode_persistent_kernel, types, consts, 3)
    assert "async_tma_copy" in kernel.asm["ttgir"], (page, block_n, "persistent loads not pipelined")
    ptx = kernel.asm["ptx"]
    assert "atom.global.gpu.acq_rel.add" in ptx, "persistent: the merge ticket is missing"
    assert ("atom.global.gpu.relaxed.add" in ptx) == dynamic, "DYNAMIC: the work-queue draws"
    assert spilled_bytes(kernel) <= (16 if page else 0), ("the persistent kernel spills", page, block_n, group)
# DYNAMIC with gathered pages (page 16 < BLOCK_N 128, pointer loads, each key's page id from 512 preloaded ids):
# pipelined, and the 144 stack bytes measured when the queue took this path (heuristics DECODE_QUEUE_GATHERED) at most
types.update(K="*bf16", V="*bf16")
consts.update(PAGE_SIZE=16, BLOCK_N=128, MIN_CHUNK=128, GROUP=4, MERGE_M=4, MERGE_BLOCK_S=4, USE_TMA=False,
              PRELOAD_PAGES=512, MAX_SPLIT_KEYS=8192, DYNAMIC=True, QUEUE_SPLITS=4)
kernel = compile_for_sm90(decode_persistent_kernel, types, consts, 3)
assert "async_copy_global_to_local" in kernel.asm["ttgir"], "gathered persistent loads not pipelined"
assert spilled_bytes(kernel) <= 160, ("the gathered persistent kernel spills more", spilled_bytes(kernel))
# ALiBi (per-row slopes, the bias added in the KV loop): both kernels compile and keep their loads pipelined
types.update(ALIBI_SLOPES="*fp32")
kernel = compile_for_sm90(decode_persistent_kernel, types, dict(consts, ALIBI=True), 3)
assert "async_copy_global_to_local" in kernel.asm["ttgir"], "ALiBi: persistent loads not pipelined"
compile_stage1(0, True, 0, ALIBI=True)
compile_stage1(16, False, 64, ALIBI=True, SEQLEN_Q=2, SOFTCAP=True)
types = dict(O_IN="*fp32", LSE_IN="*fp32", O_OUT="*bf16", LSE_OUT="*fp32")
compile_for_sm90(merge_many_kernel, types, dict(HEADDIM=128, BLOCK_R=1, BLOCK_S=64, BLOCK_D=128, LSE_LOG2=True,
                                               USE_PDL=True, EARLY_TRIGGER=False), 1)
ptx = compile_for_sm90(merge_many_kernel, types, dict(HEADDIM=128, BLOCK_R=1, BLOCK_S=64, BLOCK_D=128,
                                                     LSE_LOG2=True, USE_PDL=True, EARLY_TRIGGER=True), 1).asm["ptx"]
assert 0 <= ptx.find("griddepcontrol.launch_dependents") < ptx.find("griddepcontrol.wait"), "early trigger"
# LIVE_ONLY (softmax_state.fold_live_states) compiles with its state strides widened to 64 bits, also where one is
# specialised to the constant 1
for one in ({}, dict(stride_lin=1)):
    compile_for_sm90(merge_many_kernel, types, dict(HEADDIM=128, BLOCK_R=4, BLOCK_S=4, BLOCK_D=128, LSE_LOG2=True,
                                                   USE_PDL=True, LIVE_ONLY=True, STATES_PAD=64, **one), 1)
print("compiled")
'''


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter accepts code the GPU compiler rejects (e.g. non-constexpr globals). Compile
    the main stage-1 variants (TMA, PDL, preloaded page tables, gathers), the persistent kernel and the merge for sm_90 with Triton's own
    ptxas - no GPU needed - and check that the K/V loads are software-pipelined (cp.async or TMA)."""
    run_sm90_compile_script(_HOPPER_COMPILE_SCRIPT)


def test_stage1_retries_with_fewer_stages_when_shared_memory_runs_out():
    """decode_launch's one fallback: a depth whose tiles do not fit in shared memory is retried one stage
    shallower, down to 1; nothing is remembered between calls (the launch cache's record of a key holds the depth
    that ran), and a launch that fits nowhere raises."""
    from triton.runtime.errors import OutOfResources

    from flashdecode.ops import decode_launch

    tried = []

    def launch(stages):
        tried.append(stages)
        if stages > 2:
            raise OutOfResources(240000, 232448, "shared memory")
        return stages

    assert decode_launch._launch_fitting_shared_memory(launch, 4) == 2
    assert decode_launch._launch_fitting_shared_memory(launch, 4) == 2
    assert tried == [4, 3, 2, 4, 3, 2]
    assert decode_launch._launch_fitting_shared_memory(launch, 1) == 1
    tried.clear()
    with pytest.raises(OutOfResources):
        decode_launch._launch_fitting_shared_memory(lambda s: launch(9), 3)
    assert tried == [9, 9, 9]


@pytest.mark.gpu
def test_gpu_stage_fallback_is_recorded_per_launch_key(gen, monkeypatch):
    """A config asking for more pipeline stages than shared memory holds (hd256, 64 query rows, 6 stages of 64-key
    K / V tiles): the launcher's one fallback launches shallower depths until one fits, the launch cache records
    that launch under the call's key, and the repeated call launches it directly (no retry, no JIT call: the bound
    launch of decode_host.bound skips the fallback altogether)."""
    from flashdecode.ops import decode_launch

    tried = []
    fallback = decode_launch._launch_fitting_shared_memory

    def recording(launch, num_stages):
        return fallback(lambda stages: (tried.append(stages), launch(stages))[1], num_stages)

    monkeypatch.setattr(decode_launch, "_launch_fitting_shared_memory", recording)
    q, k, v = _make(gen, 2, 3000, 64, 1, 256, torch.bfloat16)
    lens = _lens([3000, 1777])
    config = dataclasses.replace(decode_config(q, k, v, lens), num_stages=6)
    assert config.block_n == 64
    launches = lambda: decode_launch._STAGE1.jit_launches + decode_launch._PERSISTENT.jit_launches  # noqa: E731
    out, lse = flashdecode.flash_decode(q, k, v, lens, config=config, return_lse=True)
    _assert_matches_reference(out, lse, q, k, v, lens)
    assert tried[0] == 6 and len(tried) > 1 and tried == list(range(6, tried[-1] - 1, -1)), tried
    first, fitted = launches(), tried[-1]
    tried.clear()
    out, lse = flashdecode.flash_decode(q, k, v, lens, config=config, return_lse=True)
    _assert_matches_reference(out, lse, q, k, v, lens)
    assert launches() == first and tried == [], (tried, fitted)


@pytest.mark.xdist_group("gpu_bigmem")  # big tensors: gpu_check's bigmem part, 4 workers
@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_cache_beyond_2_pow_31_elements(gen, paged):
    """Offsets past 2**31 elements (int64 address math): 17 x 128k x 8 x 128 = 2.28e9 elements per cache; the last
    sequence is the long one, so its keys sit past the int32 range (pages 16 with an identity block table)."""
    batch, cap, hk, d = 17, 131072, 8, 128
    k = torch.randn(batch, cap, hk, d, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(batch, cap, hk, d, device=DEVICE, dtype=torch.bfloat16)
    assert k.numel() > 2**31
    q = randn(batch, 8, d, gen=gen, dtype=torch.bfloat16)
    lens = _lens([5] * (batch - 1) + [cap - 3])
    if paged:
        page = 16
        kc, vc = k.view(-1, page, hk, d), v.view(-1, page, hk, d)
        table = torch.arange(batch * cap // page, device=DEVICE, dtype=torch.int32).view(batch, cap // page)
        out = flashdecode.flash_decode(q, kc, vc, lens, block_table=table)
    else:
        out = flashdecode.flash_decode(q, k, v, lens)
    last = slice(batch - 1, batch)
    o64, _ = ref.decode_ref(q[last].double(), k[last].double(), v[last].double(), lens[last])
    o_same, _ = ref.decode_ref(q[last], k[last], v[last], lens[last])
    assert_fa_close(out[last], o64, o_same, factor=3.0, atol=1e-4)
    o64_first, _ = ref.decode_ref(q[:1].double(), k[:1].double(), v[:1].double(), lens[:1])
    torch.testing.assert_close(out[:1].double(), o64_first, atol=2e-2, rtol=0)


def test_32_bit_offsets_only_for_caches_below_2_31_elements():
    """OFFS_32 (32-bit gather offsets) is chosen from the cache's last element offset, not its size alone: a dense
    cache of 2**31 elements (last offset 2**31 - 1) qualifies, a larger one does not, nor a view of fewer elements
    whose strides reach past 2**31."""
    from flashdecode.ops.decode_policy import _offsets_fit_int32

    assert _offsets_fit_int32(torch.empty(2**14, 16, 8, 1024, device="meta"))
    assert not _offsets_fit_int32(torch.empty(2**14, 16, 8, 1025, device="meta"))
    wide = torch.empty(2**20, 2**11 + 1, device="meta")[:, :8]  # 8 columns of rows 2**11 + 1 apart
    assert wide.numel() < 2**31 and not _offsets_fit_int32(wide)


def test_config_override_is_checked_against_the_call(gen):
    """config= on flash_decode / DecodePlan: not a DecodeConfig -> TypeError naming config; a num_splits that
    disagrees, PDL or prefetch where the device cannot run them, 32-bit offsets the cache does not fit ->
    ValueError naming config (or num_splits); a valid override runs exactly."""
    q, k, v = _make(gen, 2, 40, 4, 2, 64, torch.float16)
    lens = _lens([40, 9])
    with pytest.raises(TypeError, match="config"):
        flashdecode.flash_decode(q, k, v, lens, config={"block_n": 16})
    resolved = decode_config(q, k, v, lens, num_splits=3)
    with pytest.raises(ValueError, match="num_splits"):
        flashdecode.flash_decode(q, k, v, lens, num_splits=2, config=resolved)
    # PDL and the L2 prefetch are inline asm: only a GPU of sm_90+ runs them (elsewhere the override is refused)
    hopper_gpu = DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE)[0] >= 9
    refused = [dict(merge_max_rows=3)] + ([] if hopper_gpu else [dict(use_pdl=True), dict(prefetch_blocks=1)])
    for change in refused:
        with pytest.raises(ValueError, match="config"):
            flashdecode.flash_decode(q, k, v, lens, config=dataclasses.replace(resolved, **change))
    with pytest.raises(ValueError, match="num_splits"):
        flashdecode.DecodePlan(2, 4, 2, 64, max_seqlen_k=40, dtype=torch.float16, device=DEVICE, num_splits=2,
                               config=resolved)
    with pytest.raises(ValueError, match="config"):
        flashdecode.flash_decode(q, k, v, lens, plan=flashdecode.DecodePlan(2, 4, 2, 64, max_seqlen_k=40,
                                 dtype=torch.float16, device=DEVICE), config=resolved)
    _check(q, k, v, lens, num_splits=3, tweak=dict(block_n=32, num_stages=2))
