"""NaN semantics of decode, one way on every path: a NaN in q, a key, a value, an e4m3 NaN code or a scale (NaN, or an
inf k scale: the documented cache.float() * scale) makes exactly the rows (sequence, query head) that read it NaN,
element for element as the float64 reference (reference.decode_ref) has them; every other row matches the reference.
Absent pages (block-table ids outside [0, num_pages)) are masked by their ids, never by testing scores for NaN: an
id past a sequence's length has no effect, an id within it leaves its page's keys out. Garbage past the lengths and
in unused pages (NaN / inf) is never read.

Each case forces one path through config= (kernels/decode.py: contiguous, page ids preloaded or read in the loop,
TMA - the interpreter runs host tensor descriptors -, the persistent kernel and its work queue, the split grid and
its merge kernel, the device-split grid with the merge kernel or merging in-kernel, batch-invariant fixed splits);
one NaN of each kind sits in its own (sequence, kv head) group, so one call checks them all.
"""

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import DecodePath
from flashdecode import reference as ref
from flashdecode.ops.decode import decode_config
from helpers import DEVICE, HAS_CUDA, assert_fa_close, pack_present_keys, randn
from quant_helpers import FP8, INT8, paged_quant_cache, quantize_float_cache

LENS = [37, 20, 50]
NHEADS, NHEADS_KV, HEADDIM = 4, 2, 32
GROUP = NHEADS // NHEADS_KV
NAN, INF = float("nan"), float("inf")
# the interpreter's numpy reductions warn on rows of NaN
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")


