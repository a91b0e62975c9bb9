"""Pure launch-policy functions (no kernels, no tensors): device facts and split counts. Unit-tested on the CPU."""

from __future__ import annotations

import bisect
import functools

from flashdecode.config import AttentionConfig, AttentionProblem

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


# Flash-Decoding policy constants: the most splits a sequence gets (partial-buffer size) and the fewest KV blocks
# a non-empty split holds.
DECODE_MAX_SPLITS = 64
DECODE_MIN_BLOCKS_PER_SPLIT = 1
# Contexts this short run unsplit (one or two KV blocks at hd128 bf16). With the merge and stage 1 both programmatic
# dependent launches, splitting already pays at 512 keys (H100, b1 16/2 hd128 bf16, CUDA-graph replay, one run: 4
# splits 5.6 us vs unsplit 6.7 contiguous, 6.9 vs 10.1 at page 16); before PDL it did not (8.7 unsplit vs 9.3 split).
DECODE_NO_SPLIT_MAX_KEYS = 128
# Smallest page whose ids are spread over a block's keys in registers (a BLOCK_N x BLOCK_N / page select):
# smaller pages read their ids from the block table inside the KV loop.
DECODE_MIN_PRELOAD_PAGE = 8
# Paged caches whose pages need gathers from preloaded page ids (DECODE_MIN_PRELOAD_PAGE <= page < a 16 KiB tile)
# take 16 KiB tiles at any batch when a split holds at most this many live keys (measured at page 16: 512 faster,
# 8192 slower; see decode_block_config).
DECODE_SMALL_TILE_MAX_SPLIT_KEYS = 2048
# The merge's early PDL trigger (see decode_block_config) for splits of at most this many KV blocks.
DECODE_EARLY_TRIGGER_MAX_SPLIT_BLOCKS = 2
# (batch, kv head) pairs between half the SMs and the SMs on Hopper run decode as one persistent launch with split
# counts chosen on the device (kernels/decode.py decode_persistent_kernel; contiguous caches and pages that are
# multiples of BLOCK_N): one work item per program for equal lengths, split items for a long sequence among short
# ones. H100, Llama 32/8 hd128 bf16 8k, us, persistent vs the two-kernel split grid (decodetune T1207 / T1208,
# T1134): b9 102.2 vs 110.2, b12 139.9 vs 143.5, b16 177.9 vs 188.0 (page 128 179.8 vs 190.8); one 128k sequence
# among 15 of 1k 211.9 vs 207.5. With more pairs than SMs its static assignment runs a second round on some
# programs where the split grid's many small programs are balanced by the hardware (b17: 136 one-split items on 132
# programs, n1 227.8 vs 199.4; b24 268.0 vs 277.2, b64 696.4 vs 722.4 unsplit); a work queue fixes that (below).
DECODE_PERSISTENT_AT_BATCH = True
# Contiguous caches take the persistent kernel from a third of the SMs' worth of pairs (two or three splits per
# sequence; its in-kernel merge of so few partials is cheaper than the merge kernel's launch). H100, Llama 32/8 hd128
# bf16 contiguous, one run each (decodetune T1931, T1932), us at 1k / 8k / 32k / one 128k among short ones,
# persistent vs split grid: b6 15.6 / 73.4 / 272.6 / 193.8 vs 15.4 / 75.6 / 271.4 / 197.9; b7 16.7 / 82.7 / 307.9 /
# 208.3 vs 17.2 / 86.3 / 323.4 / 199.7; b8 17.9 / 93.6 / 350.6 / 209.5 vs 20.1 / 97.4 / 359.8 / 198.1 (the mix
# loses up to 6%, as at b9-b16). b4 (32 pairs) does not gain (1k 12.6 vs 11.7, 8k 51.1 vs 52.5) and page 64 loses
# at 32k (b8 422.3 vs 364.1: a whole sequence's page ids do not fit the preload), so paged caches keep the half.
DECODE_PERSISTENT_CONTIG_MIN_PAIRS_DIV = 3
# Pages that are multiples of the few-pairs tile (bf16 hd128: 64 keys; pages 64, 128, 256) take the persistent
# kernel with its work queue from this fraction of the SMs' worth of pairs (below half, where the split grid ran
# them: a plan's split count, sized for the worst mix of lengths, gives equal lengths hundreds of short splits).
# H100, Llama 32/8 hd128 bf16, us at 1k / 8k / 32k / one 128k among 1k, queue vs split grid (static shares) (decodetune
# T0652, T0654, one run): b8 (64 pairs) page 64 19.3 / 97.0 / 359.6 / 196.8 vs 21.1 / 99.5 / 364.9 / 204.5 (18.2 /
# 96.7 / 361.1 / 213.2), page 128 19.4 / 96.3 / 357.5 / 196.2 vs 22.2 / 99.1 / 363.8 / 205.2, page 256 20.0 / 95.5 /
# 356.1 / 194.0 vs 21.5 / 99.0 / 363.1 / 203.1; but b6 (48 pairs) page 64 16.8 / 77.8 / 282.0 / 194.1 vs 16.1 /
# 77.0 / 276.6 / 201.6, so not from a third. Contiguous b8 keeps static shares (queue 19.3 / 94.5 / 352.0 / 192.4 vs
# 18.1 / 93.5 / 351.8 / 209.2: uniform batches lose); gathered and 1-7-key pages at b8 gain nothing clear (T0652).
DECODE_PAGED_QUEUE_MIN_PAIRS_FRACTION = 0.45
# More pairs than SMs: the persistent kernel with a work queue (programs take the next item from an atomic counter)
# and split counts that let the last items end together (4 item slots per program then; the rule below since
# session 10). H100, Llama 32/8 hd128 bf16 contig, one run (decodetune T0650/T0651), us, queue with 4 slots vs the
# split grid (2 / 8 slots):
# b17 8k 198.7 vs 198.3 (229.3 / 197.9); b24 8k 270.7 vs 276.6 (269.5 / 274.0); b32 8k 357.1 vs 366.3 (352.0 /
# 360.6); b64 4k 353.8 vs 386.3 (352.8 / 360.4); b64 one 128k among 63 of 1k 266.5 vs 309.8 (266.4 / 266.4).
DECODE_PERSISTENT_DYNAMIC = True
# The queue's split counts (kernels/decode.py _queue_split_ways, on the device from the live lengths): equal lengths
# split up to this many ways, only where the queue's last round would hold fewer than DECODE_QUEUE_FULL_FRACTION of
# the programs (too few loads in flight for the memory bandwidth; 72 of 132 programs suffice), each further split
# costing DECODE_QUEUE_SPLIT_COST. Before session 10: 4 slots per program (b32 at 8 kv heads: two splits each).
# H100, Llama 32/8 hd128 bf16, us, this rule vs 4 slots vs one split per sequence (decodetune T0638-T0640, one run):
# 8k contiguous b17 198.3 / 199.1 / 229.4 (136 pairs: 4 splits each, not a second round of 4 items), b24 271.2 /
# 270.5 / 269.5, b32 351.6 / 356.8 / 351.1; b64 4k 353.3 / 353.7 / 353.3, one 128k among 63 of 1k 269.6 / 266.1 /
# 268.9; 8k page 64 b32 357.4 vs 366.5 (4 slots); page 16 b24 (192 pairs: a last round of 60) 280.6 vs 280.2 (4
# slots) vs 287.0 (one split), hence a half, not less.
DECODE_QUEUE_MAX_SPLITS = 4
DECODE_QUEUE_FULL_FRACTION = 0.5
DECODE_QUEUE_SPLIT_COST = 0.03
# Pages smaller than a block (8 <= page < a 16 KiB tile) take that queue too, from 3/4 of the SMs' worth of pairs,
# with 32 KiB tiles (128 keys at bf16 hd128; they spill 144 bytes there, 64-key tiles none, yet measure faster) and,
# up to one pair per SM, one slot per program (one split per sequence when lengths are equal). H100, Llama 32/8
# hd128 bf16 page 16 8k, us, vs the split grid with 16 KiB tiles (decodetune T0934, T0940-T0942): b64 717.0 vs
# 734.4 (64-key tiles 728.4), b32 369.6 vs 386.0, b24 281.0 vs 292.6, b16 187.3 / 187.4 vs 192.7 / 192.9; b12
# 144.7 vs 146.7 and b9 116.3 vs 112.2 (so not below 3/4); one 128k sequence among 15 / 23 / 31 / 63 of 1k 209.4
# vs 221.8, 222.1 vs 244.0, 230.2 vs 265.2, 279.9 vs 351.3. Static shares lose the mixed batch (b16 292.7).
DECODE_QUEUE_GATHERED = True
# Pages below DECODE_MIN_PRELOAD_PAGE (1-7 keys, ids read in the KV loop at batch) take the queue as well, from the
# same 3/4 of the SMs' worth of pairs. H100, Llama 32/8 hd128 bf16 8k, us, vs the split grid (decodetune
# T0639 / T0640, one run): page 1 b16 187.3 vs 193.3, b32 364.5 vs 374.6, b64 717.7 vs 737.7; one 128k among 15 /
# 31 / 63 of 1k 213.5 vs 223.9, 232.6 vs 266.5, 275.9 vs 354.3; page 3 b32 365.1 vs 375.9, mixed 232.4 vs 271.6.
DECODE_QUEUE_KEY_PAGES = True
# Gathered pages with few (batch, kv head) pairs take 8 KiB tiles (bf16 hd128: 32 keys) when a split holds at most
# this many live keys (0 = never). H100, b1 16/2 hd128 bf16 page 16, one run (decodetune T1117): 32-key tiles 4.9 /
# 6.6 us at 512 / 4k vs 5.1 / 7.3 with 64, but 18.6 / 32.6 vs 17.8 / 29.8 at 32k / 64k (512-key splits).
DECODE_TINY_TILE_MAX_SPLIT_KEYS = 64
# Pipeline stages added where stage 1's KV loop reads page ids from the block table (pages that do not divide a
# block, e.g. 3 keys; smaller pages whose ids outgrow the preload; block-multiple pages of long sequences on the
# persistent kernel) and a split holds at least DECODE_TABLE_READ_MIN_SPLIT_BLOCKS blocks: the read takes a stage of
# its own ahead of the K/V loads it feeds, so 3 stages left K/V single-buffered (ops/decode.py _pipeline_stages).
# H100, b1 16/2 hd128 bf16, one run (decodetune T0419 console), us, +2 / +0 stages: page 1 (ids read in the loop)
# 19.2 / 24.3 at 32k, 31.5 / 40.0 at 64k, 54.8 / 71.4 at 128k; page 3 19.0 / 22.9 at 32k, 54.9 / 67.8 at 128k
# (+3 no better, +1 no gain). Short splits lost: b1 page 1 4k (64-key splits) 8.2 vs 7.2; Llama 32/8 b16 page 1 8k
# (512-key splits of 128-key tiles, 2048 programs) 202.1 vs 192.8, where single-buffered programs fit three per SM.
DECODE_TABLE_READ_EXTRA_STAGES = 2
DECODE_TABLE_READ_MIN_SPLIT_BLOCKS = 8
# Block-multiple pages in 16 KiB tiles (page_tiles in decode_block_config) whose whole-sequence ids outgrow the
# persistent kernel's preload: bounded splits, so that a split's ids fit (True), or one id read per block in the
# loop (False). Session 8 measured the bound faster with 3 stages (Llama 32/8 page 64 b32 32k 1457.8 vs 1627.2 us,
# T1949); with the table-read stages the loop wins (decodetune T0426 / T0427: b16 32k 710.4 vs 738.6, b32 32k
# 1409.2 vs 1458.7; b64 8k and the mixes within 0.3%, b16 mixed 208.1 vs 205.5).
DECODE_PERSISTENT_BOUND_PAGES = False
# Pages of 1, 2 or 4 keys preload their split's ids and gather one per key, as 8-63-key pages do (up to
# PRELOAD_GATHER_MAX ids; longer splits read them in the loop), with few (batch, kv head) pairs only. H100, one run
# (decodetune T0425), us, preloaded vs read in the loop (+2 stages) vs before session 9 (in the loop, 3 stages): b1
# 16/2 page 1 5.1 / 5.5 / 5.6 at 512, 18.0 / 19.4 / 24.6 at 32k, 30.1 / 31.5 / 40.3 at 64k (128k: 2048 ids, not
# preloaded, 54.9 / 54.8 / 70.9); Llama 32/8 b4 8k 56.4 / 60.0 / 60.1 (FlashInfer 55.1 in T1942). Many pairs lose
# (short programs wait for the ids before their first K/V load): b16 8k 203.4 vs 192.7, b64 739.7 vs 772.9; with
# the gathered-page work queue too (variant ids1, T0419) b16 took 226.0.
DECODE_PRELOAD_KEY_IDS = True
# The split grid (few (batch, kv head) pairs) with each sequence's split count chosen on the device from all live
# lengths, one program per work item (kernels/decode.py DEVICE_SPLITS), where the split count comes from the policy
# and more than one sequence runs: a plan's count is sized for the worst mix of lengths (balance_mixed: 16 at 8 kv
# heads), which gives equal lengths many short splits. Items: each sequence's floor'd share of this many per SM.
# Contiguous caches from DECODE_DEVICE_SPLITS_MIN_PAIRS pairs. H100, Llama 32/8 hd128 bf16, us at 1k / 8k / 32k /
# one 128k among 1k, one run (decodetune T0736), with the merge over two head-dim halves (below) vs the plan's 16
# splits (4 splits, the equal lengths' count, in brackets): b4 11.2 / 49.4 / 177.2 / 182.8 vs 11.0 / 50.5 / 180.3
# / 192.1 (10.2 / 48.4 / 173.9 / 407.2); but b2 7.2 / 28.3 / 91.9 / 179.5 vs 6.8 / 27.7 / 92.7 / 179.8, and page
# 16 b4 12.8 / 54.8 / 192.7 / 199.6 vs 11.7 / 53.6 / 192.9 / 199.7 (its 16 splits cost the 1k and 8k rows less).
# The device path itself costs ~0.5 us (ncu at b2 8k: stage 1 30.4 vs 29.9 us with the same 8 splits; the item
# mapping's values live in vector registers, so the loop's TMA coordinates take R2UR moves).
# Pages that are multiples of the tile (TMA, one id per block) take it too, up to a third of the SMs' worth of
# pairs (as contiguous caches, whose persistent kernel starts there): Llama 32/8, us at 1k / 8k / 32k / one 128k
# among the others of 1k, device vs plan counts (decodetune T0904, T0907): b4 page 64 11.4 / 51.6 / 183.8 / 188.0
# vs 12.1 / 52.9 / 185.0 / 195.7, page 128 11.6 / 51.1 / 182.1 / 187.3 vs 11.6 / 52.4 / 183.7 / 195.2; b5 page 64
# 12.9 / 63.1 / 232.4 / 190.3 vs 13.4 / 63.1 / 235.9 / 198.9, page 128 13.4 / 62.1 / 229.0 / 188.9 vs 13.7 / 62.2 /
# 233.2 / 199.0. At b6 (48 pairs: 2 splits each, 96 programs on 132 SMs) equal long lengths lose (T0905): page 64
# 8k / 32k 76.2 / 281.3 vs 75.4 / 272.5 (the mix still wins, 193.0 vs 198.4).
DECODE_DEVICE_SPLITS = True
DECODE_DEVICE_SPLITS_MIN_PAIRS = 32
DECODE_DEVICE_SPLITS_PAGED_MAX_PAIRS_DIV = 3
DECODE_DEVICE_SPLIT_SLOTS_PER_SM = 1
# The merge kernel over two head-dim halves (twice the programs) from this many (batch, kv head) pairs among few:
# with a plan's 16 splits per sequence one program held 4 rows x 16 splits x 128 columns and the merge's latency
# showed (ncu, b2 8k: 5.0 vs 3.8 us for 8 splits). Same run as above, us, halves vs whole rows: b2 contiguous 6.8 /
# 27.7 / 92.7 / 179.8 vs 7.6 / 28.0 / 93.9 / 181.0, b4 11.0 / 50.5 / 180.3 / 192.1 vs 11.7 / 52.3 / 182.3 / 194.4,
# b4 page 16 11.7 / 53.6 / 192.9 / 199.7 vs 12.3 / 55.5 / 195.8 / 202.5. At b1 16/2 (2 pairs) halves measured
# within noise (session 3); below 16 pairs see DECODE_MERGE_FEW_PAIRS_D_CHUNKS.
DECODE_MERGE_SPLIT_D_MIN_PAIRS = 16
# Below DECODE_MERGE_SPLIT_D_MIN_PAIRS the merge runs one query row per program over this many head-dim quarters,
# with all of a row's splits in one pass: a merge of few rows was a handful of programs each pulling up to 64
# splits x 128 columns from L2 (b1 16/2: 16 programs of 32 KiB; Llama 32/8 b1: 8 programs of 4 rows), and the
# merge sits on the critical path between a call's last stage-1 program and the next call (1.5 us of it at 32k,
# scripts/stage1_timeline.py). H100, bf16 hd128, two runs each (session 13), us, one row x quarters vs the tile of
# up to 8192 values: b1 16/2 1k / 8k / 32k contiguous 4.71 / 6.76 / 16.19 vs 5.20 / 7.12 / 16.40, page 16 5.07 /
# 7.65 / 17.15 vs 5.44 / 8.25 / 17.28 (512 / 4k / 128k 4.31 / 5.70 / 48.77 vs 4.54 / 5.97 / 48.99); Llama 32/8 b1
# 1k / 8k / 32k 5.33 / 16.23 / 48.65 vs 6.12 / 16.45 / 48.92, page 16 5.58 / 16.68 / 51.27 vs 6.40 / 17.00 / 51.63.
# Two rows per program at 32/8 b1 measured the same; two splits passes (half the states per pass) lost at 8k.
# b2 (16 pairs) and b4 keep their halves (one row x quarters: b2 1k 7.3 vs 6.8 us, 8k / 32k equal).
DECODE_MERGE_FEW_PAIRS_D_CHUNKS = 4
# Paged stage 1 reads its split's page ids beside its length after the PDL wait (the range from the length read
# before the wait, checked after it) instead of one round trip behind it (kernels/decode.py SPEC_PAGES).
DECODE_SPEC_PAGES = True


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


