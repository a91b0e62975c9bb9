"""Decode launch policy (flashdecode.heuristics): split counts from live lengths, SMs and the batch."""

from flashdecode import heuristics as hx


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
    cfg = hx.decode_block_config(128, 2, interpret=False)
    assert cfg["USE_PDL"] == cfg["PDL_WAIT"] == hx._is_hopper_or_newer()
    assert not hx.decode_block_config(128, 2, interpret=True).get("PDL_WAIT", False)


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
            cfg = hx.decode_block_config(headdim, elem, interpret=False)
            pad = hx.next_power_of_2(headdim)
            assert cfg["num_stages"] * 2 * cfg["BLOCK_N"] * pad * elem <= 200 * 1024
            assert cfg["BLOCK_N"] >= 16 and cfg["BLOCK_N"] & (cfg["BLOCK_N"] - 1) == 0
    assert hx.decode_block_config(128, 2, interpret=False)["BLOCK_N"] == 128
    # few (batch, kv head) pairs, e.g. batch 1 with 2 kv heads: 16 KiB tiles, never below 64 keys
    assert hx.decode_block_config(128, 2, interpret=False, kv_pairs=2, num_sms=132)["BLOCK_N"] == 64
    assert hx.decode_block_config(128, 2, interpret=False, kv_pairs=128, num_sms=132)["BLOCK_N"] == 128
    assert hx.decode_block_config(64, 2, interpret=False, kv_pairs=2, num_sms=132)["BLOCK_N"] == 128
    assert hx.decode_block_config(256, 2, interpret=False, kv_pairs=2, num_sms=132)["BLOCK_N"] == 64
    assert hx.decode_block_config(128, 2, interpret=True)["BLOCK_N"] == 16


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


def test_persistent_decode_from_half_the_sms(monkeypatch):
    """On Hopper, decode runs as one persistent launch once the (batch, kv head) pairs fill more than half the SMs
    (a third for contiguous caches, 0.45 for pages that are multiples of the tile):
    with static shares up to one pair per SM, with a work queue beyond (DECODE_PERSISTENT_DYNAMIC; off: the
    hardware-balanced split grid there); fewer pairs split over the SMs with the split grid."""
    import flashdecode.heuristics as hx

    monkeypatch.setattr(hx, "_is_hopper_or_newer", lambda: True)
    cfgs = {pairs: hx.decode_block_config(128, 2, False, kv_pairs=pairs, num_sms=132)
            for pairs in (2, 44, 45, 66, 67, 96, 128, 132, 133, 512)}
    # contiguous caches from a third of the SMs (with the few-pairs tiles), paged ones from half
    assert {p: c["PERSISTENT"] for p, c in cfgs.items()} == {2: False, 44: False, 45: True, 66: True, 67: True,
                                                            96: True, 128: True, 132: True, 133: True, 512: True}
    assert cfgs[45]["BLOCK_N"] == 64 and cfgs[67]["BLOCK_N"] == 128
    # block-multiple pages (of the few-pairs 64-key tiles) from 0.45 of the SMs, on the work queue there
    for page in (64, 128):
        paged = {pairs: hx.decode_block_config(128, 2, False, kv_pairs=pairs, num_sms=132, page_size=page)
                 for pairs in (45, 59, 60, 66, 67)}
        assert {p: (c["PERSISTENT"], c["PERSISTENT_DYNAMIC"]) for p, c in paged.items()} == {
            45: (False, False), 59: (False, False), 60: (True, True), 66: (True, True), 67: (True, False)}, page
        assert paged[66]["BLOCK_N"] == 64
    # pages that are no block multiple (16, 1) keep the split grid below half of the SMs
    assert not any(hx.decode_block_config(128, 2, False, kv_pairs=64, num_sms=132, page_size=page)["PERSISTENT"]
                   for page in (1, 16))
    # pages of one 16 KiB tile (64 keys) from 3/4 of the SMs: 64-key tiles, so the queue serves them as block
    # multiples
    page64 = {pairs: hx.decode_block_config(128, 2, False, kv_pairs=pairs, num_sms=132, page_size=64)
              for pairs in (99, 100, 128, 133)}
    assert {p: (c["BLOCK_N"], c["PERSISTENT_DYNAMIC"]) for p, c in page64.items()} == {
        99: (128, False), 100: (64, True), 128: (64, True), 133: (64, True)}
    assert [p for p, c in cfgs.items() if c["PERSISTENT_DYNAMIC"]] == [133, 512]
    assert all(c["PERSISTENT_SLOTS"] == 1 and c["PERSISTENT_QUEUE_SPLITS"] == hx.DECODE_QUEUE_MAX_SPLITS
               for c in cfgs.values())  # the queue splits equal lengths on the device (kernels _queue_split_ways)
    # pages smaller than a block (bf16 hd128 page 16, 512-key splits; pages of 1-7 keys alike): the queue with 32
    # KiB tiles from 3/4 of the SMs' worth of pairs, the split grid with 16 KiB tiles below (page 16)
    for page in (16, 1, 3):
        gathered = {pairs: hx.decode_block_config(128, 2, False, kv_pairs=pairs, num_sms=132, page_size=page,
                                                  split_keys=512) for pairs in (96, 128, 512)}
        assert {p: (c["PERSISTENT_GATHERED"], c["PERSISTENT_DYNAMIC"], c["BLOCK_N"])
                for p, c in gathered.items()} == {96: (False, False, 64 if page == 16 else 128),
                                                  128: (True, True, 128), 512: (True, True, 128)}, page
    monkeypatch.setattr(hx, "DECODE_QUEUE_KEY_PAGES", False)
    assert not hx.decode_block_config(128, 2, False, kv_pairs=512, num_sms=132, page_size=1)["PERSISTENT_GATHERED"]
    monkeypatch.setattr(hx, "DECODE_PERSISTENT_DYNAMIC", False)
    assert not hx.decode_block_config(128, 2, False, kv_pairs=133, num_sms=132)["PERSISTENT"]
    assert not hx.decode_block_config(128, 2, False, kv_pairs=512, num_sms=132, page_size=16)["PERSISTENT_GATHERED"]
    monkeypatch.setattr(hx, "DECODE_PERSISTENT_AT_BATCH", False)
    assert not hx.decode_block_config(128, 2, False, kv_pairs=128, num_sms=132)["PERSISTENT"]
    monkeypatch.setattr(hx, "_is_hopper_or_newer", lambda: False)
    monkeypatch.setattr(hx, "DECODE_PERSISTENT_AT_BATCH", True)
    assert not hx.decode_block_config(128, 2, False, kv_pairs=128, num_sms=132)["PERSISTENT"]


