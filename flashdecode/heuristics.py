"""Pure launch-policy functions (no kernels, no tensors): device facts, the decode configuration
(resolve_decode_config) and its geometry, the prefill tile candidates. Unit-tested on the CPU; the evidence behind
each constant is in docs/decisions.md."""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Optional

from flashdecode.config import (AttentionConfig, AttentionProblem, DecodeConfig, DecodePath, GluonBwdConfig,
                                GluonFwdConfig)

# The SM count we assume when there is no GPU (CPU interpreter runs): the H100 we target, so the CPU makes the
# same policy decisions the GPU would.
DEFAULT_NUM_SMS = 132


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device=None) -> int:
    """Streaming multiprocessors of ``device`` (a torch.device, str or None); DEFAULT_NUM_SMS off the GPU."""
    import torch

    device = torch.device(device) if device is not None else None
    if device is None:
        if not torch.cuda.is_available():
            return DEFAULT_NUM_SMS
        return _cuda_sm_count(torch.cuda.current_device())
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# ----------------------------------------------------------------------------------------------------------------
# Decode (flash_decode, DecodePlan): the constants of resolve_decode_config. Each line states the rule; the
# measurements, evidence files and dates are in docs/decisions.md ("Decode"). "Pairs": (batch, kv head) pairs,
# i.e. stage-1 programs per split.
# ----------------------------------------------------------------------------------------------------------------

# 8-bit caches (elem_bytes 1): a K / V tile of 16 KiB of 8-bit values, at most 128 keys (hd128: 128 keys), whatever
# the pairs, and one warp per DECODE_QUANT_ELEMS_PER_WARP elements of it (docs/decisions.md, "8-bit cache tiles").
DECODE_QUANT_TILE_BYTES = 16384
# 4 warps a 128 x 128 tile (128 values per thread; stage 1 holds it without spills, the persistent kernel spills a
# few bytes per work item) and twice the programs of a
# 16-bit cache (splits from 2 waves of the SMs, up to DECODE_QUANT_MAX_SPLITS; persistent grids of 2 programs per
# SM): the 8-bit loop is latency-bound, and two 4-warp programs per SM hide more of it than one of 8 warps (H100,
# e4m3 per-token scales, `fp8_decode --sweep`: b1 16/2 128k 40.2 -> 33.2 us, 32k 16.0 -> 14.0, Llama-3-8B b16 8k
# 128.2 -> 110.8 us; docs/decisions.md, "8-bit cache tiles").
DECODE_QUANT_ELEMS_PER_WARP = 4096
# batch-invariant decode (FIXED_SPLIT) keeps one warp per 2048 (8 warps at hd128): its stage 1 spills at 4 warps
# on pages of 16 and was not measured there.
DECODE_QUANT_FIXED_SPLIT_ELEMS_PER_WARP = 2048
DECODE_QUANT_WAVES = 2
DECODE_QUANT_MAX_SPLITS = 128
# e4m3 tiles reach their 16-bit dot operand by integer bit operations (kernels/kv_quant.py e4m3_bits: PRMT / shift /
# LOP3 on the full-rate ALU) instead of sm_90's conversion instructions (F2FP.F16.E4M3 per two values, plus an
# F2F.BF16.F16 per value for bf16), the power-of-two factor folded into the scores' scale (K) or one packed multiply
# (V), and (GPU) K converted before its layout change like V, which keeps q_k's mma fragments ldmatrix-loaded
# (docs/decisions.md, "8-bit cache tiles"); False: the conversion instructions, K converted after (the A/B baseline).
DECODE_QUANT_BIT_CONVERT = True
# 8-bit caches keep the softmax row sums per key column and sum them once after the KV loop (DecodeConfig
# softmax_sum_tile: no cross-warp sum per block, 8 -> 5 barriers in the contiguous loop): the latency-bound 8-bit
# loop gained on both Hopper parts (e4m3, per-token scales, `fp8_decode --sweep`: H200 b1 16/2 128k 28.6 -> 27.0 us,
# 32k 13.2 -> 13.1, Llama-3-8B b16 8k 96.2 -> 93.6; H100 33.1 -> 32.9, 13.4 -> 13.1; docs/decisions.md). Batch-
# invariant decode keeps its per-block sums (its 8-warp tiles were not timed with it).
DECODE_QUANT_SUM_TILE = True
# 8-bit caches whose splits hold at least this many keys split each block's keys across the warps, each warp with
# its own softmax state (DecodeConfig quant_warp_split; kernels/decode_blocks.py _attend_blocks_warps: 2 CTA
# barriers per block instead of 5). H200, e4m3, per-token scales, `fp8_decode --sweep` (docs/decisions.md, "8-bit
# cache tiles"): on the device-split grid (below) Llama-3-8B 8k b16 (splits of 4096 keys) 86.4 -> 83.7 us, b32 /
# b64 (8192) 165.9 -> 149.3 / 322.1 -> 300.3, b8 (2048) 48.8 -> 50.8; b1 16/2 in 128 splits of 256 / 512 / 1024
# keys (32k / 64k / 128k) 13.0 -> 19.7, 18.1 -> 23.9, 27.7 -> 32.1.
DECODE_QUANT_WARP_SPLIT_MIN_KEYS = 4096
# 8-bit split grids whose programs fit in one wave of one program per SM (short contexts at small batches: a
# split is one or two blocks) run 2 pipeline stages instead of 3. H200, e4m3, per-token scales, b1 16/2,
# contiguous, `fp8_decode --sweep` (docs/decisions.md, "8-bit cache tiles"), us 3 -> 2 stages: 512 5.1 -> 4.5, 1k
# 5.5 -> 4.8, 2k 5.7 -> 5.1, 4k 6.2 -> 5.7, 8k (128 programs) 7.6 -> 7.1; 16k (256 programs, two an SM) 9.7 -> 10.1.
DECODE_QUANT_ONE_WAVE_STAGES = 2
# Batches of an 8-bit cache that the persistent kernel would serve take the device-split grid instead (split
# counts still chosen on the device from the live lengths, one program per work item, the merge kernel after), its
# items sharing DECODE_QUANT_WAVES programs per SM: H200, Llama-3-8B 8k, resolved persistent -> this grid (with
# quant_warp_split where it applies) b8 51.9 -> 48.8 us, b16 94.5 -> 83.7, b32 163.6 -> 149.3, b64 323.7 -> 300.3.
DECODE_QUANT_DEVICE_SPLIT_GRID = True
# Both only on contiguous caches and pages smaller than a block (pages of 16, b16 8k: 113.2 -> 99.7 us). Pages that
# are block multiples keep the persistent kernel's shared loop: the engine (pages of 128) lost with them, Llama-3-8B
# random weights, e4m3 pages, b64 4k 6139.7 -> 5447.8 tok/s, b16 8k 2142.5 -> 2067.1 (b16 4k 2540.1 -> 2581.9),
# and the warp-split loop spills 6-7 values a block there (sm_90 compile).
# The 8-bit grid's merge kernel, where one runs (merge_in_kernel off by config=), reads every lse of a row first,
# then only its live slots (DecodeConfig.merge_live_only): a row has num_splits slots (33 at the Llama-3-8B shape)
# and uses the 1-2 the device gave it. H200, Llama-3-8B 8k e4m3, CUDA-graph us, reading every slot / live only: b32
# 151.4 / 148.2, b64 306.3 / 295.5. The bf16 device-split grid keeps the one-step merge: its sequences may hold many
# live slots, which the live-only fold takes 2 a step (not timed there).
DECODE_MERGE_LIVE_ONLY = True
# 8-bit batches on that grid launch no merge kernel (DecodeConfig.merge_in_kernel): a sequence given one split
# writes its result, the last split of a longer one to finish merges. H200, same shape, merge kernel / in-kernel:
# b16 87.1 / 81.9 us, b32 149.4 / 143.6, b64 298.4 / 299.9 (every sequence one split: a tie).
DECODE_QUANT_MERGE_IN_KERNEL = True
# Most splits per sequence (the partial buffers' size) and fewest KV blocks a non-empty split holds.
DECODE_MAX_SPLITS = 64
DECODE_MIN_BLOCKS_PER_SPLIT = 1
# Most block-table ids a split holds in registers; pages smaller than a block (ids gathered per key) hold more.
DECODE_PRELOAD_PAGES_MAX = 256
DECODE_PRELOAD_GATHER_MAX = 1024
# Contexts of at most this many keys run unsplit (with PDL, 512 keys already gain from splitting).
DECODE_NO_SPLIT_MAX_KEYS = 128
# Smallest page whose ids are gathered per key from the preload (smaller ones: DECODE_PRELOAD_KEY_IDS, or read in
# the KV loop).
DECODE_MIN_PRELOAD_PAGE = 8
# Gathered pages take 16 KiB tiles at any batch while a split holds at most this many live keys.
DECODE_SMALL_TILE_MAX_SPLIT_KEYS = 2048
# Gathered pages with few pairs take 8 KiB tiles while a split holds at most this many live keys (0: never).
DECODE_TINY_TILE_MAX_SPLIT_KEYS = 64
# The merge lets the next kernel launch before its own wait for splits of at most this many blocks.
DECODE_EARLY_TRIGGER_MAX_SPLIT_BLOCKS = 2
# Hopper: pairs between half the SMs and the SMs run the persistent kernel (device split counts, in-kernel merge).
DECODE_PERSISTENT_AT_BATCH = True
# Contiguous caches take it from a third of the SMs' worth of pairs (paged ones keep the half).
DECODE_PERSISTENT_CONTIG_MIN_PAIRS_DIV = 3
# Tile-multiple pages take its work queue from this fraction of the SMs' worth of pairs.
DECODE_PAGED_QUEUE_MIN_PAIRS_FRACTION = 0.45
# More pairs than SMs: the persistent kernel draws work items from a queue (atomic counter).
DECODE_PERSISTENT_DYNAMIC = True
# The queue splits equal lengths up to DECODE_QUEUE_MAX_SPLITS ways where its last round would hold fewer than
# DECODE_QUEUE_FULL_FRACTION of the programs, each further split costing DECODE_QUEUE_SPLIT_COST.
DECODE_QUEUE_MAX_SPLITS = 4
DECODE_QUEUE_FULL_FRACTION = 0.5
DECODE_QUEUE_SPLIT_COST = 0.03
# Gathered pages (8 <= page < a 16 KiB tile) take the queue from 3/4 of the SMs' worth of pairs, 32 KiB tiles.
DECODE_QUEUE_GATHERED = True
# Pages of 1-7 keys take the queue likewise.
DECODE_QUEUE_KEY_PAGES = True
# Pipeline stages added where the KV loop reads page ids from the block table and a split may hold at least
# DECODE_TABLE_READ_MIN_SPLIT_BLOCKS blocks (3 stages left K / V single-buffered behind the table read).
DECODE_TABLE_READ_EXTRA_STAGES = 2
DECODE_TABLE_READ_MIN_SPLIT_BLOCKS = 8
# Pages of 1, 2, 4 keys preload their split's ids (as gathered pages), with few pairs only.
DECODE_PRELOAD_KEY_IDS = True
# The split grid with split counts chosen on the device (a policy count at batch > 1): contiguous caches from
# DECODE_DEVICE_SPLITS_MIN_PAIRS pairs, tile-multiple pages up to a third of the SMs' worth; work items share
# DECODE_DEVICE_SPLIT_SLOTS_PER_SM x SMs slots.
DECODE_DEVICE_SPLITS = True
DECODE_DEVICE_SPLITS_MIN_PAIRS = 32
DECODE_DEVICE_SPLITS_PAGED_MAX_PAIRS_DIV = 3
DECODE_DEVICE_SPLIT_SLOTS_PER_SM = 1
# The merge over two head-dim halves from this many pairs among few; below it one row per program over
# DECODE_MERGE_FEW_PAIRS_D_CHUNKS head-dim chunks.
DECODE_MERGE_SPLIT_D_MIN_PAIRS = 16
DECODE_MERGE_FEW_PAIRS_D_CHUNKS = 4
# Hopper, paged: a split's page ids read beside its length after the PDL wait (kernels/decode.py SPEC_PAGES).
DECODE_SPEC_PAGES = True
# Batch-invariant decode (batch_invariant_config): every sequence is split every this many keys, whatever its batch
# (a constant, the same in the interpreter and on every GPU): 128k keys take 64 splits, which with 2 kv heads fill
# the H100's 132 SMs at batch 1, while contexts of at most this many keys stay one split (a multiple of any block_n).
DECODE_BATCH_INVARIANT_SPLIT_KEYS = 2048
# ... at most this many splits per sequence (2M keys; the launch's split grid follows from the cache's capacity) ...
DECODE_BATCH_INVARIANT_MAX_SPLITS = 1024
# ... merged this many at a time, in order (128k keys: two steps).
DECODE_BATCH_INVARIANT_MERGE_BLOCK_S = 32