def decode_block_config(headdim: int, elem_bytes: int, interpret: bool, kv_pairs: int | None = None,
                        num_sms: int = DEFAULT_NUM_SMS, page_size: int = 0, split_keys: int | None = None) -> dict:
    """Stage-1 launch constants for flash_decode: BLOCK_N keys per step, warps, pipeline stages.

    On the GPU: 32 KiB K tiles with 3 stages (bf16 hd128: 128 keys, the 28.5 us prototype in KERNEL_NOTES.md; 2
    stages measured much slower), so 3 stages of K and V (192 KiB) fit in Hopper's shared memory for every head dim
    and dtype. With few (batch, kv head) pairs (``kv_pairs`` * 2 <= ``num_sms``: the SMs are filled by splits, as at
    batch 1) the tiles shrink to 16 KiB but >= 64 keys (bf16 hd128: 64): twice the splits at short contexts, a
    shorter pipeline ramp. H100, b1 16/2 hd128 bf16, one run (with the PDL and split defaults below), us at 512 / 4k
    / 32k / 64k: contiguous 5.1 / 7.0 / 16.9 / 28.0 vs 5.5 / 6.9 / 17.7 / 29.3 with 128 keys, page 16 5.3 / 7.9 /
    18.4 / 31.4 vs 6.8 / 8.3 / 19.9 / 33.6 (batch >= 16 keeps 128: not measured with 64). In the CPU interpreter the
    cost is per op, and 16-key tiles make small test lengths cross several blocks and splits. PRELOAD_PAGES_MAX: the
    most block-table entries a split may hold in registers (KERNEL_NOTES.md: reading the block table inside the KV
    loop stalled the pipeline); PRELOAD_GATHER_MAX the same for pages smaller than a block, whose ids are looked up
    by tl.gather (Llama 32/8 b16, one 128k sequence among 15 of 1k, page 16: 1024 ids 219.9 us vs 229.9 with 256,
    decodetune T1153). PERSISTENT_GATHERED lets such pages take the persistent path too: with static shares b16
    8k 186.0 vs 192.7 us, but b64 741.6 vs 733.6 and the mixed batch 292.7 vs 219.9 (T1156), so only with the work
    queue (from 3/4 of the SMs' worth of pairs, DECODE_QUEUE_GATHERED). USE_TMA: host tensor descriptors for
    contiguous caches and pages that are multiples of BLOCK_N (Hopper; 8.1 vs 9.0 us at 4k, equal at 64k on our
    H100). USE_PDL: programmatic dependent launch of the merge. PDL_WAIT: stage 1 itself is a
    programmatic dependent of the kernel before it (its launch overlaps that kernel's tail; it waits on the device
    before touching memory). H100, b1 16/2 hd128 bf16, one run, us at 512 / 4k / 32k / 64k contiguous: no PDL 7.0 /
    8.2 / 18.5 / 30.2, merge PDL 6.9 / 7.4 / 18.5 / 30.4, both 6.7 / 6.8 / 18.0 / 29.5 (page 16: 10.4 / 9.6 / 20.7 /
    34.6 -> 10.1 / 8.3 / 19.7 / 33.7). FUSED_MERGE: split launches merge in their last program per kv head (atomic
    ticket) instead of a second kernel; off: same run, it won only where the merge is tiny (512 keys in 4 splits 5.3
    vs 5.6 us contiguous but 7.2 vs 6.9 at page 16; 32/8 heads 32k 50.1 vs 51.2) and lost from 4k up (8.2 vs 6.8 at
    4k, 19.5 vs 18.0 at 32k: one program reads all of a head's partials). ``split_keys``: the host's estimate of
    live keys per split (max_seqlen_k / num_splits; None = not known yet), ``page_size``: 0 contiguous. Round 3
    (H100, same runs, decodetune T0902 / T0903): PREFETCH_BLOCKS: with few (batch, kv head) pairs, stage 1
    prefetches its split's first block into L2 before the PDL wait (b1 16/2 contiguous 4.8 / 6.7 / 16.4 / 27.4 /
    49.0 vs 5.0 / 7.0 / 16.9 / 28.1 / 49.4 us at 512 / 4k / 32k / 64k / 128k; page 16 5.0 / 7.4 / 18.7 / 31.5 / 54.4
    vs 5.3 / 7.9 / 18.5 / 31.3 / 54.9; 4 blocks: no better). MERGE_EARLY_TRIGGER: the merge lets the next kernel
    launch before its own wait, so the next call's stage 1 prefetches during this call; only for splits of <= 2
    blocks (latency-bound calls: with the prefetch 4.6 vs 4.8 at 512, 6.1 vs 6.7 at 4k; T0921: 8k 7.3 vs 8.0, page
    16 8.8 vs 9.6) - from 4 blocks per split it loses (16k 11.3 vs 10.9, 32k 17.1 vs 16.4). Many pairs, paged with
    pages that need gathers and short splits (one 128k sequence's balance_mixed splits over a uniform batch): 16 KiB
    tiles too (Llama 32/8 8k page 16: b16 195.8 vs 212.4 us, T0921 b16 194.1 vs 210.9 and b64 737.0 vs 787.4; with
    8k-key splits the in-loop block table reads made them slower, 237.7 vs 192.8). PERSISTENT (default on Hopper
    with num_sms / 2 < pairs <= num_sms, DECODE_PERSISTENT_AT_BATCH): all of decode as one launch of kernels/decode.py
    decode_persistent_kernel - per-sequence split counts chosen on the device from the live lengths, a fixed grid of
    PERSISTENT_PROGRAMS (default: the SMs) over midpoint-balanced work items, the merge in-kernel - so uniform
    batches stop paying for balance_mixed (b16 32/8 8k contiguous 177.7 vs 188.4 us for the split grid, T1134);
    contiguous caches from a third of the SMs' worth of pairs (DECODE_PERSISTENT_CONTIG_MIN_PAIRS_DIV).
    PERSISTENT_DYNAMIC (more pairs than SMs; gathered pages from 3/4 of them): programs draw work items from a
    queue, with PERSISTENT_SLOTS slots per program for the split counts and equal lengths split up to
    PERSISTENT_QUEUE_SPLITS ways where the last round would idle the bandwidth (DECODE_QUEUE_MAX_SPLITS).
    Contiguous caches and pages that are multiples of BLOCK_N; gathered pages and pages of 1-7 keys only with the
    queue (PERSISTENT_GATHERED above, DECODE_QUEUE_KEY_PAGES).
    """
    if interpret:  # PERSISTENT_PROGRAMS: few programs, so CPU tests give each one several work items
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "PRELOAD_PAGES_MAX": 256, "FUSED_MERGE": False,
                "PERSISTENT_PROGRAMS": 3, "PRELOAD_KEY_IDS": DECODE_PRELOAD_KEY_IDS}
    head_dim_pad = next_power_of_2(max(16, headdim))
    block_n = min(128, max(16, 32768 // (head_dim_pad * elem_bytes)))
    small_tile = max(64, 16384 // (head_dim_pad * elem_bytes))
    few_pairs = kv_pairs is not None and 2 * kv_pairs <= num_sms
    gathered = DECODE_MIN_PRELOAD_PAGE <= page_size < small_tile
    short_gathered_splits = (gathered and split_keys is not None
                             and split_keys <= DECODE_SMALL_TILE_MAX_SPLIT_KEYS)
    hopper = _is_hopper_or_newer()
    many_pairs = kv_pairs is not None and kv_pairs > num_sms
    # gathered pages on the persistent kernel's work queue keep 32 KiB tiles (its splits are chosen on the device)
    queue_pairs = kv_pairs is not None and 4 * kv_pairs > 3 * num_sms
    key_pages = 0 < page_size < DECODE_MIN_PRELOAD_PAGE and DECODE_QUEUE_KEY_PAGES
    queue_gathered = bool(hopper and (gathered or key_pages) and DECODE_PERSISTENT_DYNAMIC and DECODE_QUEUE_GATHERED
                          and queue_pairs)
    if few_pairs or (short_gathered_splits and not queue_gathered):
        block_n = min(block_n, small_tile)
    page_tiles = bool(queue_pairs and page_size % block_n and page_size % small_tile == 0)
    if page_tiles:
        # pages of one 16 KiB tile (bf16 hd128: 64 keys) from 3/4 of the SMs' worth of pairs: 16 KiB tiles make
        # them block multiples (tensor descriptors, the persistent kernel's queue). H100, Llama 32/8 8k page 64, us
        # (decodetune T1945): b32 366.4 vs 379.2 with the split grid's 32 KiB gathers, b64 711.4 vs 750.7; one 128k
        # among 31 / 63 of 1k 261.5 vs 260.4, 318.1 vs 348.3. b16 (pairs <= SMs) on the queue too (T0419 console):
        # 184.4 vs 196.9, mixed 210.7 vs 220.8 (static shares: 182.9, but the mix 220.8; in T1945 243.2).
        # Long sequences whose page ids do not all fit the preload read them in the loop (with the table-read
        # stages below; PERSISTENT_BOUND_PAGES: bounded splits instead, see DECODE_PERSISTENT_BOUND_PAGES).
        block_n = small_tile
    if few_pairs and gathered and split_keys is not None and split_keys <= DECODE_TINY_TILE_MAX_SPLIT_KEYS:
        block_n = min(block_n, max(32, 8192 // (head_dim_pad * elem_bytes)))
    prefetch = 1 if hopper and few_pairs else 0
    # contiguous caches: persistent from a third of the SMs' worth of pairs (DECODE_PERSISTENT_CONTIG_MIN_PAIRS_DIV)
    contig_persistent = (page_size == 0 and kv_pairs is not None
                         and DECODE_PERSISTENT_CONTIG_MIN_PAIRS_DIV * kv_pairs > num_sms)
    # block-multiple pages: persistent with the work queue from DECODE_PAGED_QUEUE_MIN_PAIRS_FRACTION of the SMs
    paged_queue = bool(few_pairs and page_size > 0 and page_size % block_n == 0 and DECODE_PERSISTENT_DYNAMIC
                       and kv_pairs > DECODE_PAGED_QUEUE_MIN_PAIRS_FRACTION * num_sms)
    # device-side split counts in the split grid: contiguous caches, and tile-multiple pages below a third of the
    # SMs' worth of pairs (DECODE_DEVICE_SPLITS_PAGED_MAX_PAIRS_DIV)
    device_split_layout = page_size == 0 or (
        page_size % block_n == 0 and kv_pairs is not None
        and DECODE_DEVICE_SPLITS_PAGED_MAX_PAIRS_DIV * kv_pairs <= num_sms)
    # the merge: one row per program over head-dim quarters below 16 pairs, halves from there among few pairs
    # (DECODE_MERGE_FEW_PAIRS_D_CHUNKS, DECODE_MERGE_SPLIT_D_MIN_PAIRS)
    row_merge = few_pairs and kv_pairs < DECODE_MERGE_SPLIT_D_MIN_PAIRS
    merge_d_chunks = DECODE_MERGE_FEW_PAIRS_D_CHUNKS if row_merge else (2 if few_pairs else 1)
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 3, "PRELOAD_PAGES_MAX": 256,
            "PRELOAD_GATHER_MAX": 1024, "USE_TMA": hopper, "USE_PDL": hopper, "PDL_WAIT": hopper, "FUSED_MERGE": False,
            "PREFETCH_BLOCKS": prefetch,
            "MERGE_EARLY_TRIGGER": bool(prefetch and split_keys is not None
                                        and split_keys <= DECODE_EARLY_TRIGGER_MAX_SPLIT_BLOCKS * block_n),
            "PERSISTENT": bool(hopper and DECODE_PERSISTENT_AT_BATCH and kv_pairs is not None
                               and (not few_pairs or contig_persistent or paged_queue)
                               and (kv_pairs <= num_sms or DECODE_PERSISTENT_DYNAMIC)),
            "PERSISTENT_DYNAMIC": many_pairs or queue_gathered or page_tiles or paged_queue,
            "PERSISTENT_GATHERED": queue_gathered,
            "PERSISTENT_SLOTS": 1, "PERSISTENT_QUEUE_SPLITS": DECODE_QUEUE_MAX_SPLITS,
            "PERSISTENT_BOUND_PAGES": page_tiles and DECODE_PERSISTENT_BOUND_PAGES,
            "TABLE_READ_EXTRA_STAGES": DECODE_TABLE_READ_EXTRA_STAGES,
            "TABLE_READ_MIN_SPLIT_BLOCKS": DECODE_TABLE_READ_MIN_SPLIT_BLOCKS,
            "PRELOAD_KEY_IDS": DECODE_PRELOAD_KEY_IDS and few_pairs,
            "DEVICE_SPLITS": bool(DECODE_DEVICE_SPLITS and few_pairs and kv_pairs >= DECODE_DEVICE_SPLITS_MIN_PAIRS
                                  and device_split_layout),
            "DEVICE_SPLIT_SLOTS": DECODE_DEVICE_SPLIT_SLOTS_PER_SM * num_sms,
            "MERGE_D_CHUNKS": merge_d_chunks,
            "MERGE_MAX_ROWS": 1 if row_merge else 0,
            "SPEC_PAGES": bool(hopper and DECODE_SPEC_PAGES)}


@functools.lru_cache(maxsize=None)
def _is_hopper_or_newer() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


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
        bwd_autotune=problem.autotune)