def test_key_page_ids_preloaded_with_few_pairs_and_table_reads_pipelined_deeper():
    """Pages of 1-4 keys preload their ids only while the (batch, kv head) pairs fill at most half the SMs (short
    programs at batch lost waiting for them); loops that read the block table get extra stages everywhere."""
    import flashdecode.heuristics as hx

    key_ids = {pairs: hx.decode_block_config(128, 2, False, kv_pairs=pairs, num_sms=132, page_size=1)
               for pairs in (2, 66, 67, 512)}
    assert {p: c["PRELOAD_KEY_IDS"] for p, c in key_ids.items()} == {2: True, 66: True, 67: False, 512: False}
    assert all(c["TABLE_READ_EXTRA_STAGES"] == hx.DECODE_TABLE_READ_EXTRA_STAGES > 0 for c in key_ids.values())
    assert all(c["TABLE_READ_MIN_SPLIT_BLOCKS"] == hx.DECODE_TABLE_READ_MIN_SPLIT_BLOCKS for c in key_ids.values())


def test_device_splits_and_merge_halves_for_batches_below_a_third_of_the_sms():
    """The split grid below a third of the SMs' worth of pairs: contiguous caches from 32 pairs (Llama 32/8 b4-b5)
    choose each sequence's split count on the device (DEVICE_SPLITS; the ops layer uses it for a policy count at
    batch > 1), and so do pages that are tile multiples up to a third of the SMs' worth (b6 lost at long equal
    lengths); gathered pages keep the plan's count; the merge runs over two head-dim halves from 16 pairs, one
    row per program over head-dim quarters below that (batch 1: 2 or 8 pairs); the persistent kernel's range (45+
    contiguous pairs) needs neither."""
    import flashdecode.heuristics as hx

    def cfg(pairs, page=0):
        return hx.decode_block_config(128, 2, False, kv_pairs=pairs, num_sms=132, page_size=page, split_keys=512)

    assert {p: cfg(p)["DEVICE_SPLITS"] for p in (2, 8, 16, 31, 32, 40, 44)} == {
        2: False, 8: False, 16: False, 31: False, 32: True, 40: True, 44: True}
    assert not any(cfg(32, page)["DEVICE_SPLITS"] for page in (1, 16))
    assert {(p, page): cfg(p, page)["DEVICE_SPLITS"] for p in (31, 32, 44, 45, 48) for page in (64, 256)} == {
        (p, page): 32 <= p <= 44 for p in (31, 32, 44, 45, 48) for page in (64, 256)}
    assert {p: cfg(p)["MERGE_D_CHUNKS"] for p in (2, 8, 15, 16, 32, 66, 67)} == {
        2: 4, 8: 4, 15: 4, 16: 2, 32: 2, 66: 2, 67: 1}
    assert {p: cfg(p)["MERGE_MAX_ROWS"] for p in (2, 8, 15, 16, 67)} == {2: 1, 8: 1, 15: 1, 16: 0, 67: 0}
    assert cfg(32)["DEVICE_SPLIT_SLOTS"] == 132 * hx.DECODE_DEVICE_SPLIT_SLOTS_PER_SM
