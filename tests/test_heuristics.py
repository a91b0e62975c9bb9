"""Decode launch policy (flashdecode.heuristics): split counts from live lengths, SMs and the batch."""

import dataclasses

from flashdecode import DecodePath
from flashdecode import heuristics as hx

_HOPPER = hx.DecodeDevice(num_sms=132, interpret=False, hopper=True, pdl=True)


def _choice(headdim, elem_bytes, interpret=False, kv_pairs=128, num_sms=132, page_size=0, split_keys=None,
            hopper=True):
    """The tile policy's choice (heuristics._stage1_choice) for kv_pairs (batch, kv head) pairs: batch kv_pairs,
    one kv head, one query row; the H100's 132 SMs; Hopper unless told."""
    dev = hx.DecodeDevice(num_sms=num_sms, interpret=interpret, hopper=hopper, pdl=hopper)
    return hx._stage1_choice(_problem(headdim, elem_bytes, kv_pairs, page_size), dev, split_keys)


def _problem(headdim=128, elem_bytes=2, batch=1, page_size=0, nheads_kv=1, group=1, **kw):
    kw.setdefault("live_keys", 8192)
    return hx.DecodeProblem(batch=batch, grid_batch=batch, seqlen_q=1, group=group, nheads_kv=nheads_kv,
                            headdim=headdim, elem_bytes=elem_bytes, page_size=page_size, capacity=1 << 17,
                            window_left=-1, **kw)


def test_decode_splits_fill_the_sms_at_batch_1():
    # b1, 2 kv heads, 64k: enough splits for ~132 programs, capped by DECODE_MAX_SPLITS
    assert hx.decode_num_splits(1, 2, 65536, 132, block_n=128, max_splits=64) == 64
    assert hx.decode_num_splits(1, 2, 65536, 132, block_n=128, max_splits=128) == 66


def test_decode_splits_never_exceed_blocks_of_the_live_length():
    assert hx.decode_num_splits(1, 2, 1024, 132, block_n=128) == 8
    assert hx.decode_num_splits(1, 2, 1024, 132, block_n=128, min_blocks_per_split=2) == 4
    assert hx.decode_num_splits(1, 2, 1, 132, block_n=128) == 1
    assert hx.decode_num_splits(3, 2, 0, 132) == 1


def test_short_contexts_are_not_split():
    assert hx.decode_num_splits(1, 2, hx.DECODE_NO_SPLIT_MAX_KEYS, 132, block_n=128) == 1
    assert hx.decode_num_splits(1, 2, hx.DECODE_NO_SPLIT_MAX_KEYS + 1, 132, block_n=128) > 1
    # with PDL, 512 keys already pay for a split: one 128-key block per program (H100: 5.6 vs 6.7 us unsplit)
    assert hx.decode_num_splits(1, 2, 512, 132, block_n=128) == 4


def test_decode_pdl_only_where_the_gpu_has_it():
    """Both programmatic dependent launches (merge after stage 1, stage 1 after the previous kernel) are on for
    Hopper and off elsewhere; the interpreter config never asks for them (inline asm)."""
    for hopper in (False, True):
        dev = hx.DecodeDevice(num_sms=132, interpret=False, hopper=hopper, pdl=hopper)
        cfg = hx.resolve_decode_config(_problem(), dev)
        assert cfg.use_pdl == cfg.pdl_wait == hopper
    interp = hx.DecodeDevice(num_sms=132, interpret=True, hopper=False, pdl=False)
    cfg = hx.resolve_decode_config(_problem(), interp)
    assert not (cfg.use_pdl or cfg.pdl_wait or cfg.prefetch_blocks or cfg.use_tma)
    # a plan's use_pdl=False also keeps stage 1 from waiting on the kernel before it
    cfg = hx.resolve_decode_config(_problem(use_pdl=False), _HOPPER)
    assert not (cfg.use_pdl or cfg.pdl_wait or cfg.merge_early_trigger)


def test_decode_splits_shrink_with_batch():
    assert hx.decode_num_splits(64, 8, 8192, 132, block_n=128) == 1
    assert hx.decode_num_splits(4, 8, 8192, 132, block_n=128) == 4


