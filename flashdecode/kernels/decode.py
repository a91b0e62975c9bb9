"""Flash-Decoding stage 1: split-KV attention of a few query rows against a contiguous or paged KV cache.

Grid (NUM_SPLITS, nheads_kv * NUM_M_BLOCKS, batch). One program owns one split of one sequence's live KV range
for one kv head, and serves every query row of that kv head's GQA group at once: the rows (seqlen_q new tokens x
GROUP query heads, row r = t * GROUP + g) form one BLOCK_M tile (padded to the MMA minimum of 16), so each K/V tile
is read from memory once per kv head, not once per query head.

Split ranges are derived on the device from cache_seqlens, so a launch with a fixed grid (CUDA graphs) stays
correct when the lengths change: chunk = max(ceil(live / (NUM_SPLITS * BLOCK_N)) * BLOCK_N, MIN_CHUNK) keys (or
a fixed SPLIT_KEYS: batch-invariant decode), split s covers [lo + s * chunk, min(lo + (s + 1) * chunk, seqlen));
splits past the end are empty, write lse = -inf and exit. With FINAL (one split) the program writes the normalised
output and natural-log lse directly; otherwise it writes a normalised fp32 partial and its log2 lse for
``kernels.merge``.

Masks (bottom-right aligned, always causal among the new tokens, as reference.decode_split_ref): row t sits at key
position qpos = seqlen - SEQLEN_Q + t and sees keys j with j <= qpos and, with a window, j >= qpos - window_left.
Blocks that every row sees entirely run without masks; only the tail (or every block under a window) is masked.

The work schedule (split ranges, device split counts, the persistent kernel's queue) is kernels.decode_schedule,
the K/V fetches (page gathers, tile loads, L2 prefetch) kernels.decode_gather, the attention bodies (one split's KV
loops) kernels.decode_blocks, the in-kernel merge's epilogue kernels.decode_epilogue; this module holds the two
kernels.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashdecode.kernels.decode_args import PREFETCH_OFF, QUANT_TILES_OFF
from flashdecode.kernels.decode_blocks import attend_split
from flashdecode.kernels.decode_epilogue import finish_split, group_rows
from flashdecode.kernels.decode_gather import prefetch_split_head, split_page_ids
from flashdecode.kernels.decode_schedule import (device_split_counts, item_of, items_before, planned_item, split_range,
                                                 stale_split_range)
from flashdecode.kernels.score import alibi_slope_log2
from flashdecode.kernels.softmax_state import LN2


@triton.jit
def decode_split_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, O, LSE, kv_raw,
    scales, window_left, capacity, num_pages, batch,
    stride_q, stride_k, stride_btb, stride_o, stride_l,
    ROWS: tl.constexpr, HEADDIM: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, PAGES: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, FINAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = PREFETCH_OFF,
    DEVICE_SPLITS: tl.constexpr = None, OFFS_32: tl.constexpr = False, SPEC_PAGES: tl.constexpr = False,
    alibi=None, ALIBI: tl.constexpr = False, kv_scales=None, KV_QUANT: tl.constexpr = 0,
    QUANT_TILES: tl.constexpr = QUANT_TILES_OFF, final=None, MERGE: tl.constexpr = None,
):
    """Stage 1 (see module doc).

    Grouped arguments (kernels/decode_args.py): scales = (score_scale, softcap_out) fp32: the logit scale (softcap:
    tanh's argument, else log2 units) and the softcap in log2 units; ROWS (SEQLEN_Q, GROUP, NUM_M_BLOCKS), TILE
    (BLOCK_M, BLOCK_N, BLOCK_D), SPLITS (NUM_SPLITS, MIN_CHUNK, MERGE_SPLITS, SPLIT_KEYS), PAGES (PAGE_SIZE,
    PRELOAD_PAGES), PDL (USE_PDL, PDL_WAIT), PREFETCH (PREFETCH_KEYS, LINE_ELEMS, NUM_LINES), DEVICE_SPLITS (None,
    or SPLIT_SLOTS, BATCH_PAD, MAX_SPLIT_KEYS, KV_PROGRAMS), named below as the helpers take them.

    Q: (batch, SEQLEN_Q, nheads, HEADDIM) via strides. With USE_TMA, K and V are host TensorDescriptors over the
    cache viewed as (rows, nheads_kv * HEADDIM), block (BLOCK_N, HEADDIM), and carry no pointer arithmetic.
    PRELOAD_PAGES (a power of two >= the pages one split spans, or 0; the launcher only sets it for pages that
    divide BLOCK_N or are multiples of it): the split's block-table slice is read into registers before the KV
    loop, so no block-table read sits between a block's address and its load.
    USE_PDL: let the merge kernel (a programmatic dependent launch) start early; it waits on the device.
    PDL_WAIT: this kernel is itself launched as a programmatic dependent of the previous kernel in the stream (its
    launch overlaps that kernel's tail); it waits for that kernel's completion and writes before it reads or writes
    any memory. K, V: contiguous (batch, max_seqlen, nheads_kv, HEADDIM)
    (PAGE_SIZE == 0, stride_kb = batch stride) or paged (num_pages, PAGE_SIZE, nheads_kv, HEADDIM) (stride_kb = page
    stride); K and V share strides, unit stride on the head dim. SEQLENS int32 (batch,), clamped to ``capacity``.
    BLOCK_TABLE int32 (batch, pages_per_seq). FINAL: O like Q in the output dtype, LSE (batch, SEQLEN_Q, nheads)
    fp32 natural log. Otherwise O (batch, SEQLEN_Q, nheads, NUM_SPLITS, HEADDIM) fp32 and LSE (..., NUM_SPLITS) log2
    (MERGE_SPLITS: NUM_SPLITS padded to a power of two).
    PREFETCH_KEYS (0 = off; a power of two): L2 prefetch of the split's first keys before anything else (before
    gdc_wait), from kv_raw = (K_RAW, V_RAW, stride_rb): the cache tensors themselves, also on the TMA path, and
    their batch or page stride (num_pages their page count when paged); LINE_ELEMS elements per 128-byte line,
    NUM_LINES lines (a power of two) per head-dim row. Only a hint: the data is read again after the wait.
    OFFS_32: every element offset into K / V (pointer path) is < 2**31, so the gathers' address math stays 32-bit.
    SPEC_PAGES (paged with PRELOAD_PAGES, not DEVICE_SPLITS; pays with PDL_WAIT): the split's page ids are read
    beside its length instead of after it, for the range the length read before gdc_wait gives; kept when the
    length read after the wait gives the same pages, else read again (one L2 round trip less at the ramp).
    DEVICE_SPLITS (given, not FINAL): grid (programs, 1, 1) instead, program p runs work
    item p of the split counts chosen on the device from all ``batch`` lengths (planned_item; KV_PROGRAMS = kv
    heads x NUM_M_BLOCKS programs per split: each sequence's share of SPLIT_SLOTS items, at most NUM_SPLITS, at
    least cdiv(len, MAX_SPLIT_KEYS) when MAX_SPLIT_KEYS > 0); programs past the last item exit. The prefetch places
    the item with the lengths read before the wait (a hint), the work with those read after it. A sequence's split
    0 also writes lse -inf into the partial slots its sequence does not use, so the merge over NUM_SPLITS slots
    sees them as empty.
    ALIBI: alibi = (ALIBI_SLOPES, stride_alibi): fp32 slopes per (sequence, query head) through (batch stride, head
    stride) (batch stride 0 for (nheads,) slopes): the bias -slope * |qpos - key| (score.alibi_slope_log2).
    KV_QUANT > 0: kv_scales = (K_SCALE, V_SCALE, scale strides) of an 8-bit cache (attend_split);
    QUANT_TILES: _attend_blocks'.
    MERGE (with DEVICE_SPLITS; kernels/decode_args.MergeTile): no merge kernel follows. final = (O_FINAL, LSE_FINAL,
    TICKETS, (stride_f, stride_fl)) as the persistent kernel takes them: a sequence the device gave one split writes
    its result there directly (an empty sequence (0, -inf)); the splits of a longer one store their partials, draw
    a ticket of their (sequence, kv head, row block) and the last of them merges (_merge_if_last_ticket); no split
    returns early, and no slot past a sequence's splits is read, so none is marked.
    """
    SEQLEN_Q: tl.constexpr = ROWS.seqlen_q
    GROUP: tl.constexpr = ROWS.group
    NUM_M_BLOCKS: tl.constexpr = ROWS.num_m_blocks
    BLOCK_M: tl.constexpr = TILE.block_m
    BLOCK_N: tl.constexpr = TILE.block_n
    BLOCK_D: tl.constexpr = TILE.block_d
    NUM_SPLITS: tl.constexpr = SPLITS.num_splits
    MIN_CHUNK: tl.constexpr = SPLITS.min_chunk
    MERGE_SPLITS: tl.constexpr = SPLITS.merge_splits
    SPLIT_KEYS: tl.constexpr = SPLITS.split_keys
    PAGE_SIZE: tl.constexpr = PAGES.page_size
    PRELOAD_PAGES: tl.constexpr = PAGES.preload
    USE_PDL: tl.constexpr = PDL.launch_dependents
    PDL_WAIT: tl.constexpr = PDL.wait
    PREFETCH_KEYS: tl.constexpr = PREFETCH.keys
    DEVICE: tl.constexpr = DEVICE_SPLITS is not None  # split counts chosen on the device, one program per item
    IN_KERNEL_MERGE: tl.constexpr = DEVICE and MERGE is not None
    stride_qb, stride_qt, stride_qh, stride_qd = stride_q
    stride_kb, stride_kt, stride_kh = stride_k
    stride_ob, stride_ot, stride_oh, stride_os, stride_od = stride_o
    stride_lb, stride_lt, stride_lh, stride_ls = stride_l
    # SPEC_PAGES: the split's page ids are read right after the wait, beside its length, from the range the
    # pre-wait length gives; the read after the wait decides whether that guess holds (see attend_split)
    SPEC: tl.constexpr = SPEC_PAGES and PAGE_SIZE > 0 and PRELOAD_PAGES > 0 and not DEVICE
    stale_start = 0
    stale_end = 0
    if DEVICE:
        split = 0
        pid_hm = 0
        b = 0
        num_splits = 1
        if PREFETCH_KEYS > 0:  # the item as the (possibly stale) lengths place it: a hint only, as below
            b, pid_hm, split, num_splits, stale_len = planned_item(SEQLENS, tl.program_id(0), batch, capacity,
                                                                    DEVICE_SPLITS, NUM_SPLITS, MIN_CHUNK, ".cg")
            stale_start, stale_end = split_range(stale_len, split, window_left, SEQLEN_Q, num_splits, BLOCK_N,
                                                 MIN_CHUNK, WINDOW)  # empty past the last item (length 0)
    else:
        split = tl.program_id(0)
        pid_hm = tl.program_id(1)
        b = tl.program_id(2)
        num_splits = NUM_SPLITS
        if PREFETCH_KEYS > 0 or SPEC:
            stale_start, stale_end = stale_split_range(SEQLENS, b, split, num_splits, capacity, window_left,
                                                        SEQLEN_Q, BLOCK_N, MIN_CHUNK, WINDOW, SPLIT_KEYS)
    if PREFETCH_KEYS > 0:
        K_RAW, V_RAW, stride_rb = kv_raw
        prefetch_split_head(K_RAW, V_RAW, BLOCK_TABLE + b.to(tl.int64) * stride_btb, b, pid_hm // NUM_M_BLOCKS,
                             stale_start, stale_end, num_pages, stride_rb, stride_kt, stride_kh, PAGE_SIZE,
                             HEADDIM, PREFETCH_KEYS, PREFETCH.line_elems, PREFETCH.num_lines)
    if PDL_WAIT:  # no memory read before this line but hints: the previous kernel may still write q, K/V, lengths
        gdc_wait()
    if USE_PDL:
        gdc_launch_dependents()
    if DEVICE:  # the item again, from the lengths as the previous kernel left them
        b, pid_hm, split, num_splits, seqlen = planned_item(SEQLENS, tl.program_id(0), batch, capacity,
                                                             DEVICE_SPLITS, NUM_SPLITS, MIN_CHUNK, "")
        if b >= batch:  # past the last work item
            return
    hk = pid_hm // NUM_M_BLOCKS
    m_block = pid_hm % NUM_M_BLOCKS
    bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_btb

    t, head, row_ok = group_rows(m_block, hk, BLOCK_M, BLOCK_M, GROUP, SEQLEN_Q)
    # q before the length: its address does not depend on it, so both loads are in flight together (issued after
    # the length, behind the empty-split branch, q's round trip delayed the first K/V loads)
    q = _load_q(Q, b, t, head, row_ok, stride_qb, stride_qt, stride_qh, stride_qd, HEADDIM, BLOCK_D)
    alibi_log2 = alibi_slope_log2(alibi, b, head, ALIBI, row_ok)
    spec_pages = 0
    if SPEC:  # after the wait (the ids are current), before the length (their read overlaps its round trip)
        spec_pages = split_page_ids(bt_row, stale_start, stale_end, PAGE_SIZE, PRELOAD_PAGES)
    if not DEVICE:  # (the device-split path read every length already)
        seqlen = tl.maximum(tl.minimum(tl.load(SEQLENS + b), capacity), 0)
    start, end = split_range(seqlen, split, window_left, SEQLEN_Q, num_splits, BLOCK_N, MIN_CHUNK, WINDOW,
                             SPLIT_KEYS)

    o_rows = b.to(tl.int64) * stride_ob + t * stride_ot + head * stride_oh + split * stride_os
    lse_rows = LSE + b.to(tl.int64) * stride_lb + t * stride_lt + head * stride_lh
    lse_ptrs = lse_rows + split * stride_ls
    if DEVICE and not IN_KERNEL_MERGE:
        if split == 0:  # the slots this sequence does not use must read as empty states in the merge
            unused = tl.arange(0, MERGE_SPLITS)
            tl.store(lse_rows[:, None] + unused[None, :] * stride_ls, tl.full([BLOCK_M, MERGE_SPLITS],
                     float("-inf"), tl.float32),
                     mask=row_ok[:, None] & ((unused >= num_splits) & (unused < NUM_SPLITS))[None, :])
    if not FINAL and not IN_KERNEL_MERGE:
        if start >= end:  # an empty split: the merge must see (-, -inf); its partial output is never read
            tl.store(lse_ptrs, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            return

    o, lse2 = attend_split(q, K, V, bt_row, b, hk, t, seqlen, start, end, window_left, scales, num_pages, stride_k,
                            HEADDIM, TILE, PAGES, SEQLEN_Q, SOFTCAP, WINDOW, DOT_PRECISION, USE_TMA, OFFS_32,
                            spec_pages, stale_start, stale_end, SPEC, alibi_log2, ALIBI, kv_scales, KV_QUANT,
                            QUANT_TILES)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEADDIM
    o_ptrs = O + o_rows[:, None] + offs_d[None, :] * stride_od
    if FINAL:
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptrs, lse2 * LN2, mask=row_ok)
    elif IN_KERNEL_MERGE:
        O_FINAL, LSE_FINAL, TICKETS, stride_final = final
        finish_split(O, LSE, O_FINAL, LSE_FINAL, TICKETS + b * DEVICE_SPLITS.kv_programs + pid_hm, o, lse2, b,
                      hk, m_block, split, t, head, row_ok, offs_d, d_ok, num_splits, stride_o, stride_l,
                      stride_final, GROUP, SEQLEN_Q, HEADDIM, TILE, SPLITS, MERGE)
    else:
        tl.store(o_ptrs, o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptrs, lse2, mask=row_ok)


@triton.jit
def _load_q(Q, b, t, head, row_ok, stride_qb, stride_qt, stride_qh, stride_qd, HEADDIM: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """(ROWS, BLOCK_D) query rows (t, head, row_ok: (ROWS,)) of sequence b; missing rows and columns load as 0."""
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b.to(tl.int64) * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh \
        + offs_d[None, :] * stride_qd
    return tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d < HEADDIM)[None, :], other=0.0)


@triton.jit
def decode_persistent_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, O, LSE, O_FINAL, LSE_FINAL, TICKETS, QUEUE,
    batch, scales, window_left, capacity,
    stride_q, stride_k, stride_btb, stride_o, stride_l, stride_final,
    ROWS: tl.constexpr, HEADDIM: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, PAGES: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    PDL: tl.constexpr, SCHEDULE: tl.constexpr, MERGE: tl.constexpr, OFFS_32: tl.constexpr = False, num_pages=1,
    alibi=None, ALIBI: tl.constexpr = False, kv_scales=None, KV_QUANT: tl.constexpr = 0,
    QUANT_TILES: tl.constexpr = QUANT_TILES_OFF,
):
    """All of Flash-Decoding in one launch, with the split count chosen on the device (config PERSISTENT).

    Grid (programs,): a fixed number of programs (CUDA-graph friendly) loops over work items (sequence b, kv head x
    row block, split s). Each program runs the consecutive items whose midpoints fall in its equal share of all
    items' keys (items_before): one long item per program, or many short ones together, so that a long sequence's
    splits and the short sequences never pile up on the same programs (the round-robin order they had before ran
    one long and one short item on 100 of 132 programs for one 128k sequence among 15 of 1k). Every program derives
    the same per-sequence split counts from the live lengths (device_split_counts), so a uniform batch runs one
    split per sequence, while one long sequence among short ones still gets many splits - without the plan paying
    for the worst mix up front (balance_mixed). A sequence with one split writes its final output directly; the
    splits of a longer one write fp32 partials and draw tickets, and the last of them merges
    (_merge_if_last_ticket), so no merge kernel follows.

    Arguments as decode_split_kernel, plus the in-kernel merge's: O (batch, SEQLEN_Q, nheads, NUM_SPLITS,
    HEADDIM) fp32 and LSE (..., NUM_SPLITS) log2 partials, O_FINAL like Q, LSE_FINAL (batch, SEQLEN_Q, nheads) fp32
    natural log (stride_final: their strides, (stride_f, stride_fl)), TICKETS int32 (batch * NHEADS_KV *
    NUM_M_BLOCKS,) zeros at rest, MERGE (MERGE_M, MERGE_BLOCK_S of _merge_if_last_ticket); plus ``batch``
    (sequences to serve, <= BATCH_PAD) and SCHEDULE (kernels/decode_args.WorkSchedule: NHEADS_KV, BATCH_PAD,
    MAX_SPLIT_KEYS, DYNAMIC and the queue's SLOTS_PER_PROGRAM, QUEUE_SPLITS, QUEUE_FULL_FRACTION,
    QUEUE_SPLIT_COST). PRELOAD_PAGES must bound the pages of any split: of a whole sequence (the launcher
    derives it from one split per sequence), or of a split of at most MAX_SPLIT_KEYS keys (pages smaller than a
    block, whose per-key ids are gathered from the preload: long sequences then take more splits). PDL: let
    the next kernel (a programmatic dependent that waits on the device, e.g. the next call's stage 1) launch early;
    wait for the previous one.

    DYNAMIC (for more (sequence, kv head) pairs than programs): instead of the static shares, programs take the
    next work item from QUEUE[0] (an int32 counter, zero at rest, as QUEUE[1]) until none is left, so that items
    of unequal cost balance like the split grid's programs do under the hardware scheduler; the split counts then
    divide SLOTS_PER_PROGRAM x programs slots and, with QUEUE_SPLITS, split equal lengths where the last round
    would idle the bandwidth (device_split_counts), so that a batch just above the program count (e.g. 136 pairs
    on 132 programs) still ends together. The last program to finish (QUEUE[1]) resets both.
    """
    DYNAMIC: tl.constexpr = SCHEDULE.dynamic
    stride_qb, stride_qt, stride_qh, stride_qd = stride_q
    if PDL.wait:
        gdc_wait()
    if PDL.launch_dependents:
        gdc_launch_dependents()
    KVP: tl.constexpr = SCHEDULE.nheads_kv * ROWS.num_m_blocks
    offs_b = tl.arange(0, SCHEDULE.batch_pad)
    in_batch = offs_b < batch
    lens = tl.maximum(tl.minimum(tl.load(SEQLENS + offs_b, mask=in_batch, other=0), capacity), 0)
    programs = tl.num_programs(0)
    splits_b = device_split_counts(lens, in_batch, programs * SCHEDULE.slots_per_program, programs, KVP,
                                    SPLITS.num_splits, SPLITS.min_chunk, SCHEDULE.max_split_keys,
                                    SCHEDULE.queue_splits, SCHEDULE.queue_full_fraction, SCHEDULE.queue_split_cost)
    items_b = tl.where(in_batch, splits_b * KVP, 0)
    items_end = tl.cumsum(items_b, 0)  # work items of sequences 0..b
    offs_d = tl.arange(0, TILE.block_d)
    d_ok = offs_d < HEADDIM
    if DYNAMIC:
        w = tl.atomic_add(QUEUE, 1, sem="relaxed", scope="gpu")
        stop = tl.sum(items_b, 0)
    else:
        pid = tl.program_id(0)
        w = items_before(pid, lens, in_batch, splits_b, programs, KVP).to(tl.int32)
        stop = items_before(pid + 1, lens, in_batch, splits_b, programs, KVP).to(tl.int32)
    while w < stop:
        b, pid_hm, split, num_splits, seqlen = item_of(w, offs_b, lens, splits_b, items_b, items_end)
        hk = pid_hm // ROWS.num_m_blocks
        m_block = pid_hm % ROWS.num_m_blocks
        start, end = split_range(seqlen, split, window_left, ROWS.seqlen_q, num_splits, TILE.block_n,
                                 SPLITS.min_chunk, WINDOW)
        t, head, row_ok = group_rows(m_block, hk, TILE.block_m, TILE.block_m, ROWS.group, ROWS.seqlen_q)
        # (an empty split - only possible where MIN_CHUNK rounds the chunks up - runs empty KV loops and stores
        # (0, -inf): it still draws its ticket)
        bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_btb
        q = _load_q(Q, b, t, head, row_ok, stride_qb, stride_qt, stride_qh, stride_qd, HEADDIM, TILE.block_d)
        alibi_log2 = alibi_slope_log2(alibi, b, head, ALIBI, row_ok)
        o, lse2 = attend_split(q, K, V, bt_row, b, hk, t, seqlen, start, end, window_left, scales, num_pages,
                                stride_k, HEADDIM, TILE, PAGES, ROWS.seqlen_q, SOFTCAP, WINDOW, DOT_PRECISION, USE_TMA,
                                OFFS_32, 0, 0, 0, False, alibi_log2, ALIBI, kv_scales, KV_QUANT,
                                QUANT_TILES)
        finish_split(O, LSE, O_FINAL, LSE_FINAL, TICKETS + b * KVP + pid_hm, o, lse2, b, hk, m_block, split, t,
                      head, row_ok, offs_d, d_ok, num_splits, stride_o, stride_l, stride_final, ROWS.group,
                      ROWS.seqlen_q, HEADDIM, TILE, SPLITS, MERGE)
        if DYNAMIC:
            w = tl.atomic_add(QUEUE, 1, sem="relaxed", scope="gpu")
        else:
            w += 1
    if DYNAMIC:
        # acq_rel: this program's last queue draw precedes its count here, and the last program sees them all
        # before it resets the queue for the next launch (which waits for this one to finish)
        done = tl.atomic_add(QUEUE + 1, 1, sem="acq_rel", scope="gpu")
        if done == programs - 1:
            tl.atomic_xchg(QUEUE, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(QUEUE + 1, 0, sem="relaxed", scope="gpu")