def decode_num_splits(batch: int, nheads_kv: int, max_seqlen_k: int, num_sms: int, *,
                      block_n: int = 64, min_blocks_per_split: int = 1, max_splits: int = 64,
                      waves: float = 1.0, total_seqlen_k: int | None = None) -> int:
    """How many programs share one sequence's KV range in Flash-Decoding.

    Balance: the kernel takes as long as its longest program, which holds max_seqlen_k / splits keys, while the
    whole batch holds nheads_kv * total_seqlen_k keys spread over ``num_sms * waves`` program slots. Equal work
    per slot needs splits ~ num_sms * waves * max_seqlen_k / (nheads_kv * total_seqlen_k), rounded down so the
    programs fit the slots: for equal lengths that
    is num_sms * waves / (batch * nheads_kv), and one 128k sequence among short ones gets about num_sms / nheads_kv
    splits instead of the one that batch * nheads_kv alone would suggest (total_seqlen_k=None means equal lengths).
    Capped so that every split keeps >= ``min_blocks_per_split`` KV blocks of ``block_n`` keys (the partial write
    and the merge cost more than they save below that) and by ``max_splits`` (the workspace size).
    ``max_seqlen_k`` is the longest *live* length, never the cache capacity. Contexts of at most
    DECODE_NO_SPLIT_MAX_KEYS keys are not split at all.
    """
    if batch <= 0 or nheads_kv <= 0 or max_seqlen_k <= DECODE_NO_SPLIT_MAX_KEYS:
        return 1
    if total_seqlen_k is None or total_seqlen_k < max_seqlen_k:
        total_seqlen_k = batch * max_seqlen_k
    # Rounded down: one stage-1 program fills an SM (192 KiB of shared memory), so 17 splits x 8 kv heads = 136
    # programs on 132 SMs leave 4 programs for a second wave, while 16 x 8 = 128 fit in one.
    want = max(1, (int(num_sms * waves) * max_seqlen_k) // (nheads_kv * total_seqlen_k))
    by_length = max(1, cdiv(max_seqlen_k, block_n * min_blocks_per_split))
    return max(1, min(want, by_length, max_splits))


@dataclasses.dataclass(frozen=True)
class DecodeDevice:
    """Facts of the device a decode call runs on."""

    num_sms: int
    interpret: bool  # the CPU interpreter: small tiles, few programs, no inline asm (prefetch, PDL)
    hopper: bool     # sm_90 or newer: tensor descriptors (TMA), the persistent kernel, PDL in the policy
    pdl: bool        # programmatic dependent launches can run here (a GPU of sm_90+, not the interpreter)


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    """A decode call as the host knows it (no tensor values): shapes, the cache layout and the length bounds."""

    batch: int               # sequences of this call
    grid_batch: int          # the batch tiles are chosen for (a plan's max_batch, so one plan keeps one variant)
    seqlen_q: int            # new tokens per sequence
    group: int               # query heads per kv head
    nheads_kv: int
    headdim: int
    elem_bytes: int          # of q / the cache
    page_size: int           # 0: contiguous cache
    capacity: int            # keys one sequence's cache holds
    window_left: int         # -1: no window
    live_keys: int           # host bound on one sequence's live keys (sizes the splits)
    total_keys: int | None = None   # host sum of the live lengths (None: lengths assumed equal)
    num_splits: int | None = None   # a fixed split count (the caller's, a plan's); None: the policy's
    device_may_reduce_splits: bool = False  # num_splits came from the policy: device paths may use fewer
    retile_for_device_splits: bool = False  # tiles for the splits the device gives equal lengths (a plan)
    use_pdl: bool | None = None     # the caller's PDL override (None: the policy's)
    cache_tma_ok: bool = False      # the cache views densely as (rows, nheads_kv * headdim), 16-byte aligned
    cache_offsets_fit_int32: bool = False  # every element offset into the cache is < 2**31
    batch_invariant: bool = False   # one config whatever the batch and the other lengths (batch_invariant_config)
    balance_mixed: bool = False     # the host does not know the lengths: the policy's splits also cover the worst mix

    @property
    def block_m(self) -> int:
        return decode_block_m(self.group * self.seqlen_q)

    @property
    def kv_programs(self) -> int:
        """Stage-1 programs per split and sequence: kv heads x row blocks."""
        return self.nheads_kv * cdiv(self.group * self.seqlen_q, self.block_m)

    @property
    def block_d(self) -> int:
        return next_power_of_2(max(16, self.headdim))


@dataclasses.dataclass(frozen=True)
class _Stage1Choice:
    """What the tile policy chooses for one estimate of the live keys per split (before the split path)."""

    block_n: int
    num_stages: int
    use_hopper: bool
    prefetch_blocks: int
    num_warps: int
    merge_early_trigger: bool
    persistent: bool
    persistent_dynamic: bool
    persistent_gathered: bool
    persistent_programs: int  # 0: the SMs
    preload_key_ids: bool
    device_splits: bool
    merge_d_chunks: int
    merge_max_rows: int


def _stage1_choice(p: DecodeProblem, dev: DecodeDevice, split_keys: int | None) -> _Stage1Choice:
    """Tiles and launch path flags for ``split_keys`` live keys per split (None: not known yet)."""
    if dev.interpret:  # few programs, so CPU tests give each one several work items
        return _Stage1Choice(block_n=16, num_stages=1, use_hopper=False, prefetch_blocks=0, num_warps=4,
                             merge_early_trigger=False, persistent=False, persistent_dynamic=False,
                             persistent_gathered=False, persistent_programs=3,
                             preload_key_ids=DECODE_PRELOAD_KEY_IDS, device_splits=False, merge_d_chunks=1,
                             merge_max_rows=0)
    kv_pairs, num_sms, page_size = p.grid_batch * p.kv_programs, dev.num_sms, p.page_size
    head_dim_pad, elem_bytes = p.block_d, p.elem_bytes
    # 32 KiB K tiles (bf16 hd128: 128 keys); 16 KiB (>= 64 keys) where few (batch, kv head) pairs leave the SMs
    # to the splits (docs/decisions.md, "32 KiB tile, 16 KiB with few pairs")
    block_n = min(128, max(16, 32768 // (head_dim_pad * elem_bytes)))
    small_tile = max(64, 16384 // (head_dim_pad * elem_bytes))
    few_pairs = 2 * kv_pairs <= num_sms
    gathered = DECODE_MIN_PRELOAD_PAGE <= page_size < small_tile
    short_gathered_splits = gathered and split_keys is not None and split_keys <= DECODE_SMALL_TILE_MAX_SPLIT_KEYS
    hopper = dev.hopper
    many_pairs = kv_pairs > num_sms
    # gathered pages on the persistent kernel's work queue keep 32 KiB tiles (its splits are chosen on the device)
    queue_pairs = 4 * kv_pairs > 3 * num_sms
    key_pages = 0 < page_size < DECODE_MIN_PRELOAD_PAGE and DECODE_QUEUE_KEY_PAGES
    queue_gathered = bool(hopper and (gathered or key_pages) and DECODE_PERSISTENT_DYNAMIC and DECODE_QUEUE_GATHERED
                          and queue_pairs)
    if few_pairs or (short_gathered_splits and not queue_gathered):
        block_n = min(block_n, small_tile)
    # pages of one 16 KiB tile from 3/4 of the SMs' worth of pairs: 16 KiB tiles make them block multiples
    page_tiles = bool(queue_pairs and page_size % block_n and page_size % small_tile == 0)
    if page_tiles:
        block_n = small_tile
    if few_pairs and gathered and split_keys is not None and split_keys <= DECODE_TINY_TILE_MAX_SPLIT_KEYS:
        block_n = min(block_n, max(32, 8192 // (head_dim_pad * elem_bytes)))
    num_warps = 4
    if elem_bytes == 1:
        block_n, num_warps = decode_quant_tile(p, block_n)
    prefetch = 1 if hopper and few_pairs else 0
    contig_persistent = page_size == 0 and DECODE_PERSISTENT_CONTIG_MIN_PAIRS_DIV * kv_pairs > num_sms
    paged_queue = bool(few_pairs and page_size > 0 and page_size % block_n == 0 and DECODE_PERSISTENT_DYNAMIC
                       and kv_pairs > DECODE_PAGED_QUEUE_MIN_PAIRS_FRACTION * num_sms)
    device_split_layout = page_size == 0 or (
        page_size % block_n == 0 and DECODE_DEVICE_SPLITS_PAGED_MAX_PAIRS_DIV * kv_pairs <= num_sms)
    row_merge = few_pairs and kv_pairs < DECODE_MERGE_SPLIT_D_MIN_PAIRS
    return _Stage1Choice(
        block_n=block_n, num_stages=3, use_hopper=hopper, prefetch_blocks=prefetch, num_warps=num_warps,
        merge_early_trigger=bool(prefetch and split_keys is not None
                                 and split_keys <= DECODE_EARLY_TRIGGER_MAX_SPLIT_BLOCKS * block_n),
        persistent=bool(hopper and DECODE_PERSISTENT_AT_BATCH and (not few_pairs or contig_persistent or paged_queue)
                        and (kv_pairs <= num_sms or DECODE_PERSISTENT_DYNAMIC)),
        persistent_dynamic=many_pairs or queue_gathered or page_tiles or paged_queue,
        persistent_gathered=queue_gathered, persistent_programs=0,
        preload_key_ids=DECODE_PRELOAD_KEY_IDS and few_pairs,
        device_splits=bool(DECODE_DEVICE_SPLITS and few_pairs and kv_pairs >= DECODE_DEVICE_SPLITS_MIN_PAIRS
                           and device_split_layout),
        merge_d_chunks=DECODE_MERGE_FEW_PAIRS_D_CHUNKS if row_merge else (2 if few_pairs else 1),
        merge_max_rows=1 if row_merge else 0)


def decode_quant_convert(dev: DecodeDevice) -> dict:
    """The DecodeConfig fields of how 8-bit tiles become 16-bit dot operands (kernels/kv_quant.py): V converted
    before its layout change on a GPU (quant_v_convert_first; inline asm, which the CPU interpreter does not run);
    with DECODE_QUANT_BIT_CONVERT, e4m3 tiles by integer bit operations (quant_convert: packed PTX on a GPU, 2;
    Triton integer ops in the interpreter, 1), K after its layout change (quant_k_convert_first stays an option:
    on the H100 it was 1.12-1.26x slower than K after and its outputs were not bitwise equal to the other
    conversions' - docs/decisions.md, "8-bit cache tiles"); else the conversion instructions (0), K after."""
    bits = DECODE_QUANT_BIT_CONVERT
    return dict(quant_v_convert_first=not dev.interpret, quant_convert=(1 if dev.interpret else 2) if bits else 0,
                quant_k_convert_first=False)


def decode_quant_warp_split(p: DecodeProblem, dev: DecodeDevice, block_n: int, num_warps: int,
                            split_keys: int) -> bool:
    """DecodeConfig.quant_warp_split: an 8-bit cache on a Hopper GPU (where it was timed) whose splits hold at least
    DECODE_QUANT_WARP_SPLIT_MIN_KEYS keys (``split_keys``: the live keys over the splits), where each warp's 16 or
    more keys of a block fit the dot, contiguous or in pages smaller than a block
    (DECODE_QUANT_DEVICE_SPLIT_GRID's note). Off in the interpreter, whose 3-D bf16 dots are not exact."""
    return (p.elem_bytes == 1 and dev.hopper and not dev.interpret and split_keys >= DECODE_QUANT_WARP_SPLIT_MIN_KEYS
            and block_n >= 16 * num_warps and not _block_multiple_pages(p, block_n))


def _block_multiple_pages(p: DecodeProblem, block_n: int) -> bool:
    """A paged cache whose pages hold whole blocks of block_n keys."""
    return p.page_size > 0 and p.page_size % block_n == 0


def decode_quant_tile(p: DecodeProblem, block_n: int,
                      elems_per_warp: int = DECODE_QUANT_ELEMS_PER_WARP) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of an 8-bit cache (p.elem_bytes 1) where the 16-bit rules chose ``block_n`` (computed
    with 1-byte elements): a tile of DECODE_QUANT_TILE_BYTES of 8-bit values (at most 128 keys; fewer only where
    the rules above chose fewer keys), one warp per ``elems_per_warp`` of its elements (4 to 8). The loop
    converts the tile to q's dtype in registers: at 4 warps a 128 x 128 tile holds 128 converted values per thread
    (the persistent kernel spills a few bytes on sm_90), yet two such programs per SM beat one of 8 warps
    (docs/decisions.md, "8-bit cache tiles")."""
    block_n = min(block_n, max(16, DECODE_QUANT_TILE_BYTES // p.block_d))
    return block_n, min(8, max(4, block_n * p.block_d // elems_per_warp))


def decode_policy_splits(p: DecodeProblem, dev: DecodeDevice, block_n: int) -> int:
    """The split count of a call whose lengths the host knows (p.live_keys, p.total_keys): only the window's keys
    are live with a window (lengths then treated as equal)."""
    live, total = p.live_keys, p.total_keys
    if p.window_left >= 0:
        live, total = min(live, p.window_left + p.seqlen_q), None
    return decode_num_splits(p.batch, p.kv_programs, live, dev.num_sms, block_n=block_n,
                             min_blocks_per_split=DECODE_MIN_BLOCKS_PER_SPLIT, total_seqlen_k=total,
                             **_split_occupancy(p.elem_bytes, dev))


def _program_waves(elem_bytes: int, dev: DecodeDevice) -> int:
    """Programs per SM a decode grid aims at: DECODE_QUANT_WAVES for an 8-bit cache on the GPU (its 4-warp
    programs run two per SM), else 1. Sizes both the split counts and the persistent grid."""
    return DECODE_QUANT_WAVES if elem_bytes == 1 and not dev.interpret else 1


def _split_occupancy(elem_bytes: int, dev: DecodeDevice) -> dict:
    """decode_num_splits' waves / max_splits (_program_waves; 8-bit caches up to DECODE_QUANT_MAX_SPLITS)."""
    if _program_waves(elem_bytes, dev) > 1:
        return dict(waves=_program_waves(elem_bytes, dev), max_splits=DECODE_QUANT_MAX_SPLITS)
    return dict(max_splits=DECODE_MAX_SPLITS)


def decode_plan_problem(max_batch: int, nheads_kv: int, group: int, max_seqlen_q: int, headdim: int,
                        elem_bytes: int, max_seqlen_k: int, **kw) -> DecodeProblem:
    """The problem a DecodePlan is sized for from its host-side bounds: a contiguous cache of max_seqlen_k keys at
    max_batch (``kw``: further DecodeProblem fields, e.g. batch_invariant)."""
    return DecodeProblem(batch=max_batch, grid_batch=max_batch, seqlen_q=max_seqlen_q, group=group,
                         nheads_kv=nheads_kv, headdim=headdim, elem_bytes=elem_bytes, page_size=0,
                         capacity=max_seqlen_k, window_left=-1, live_keys=max_seqlen_k, **kw)


def decode_plan_splits(p: DecodeProblem, dev: DecodeDevice, balance_mixed: bool) -> int:
    """The policy's split count where the lengths are bounds: a DecodePlan's (decode_plan_problem: the tiles of a
    contiguous cache at max_batch) and an eager call's whose lengths the host does not know (p.balance_mixed): the
    lengths of p.live_keys (p.total_keys their sum where the host knows it), or with balance_mixed also the worst
    mix (one such sequence among empty ones; the device paths then give equal lengths fewer)."""
    block_n = _stage1_choice(p, dev, None).block_n
    splits = decode_policy_splits(p, dev, block_n)
    return max(splits, _worst_mix_splits(p, dev, block_n)) if balance_mixed else splits


def _worst_mix_splits(p: DecodeProblem, dev: DecodeDevice, block_n: int) -> int:
    """The split count of the worst mix of lengths up to p.live_keys: one such sequence among empty ones (about
    num_sms / nheads_kv splits; the device paths give shorter sequences fewer)."""
    live = p.live_keys if p.window_left < 0 else min(p.live_keys, p.window_left + p.seqlen_q)
    return decode_num_splits(p.batch, p.kv_programs, live, dev.num_sms, block_n=block_n,
                             min_blocks_per_split=DECODE_MIN_BLOCKS_PER_SPLIT, total_seqlen_k=live,
                             **_split_occupancy(p.elem_bytes, dev))


def decode_fixed_split_partials(max_seqlen_k: int, config: DecodeConfig) -> int:
    """Splits of a FIXED_SPLIT config (config.split_keys keys each) that a DecodePlan of max_seqlen_k keys holds
    partials for: those of max_seqlen_k keys, at most config.num_splits."""
    return min(cdiv(max(max_seqlen_k, 1), config.split_keys), config.num_splits)


def decode_device_uniform_splits(p: DecodeProblem, num_splits: int, slots: int) -> int:
    """Splits per sequence the DEVICE_SPLIT_GRID gives a batch of equal lengths (kernels/decode.py
    decode_schedule.device_split_counts: each sequence's floor'd share of the slots)."""
    return max(1, min(num_splits, slots // (p.kv_programs * p.batch)))


def resolve_decode_config(p: DecodeProblem, dev: DecodeDevice) -> DecodeConfig:
    """Every launch decision of a decode call (docs/architecture.md, "Decode dispatch"), from what the host knows.

    The split count: p.num_splits, else the policy's for p.live_keys / p.total_keys with the tiles of an unknown
    split length. The tiles are then chosen for the live keys per split; a plan (p.retile_for_device_splits)
    whose device picks the split counts chooses them for the splits the device gives equal lengths. Every field
    is computed first and the config built once."""
    if p.batch_invariant:
        return batch_invariant_config(p, dev)
    if p.num_splits is None:  # lengths the host does not know size the splits for any mix, as a DecodePlan does
        splits, may_reduce = decode_plan_splits(p, dev, p.balance_mixed), True
    else:
        splits, may_reduce = p.num_splits, p.device_may_reduce_splits
    live = max(p.live_keys, 1)
    slots = DECODE_DEVICE_SPLIT_SLOTS_PER_SM * dev.num_sms
    choice = _stage1_choice(p, dev, cdiv(live, splits))
    persistent = _persistent_layout(p, choice)
    quant_grid = _quant_device_split_grid(p, choice, persistent, may_reduce)
    if p.retile_for_device_splits and may_reduce and choice.device_splits and not persistent and p.batch > 1:
        # (quant_grid is False here: it needs the persistent kernel's layout)
        choice = _stage1_choice(p, dev, cdiv(live, decode_device_uniform_splits(p, splits, slots)))
        persistent = _persistent_layout(p, choice)
    preload = PageIdPreload(block_n=choice.block_n, key_ids=choice.preload_key_ids, **_preload_limits(dev))
    # the device's split counts need a preload that holds a whole sequence's ids where the kernel relies on it
    whole_sequence_ids = decode_persistent_preload(p, preload, splits)[1] == 0
    quant_grid = quant_grid and whole_sequence_ids
    split_keys = cdiv(live, splits)
    if quant_grid:  # its items share the 8-bit loop's programs per SM
        slots *= _program_waves(p.elem_bytes, dev)
        split_keys = cdiv(live, decode_device_uniform_splits(p, splits, slots))
    device_splits = quant_grid or (may_reduce and choice.device_splits and not persistent)
    path = _decode_path(p, splits, persistent and not quant_grid, choice.persistent_dynamic,
                        device_splits and whole_sequence_ids)
    use_pdl, pdl_wait = _pdl_flags(p, dev, choice.use_hopper)
    quant_grid_path = quant_grid and path is DecodePath.DEVICE_SPLIT_GRID
    return DecodeConfig(
        path=path, num_splits=splits, block_n=choice.block_n, num_warps=choice.num_warps,
        num_stages=_quant_one_wave_stages(p, dev, path, splits) or choice.num_stages,
        **_table_read_stages(dev), preload_pages_max=preload.pages_max, preload_gather_max=preload.gather_max,
        preload_key_ids=choice.preload_key_ids, use_tma=choice.use_hopper and decode_tma_fits(p, choice.block_n),
        use_pdl=use_pdl, pdl_wait=pdl_wait, prefetch_blocks=0 if dev.interpret else choice.prefetch_blocks,
        merge_early_trigger=choice.merge_early_trigger and pdl_wait,
        merge_d_chunks=choice.merge_d_chunks, merge_max_rows=choice.merge_max_rows,
        offs_32=p.cache_offsets_fit_int32, spec_pages=bool(choice.use_hopper and DECODE_SPEC_PAGES),
        persistent_programs=(choice.persistent_programs or dev.num_sms) * _program_waves(p.elem_bytes, dev),
        persistent_slots=1, queue_splits=DECODE_QUEUE_MAX_SPLITS if choice.persistent_dynamic else 0,
        queue_full_fraction=DECODE_QUEUE_FULL_FRACTION, queue_split_cost=DECODE_QUEUE_SPLIT_COST,
        device_split_slots=slots, softmax_sum_tile=DECODE_QUANT_SUM_TILE and p.elem_bytes == 1,
        quant_warp_split=decode_quant_warp_split(p, dev, choice.block_n, choice.num_warps, split_keys),
        merge_live_only=DECODE_MERGE_LIVE_ONLY and quant_grid_path,
        merge_in_kernel=DECODE_QUANT_MERGE_IN_KERNEL and quant_grid_path, **decode_quant_convert(dev))


def _persistent_layout(p: DecodeProblem, choice: _Stage1Choice) -> bool:
    """The tile policy chose the persistent kernel and the cache's pages suit it (block multiples, or gathered
    pages on its work queue)."""
    return choice.persistent and (p.page_size % choice.block_n == 0 or choice.persistent_gathered)


def _quant_device_split_grid(p: DecodeProblem, choice: _Stage1Choice, persistent: bool, may_reduce: bool) -> bool:
    """DECODE_QUANT_DEVICE_SPLIT_GRID's rule: an 8-bit batch the persistent kernel would serve, whose split counts
    the device may choose, contiguous or in pages smaller than a block (the caller adds the preload condition)."""
    return bool(DECODE_QUANT_DEVICE_SPLIT_GRID and persistent and may_reduce and p.batch > 1
                and p.elem_bytes == 1 and not _block_multiple_pages(p, choice.block_n))


def _pdl_flags(p: DecodeProblem, dev: DecodeDevice, hopper: bool) -> tuple[bool, bool]:
    """(use_pdl, pdl_wait): programmatic dependent launches on a Hopper GPU that runs them; the caller's
    p.use_pdl False also keeps stage 1 from waiting on the previous kernel."""
    pdl = hopper and dev.pdl
    if p.use_pdl is None:
        return pdl, pdl
    use_pdl = p.use_pdl and dev.pdl
    return use_pdl, pdl and use_pdl


def _table_read_stages(dev: DecodeDevice) -> dict:
    """DecodeConfig's table-read stage fields (DECODE_TABLE_READ_*; none in the interpreter)."""
    return dict(table_read_extra_stages=0 if dev.interpret else DECODE_TABLE_READ_EXTRA_STAGES,
                table_read_min_split_blocks=0 if dev.interpret else DECODE_TABLE_READ_MIN_SPLIT_BLOCKS)


def _preload_limits(dev: DecodeDevice) -> dict:
    """The most block-table ids a split holds in registers (PageIdPreload's pages_max / gather_max; the
    interpreter gathers no more than whole pages' ids)."""
    return dict(pages_max=DECODE_PRELOAD_PAGES_MAX,
                gather_max=DECODE_PRELOAD_PAGES_MAX if dev.interpret else DECODE_PRELOAD_GATHER_MAX)


def _quant_one_wave_stages(p: DecodeProblem, dev: DecodeDevice, path: DecodePath, splits: int) -> int | None:
    """DECODE_QUANT_ONE_WAVE_STAGES for an 8-bit split grid on the GPU whose programs (splits x (batch, kv head)
    pairs) fit in one per SM, else None (the rules' stages stand)."""
    one_wave = splits * p.grid_batch * p.kv_programs <= dev.num_sms
    if p.elem_bytes == 1 and not dev.interpret and path is DecodePath.SPLIT_GRID and one_wave:
        return DECODE_QUANT_ONE_WAVE_STAGES
    return None


def batch_invariant_config(p: DecodeProblem, dev: DecodeDevice) -> DecodeConfig:
    """The config of batch-invariant decode (flash_decode(batch_invariant=True)): no field depends on the batch,
    the grid batch, the other sequences' lengths, the capacity or the host's length bounds, so each (sequence, head)
    row is computed by the same kernel variant, over the same key ranges, in the same order, whatever batch it sits
    in: its out and lse are bitwise reproducible (docs/decisions.md, "Batch-invariant decode").

    The FIXED_SPLIT path: split s of a sequence holds keys [lo + s * split_keys, lo + (s + 1) * split_keys) (lo: 0,
    or its window's first block), DECODE_BATCH_INVARIANT_SPLIT_KEYS keys each whatever the batch, so only the
    sequence's own length decides how many of its splits hold keys; the launch's split grid is sized from the
    cache (capacity or window), the splits past a sequence's end write empty states, and the merge folds the splits
    in order, merge_block_s at a time, leaving out steps whose states are all empty (kernels/merge.py SKIP_EMPTY),
    so trailing empty splits change no bit. p.num_splits == 1 (num_splits=1, the nosplit engine backend) keeps the
    UNSPLIT variant: one program per row block over all its keys (32 KiB tiles, an 8-bit cache's
    decode_quant_tile, no page-id preload). Tiles from the head dim and dtype alone (16 KiB of 16-bit K on
    FIXED_SPLIT, an 8-bit cache's decode_quant_tile; 16 keys in the interpreter); the page-id preload and the
    pipeline depth follow from split_keys and the page size (never the capacity); descriptors, the spec-page read
    and the L2 prefetch stay off so that the variant does not follow the cache's alignment or the block table
    either; PDL (the GPU's, not the batch's) only changes when kernels start; the merge runs one row per program
    over head-dim quarters (the shape that serves batch 1's few rows)."""
    interpret, unsplit = dev.interpret, p.num_splits == 1
    block_n = min(128, max(16, (32768 if unsplit else 16384) // (p.block_d * p.elem_bytes)))
    num_warps = 4
    if p.elem_bytes == 1 and not interpret:  # an 8-bit cache: its tile rule (decode_quant_tile), on both paths
        block_n, num_warps = decode_quant_tile(p, block_n, DECODE_QUANT_FIXED_SPLIT_ELEMS_PER_WARP)
    common = dict(
        block_n=16 if interpret else block_n, num_warps=num_warps, num_stages=1 if interpret else 3,
        preload_key_ids=False, use_tma=False, prefetch_blocks=0, merge_early_trigger=False,
        offs_32=p.cache_offsets_fit_int32, spec_pages=False, persistent_programs=max(dev.num_sms, 1),
        persistent_slots=1, queue_splits=0, queue_full_fraction=DECODE_QUEUE_FULL_FRACTION,
        queue_split_cost=DECODE_QUEUE_SPLIT_COST,
        device_split_slots=max(DECODE_DEVICE_SPLIT_SLOTS_PER_SM * dev.num_sms, 1), **decode_quant_convert(dev))
    if unsplit:  # one program per row block over all its keys (32 KiB tiles), no page-id preload
        return DecodeConfig(
            path=DecodePath.UNSPLIT, num_splits=1, table_read_extra_stages=0, table_read_min_split_blocks=0,
            preload_pages_max=0, preload_gather_max=0, use_pdl=False, pdl_wait=False, merge_d_chunks=1,
            merge_max_rows=0, **common)
    limits = _preload_limits(dev)
    return DecodeConfig(
        path=DecodePath.FIXED_SPLIT, num_splits=DECODE_BATCH_INVARIANT_MAX_SPLITS,
        split_keys=DECODE_BATCH_INVARIANT_SPLIT_KEYS, merge_block_s=DECODE_BATCH_INVARIANT_MERGE_BLOCK_S,
        **_table_read_stages(dev), preload_pages_max=limits["pages_max"], preload_gather_max=limits["gather_max"],
        use_pdl=dev.pdl, pdl_wait=dev.pdl, merge_d_chunks=DECODE_MERGE_FEW_PAIRS_D_CHUNKS, merge_max_rows=1,
        **common)


def _decode_path(p: DecodeProblem, splits: int, persistent: bool, dynamic: bool, device_splits: bool) -> DecodePath:
    """The DecodePath of the resolved choices (device_splits: the device may choose the split counts and a
    preload holds a whole sequence's page ids where the kernel relies on it)."""
    if splits == 1:
        return DecodePath.UNSPLIT
    if persistent:
        return DecodePath.PERSISTENT_QUEUE if dynamic else DecodePath.PERSISTENT
    if device_splits and p.batch > 1:
        return DecodePath.DEVICE_SPLIT_GRID
    return DecodePath.SPLIT_GRID


def decode_tma_fits(p: DecodeProblem, block_n: int) -> bool:
    """The TMA path views the cache as 2-D (rows, nheads_kv * headdim): dense and aligned (p.cache_tma_ok), the
    head dim a power of two (one box), and a block must not straddle a page."""
    return p.cache_tma_ok and (p.page_size == 0 or p.page_size % block_n == 0) and p.headdim == p.block_d


# ----------------------------------------------------------------------------------------------------------------
# Decode geometry: what follows from a DecodeConfig and the shapes (no choices)
# ----------------------------------------------------------------------------------------------------------------

def decode_min_chunk(block_n: int) -> int:
    """Fewest keys a non-empty split of block_n-key blocks holds (the kernels' MIN_CHUNK): with a fixed split
    count, short sequences use fewer splits instead of many tiny ones."""
    return block_n * DECODE_MIN_BLOCKS_PER_SPLIT


def decode_max_split_keys(p: DecodeProblem, block_n: int, num_splits: int, split_keys: int = 0) -> int:
    """The most keys one of num_splits splits can hold (kernels/decode.py split_range at the cache capacity; on
    FIXED_SPLIT its split_keys, whatever the capacity)."""
    if split_keys:
        return split_keys
    return max(cdiv(p.capacity, num_splits * block_n) * block_n, decode_min_chunk(block_n))


@dataclasses.dataclass(frozen=True)
class PageIdPreload:
    """The fields of a DecodeConfig that bound the block-table ids a split holds in registers (the resolver builds
    one from the fields it has computed, the launch from the config: PageIdPreload.of)."""

    block_n: int
    pages_max: int    # DecodeConfig.preload_pages_max
    gather_max: int   # DecodeConfig.preload_gather_max
    key_ids: bool     # DecodeConfig.preload_key_ids
    split_keys: int = 0  # DecodeConfig.split_keys (FIXED_SPLIT)

    @classmethod
    def of(cls, config: DecodeConfig) -> "PageIdPreload":
        return cls(block_n=config.block_n, pages_max=config.preload_pages_max,
                   gather_max=config.preload_gather_max, key_ids=config.preload_key_ids,
                   split_keys=config.split_keys)


def decode_preload_pages(p: DecodeProblem, preload: PageIdPreload, num_splits: int) -> int:
    """Block-table entries one of num_splits splits can span (a power of two), held in registers; 0 when too many
    or the pages neither divide nor are multiples of a block (then the loop reads the block table). The bound
    comes from the capacity, a host-side shape: no sync."""
    page, block_n = p.page_size, preload.block_n
    if page == 0 or preload.pages_max <= 0:
        return 0
    small_pages = (page < block_n and block_n % page == 0
                   and (page >= DECODE_MIN_PRELOAD_PAGE or preload.key_ids))
    if not (small_pages or page % block_n == 0):
        return 0
    chunk_max = decode_max_split_keys(p, block_n, num_splits, preload.split_keys)
    # splits start at multiples of BLOCK_N: on a page boundary for pages that divide it, else possibly mid-page
    straddle = 0 if small_pages else 1
    pages = next_power_of_2(max(cdiv(chunk_max, page) + straddle, block_n // page))
    limit = preload.gather_max if small_pages else preload.pages_max
    return pages if pages <= limit else 0


def decode_persistent_preload(p: DecodeProblem, preload: PageIdPreload, num_splits: int) -> tuple[int, int]:
    """(PRELOAD_PAGES, MAX_SPLIT_KEYS) where a split may span a whole sequence (the persistent kernel, the device's
    split counts, at most num_splits per sequence): pages preload a whole sequence's ids when they fit; otherwise,
    for pages smaller than a block, a num_splits-th of the capacity, each split bounded to as many keys
    (num_splits splits always fit); when even that is too many (or for block-multiple pages) the loop reads the
    ids. MAX_SPLIT_KEYS 0: unbounded."""
    whole = decode_preload_pages(p, preload, 1)
    small_pages = 0 < p.page_size < preload.block_n
    if p.page_size == 0 or whole > 0 or not small_pages:
        return whole, 0
    pages = decode_preload_pages(p, preload, num_splits)
    return pages, (decode_max_split_keys(p, preload.block_n, num_splits, preload.split_keys) if pages else 0)


def decode_pipeline_stages(p: DecodeProblem, config: DecodeConfig, preload_pages: int, split_keys_max: int) -> int:
    """num_stages of a stage-1 launch: the config's, plus its table-read stages where the KV loop reads page ids
    from the block table (paged, nothing preloaded) and a split may hold at least table_read_min_split_blocks
    blocks: the pipeliner issues such a read a stage ahead of the K/V loads it feeds, so 3 stages left K / V
    single-buffered (docs/decisions.md, DECODE_TABLE_READ_EXTRA_STAGES)."""
    long_splits = split_keys_max >= config.table_read_min_split_blocks * config.block_n
    if p.page_size > 0 and preload_pages == 0 and long_splits:
        return config.num_stages + config.table_read_extra_stages
    return config.num_stages


def decode_prefetch_shape(p: DecodeProblem, config: DecodeConfig, num_splits: int) -> tuple[int, int, int]:
    """(PREFETCH_KEYS, LINE_ELEMS, NUM_LINES) of stage 1's pre-wait L2 prefetch: the first prefetch_blocks blocks of
    a split, no more than a split can hold (a power of two, so a short split does not prefetch past its end
    repeatedly); 128-byte lines of one head-dim row."""
    if config.prefetch_blocks <= 0:
        return 0, 64, 1
    split_max = decode_max_split_keys(p, config.block_n, num_splits, config.split_keys)
    keys = next_power_of_2(min(config.prefetch_blocks * config.block_n, split_max))
    line_elems = 128 // p.elem_bytes
    return keys, line_elems, next_power_of_2(cdiv(p.headdim, line_elems))


def decode_block_m(group_rows: int) -> int:
    """Query rows (GQA group x new tokens) per stage-1 program: padded to the MMA minimum of 16, at most 64
    (bigger groups are split over more programs, each reading K/V again)."""
    return min(max(16, next_power_of_2(group_rows)), 64)


# ----------------------------------------------------------------------------------------------------------------
# Prefill (flash_attn): the AttentionConfig of one problem, autotune candidates, shared-memory pruning, shape buckets
# (each rule's evidence: docs/decisions.md, "Prefill")
# ----------------------------------------------------------------------------------------------------------------

# Backward through tensor descriptors (deterministic mode, Hopper) from this many keys; shorter ones keep pointers.
PREFILL_BWD_TMA_MIN_KEYS = 8192
# Forward tiles (BLOCK_M, BLOCK_N, num_warps, num_stages): BLOCK_M a multiple of 64 and 4k warps for wgmma.
PREFILL_FWD_CANDIDATES = ((128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3), (128, 64, 4, 2), (128, 32, 4, 3))
# Long 16-bit hd128 sequences on the descriptor path: the first of these that fits, never autotuned.
# flash_attn_varlen takes the ragged Gluon kernel on sm_90 (ops/gluon_attention.py gluon_varlen_forward_into):
# 1.30-1.97x the Triton kernel on every ragged row of `bench prefill --ragged` (H100), its GPU tests pass
# (docs/decisions.md, "Ragged prefill on the Gluon kernel"). False sends every ragged call to the Triton kernel.
PREFILL_RAGGED_GLUON = True
# flash_attn_varlen's backward takes the ragged Gluon kernel on sm_90 (ops/gluon_backward.py gluon_varlen_backward:
# fp16/bf16, hd 64/128, causal, sliding windows, softcap; no ALiBi). Off until its GPU tests and `bench prefill
# --ragged --modes fwd+bwd` are run on the H100; a GluonBwdConfig given to gluon_varlen_backward takes it regardless.
PREFILL_RAGGED_GLUON_BWD = False
PREFILL_FWD_LONG_MIN_KEYS = 16384
PREFILL_FWD_LONG_CANDIDATES = ((128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 2))
# Deterministic backward, two launches: dK/dV (BLOCK_N held, BLOCK_M streamed, warps, stages) and dQ (BLOCK_M held,
# BLOCK_N streamed, warps, stages); the first of each is the untuned default.
PREFILL_BWD_KV_CANDIDATES = ((64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2), (128, 64, 8, 3))
PREFILL_BWD_Q_CANDIDATES = ((128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2))
# deterministic=False: the dK/dV program adding dQ by atomics; 128 KV rows halve the atomic traffic of 64.
PREFILL_BWD_ATOMIC_CANDIDATES = ((128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 3), (64, 32, 4, 2))
# Deterministic backward in one launch: (BLOCK_N, BLOCK_M, BLOCK_M2, BLOCK_N2, SPLIT_DKDV, warps, stages);
# BLOCK_N == BLOCK_M2 (BLOCK_N / 2 with SPLIT_DKDV) pairs KV block j with Q block j.
PREFILL_BWD_FUSED_CANDIDATES = ((128, 64, 128, 64, False, 8, 3), (128, 64, 128, 64, False, 8, 2),
                                (64, 64, 64, 64, False, 4, 2), (128, 32, 128, 32, False, 8, 3),
                                (64, 64, 64, 64, False, 4, 3))
# The one-launch backward by default for 16-bit head dim 256 from this many keys (slower at hd128).
PREFILL_BWD_FUSED_MIN_KEYS = 8192
# Head dim 256 at 16-bit: 8-warp / 64-row tiles that compile without spills (not yet timed on a GPU).
PREFILL_LARGE_HEAD_DIM = 256
PREFILL_LARGE_HEAD_DIM_CANDIDATES = {
    "fwd": ((128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2)),
    "bwd_dkdv": ((64, 16, 8, 2), (64, 32, 8, 2)),
    "bwd_dq": ((64, 64, 8, 2), (64, 32, 8, 2), (128, 32, 8, 2)),
    # SPLIT_DKDV: a dV program and a dK program per 128 keys, one fp32 accumulator each
    "bwd_fused": ((64, 16, 64, 64, False, 8, 2), (128, 32, 64, 64, True, 8, 2), (128, 64, 64, 64, True, 8, 1),
                  (64, 32, 64, 32, False, 8, 2), (128, 32, 64, 32, True, 8, 2)),
}
# One small fixed tile for the CPU interpreter (its speed scales with the number of ops, not the tile size).
PREFILL_INTERPRET_BLOCKS = (32, 32)
# Tiles (held, streamed) of each kernel that count against shared memory: the forward holds Q and streams K, V;
# the backward kernels hold two tiles (K, V or Q, dO), the atomic dK/dV also stages dS^T and the dQ tile.
_PREFILL_TILES_HELD_STREAMED = {"fwd": (1, 2), "bwd_dkdv": (2, 2), "bwd_dq": (2, 2), "bwd_atomic": (4, 2)}


# flash_attn_with_kvcache over a paged cache sends this many new query tokens per sequence (and more) to the paged
# prefill kernel (one program per 128 query rows of a head, no KV split); fewer stay on the split-KV decode kernels,
# which pack a kv group's rows into one tile. Not yet timed (docs/decisions.md, "Paged prefill").
KVCACHE_PREFILL_MIN_QUERIES = 64


def kvcache_uses_prefill(seqlen_q: int, decode_can_mask: bool) -> bool:
    """Whether flash_attn_with_kvcache's paged call of ``seqlen_q`` new tokens per sequence runs the paged prefill
    kernel: long chunks, or masks the decode kernels cannot express (decode_can_mask False: non-causal windows
    that cut rows, ALiBi on non-causal rows)."""
    return seqlen_q >= KVCACHE_PREFILL_MIN_QUERIES or (seqlen_q > 1 and not decode_can_mask)


def use_bwd_tma(max_seqlen_k: int, deterministic: bool) -> bool:
    """Default for the tensor-descriptor backward (the caller still checks the GPU and the layout): long sequences,
    deterministic mode only (the atomic mode with descriptors was never timed)."""
    return deterministic and max_seqlen_k >= PREFILL_BWD_TMA_MIN_KEYS


def use_fwd_long_config(max_seqlen_k: int, head_dim_pad: int, elem_bytes: int, use_tma: bool) -> bool:
    """Fixed forward tile (PREFILL_FWD_LONG_CANDIDATES, untimed) instead of autotuning."""
    return use_tma and elem_bytes == 2 and head_dim_pad == 128 and max_seqlen_k >= PREFILL_FWD_LONG_MIN_KEYS


def use_bwd_fused(max_seqlen_k: int, head_dim_pad: int, elem_bytes: int) -> bool:
    """Default for the one-launch deterministic backward."""
    return head_dim_pad >= PREFILL_LARGE_HEAD_DIM and elem_bytes == 2 and max_seqlen_k >= PREFILL_BWD_FUSED_MIN_KEYS


def prefill_bwd_fused_configs_that_fit(candidates, head_dim_pad: int, elem_bytes: int, smem_limit: int):
    """Fused-backward candidates whose larger phase fits ``smem_limit`` bytes (both phases hold two tiles, K/V or
    Q/dO, and stream two, Q/dO or K/V; the compiler reuses one phase's shared memory for the other); the smallest
    candidate if none does."""
    def need(c):
        return max(prefill_shared_bytes(c[0], c[1], head_dim_pad, c[6], elem_bytes, 2, 2),
                   prefill_shared_bytes(c[2], c[3], head_dim_pad, c[6], elem_bytes, 2, 2))
    fits = [c for c in candidates if need(c) <= smem_limit]
    return fits or [min(candidates, key=need)]


def prefill_candidates(kernel_name: str, default: tuple, head_dim_pad: int, elem_bytes: int) -> tuple:
    """Autotune candidates of one prefill kernel for a padded head dim: the large-head-dim tiles at 16-bit hd256,
    ``default`` otherwise (fp32 keeps the default list and its shared-memory pruning)."""
    if head_dim_pad >= PREFILL_LARGE_HEAD_DIM and elem_bytes == 2:
        return PREFILL_LARGE_HEAD_DIM_CANDIDATES.get(kernel_name, default)
    return default


def prefill_shared_bytes(block_rows: int, block_stream: int, head_dim_pad: int, num_stages: int, elem_bytes: int,
                         streamed_tensors: int = 2, held_tensors: int = 1) -> int:
    """Rough shared memory of an attention program: the tiles it holds once plus ``num_stages`` copies of the
    tiles it streams (K and V in the forward)."""
    held = held_tensors * block_rows * head_dim_pad
    streamed = num_stages * streamed_tensors * block_stream * head_dim_pad
    return (held + streamed) * elem_bytes


def prefill_configs_that_fit(candidates, head_dim_pad: int, elem_bytes: int, smem_limit: int,
                             streamed_tensors: int = 2, held_tensors: int = 1):
    """Candidates whose tiles fit in ``smem_limit`` bytes; the smallest candidate if none does."""
    def need(c):
        return prefill_shared_bytes(c[0], c[1], head_dim_pad, c[3], elem_bytes, streamed_tensors, held_tensors)
    fits = [c for c in candidates if need(c) <= smem_limit]
    return fits or [min(candidates, key=need)]


def seqlen_bucket(n: int) -> int:
    """Autotune key for a length: its power-of-two ceiling capped at 16k, so a growing prompt re-tunes at most
    log2 times and never recompiles (lengths themselves are runtime arguments)."""
    return min(next_power_of_2(max(1, n)), 16384)


# Lengths at which resolve_attention_config's decisions change (it looks at max_seqlen_k only through these).
PREFILL_LENGTH_THRESHOLDS = (PREFILL_BWD_TMA_MIN_KEYS, PREFILL_BWD_FUSED_MIN_KEYS, PREFILL_FWD_LONG_MIN_KEYS)
_SORTED_LENGTH_THRESHOLDS = tuple(sorted(PREFILL_LENGTH_THRESHOLDS))


def prefill_length_class(max_seqlen_k: int) -> int:
    """How many of the thresholds ``max_seqlen_k`` reaches: lengths of one class get the same AttentionConfig, so
    launch caches key on it instead of the length (a bisection: it runs on every call)."""
    return bisect.bisect_right(_SORTED_LENGTH_THRESHOLDS, max_seqlen_k)


def _prefill_tiles(kernel: str, default: tuple, problem: AttentionProblem) -> tuple:
    """The candidates of one kernel that fit the device's shared memory (in the order they are tried)."""
    candidates = prefill_candidates(kernel, default, problem.head_dim_pad, problem.elem_bytes)
    held, streamed = _PREFILL_TILES_HELD_STREAMED[kernel]
    return tuple(prefill_configs_that_fit(candidates, problem.head_dim_pad, problem.elem_bytes, problem.smem_limit,
                                          streamed_tensors=streamed, held_tensors=held))


def resolve_attention_config(problem: AttentionProblem) -> AttentionConfig:
    """Every launch decision of one flash_attn / flash_attn_varlen problem (forward and backward), from its
    description and the device's facts. Pure: no tensors, no device queries."""
    hopper = problem.capability_major >= 9
    fwd_tma = problem.tma_layout and hopper
    if problem.interpret:  # one tile, never timed: the interpreter's speed is set by the number of ops
        bm, bn = PREFILL_INTERPRET_BLOCKS
        tile = (bm, bn, 4, 1)
        return AttentionConfig(
            fwd_tma=fwd_tma, fwd_tiles=(tile,), fwd_autotune=False,
            bwd_tma=fwd_tma and use_bwd_tma(problem.max_seqlen_k, problem.deterministic),
            bwd_fused=use_bwd_fused(problem.max_seqlen_k, problem.head_dim_pad, problem.elem_bytes),
            bwd_dkdv_tiles=(tile,), bwd_dq_tiles=(tile,), bwd_atomic_tiles=(tile,),
            bwd_fused_tiles=((bn, bm, bm, bn, False, 4, 1),), bwd_autotune=False)
    fwd_long = use_fwd_long_config(problem.max_seqlen_k, problem.head_dim_pad, problem.elem_bytes, fwd_tma)
    # sm_90: the Gluon kernels wherever the dispatch takes them (docs/architecture.md, "Prefill dispatch")
    backend = "gluon" if problem.capability_major == 9 else "triton"
    fused = prefill_candidates("bwd_fused", PREFILL_BWD_FUSED_CANDIDATES, problem.head_dim_pad, problem.elem_bytes)
    return AttentionConfig(
        fwd_tma=fwd_tma,
        fwd_tiles=(tuple(prefill_configs_that_fit(PREFILL_FWD_LONG_CANDIDATES, problem.head_dim_pad,
                                                  problem.elem_bytes, problem.smem_limit)) if fwd_long
                   else _prefill_tiles("fwd", PREFILL_FWD_CANDIDATES, problem)),
        fwd_autotune=problem.autotune and not fwd_long,
        bwd_tma=fwd_tma and use_bwd_tma(problem.max_seqlen_k, problem.deterministic),
        bwd_fused=use_bwd_fused(problem.max_seqlen_k, problem.head_dim_pad, problem.elem_bytes),
        bwd_dkdv_tiles=_prefill_tiles("bwd_dkdv", PREFILL_BWD_KV_CANDIDATES, problem),
        bwd_dq_tiles=_prefill_tiles("bwd_dq", PREFILL_BWD_Q_CANDIDATES, problem),
        bwd_atomic_tiles=_prefill_tiles("bwd_atomic", PREFILL_BWD_ATOMIC_CANDIDATES, problem),
        bwd_fused_tiles=tuple(prefill_bwd_fused_configs_that_fit(fused, problem.head_dim_pad, problem.elem_bytes,
                                                                 problem.smem_limit)),
        bwd_autotune=problem.autotune, backend=backend)


# ----------------------------------------------------------------------------------------------------------------
# The Gluon kernels (sm_90, ops/gluon_attention.py): when they take a call, and the launch of each. Each rule's
# evidence: docs/decisions.md ("Gluon")
# ----------------------------------------------------------------------------------------------------------------

GLUON_HEAD_DIMS = (64, 128)
GLUON_HD64_MIN_KEYS = 1024  # gluon_pays: hd64 calls take the Gluon kernel from this many keys
FP8_HEAD_DIMS = (64, 128, 256)  # the e4m3 kernel's head dims (no register spills at any, 2 stages fit hd256)
LPT_TILE_OVERHEAD_BLOCKS = 2.0  # lpt_schedule's cost of a tile beyond its key blocks (Q load, epilogue), in blocks
THREE_CONSUMERS_MIN_KEYS = 16384  # hd64: three consumer warpgroups from here (resolve_gluon_config)
PERSISTENT_MAX_KEYS = 2048  # persistent CTAs (one per SM) up to this many keys (resolve_gluon_config)
PERSISTENT_MID_MAX_KEYS = 8192  # ... and up to this many for causal launches and hd64 (resolve_gluon_config)
LPT_OVERLAP_CAUSAL_MIN_KEYS = 4096  # hd128 causal: host tile lists + the overlapped loop beyond this many keys
LPT_OVERLAP_MIN_KEYS = 1024  # hd128 non-causal: ... from this many keys up to PERSISTENT_MID_MAX_KEYS
FP8_BN256_MIN_KEYS = 16384  # e4m3 hd128: 256-key blocks from here (resolve_gluon_fp8_config)


def resolve_gluon_config(headdim: int, causal: bool = False, seqlen_k: int = 0) -> GluonFwdConfig:
    """hd128: two stages of 128-key K/V (64 KiB each) beside a 128-row Q tile fill most of the 227 KiB of shared
    memory; hd64 tiles are half the size, so three stages fit with room to spare.

    Persistent CTAs only for short keys (to 2k; to 8k for causal launches and hd64; hd128 causal launches beyond
    4k and non-causal ones of 1k-8k keys take the host-made longest-first tile lists of tile_order="lpt" with the
    overlapped loop, see below): there each tile is a few
    blocks, and a CTA that stays resident loads the next tile's first K/V blocks under the current tile's last ones
    and its epilogue (H100, 16 x 1k: +10-11% hd128, +6-12% hd64); at 16k keys it measured 1-7% slower at hd128,
    and at 4k-8k non-causal hd128 2-6% slower. A causal persistent CTA takes its tiles in
    pairs of one head's k-th heaviest and k-th lightest (tile_order="pairs"): a static round robin over single
    tiles gave some CTAs far more work than others (16k causal hd128: ~400 vs 580-630 TFLOP/s). Long causal
    launches at hd128 take tile_order="lpt" instead (each persistent CTA gets a host-made list of tiles, heaviest
    first, greedily balanced by key blocks: H100 kernel time, 1 x 16k causal 611.2 -> 618.5 TFLOP/s, the engine's
    64k x 32 / 8 heads 566.2 -> 575.1; docs/decisions.md); hd64 (unmeasured there) stays one CTA per tile.

    hd64 from THREE_CONSUMERS_MIN_KEYS keys: three consumer warpgroups (192-row tiles, 160 registers each), FA3's
    hd64 tile - at hd64 a block's softmax costs as much as its two GEMMs, and a third warpgroup keeps the tensor
    cores fed while two run softmax (H100, 16k keys: 538.8 vs 452.3 TFLOP/s, causal 483.9 vs 464.6; cuDNN 497.6 /
    452.2 in the same run). At 16 x 1k it lost (412 vs 418; causal 168 vs 238: few blocks per tile), and lengths
    between were not measured."""
    persistent = 0 < seqlen_k <= PERSISTENT_MAX_KEYS or (
        0 < seqlen_k <= PERSISTENT_MID_MAX_KEYS and (causal or headdim == 64))
    if headdim == 64 and seqlen_k >= THREE_CONSUMERS_MIN_KEYS:
        return GluonFwdConfig(num_consumers=3, consumer_regs=160, num_stages=3)
    # two Q buffer sets where CTAs are persistent: 16 x 1k non-causal 1.056x (hd128) / 1.074x (hd64) on the H100;
    # one set elsewhere (16k keys: 0.97x; forced-persistent causal 0.985x) - docs/decisions.md. Causal persistent
    # CTAs take pairs of one head's heavy and light tiles (equal work per unit, so the round robin balances):
    # 16 x 1k causal 352 -> 408 TFLOP/s at hd128, 235 -> 277 at hd64, 4 x 4k 517 -> 564 / 374 -> 398, 2 x 8k
    # 573 -> 586 / 418 -> 422; at 16k keys pairs gave nothing. hd64 non-causal persistent to 8k: 4 x 4k 424 -> 462,
    # 2 x 8k 438 -> 477 (hd128 lost there: 607 -> 595, 617 -> 581).
    # hd128: FA3's intra-warpgroup overlap (block j's softmax under PV of block j - 1) with K and V slots released
    # apart (the overlapped loop holds a V slot a block longer, so with one release per slot the next K load waited
    # on it): H100 kernel time, 1 x 16k x 16 heads, 652.2 -> 705.7 TFLOP/s, causal 628.8 -> 690.9 (cuDNN 647.9 /
    # 634.6, FA3 707.5 / 715.6 in the same run; docs/decisions.md). Not on the short persistent launches: with the
    # two Q buffer sets' unrolled tile loop they spill and lost (16 x 1k causal 427.7 -> 241.1, 4 x 4k causal
    # 589.7 -> 551.5; non-causal 16 x 1k 592.4 -> 588.9).
    # Host tile lists with the overlapped loop instead: causal launches beyond 4k keys, non-causal ones of 1k-8k
    # keys (kernel time: 2 x 8k causal 617.7 -> 643.1; non-causal 16 x 1k 595.5 -> 616.5, 4 x 4k 687.7 -> 707.2,
    # 2 x 8k 707.9 -> 713.7; 4 x 4k causal lost, 587.5 -> 569.6).
    if headdim == 128 and (seqlen_k > LPT_OVERLAP_CAUSAL_MIN_KEYS if causal
                           else LPT_OVERLAP_MIN_KEYS <= seqlen_k <= PERSISTENT_MID_MAX_KEYS):
        return GluonFwdConfig(num_stages=2, persistent=True, q_buffers=2, tile_order="lpt", overlap=True,
                              split_release=True)
    stages = 2 if headdim > 64 else 3
    if persistent:
        return GluonFwdConfig(num_stages=stages, persistent=True, q_buffers=2,
                              tile_order="pairs" if causal else "round_robin")
    # causal launches get here only with seqlen_k unknown (0): the overlapped causal loop spills one CTA per tile
    fa3_loop = headdim == 128 and not causal
    return GluonFwdConfig(num_stages=stages, overlap=fa3_loop, split_release=fa3_loop)


def resolve_gluon_fp8_config(headdim: int, causal: bool = False, seqlen_k: int = 0) -> GluonFwdConfig:
    """The e4m3 kernel's launch: K and V^T slots are half the bf16 size, so the ring gets more stages in the same
    shared memory (hd64: 4, hd128: 3, hd256: 2 - 196 KiB with the 64 KiB Q tile); persistent CTAs for non-causal
    launches to 2k keys (tile pairs are not timed for e4m3). hd128 from FP8_BN256_MIN_KEYS keys: 256-key blocks in
    two stages (the per-block rescale and bookkeeping amortised over twice the keys; H100, 16k keys: 906.0 vs 830.5
    TFLOP/s, causal 957.4 vs 837.9, docs/decisions.md; shorter keys not timed), non-causal ones on persistent CTAs
    with two Q buffer sets (each tile's first loads under the previous tile's last blocks and store: 986.4 vs 891.9
    TFLOP/s; causal ones spill there and lose, 634.3 vs 925.5). No OVERLAP: its P (e4m3) would be a dependency of a
    wgmma wait, which Triton 3.6 cannot lower for 8-bit values."""
    persistent = not causal and 0 < seqlen_k <= PERSISTENT_MAX_KEYS
    if headdim == 128 and seqlen_k >= FP8_BN256_MIN_KEYS:
        if causal:
            return GluonFwdConfig(num_stages=2, block_n=256)
        return GluonFwdConfig(num_stages=2, block_n=256, persistent=True, q_buffers=2)
    return GluonFwdConfig(num_stages={64: 4, 128: 3}.get(headdim, 2), persistent=persistent)


def gluon_pays(headdim: int, seqlen_k: int) -> bool:
    """The dispatch rule: whether the Gluon kernel is the faster forward (vs the Triton path) of a supported call.

    Measured per call with do_bench (H100, bf16, benchmarks/probes/gluon_dispatch.py, docs/decisions.md; its L2
    flush between calls hides host work shorter than itself, so short shapes compare kernel times, and the Gluon
    host path measured no slower than the Triton one, benchmarks/probes/gluon_host_overhead.py):
    hd128 faster on every shape timed (1.08-2.25x: 128 to 16k tokens, GQA, a 512-row chunk against 4k keys, 64
    queries against 2k keys, causal or not); hd64 faster from 1024 keys (1.08-1.21x) and slower below (0.30-0.77x
    at 128 and 512 keys)."""
    return headdim == 128 or seqlen_k >= GLUON_HD64_MIN_KEYS


def gluon_varlen_pays(headdim: int) -> bool:
    """The ragged (varlen) forward's dispatch rule: the Gluon kernel at hd128 and hd64 whatever the mean length.
    A ragged batch fills the card with tiles where a short dense call does not, so gluon_pays's hd64 floor does not
    carry over (H100, 16 / 16 heads hd64, 16k tokens, kernel TFLOP/s Gluon vs Triton, causal / not: 64 x 256
    107 / 281 vs 93 / 168, random 100..4000 311 / 356 vs 292 / 363, 16 x 1k 281 / 405 vs 203 / 313; docs/decisions.md,
    "Ragged hd64 on the Gluon kernel")."""
    return headdim in GLUON_HEAD_DIMS


RAGGED_PAIRS_MAX_KEYS = 1024  # causal ragged batches: persistent tile pairs up to this mean length (below)


def resolve_gluon_varlen_config(headdim: int, causal: bool, mean_keys: int) -> GluonFwdConfig:
    """The launch of a ragged batch whose sequences hold mean_keys keys on average (total_k / batch: the lengths
    themselves sit on the device). resolve_gluon_config's rule at that length, except:
    - host-made tile lists (tile_order "lpt") would need the lengths on the host: those launches take one CTA per
      tile instead (the hardware's block dispatch balances tiles of unequal sequences), with FA3's overlapped loop
      where it holds its state in registers (non-causal; the causal one spills one CTA per tile). Zeroing the last
      key block's V rows past the keys (the next sequence's rows, kernels/gluon/attn_fwd.py) costs it 8 bytes of
      spills, as it does the hd64 three-warpgroup tile (sm_90 SASS: stored and reloaded at a partition's start
      and the tile's epilogue, never in the key-block loop); both kept, not yet timed against the plain loop with
      the zeroing (benchmarks/probes/gluon_varlen.py);
    - causal hd128 batches averaging more than RAGGED_PAIRS_MAX_KEYS keys take one CTA per tile too (hd64 was not
      measured ragged and keeps resolve_gluon_config's rule): a head's heavy and
      light tiles pair up into equal units only when its sequences are equal, and ragged ones are not (H100, 32 / 8
      heads hd128, kernel time: random lengths 100..4000 one CTA per tile 497.7 vs pairs 447.2 TFLOP/s; 64 x 256
      pairs 203.1 vs 162.7; docs/decisions.md, "Ragged prefill on the Gluon kernel")."""
    cfg = resolve_gluon_config(headdim, causal, mean_keys)
    if cfg.tile_order == "lpt" or (causal and headdim == 128 and mean_keys > RAGGED_PAIRS_MAX_KEYS):
        return GluonFwdConfig(num_stages=cfg.num_stages, overlap=not causal, split_release=not causal)
    return cfg


# flash_attn_varlen(block_table=) and flash_attn_with_kvcache's paged prefill take the Gluon kernel
# (ops/gluon_attention.py gluon_paged_forward_into) where resolve_gluon_paged_config gives a launch: its GPU tests
# pass and it is 1.09-1.74x the Triton paged kernel on every timed row (docs/decisions.md, "Paged prefill on the
# Gluon kernel"). False sends every paged prefill to the Triton kernel unless config= asks for the Gluon one.
PREFILL_PAGED_GLUON = True
GLUON_PAGED_BLOCK_NS = (128, 64)  # key blocks a page must hold whole (the largest that divides the page size)


def gluon_paged_block_n(page_size: int) -> int:
    """The key block of the Gluon paged prefill for pages of page_size keys: the largest of GLUON_PAGED_BLOCK_NS
    that divides it (a block is one TMA box from one page), or 0 where none does (those pages stay on the Triton
    kernel, which gathers keys by pointers)."""
    return next((b for b in GLUON_PAGED_BLOCK_NS if page_size % b == 0), 0)


def resolve_gluon_paged_config(headdim: int, causal: bool, page_size: int,
                               max_seqlen_k: int) -> Optional[GluonFwdConfig]:
    """The Gluon launch of a paged prefill (q ragged, K/V in pages of page_size keys, max_seqlen_k the longest key
    count: the lengths themselves sit on the device), or None where the dispatch keeps the Triton kernel: head dims
    outside GLUON_HEAD_DIMS, pages that hold no whole key block (gluon_paged_block_n), problems gluon_pays rules
    out. The ragged resolver's launch at max_seqlen_k keys (its sequences are ragged the same way), with key blocks
    of gluon_paged_block_n(page_size) (half-size blocks in twice the stages: the same bytes in flight), and always
    the plain loop: the overlapped one spills (16 bytes, sm_90 compile) once it zeroes the last block's V rows past
    the keys (a page's tail may hold anything), and was timed without windows or softcap. Not yet timed over pages
    (PREFILL_PAGED_GLUON); windows and softcap take the same launch."""
    block_n = gluon_paged_block_n(page_size)
    if headdim not in GLUON_HEAD_DIMS or block_n == 0 or not gluon_pays(headdim, max_seqlen_k):
        return None
    cfg = resolve_gluon_varlen_config(headdim, causal, max_seqlen_k)
    if cfg.overlap or cfg.split_release:
        cfg = dataclasses.replace(cfg, overlap=False, split_release=False)
    if cfg.block_n != block_n:
        cfg = dataclasses.replace(cfg, block_n=block_n, num_stages=cfg.num_stages * cfg.block_n // block_n)
    return cfg


def resolve_gluon_bwd_config(headdim: int) -> GluonBwdConfig:
    """hd128: two 64-row Q / dO stages beside K, V, the double dS buffer and the dQ staging tile use ~208 KiB of
    shared memory. hd64: 128-row query blocks in two stages (~210 KiB): a step of half the head dim has half the
    wgmma work per barrier, dS exchange and dQ reduce-add, so doubling its rows halves those per flop (the S^T /
    dP^T accumulators grow to 64 registers each, which the half-size dK / dV accumulators leave room for).
    Measured on the H200, 16k tokens, deterministic backward alone: 453.6 / 428.9 TFLOP/s non-causal / causal
    against 368.5 / 377.9 with 64-row blocks in three stages (docs/decisions.md)."""
    if headdim > 64:
        return GluonBwdConfig(num_stages=2)
    return GluonBwdConfig(block_m=128, num_stages=2)