def _lens(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# ----------------------------------------------------------------------------------------------------------------
# Config tweaks: one decode path each (a num_splits of 1 stays UNSPLIT where a path needs splits)
# ----------------------------------------------------------------------------------------------------------------

def _splits_only(change):
    def tweak(config):
        return config if config.num_splits == 1 else change(config)
    return tweak


def _fields(**fields):
    return lambda config: dataclasses.replace(config, **fields)


IDS_IN_LOOP = dict(preload_pages_max=0, preload_gather_max=0, preload_key_ids=False)
PERSISTENT = _splits_only(_fields(path=DecodePath.PERSISTENT, persistent_programs=3))
QUEUE = _splits_only(_fields(path=DecodePath.PERSISTENT_QUEUE, persistent_programs=3, persistent_slots=2))
DEVICE_SPLITS = _splits_only(_fields(path=DecodePath.DEVICE_SPLIT_GRID, device_split_slots=8, merge_live_only=True))
DEVICE_SPLITS_IN_KERNEL = _splits_only(_fields(path=DecodePath.DEVICE_SPLIT_GRID, device_split_slots=8,
                                               merge_live_only=True, merge_in_kernel=True))


def _fixed_splits(config):
    """Batch-invariant fixed splits of 32 keys (two 16-key blocks), folded 2 a merge step (SKIP_EMPTY)."""
    return dataclasses.replace(config, path=DecodePath.FIXED_SPLIT, num_splits=4, block_n=16, split_keys=32,
                               merge_block_s=2, use_tma=False, prefetch_blocks=0, **IDS_IN_LOOP)


# (page size or None, num_splits, tweak, q dtype): every path of the float cache, fp16 and fp32 between them
FLOAT_CASES = {
    "contiguous-unsplit": (None, 1, None, torch.float16),
    "contiguous-split": (None, 3, None, torch.float32),
    "contiguous-tma": (None, 3, _fields(use_tma=True), torch.float16),
    "page1-preloaded": (1, 3, _fields(preload_key_ids=True), torch.float16),
    "page1-ids-in-loop": (1, 1, _fields(**IDS_IN_LOOP), torch.float32),
    "page3-ids-in-loop": (3, 3, None, torch.float16),
    "page3-unsplit": (3, 1, None, torch.float32),
    "page16-preloaded": (16, 3, None, torch.float32),
    "page16-ids-in-loop": (16, 3, _fields(**IDS_IN_LOOP), torch.float16),
    "page16-tma": (16, 1, _fields(use_tma=True, block_n=16), torch.float16),
    "page16-tma-ids-in-loop": (16, 3, _fields(use_tma=True, block_n=16, **IDS_IN_LOOP), torch.float32),
    "contiguous-persistent": (None, 3, PERSISTENT, torch.float32),
    "page16-persistent": (16, 3, PERSISTENT, torch.float16),
    "page3-queue": (3, 3, QUEUE, torch.float16),
    "page1-device-splits": (1, 3, DEVICE_SPLITS, torch.float32),
    "contiguous-device-splits-in-kernel-merge": (None, 3, DEVICE_SPLITS_IN_KERNEL, torch.float16),
    "page16-device-splits-in-kernel-merge": (16, 3, DEVICE_SPLITS_IN_KERNEL, torch.float32),
    "page3-fixed-splits": (3, 1, _fixed_splits, torch.float16),
}


# ----------------------------------------------------------------------------------------------------------------
# Inputs and the reference
# ----------------------------------------------------------------------------------------------------------------

def _garbage_past_lengths(k, v, lens):
    """Slots past each length hold NaN keys and inf values: never read."""
    for b, n in enumerate(lens):
        k[b, n:] = NAN
        v[b, n:] = INF


def _paged(gen, k, v, page_size, lens):
    """(k_pages, v_pages, table, present): k, v in randomly permuted pages whose unused pages hold NaN; the table
    carries two more columns of bad ids (-1, 2**30) past every sequence's pages, and sequence 1's page holding key 4
    gets the id num_pages (its keys are absent: present (batch, max_len) marks the keys that are not)."""
    kp, vp, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=2, generator=gen)
    used = torch.zeros(kp.shape[0], dtype=torch.bool)
    used[table.flatten().long().cpu()] = True
    kp[~used.to(kp.device)] = NAN
    vp[~used.to(vp.device)] = NAN
    past = torch.tensor([[-1, 2**30]], dtype=torch.int32, device=table.device).expand(table.shape[0], 2)
    table = torch.cat([table, past], dim=1).contiguous()
    present = torch.ones(len(lens), max(lens), dtype=torch.bool)
    page = 4 // page_size
    table[1, page] = kp.shape[0]
    present[1, page * page_size:(page + 1) * page_size] = False
    return kp, vp, table, present


def _reference(q, k, v, lens, present=None):
    """decode_ref (float64, and in q's dtype for the FlashAttention rule) over the present keys (one new token, no
    window: the order of keys does not matter, so they are packed to the front). k, v: the float caches."""
    if present is not None:
        k, v, lens = pack_present_keys(k, v, lens, present)
    o64, lse64 = ref.decode_ref(q.double(), k.double(), v.double(), _lens(lens))
    o_same, lse_same = ref.decode_ref(q, k.to(q.dtype), v.to(q.dtype), _lens(lens))
    return o64, lse64, o_same, lse_same


def _assert_nan_where_the_reference_has_it(out, lse, reference, nan_rows):
    """NaN exactly where the float64 reference has it (element for element, out and lse), in exactly the rows
    ``nan_rows`` ((batch, query head) pairs); every other row within the FlashAttention rule of the reference."""
    o64, lse64, o_same, lse_same = reference
    want = torch.zeros(out.shape[:2], dtype=torch.bool)
    for b, h in nan_rows:
        want[b, h] = True
    assert torch.equal(torch.isnan(o64).any(-1).cpu(), want), "the reference's NaN rows"
    assert torch.equal(torch.isnan(out).cpu(), torch.isnan(o64).cpu()), (
        f"NaN rows {torch.isnan(out).any(-1).nonzero().tolist()}, want {sorted(nan_rows)}")
    assert torch.equal(torch.isnan(lse).cpu(), torch.isnan(lse64).cpu()), "lse NaN pattern"
    clean = ~want.to(out.device)
    assert_fa_close(out[clean], o64[clean], o_same[clean], factor=3.0, atol=2e-3)
    lse_ok = ~torch.isnan(lse64)
    assert_fa_close(lse[lse_ok], lse64[lse_ok], lse_same[lse_ok], factor=3.0, atol=2e-3, name="lse")