def test_decode_splits_fit_one_wave_of_programs():
    # Llama-3-8B at batch 1: 8 kv heads x 16 splits = 128 programs <= 132 SMs (17 would spill 4 into a second wave)
    assert hx.decode_num_splits(1, 8, 131072, 132, block_n=128) == 16
    assert hx.decode_num_splits(3, 8, 131072, 132, block_n=128) == 5


def test_decode_splits_balance_one_long_sequence_among_short_ones():
    uniform = hx.decode_num_splits(64, 8, 131072, 132, block_n=128)
    mixed = hx.decode_num_splits(64, 8, 131072, 132, block_n=128, total_seqlen_k=131072 + 63 * 100)
    assert uniform == 1 and mixed >= 15  # the long sequence alone is spread over ~num_sms / nheads_kv splits


def test_decode_block_config_fits_shared_memory():
    for headdim in (64, 80, 96, 128, 256):
        for elem in (2, 4):
            cfg = _choice(headdim, elem, interpret=False)
            pad = hx.next_power_of_2(headdim)
            assert cfg.num_stages * 2 * cfg.block_n * pad * elem <= 200 * 1024
            assert cfg.block_n >= 16 and cfg.block_n & (cfg.block_n - 1) == 0
    assert _choice(128, 2, interpret=False).block_n == 128
    # few (batch, kv head) pairs, e.g. batch 1 with 2 kv heads: 16 KiB tiles, never below 64 keys
    assert _choice(128, 2, interpret=False, kv_pairs=2, num_sms=132).block_n == 64
    assert _choice(128, 2, interpret=False, kv_pairs=128, num_sms=132).block_n == 128
    assert _choice(64, 2, interpret=False, kv_pairs=2, num_sms=132).block_n == 128
    assert _choice(256, 2, interpret=False, kv_pairs=2, num_sms=132).block_n == 64
    assert _choice(128, 2, interpret=True).block_n == 16


def test_decode_block_m_pads_to_mma_minimum():
    assert [hx.decode_block_m(n) for n in (1, 5, 16, 17, 64, 200)] == [16, 16, 16, 32, 64, 64]


def test_tensor_descriptor_backward_only_for_long_deterministic_runs():
    assert hx.use_bwd_tma(hx.PREFILL_BWD_TMA_MIN_KEYS, deterministic=True)
    assert not hx.use_bwd_tma(1024, deterministic=True)  # short sequences keep the pointer backward
    assert not hx.use_bwd_tma(16384, deterministic=False)  # the atomic mode with descriptors was never timed


def test_head_dim_256_uses_tiles_that_fit_without_the_spilling_four_warp_ones():
    for name, default in (("fwd", hx.PREFILL_FWD_CANDIDATES), ("bwd_dkdv", hx.PREFILL_BWD_KV_CANDIDATES),
                          ("bwd_dq", hx.PREFILL_BWD_Q_CANDIDATES)):
        big = hx.prefill_candidates(name, default, 256, 2)
        assert big == hx.PREFILL_LARGE_HEAD_DIM_CANDIDATES[name]
        fits = hx.prefill_configs_that_fit(big, 256, 2, 227 * 1024, held_tensors=1 if name == "fwd" else 2)
        assert fits == list(big)  # every large-head-dim tile fits the H100's shared memory
        assert hx.prefill_candidates(name, default, 128, 2) == default
        assert hx.prefill_candidates(name, default, 256, 4) == default  # fp32: unchanged


def test_persistent_decode_from_half_the_sms():
    """On Hopper, decode runs as one persistent launch once the (batch, kv head) pairs fill more than half the SMs
    (a third for contiguous caches, 0.45 for pages that are multiples of the tile):
    with static shares up to one pair per SM, with a work queue beyond (DECODE_PERSISTENT_DYNAMIC; off: the
    hardware-balanced split grid there); fewer pairs split over the SMs with the split grid."""
    import flashdecode.heuristics as hx

    cfgs = {pairs: _choice(128, 2, False, kv_pairs=pairs, num_sms=132)
            for pairs in (2, 44, 45, 66, 67, 96, 128, 132, 133, 512)}
    # contiguous caches from a third of the SMs (with the few-pairs tiles), paged ones from half
    assert {p: c.persistent for p, c in cfgs.items()} == {2: False, 44: False, 45: True, 66: True, 67: True,
                                                            96: True, 128: True, 132: True, 133: True, 512: True}
    assert cfgs[45].block_n == 64 and cfgs[67].block_n == 128
    # block-multiple pages (of the few-pairs 64-key tiles) from 0.45 of the SMs, on the work queue there
    for page in (64, 128):
        paged = {pairs: _choice(128, 2, False, kv_pairs=pairs, num_sms=132, page_size=page)
                 for pairs in (45, 59, 60, 66, 67)}
        assert {p: (c.persistent, c.persistent_dynamic) for p, c in paged.items()} == {
            45: (False, False), 59: (False, False), 60: (True, True), 66: (True, True), 67: (True, False)}, page
        assert paged[66].block_n == 64
    # pages that are no block multiple (16, 1) keep the split grid below half of the SMs
    assert not any(_choice(128, 2, False, kv_pairs=64, num_sms=132, page_size=page).persistent
                   for page in (1, 16))
    # pages of one 16 KiB tile (64 keys) from 3/4 of the SMs: 64-key tiles, so the queue serves them as block
    # multiples
    page64 = {pairs: _choice(128, 2, False, kv_pairs=pairs, num_sms=132, page_size=64)
              for pairs in (99, 100, 128, 133)}
    assert {p: (c.block_n, c.persistent_dynamic) for p, c in page64.items()} == {
        99: (128, False), 100: (64, True), 128: (64, True), 133: (64, True)}
    assert [p for p, c in cfgs.items() if c.persistent_dynamic] == [133, 512]
    # the queue splits equal lengths on the device (kernels.decode_schedule queue_split_ways), one slot per program
    queue = hx.resolve_decode_config(_problem(batch=512, num_splits=4), _HOPPER)
    assert queue.path is DecodePath.PERSISTENT_QUEUE
    assert (queue.persistent_slots, queue.queue_splits) == (1, hx.DECODE_QUEUE_MAX_SPLITS)
    assert hx.resolve_decode_config(_problem(batch=128, num_splits=4), _HOPPER).path is DecodePath.PERSISTENT
    # pages smaller than a block (bf16 hd128 page 16, 512-key splits; pages of 1-7 keys alike): the queue with 32
    # KiB tiles from 3/4 of the SMs' worth of pairs, the split grid with 16 KiB tiles below (page 16)
    for page in (16, 1, 3):
        gathered = {pairs: _choice(128, 2, False, kv_pairs=pairs, num_sms=132, page_size=page,
                                                  split_keys=512) for pairs in (96, 128, 512)}
        assert {p: (c.persistent_gathered, c.persistent_dynamic, c.block_n)
                for p, c in gathered.items()} == {96: (False, False, 64 if page == 16 else 128),
                                                  128: (True, True, 128), 512: (True, True, 128)}, page
    assert not _choice(128, 2, False, kv_pairs=128, num_sms=132, hopper=False).persistent
    # gathered pages below the queue's pairs: the tile rule's persistent flag is masked (split grid)
    assert hx.resolve_decode_config(_problem(batch=96, page_size=16, num_splits=4), _HOPPER).path is \
        DecodePath.SPLIT_GRID


def test_key_page_ids_preloaded_with_few_pairs_and_table_reads_pipelined_deeper():
    """Pages of 1-4 keys preload their ids only while the (batch, kv head) pairs fill at most half the SMs (short
    programs at batch lost waiting for them); loops that read the block table get extra stages everywhere."""
    import flashdecode.heuristics as hx

    key_ids = {pairs: _choice(128, 2, False, kv_pairs=pairs, num_sms=132, page_size=1)
               for pairs in (2, 66, 67, 512)}
    assert {p: c.preload_key_ids for p, c in key_ids.items()} == {2: True, 66: True, 67: False, 512: False}
    for pairs in (2, 67, 512):
        cfg = hx.resolve_decode_config(_problem(batch=pairs, page_size=1), _HOPPER)
        assert cfg.table_read_extra_stages == hx.DECODE_TABLE_READ_EXTRA_STAGES > 0
        assert cfg.table_read_min_split_blocks == hx.DECODE_TABLE_READ_MIN_SPLIT_BLOCKS