def _decode(q, kc, vc, lens, table, num_splits, tweak, **kw):
    config = decode_config(q, kc, vc, _lens(lens), block_table=table, num_splits=num_splits, **kw)
    if tweak is not None:
        config = tweak(config)
    return flashdecode.flash_decode(q, kc, vc, _lens(lens), block_table=table, config=config, return_lse=True,
                                    **kw)


# ----------------------------------------------------------------------------------------------------------------
# Float caches
# ----------------------------------------------------------------------------------------------------------------

# one NaN of each kind in its own (sequence, kv head) group: q of (sequence 1, head 3), key 9 of (0, kv head 1),
# value 44 of (2, kv head 0); the rows that read each
Q_NAN, K_NAN, V_NAN = (1, 3), (0, 9, 1), (2, 44, 0)
FLOAT_NAN_ROWS = {(1, 3), (0, 2), (0, 3), (2, 0), (2, 1)}


@pytest.mark.parametrize("case", list(FLOAT_CASES))
def test_nan_reaches_exactly_its_rows(gen, case, device_resident):
    page_size, num_splits, tweak, dtype = FLOAT_CASES[case]
    q = randn(len(LENS), NHEADS, HEADDIM, gen=gen, dtype=dtype)
    k, v = (randn(len(LENS), max(LENS), NHEADS_KV, HEADDIM, gen=gen, dtype=dtype) for _ in range(2))
    q[Q_NAN][5] = NAN
    k[K_NAN][2] = NAN
    v[V_NAN][7] = NAN
    _garbage_past_lengths(k, v, LENS)
    kc, vc, table, present = k, v, None, None
    if page_size is not None:
        kc, vc, table, present = _paged(gen, k, v, page_size, LENS)
    out, lse = _decode(q, kc, vc, LENS, table, num_splits, tweak)
    _assert_nan_where_the_reference_has_it(out, lse, _reference(q, k, v, LENS, present), FLOAT_NAN_ROWS)


def test_fixed_splits_merge_step_of_nan_states(gen):
    """Batch-invariant merge (SKIP_EMPTY): a step whose states are NaN or empty in every row of its program (q NaN
    in every head of a one-split sequence) is live: the rows read NaN, not (0, -inf)."""
    q = randn(len(LENS), NHEADS, HEADDIM, gen=gen, dtype=torch.float16)
    k, v = (randn(len(LENS), max(LENS), NHEADS_KV, HEADDIM, gen=gen, dtype=torch.float16) for _ in range(2))
    q[1, :, 0] = NAN  # sequence 1 (20 keys): one 32-key split
    out, lse = _decode(q, k, v, LENS, None, 1, _fixed_splits)
    _assert_nan_where_the_reference_has_it(out, lse, _reference(q, k, v, LENS), {(1, h) for h in range(NHEADS)})


@pytest.mark.parametrize("page_size,tweak", [(16, None), (16, _fields(use_tma=True, block_n=16)),
                                             (16, _fields(**IDS_IN_LOOP)), (3, None)])
def test_bad_ids_past_the_length_change_nothing(gen, page_size, tweak, device_resident):
    """Bad ids (-1, 2**30, num_pages) in every block-table column past a sequence's pages: the result is bitwise
    the result with a clean table (no NaN anywhere: nothing absent is read, nothing real is dropped)."""
    q = randn(len(LENS), NHEADS, HEADDIM, gen=gen, dtype=torch.float16)
    k, v = (randn(len(LENS), max(LENS), NHEADS_KV, HEADDIM, gen=gen, dtype=torch.float16) for _ in range(2))
    kp, vp, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=2, generator=gen)
    wide = torch.full((table.shape[0], table.shape[1] + 3), kp.shape[0], dtype=torch.int32, device=table.device)
    wide[:, table.shape[1] + 1:] = torch.tensor([-1, 2**30], dtype=torch.int32)
    bad = wide.clone()
    for b, n in enumerate(LENS):
        pages = -(-n // page_size)
        wide[b, :pages] = bad[b, :pages] = table[b, :pages]
        wide[b, pages:] = table[b, 0]  # the clean table: a valid id past the length
    out_bad, lse_bad = _decode(q, kp, vp, LENS, bad, 3, tweak)
    out, lse = _decode(q, kp, vp, LENS, wide, 3, tweak)
    assert torch.isfinite(out_bad).all() and torch.equal(out_bad, out) and torch.equal(lse_bad, lse)
    o64, _, o_same, _ = _reference(q, k, v, LENS)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# 8-bit caches: NaN codes and non-finite scales
# ----------------------------------------------------------------------------------------------------------------

def _quant_inputs(gen, dtype, nan_codes):
    """fp16 q and an 8-bit cache with per-token scales, holding (each in its own (sequence, kv head) group): a NaN
    k scale (sequence 0, kv head 0, key 30), an e4m3 NaN code in a key (0, kv head 1, key 9; 0x7F, torch's cast of
    NaN) and in a value (2, kv head 1, key 3; 0xFF), an inf k scale (1, kv head 0, key 5), a NaN v scale (2, kv
    head 0, key 44), NaN in q (1, head 3). Returns q, (kc, ks, vc, vs) and the NaN rows."""
    q = randn(len(LENS), NHEADS, HEADDIM, gen=gen, dtype=torch.float16)
    k, v = (randn(len(LENS), max(LENS), NHEADS_KV, HEADDIM, gen=gen) for _ in range(2))
    kc, ks = quantize_float_cache(k, dtype, "token")
    vc, vs = quantize_float_cache(v, dtype, "token")
    q[1, 3, 5] = NAN
    ks[0, 30, 0] = NAN
    ks[1, 5, 0] = INF
    vs[2, 44, 0] = NAN
    rows = {(1, 3), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)}
    if nan_codes:
        kc.view(torch.uint8)[0, 9, 1, 2] = 0x7F
        vc.view(torch.uint8)[2, 3, 1, 4] = 0xFF
        rows |= {(0, 2), (0, 3), (2, 2), (2, 3)}
    for b, n in enumerate(LENS):  # past the lengths: NaN scales (never read)
        ks[b, n:] = NAN
        vs[b, n:] = NAN
    return q, (kc, ks, vc, vs), rows


QUANT_CASES = {
    "contiguous-unsplit": (None, 1, None),
    "contiguous-split": (None, 3, None),
    "page3-ids-in-loop": (3, 3, None),
    "page16-preloaded": (16, 1, None),
    "page16-ids-in-loop": (16, 3, _fields(**IDS_IN_LOOP)),
    "page1-persistent": (1, 3, PERSISTENT),
    "page16-device-splits-in-kernel-merge": (16, 3, DEVICE_SPLITS_IN_KERNEL),
    "contiguous-warp-split": (None, 3, _fields(quant_warp_split=True, block_n=32, num_warps=2)),
    "page3-warp-split": (3, 1, _fields(quant_warp_split=True, block_n=32, num_warps=2)),
}
# e4m3 tiles to 16 bits by bit operations (quant_convert 1, the interpreter's default; 2, packed PTX: the GPU's) or
# conversion instructions (0; the interpreter's own e4m3 conversion reads the NaN codes as +-480 - the GPU's reads
# NaN - so there NaN codes are checked on the GPU only); int8 tiles take the conversion either way
CACHES = [(FP8, 1), (FP8, 0), pytest.param(FP8, 2, marks=pytest.mark.gpu), (INT8, 1)]