def test_device_splits_and_merge_halves_for_batches_below_a_third_of_the_sms():
    """The split grid below a third of the SMs' worth of pairs: contiguous caches from 32 pairs (Llama 32/8 b4-b5)
    choose each sequence's split count on the device (DEVICE_SPLITS; the ops layer uses it for a policy count at
    batch > 1), and so do pages that are tile multiples up to a third of the SMs' worth (b6 lost at long equal
    lengths); gathered pages keep the plan's count; the merge runs over two head-dim halves from 16 pairs, one
    row per program over head-dim quarters below that (batch 1: 2 or 8 pairs); the persistent kernel's range (45+
    contiguous pairs) needs neither."""
    import flashdecode.heuristics as hx

    def cfg(pairs, page=0):
        return _choice(128, 2, False, kv_pairs=pairs, num_sms=132, page_size=page, split_keys=512)

    assert {p: cfg(p).device_splits for p in (2, 8, 16, 31, 32, 40, 44)} == {
        2: False, 8: False, 16: False, 31: False, 32: True, 40: True, 44: True}
    assert not any(cfg(32, page).device_splits for page in (1, 16))
    assert {(p, page): cfg(p, page).device_splits for p in (31, 32, 44, 45, 48) for page in (64, 256)} == {
        (p, page): 32 <= p <= 44 for p in (31, 32, 44, 45, 48) for page in (64, 256)}
    assert {p: cfg(p).merge_d_chunks for p in (2, 8, 15, 16, 32, 66, 67)} == {
        2: 4, 8: 4, 15: 4, 16: 2, 32: 2, 66: 2, 67: 1}
    assert {p: cfg(p).merge_max_rows for p in (2, 8, 15, 16, 67)} == {2: 1, 8: 1, 15: 1, 16: 0, 67: 0}
    assert hx.resolve_decode_config(_problem(batch=32), _HOPPER).device_split_slots == \
        132 * hx.DECODE_DEVICE_SPLIT_SLOTS_PER_SM


def test_decode_config_override_is_checked_and_names_config():
    """A config= override: not a DecodeConfig -> TypeError; fields out of range or disagreeing with each other ->
    ValueError; every message names config (and the field)."""
    import pytest

    from flashdecode.config import check_decode_config

    cfg = hx.resolve_decode_config(_problem(num_splits=4), _HOPPER)
    assert check_decode_config(cfg) is cfg
    with pytest.raises(TypeError, match="config"):
        check_decode_config({"block_n": 64})
    bad = [dict(block_n=48), dict(block_n=0), dict(num_warps=3), dict(num_splits=0), dict(merge_d_chunks=3),
           dict(path=DecodePath.UNSPLIT), dict(num_splits=1), dict(persistent_programs=-1), dict(num_splits=10**6),
           dict(queue_full_fraction=1.5), dict(queue_split_cost=-0.01)]
    for change in bad:
        with pytest.raises(ValueError, match="config"):
            check_decode_config(dataclasses.replace(cfg, **change))
    for change in (dict(use_tma=1), dict(block_n=64.0), dict(path="split_grid"), dict(queue_full_fraction="0.5"),
                   dict(queue_split_cost=True)):
        with pytest.raises(TypeError, match="config"):
            check_decode_config(dataclasses.replace(cfg, **change))


def test_resolved_decode_config_is_frozen_and_the_same_for_the_same_problem():
    cfg = hx.resolve_decode_config(_problem(batch=8, page_size=16), _HOPPER)
    assert cfg == hx.resolve_decode_config(_problem(batch=8, page_size=16), _HOPPER)
    import pytest

    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_n = 32


def test_eight_bit_caches_take_16_kib_tiles_on_4_warps():
    """An 8-bit cache (elem_bytes 1) converts its K / V tile to q's dtype in registers: the resolver gives it 16 KiB
    of 8-bit values (at most 128 keys) on 4 warps, whatever the batch, layout or path (two such programs per SM beat
    one of 8 warps on the H100); the 16-bit cache keeps 4 warps too."""
    for headdim, block_n, warps in ((64, 128, 4), (128, 128, 4), (256, 64, 4)):
        for batch, nheads_kv, page in ((1, 2, 0), (1, 2, 16), (1, 2, 1), (8, 2, 128), (16, 8, 16), (64, 8, 0)):
            p = _problem(headdim=headdim, elem_bytes=1, batch=batch, nheads_kv=nheads_kv, group=4, page_size=page)
            config = hx.resolve_decode_config(p, _HOPPER)
            # (paged splits short enough for the tiny tile of gathered splits: 8 KiB, see below)
            tiny = page > 0 and config.block_n == max(32, 8192 // p.block_d)
            assert config.num_warps == warps and (config.block_n == block_n or tiny), (headdim, batch, page, config)
            assert config.block_n * p.block_d <= hx.DECODE_QUANT_TILE_BYTES
            bf16 = hx.resolve_decode_config(dataclasses.replace(p, elem_bytes=2), _HOPPER)
            assert bf16.num_warps == 4
            # the 8-bit loop keeps its row sums per key column (no cross-warp sum per block); 16-bit caches do not
            assert config.softmax_sum_tile and not bf16.softmax_sum_tile
    # the tiny tile of short gathered splits (8 KiB): 4 warps
    assert hx.decode_quant_tile(_problem(elem_bytes=1), 64) == (64, 4)
    # batch-invariant decode follows the same rule (head dim and dtype only)
    # batch-invariant decode keeps its 8 warps at hd128 (DECODE_QUANT_FIXED_SPLIT_ELEMS_PER_WARP)
    config = hx.batch_invariant_config(_problem(elem_bytes=1, batch=3), _HOPPER)
    assert (config.block_n, config.num_warps) == (128, 8) and not config.softmax_sum_tile


def test_eight_bit_caches_get_twice_the_programs_on_the_gpu():
    """8-bit caches: splits from two waves of the SMs (up to DECODE_QUANT_MAX_SPLITS) and persistent grids of two
    programs per SM on the GPU; the interpreter keeps the 16-bit counts."""
    long = _problem(elem_bytes=1, batch=1, nheads_kv=2, group=8, live_keys=131072)
    fp8 = hx.resolve_decode_config(long, _HOPPER)
    bf16 = hx.resolve_decode_config(dataclasses.replace(long, elem_bytes=2), _HOPPER)
    assert fp8.num_splits == 2 * bf16.num_splits <= hx.DECODE_QUANT_MAX_SPLITS, (fp8.num_splits, bf16.num_splits)
    interp = dataclasses.replace(_HOPPER, interpret=True)
    assert hx.resolve_decode_config(long, interp).num_splits == hx.resolve_decode_config(
        dataclasses.replace(long, elem_bytes=2), interp).num_splits
    batched = _problem(elem_bytes=1, batch=16, nheads_kv=8, group=4, live_keys=8192)
    assert hx.resolve_decode_config(batched, _HOPPER).persistent_programs == 2 * _HOPPER.num_sms


def test_8bit_split_grids_of_one_wave_take_two_stages():
    """An 8-bit split grid whose programs fit in one per SM (b1 16/2 up to 8k: splits x 2 kv heads <= 132) runs
    DECODE_QUANT_ONE_WAVE_STAGES pipeline stages; more programs (16k: 256), 16-bit caches and the interpreter keep
    the rules' 3."""
    def config(live, elem_bytes=1, dev=_HOPPER, batch=1):
        p = _problem(elem_bytes=elem_bytes, batch=batch, nheads_kv=2, group=8, live_keys=live, total_keys=live * batch)
        return hx.resolve_decode_config(p, dev)
    for live in (512, 4096, 8192):
        short = config(live)
        assert short.path is DecodePath.SPLIT_GRID and short.num_splits * 2 <= 132, (live, short)
        assert short.num_stages == hx.DECODE_QUANT_ONE_WAVE_STAGES == 2
        assert config(live, elem_bytes=2).num_stages == 3
    wide = config(16384)
    assert wide.num_splits * 2 > 132 and wide.num_stages == 3
    assert config(4096, dev=dataclasses.replace(_HOPPER, interpret=True)).num_stages != 2


def test_8bit_batches_take_the_device_split_grid_with_warp_split_keys():
    """An 8-bit cache at the Llama-3-8B shape (8 kv heads, group 4) on Hopper: from the batches the persistent
    kernel would serve, the device-split grid with DECODE_QUANT_WAVES programs' worth of items per SM, the keys of
    each block split across the warps where the device's equal splits hold >= DECODE_QUANT_WARP_SPLIT_MIN_KEYS keys
    (b16 8k: 2 splits of 4096), contiguous and in pages smaller than a block; b1 keeps the split grid and the
    shared loop (128 splits of 1024 keys at 128k), pages of 128 the persistent kernel; a bf16 cache keeps its
    paths; the interpreter never splits the keys across warps."""
    def config(batch, live, elem_bytes=1, dev=_HOPPER, **kw):
        p = _problem(elem_bytes=elem_bytes, batch=batch, nheads_kv=8, group=4, live_keys=live,
                     total_keys=batch * live, **kw)
        return hx.resolve_decode_config(p, dev)
    b16 = config(16, 8192)
    assert b16.path is DecodePath.DEVICE_SPLIT_GRID and b16.quant_warp_split
    assert b16.merge_in_kernel  # no merge kernel: one-split sequences write their results, the last split merges
    assert b16.merge_live_only  # (where config= brings the merge kernel back, it reads the live slots only)
    assert b16.device_split_slots == hx.DECODE_QUANT_WAVES * 132
    assert hx.decode_device_uniform_splits(_problem(batch=16, nheads_kv=8), b16.num_splits, 264) == 2
    assert config(16, 8192, page_size=16).quant_warp_split
    paged = config(16, 8192, page_size=128)  # block-multiple pages keep the persistent kernel's shared loop
    assert paged.path in (DecodePath.PERSISTENT, DecodePath.PERSISTENT_QUEUE) and not paged.quant_warp_split
    assert not config(16, 2048).quant_warp_split  # 2 splits of 1024 keys
    b1 = hx.resolve_decode_config(_problem(elem_bytes=1, nheads_kv=2, group=8, live_keys=131072), _HOPPER)
    assert b1.path is DecodePath.SPLIT_GRID and not b1.quant_warp_split
    assert config(16, 8192, elem_bytes=2).path is not DecodePath.DEVICE_SPLIT_GRID
    assert not config(16, 8192, elem_bytes=2).merge_in_kernel
    interp = hx.DecodeDevice(num_sms=132, interpret=True, hopper=False, pdl=False)
    assert not config(16, 8192, dev=interp).quant_warp_split


def test_engine_page_identity_premise(monkeypatch):
    """test_engine_gpu's paged-vs-contiguous identity (greedy tokens on pages of 16 and of 512 bit for bit) holds
    only where both page sizes resolve the same splits and tiles: with the rules it turns off, every decode batch
    bucket of its engine (Llama-3-8B heads, max_model_len 512, buckets 1-8) takes the host's split grid with equal
    configs but for the TMA loads of the 512-key pages."""
    monkeypatch.setattr(hx, "DECODE_TINY_TILE_MAX_SPLIT_KEYS", 0)
    monkeypatch.setattr(hx, "DECODE_DEVICE_SPLITS", False)
    monkeypatch.setattr(hx, "DECODE_PERSISTENT_AT_BATCH", False)
    for batch in (1, 2, 4, 8):
        splits = hx.decode_plan_splits(hx.decode_plan_problem(batch, 8, 4, 1, 128, 2, 512), _HOPPER, False)
        configs = []
        for page_size in (16, 512):
            p = _problem(batch=batch, page_size=page_size, nheads_kv=8, group=4, live_keys=512, num_splits=splits,
                         device_may_reduce_splits=True, retile_for_device_splits=True, cache_tma_ok=True,
                         cache_offsets_fit_int32=True)
            configs.append(hx.resolve_decode_config(dataclasses.replace(p, capacity=512), _HOPPER))
        paged, whole = configs
        assert paged.path in (DecodePath.SPLIT_GRID, DecodePath.UNSPLIT), (batch, paged.path)
        assert dataclasses.replace(whole, use_tma=paged.use_tma, queue_splits=paged.queue_splits) == paged, batch