@pytest.mark.parametrize("case", list(QUANT_CASES))
@pytest.mark.parametrize("dtype,convert", CACHES)
def test_8bit_nan_codes_and_scales(gen, case, dtype, convert, device_resident):
    page_size, num_splits, tweak = QUANT_CASES[case]
    nan_codes = dtype == FP8 and (convert == 1 or HAS_CUDA)
    q, (kc, ks, vc, vs), rows = _quant_inputs(gen, dtype, nan_codes)
    kw = dict(k_scale=ks, v_scale=vs)
    kp, vp, table = kc, vc, None
    if page_size is not None:
        kp, ksp, vp, vsp, table = paged_quant_cache(gen, kc, ks, vc, vs, page_size)
        kw = dict(k_scale=ksp, v_scale=vsp)
    change = _fields(quant_convert=convert) if tweak is None else (
        lambda c: dataclasses.replace(tweak(c), quant_convert=convert))
    out, lse = _decode(q, kp, vp, LENS, table, num_splits, change, **kw)
    k = kc.float() * ks[..., None]  # the documented meaning: NaN codes and scales, inf scales included
    v = vc.float() * vs[..., None]
    _assert_nan_where_the_reference_has_it(out, lse, _reference(q, k, v, LENS), rows)


def test_inf_k_scale_reads_nan_for_every_head(gen):
    """An inf k scale makes every row that reads its key NaN, whatever the sign of q . codes (before: NaN where it
    was positive, the key silently dropped where negative); finite scales of the same call are exact."""
    q = randn(1, 8, HEADDIM, gen=gen, dtype=torch.float16)
    q[0, 4:] = -q[0, :4]  # both signs of q . codes for each key
    k, v = (randn(1, 20, 1, HEADDIM, gen=gen) for _ in range(2))
    kc, ks = quantize_float_cache(k, FP8, "token")
    vc, vs = quantize_float_cache(v, FP8, "token")
    ks[0, 7, 0] = INF
    out = flashdecode.flash_decode(q, kc, vc, _lens([20]), k_scale=ks, v_scale=vs, num_splits=2)
    assert torch.isnan(out).all()


# ----------------------------------------------------------------------------------------------------------------
# GPU: the engine's shapes at long context
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("batch", [1, 16])
def test_nan_key_in_a_long_bf16_paged_cache(page_size, batch):
    """Llama-3-8B's heads (32 / 8, hd128), bf16 pages at 32k keys as resolved (no config=): one NaN in a key of the
    last sequence's kv head 3 makes exactly its 4 query heads NaN; every other row is what the same call gives
    without the NaN."""
    gen = torch.Generator().manual_seed(0)
    seqlen, nheads, nheads_kv, headdim = 32768, 32, 8, 128
    pages_per_seq = seqlen // page_size
    num_pages = batch * pages_per_seq
    q = randn(batch, nheads, headdim, gen=gen, dtype=torch.bfloat16)
    kp = torch.randn(num_pages, page_size, nheads_kv, headdim, device=DEVICE, dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    table = torch.randperm(num_pages, generator=gen).view(batch, pages_per_seq).to(torch.int32).to(DEVICE)
    lens = _lens([seqlen] * batch)
    clean = flashdecode.flash_decode(q, kp, vp, lens, block_table=table)
    key = 12345
    kp[table[batch - 1, key // page_size].long(), key % page_size, 3, 5] = NAN
    out = flashdecode.flash_decode(q, kp, vp, lens, block_table=table)
    want = torch.zeros(batch, nheads, dtype=torch.bool, device=DEVICE)
    want[batch - 1, 12:16] = True
    assert torch.equal(torch.isnan(out).any(-1), want)
    assert torch.isnan(out[batch - 1, 12:16]).all()
    torch.testing.assert_close(out[~want], clean[~want], atol=1e-2, rtol=0)
