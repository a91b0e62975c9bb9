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
the K/V fetches (page gathers, tile loads, L2 prefetch) kernels.decode_gather; this module holds the attention
bodies and the two kernels.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashdecode.kernels.decode_args import PREFETCH_OFF, QUANT_TILES_OFF
from flashdecode.kernels.decode_gather import (block_page, block_token_pages, ids_in_loop_ok, kv_rows,  # noqa: F401
                                               load_kv_tile, prefetch_l2, prefetch_split_head, split_page_ids,
                                               tma_row)
from flashdecode.kernels.decode_schedule import (device_split_counts, item_of, items_before,  # noqa: F401
                                                 planned_item, queue_split_ways, split_range, stale_split_range)
from flashdecode.kernels.dot import dot
from flashdecode.kernels.kv_quant import CONVERT_BITS_ASM, key_scales, keys_operand, keys_tile, to_dot_dtype
from flashdecode.kernels.softmax_state import (LN2, LOG2E, fold_live_states, normalize_state, online_softmax_step,
                                               online_softmax_step_sum_tile, safe_max)


@triton.jit
def _logits_log2(qk, score_scale, softcap_out, SOFTCAP: tl.constexpr):
    """Scores of q.k in log2 units (any shape): qk * score_scale, or with SOFTCAP softcap * tanh(qk * scale /
    softcap) * log2(e) (score_scale: tanh's argument scale, softcap_out: the softcap in log2 units)."""
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (1 + e^(2x)); exp2 overflow to inf gives exactly 1, so no NaN for any logit.
        return (1.0 - 2.0 / (1.0 + tl.exp2(qk * (score_scale * 2.0 * LOG2E)))) * softcap_out
    return qk * score_scale


@triton.jit
def _attend_blocks(acc, m_i, l_i, q, k_src, v_src, bt_row, lo, hi, end, qpos, window_left,
                   score_scale, softcap_out, num_pages, stride_page, stride_tok, tma_row_base, tma_col, split_pages,
                   first_page,
                   HEADDIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   MASKED: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, PRELOAD_PAGES: tl.constexpr,
                   OFFS_32: tl.constexpr, alibi_log2=0.0, ALIBI: tl.constexpr = False, kv_quant=None,
                   KV_QUANT: tl.constexpr = 0, QUANT_TILES: tl.constexpr = QUANT_TILES_OFF,
                   SUM_TILE: tl.constexpr = False):
    """The KV loop over keys [lo, hi) in BLOCK_N steps: takes and returns the running state (acc, m_i, l_i).
    SUM_TILE: l_i is a (BLOCK_M, BLOCK_N) tile of per-column row sums (online_softmax_step_sum_tile), summed by the
    caller after the last loop.

    k_src/v_src: base pointers of this sequence/kv head (pointer path), or TMA descriptors over the cache viewed
    as (tokens, nheads_kv * headdim) (USE_TMA: contiguous, or pages that are multiples of BLOCK_N).
    Scores are in log2 units: s = qk * scale * log2(e), or softcap * tanh(qk * scale / softcap) * log2(e).
    MASKED applies the split end, the causal bound of each row and the window; unmasked calls must only cover
    blocks that every row sees entirely. Paged: keys whose page id lies outside [0, num_pages) are absent (no
    memory read outside the cache, score -inf: they contribute nothing).
    ALIBI: alibi_log2 (BLOCK_M,) fp32 is each row's ALiBi slope times log2(e); the bias -slope * |qpos - key| joins
    the scores after the softcap (flash-attn's order).
    KV_QUANT (kernels/kv_quant.py; pointer path only): an 8-bit cache whose tiles are converted to a 16-bit dtype
    for the dots, the scores scaled by each key's k scale and the probabilities by each key's v scale; kv_quant =
    (k_scale, v_scale, stride_spage, stride_stok, q_k, q_unscale): the scale pointers (KV_QUANT 2, key offsets with
    the scale strides stride_spage / stride_stok) or scalars (1), and the QK^T operand with its score scale
    (kv_quant.keys_operand; the V tile goes to q's dtype).
    Order on the scores: q.k, the k scale, the logit scale / softcap, the ALiBi bias, the masks.
    QUANT_TILES (decode_args.QuantTiles): v_first / k_first (GPU): the 8-bit V / K tile converted before its layout
    change to the mma operand (kv_quant.to_dot_dtype, keys_tile); convert: how e4m3 tiles become 16-bit (kv_quant's
    module doc).
    """
    if KV_QUANT > 0:
        k_scale, v_scale, stride_spage, stride_stok, q_k, q_unscale = kv_quant
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if USE_TMA:
            row0, key_ok = tma_row(bt_row, start_n, tma_row_base, split_pages, first_page, num_pages, PAGE_SIZE,
                                    PRELOAD_PAGES)  # (key_ok: one flag for the block's page)
            k = k_src.load([row0, tma_col])
        else:
            rows, key_ok = kv_rows(bt_row, start_n, offs_n, end, num_pages, stride_page, stride_tok, split_pages,
                                    first_page, PAGE_SIZE, BLOCK_N, MASKED, PRELOAD_PAGES, OFFS_32)
            k = load_kv_tile(k_src, rows, offs_d, offs_n, end, key_ok, HEADDIM, BLOCK_D, MASKED, PAGE_SIZE > 0)
        if KV_QUANT > 0:
            srows = rows
            if KV_QUANT == 2:
                srows, _ = kv_rows(bt_row, start_n, offs_n, end, num_pages, stride_spage, stride_stok,
                                    split_pages, first_page, PAGE_SIZE, BLOCK_N, MASKED, PRELOAD_PAGES, OFFS_32)
            elif KV_QUANT == 3:  # scales laid out like the cache without its head dim: no second page lookup
                srows = rows // HEADDIM
            ks, vs = key_scales(k_scale, v_scale, srows, key_ok, offs_n, end, MASKED, PAGE_SIZE > 0, KV_QUANT)
            k = keys_tile(k, q_k.dtype, QUANT_TILES.convert, QUANT_TILES.k_first)
            qk = dot(q_k, tl.trans(k), input_precision=DOT_PRECISION) * ks[None, :] * q_unscale
        else:
            qk = dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = _logits_log2(qk, score_scale, softcap_out, SOFTCAP)
        if ALIBI:
            s -= alibi_log2[:, None] * tl.abs(qpos[:, None] - offs_n[None, :]).to(tl.float32)
        if MASKED:
            visible = (offs_n[None, :] <= qpos[:, None]) & (offs_n < end)[None, :]
            if WINDOW:
                visible = visible & (offs_n[None, :] >= qpos[:, None] - window_left)
            s = tl.where(visible, s, float("-inf"))
        if PAGE_SIZE > 0:
            # keys of absent pages (ids outside [0, num_pages); their loads zero-filled) masked by the ids, never
            # by testing the scores for NaN: a NaN in q, a live key or a scale must reach the rows that read it
            score_ok = key_ok
            if PRELOAD_PAGES == 0:  # ids read in the loop: the mask's own read of them (ids_in_loop_ok)
                score_ok = ids_in_loop_ok(bt_row, start_n, offs_n, end, num_pages, PAGE_SIZE, BLOCK_N, MASKED)
            if USE_TMA or (PRELOAD_PAGES == 0 and PAGE_SIZE % BLOCK_N == 0):  # one flag for the block's page
                s = tl.where(score_ok, s, float("-inf"))
            else:
                s = tl.where(score_ok[None, :], s, float("-inf"))
        if SUM_TILE:
            p, alpha, m_i, l_i = online_softmax_step_sum_tile(m_i, l_i, s)
        else:
            p, alpha, m_i, l_i = online_softmax_step(m_i, l_i, s)
        if USE_TMA:
            v = v_src.load([row0, tma_col])
            if MASKED:  # TMA reads whole blocks: slots past the end may hold garbage, and 0 * NaN = NaN
                v = tl.where((offs_n < end)[:, None], v, 0.0)
        else:
            v = load_kv_tile(v_src, rows, offs_d, offs_n, end, key_ok, HEADDIM, BLOCK_D, MASKED, PAGE_SIZE > 0)
        if KV_QUANT > 0:
            p = p * vs[None, :]
            v = to_dot_dtype(v, q.dtype, QUANT_TILES.v_first, QUANT_TILES.convert)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _warp_kv_rows(bt_row, start_n, offs_n, end, num_pages, stride_page, stride_tok, split_pages, first_page,
                  PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRELOAD_PAGES: tl.constexpr,
                  OFFS_32: tl.constexpr):
    """decode_gather.kv_rows for the (WARPS, BLOCK_N // WARPS) keys ``offs_n`` of a warp-split block: element
    offsets and key_ok of the same shape. Pages smaller than a block read their keys' ids from the block table in
    the loop even where the split preloaded them: picking them from the preload is a gather along the whole block,
    which in the warps' 2-D layout compiled (sm_90) to thousands of spilling instructions per block."""
    preload: tl.constexpr = PRELOAD_PAGES if PAGE_SIZE % BLOCK_N == 0 else 0
    return kv_rows(bt_row, start_n, offs_n, end, num_pages, stride_page, stride_tok, split_pages, first_page,
                   PAGE_SIZE, BLOCK_N, MASKED, preload, OFFS_32)


@triton.jit
def _load_warp_tile(ptr_base, rows, key_ok, offs_n, end, offs_d, HEADDIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    MASKED: tl.constexpr, PAGED: tl.constexpr):
    """(WARPS, KW, BLOCK_D) 8-bit K or V tile of a warp-split block (rows, key_ok, offs_n: (WARPS, KW)); keys past
    ``end`` (MASKED), keys of absent pages (PAGED) and padded head-dim columns load as 0."""
    ptrs = ptr_base + rows[:, :, None] + offs_d[None, None, :]
    ok = offs_d[None, None, :] < HEADDIM
    if PAGED:
        ok = ok & key_ok[:, :, None]
    if MASKED:
        ok = ok & (offs_n < end)[:, :, None]
    if PAGED or MASKED or BLOCK_D != HEADDIM:
        return tl.load(ptrs, mask=ok, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _attend_blocks_warps(acc, m_i, l_i, q3, k_src, v_src, bt_row, lo, hi, end, qpos, window_left, score_scale,
                         softcap_out, num_pages, stride_page, stride_tok, split_pages, first_page, kv_quant,
                         dot_dtype: tl.constexpr, HEADDIM: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, WARPS: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
                         SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         PRELOAD_PAGES: tl.constexpr, OFFS_32: tl.constexpr, alibi_log2, ALIBI: tl.constexpr,
                         KV_QUANT: tl.constexpr, QUANT_TILES: tl.constexpr, SUM_TILE: tl.constexpr):
    """_attend_blocks for an 8-bit cache with the keys of each block split across the WARPS warps (TILE.warps):
    warp w owns keys [w * KW, (w + 1) * KW) of every BLOCK_N-key block (KW = BLOCK_N // WARPS) and keeps its own
    softmax state: m_i (WARPS, BLOCK_M), l_i (WARPS, BLOCK_M) or with SUM_TILE (WARPS, BLOCK_M, KW), acc (WARPS,
    BLOCK_M, BLOCK_D) fp32. The dots are batched over the warps (q3: q's QK^T operand, (WARPS, BLOCK_M, BLOCK_D);
    Triton lays the batch dim out across the warps), so the row max and sum never leave a warp and P stays in
    registers between the two dots: 2 CTA barriers per block where the shared loop takes 5 (sm_90 SASS; the cost is
    a whole accumulator per warp). _merge_warp_states folds the warps' states after the last loop. Arguments
    otherwise as _attend_blocks (dot_dtype: q's, the PV dot's); the pointer path only (no TMA)."""
    k_scale, v_scale, stride_spage, stride_stok, q_k, q_unscale = kv_quant
    KW: tl.constexpr = BLOCK_N // WARPS
    w_keys = tl.arange(0, WARPS)[:, None] * KW + tl.arange(0, KW)[None, :]
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + w_keys  # (WARPS, KW)
        rows, key_ok = _warp_kv_rows(bt_row, start_n, offs_n, end, num_pages, stride_page, stride_tok, split_pages,
                                     first_page, PAGE_SIZE, BLOCK_N, MASKED, PRELOAD_PAGES, OFFS_32)
        k = _load_warp_tile(k_src, rows, key_ok, offs_n, end, offs_d, HEADDIM, BLOCK_D, MASKED, PAGE_SIZE > 0)
        srows = rows
        if KV_QUANT == 2:
            srows, _ = _warp_kv_rows(bt_row, start_n, offs_n, end, num_pages, stride_spage, stride_stok,
                                     split_pages, first_page, PAGE_SIZE, BLOCK_N, MASKED, PRELOAD_PAGES, OFFS_32)
        elif KV_QUANT == 3:
            srows = rows // HEADDIM
        ks, vs = key_scales(k_scale, v_scale, srows, key_ok, offs_n, end, MASKED, PAGE_SIZE > 0, KV_QUANT)
        k = keys_tile(k, q_k.dtype, QUANT_TILES.convert, QUANT_TILES.k_first)
        qk = dot(q3, tl.permute(k, (0, 2, 1)), input_precision=DOT_PRECISION) * ks[:, None, :] * q_unscale
        s = _logits_log2(qk, score_scale, softcap_out, SOFTCAP)
        keys3 = offs_n[:, None, :]
        if ALIBI:
            s -= alibi_log2[None, :, None] * tl.abs(qpos[None, :, None] - keys3).to(tl.float32)
        if MASKED:
            visible = (keys3 <= qpos[None, :, None]) & (keys3 < end)
            if WINDOW:
                visible = visible & (keys3 >= qpos[None, :, None] - window_left)
            s = tl.where(visible, s, float("-inf"))
        if PAGE_SIZE > 0:  # absent pages, masked by their ids (as _attend_blocks)
            s = tl.where(key_ok[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        shift = safe_max(m_new)
        alpha = tl.exp2(m_i - shift)
        p = tl.exp2(s - shift[:, :, None])
        if SUM_TILE:
            l_i = l_i * alpha[:, :, None] + p
        else:
            l_i = l_i * alpha + tl.sum(p, 2)
        m_i = m_new
        v = _load_warp_tile(v_src, rows, key_ok, offs_n, end, offs_d, HEADDIM, BLOCK_D, MASKED, PAGE_SIZE > 0)
        v = to_dot_dtype(v, dot_dtype, QUANT_TILES.v_first, QUANT_TILES.convert)
        p = p * vs[:, None, :]
        acc = acc * alpha[:, :, None] + dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _merge_warp_states(acc, m_i, l_i, SUM_TILE: tl.constexpr):
    """The warps' running states of _attend_blocks_warps folded into one normalised state (o (BLOCK_M, BLOCK_D)
    fp32, lse2 (BLOCK_M,) log2; (0, -inf) for a row no warp saw a key of): weights 2^(m_w - m), 0 for an empty
    warp."""
    if SUM_TILE:
        l_i = tl.sum(l_i, 2)
    m = tl.max(m_i, 0)
    weight = tl.exp2(m_i - safe_max(m)[None, :])
    return normalize_state(tl.sum(acc * weight[:, :, None], 0), m, tl.sum(l_i * weight, 0))


@triton.jit
def _group_rows(m_block, hk, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
                SEQLEN_Q: tl.constexpr):
    """The first ROWS query rows of row block ``m_block`` of kv head ``hk``: (t, head, ok), each (ROWS,).
    Row r = t * GROUP + g serves query head hk * GROUP + g of new token t; ok marks rows that exist."""
    rows = m_block * BLOCK_M + tl.arange(0, ROWS)
    return rows // GROUP, hk * GROUP + rows % GROUP, rows < GROUP * SEQLEN_Q


@triton.jit
def _store_final(O_FINAL, LSE_FINAL, o, lse2, b, t, head, row_ok, offs_d, d_ok,
                 stride_fb, stride_ft, stride_fh, stride_fd, stride_flb, stride_flt, stride_flh):
    """Write a finished state of the rows (t, head, row_ok: (ROWS,)) of sequence b: o (ROWS, BLOCK_D) fp32 into
    O_FINAL in its dtype, lse2 (ROWS,) log2 into LSE_FINAL as natural log."""
    o_final = O_FINAL + b.to(tl.int64) * stride_fb + t * stride_ft + head * stride_fh
    tl.store(o_final[:, None] + offs_d[None, :] * stride_fd, o.to(O_FINAL.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE_FINAL + b.to(tl.int64) * stride_flb + t * stride_flt + head * stride_flh, lse2 * LN2, mask=row_ok)


@triton.jit
def _merge_if_last_ticket(O, LSE, O_FINAL, LSE_FINAL, ticket_ptr, count, b, hk, m_block,
                          stride_ob, stride_ot, stride_oh, stride_os, stride_od,
                          stride_lb, stride_lt, stride_lh, stride_ls,
                          stride_fb, stride_ft, stride_fh, stride_fd,
                          stride_flb, stride_flt, stride_flh,
                          GROUP: tl.constexpr, SEQLEN_Q: tl.constexpr, HEADDIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          MERGE_M: tl.constexpr, MERGE_SPLITS: tl.constexpr, MERGE_BLOCK_S: tl.constexpr):
    """The in-kernel merge's epilogue (the persistent kernel; decode_split_kernel with MERGE, via _finish_split), run
    by every split of a sequence after it stored its partial (o, lse2) rows: the split that draws the last ticket
    merges (no merge kernel follows).

    ticket_ptr: this (batch, kv head, row block)'s int32 counter, 0 on entry of the launch; ``count``: the splits
    that draw a ticket and whose states are merged (slots 0 .. count - 1, count <= NUM_SPLITS). The merging program
    works on the MERGE_M (the real rows, padded to a power of two, <= BLOCK_M) rows only, not on the MMA padding,
    and folds the splits' states with softmax_state.fold_live_states (MERGE_SPLITS = NUM_SPLITS padded to a power
    of two, MERGE_BLOCK_S splits a step; an unrolled loop over 1-split steps ran 64 round trips in a row: 28.9 us
    for 4k keys in 64 splits on the H100).
    """
    # All threads' partial stores must precede the release: the barrier orders them before the one thread that
    # performs the atomic, whose acq_rel (release, cumulative) then publishes them at GPU scope.
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == count - 1:  # every other split has published its partial: merge them (acquire side)
        t, head, row_ok = _group_rows(m_block, hk, MERGE_M, BLOCK_M, GROUP, SEQLEN_Q)
        lse_rows = LSE + b.to(tl.int64) * stride_lb + t * stride_lt + head * stride_lh
        o_rows = O + b.to(tl.int64) * stride_ob + t * stride_ot + head * stride_oh
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEADDIM
        # .cg: read other programs' partials from L2, never from a (non-coherent) L1 line
        acc, shift, total = fold_live_states(o_rows, lse_rows, offs_d, d_ok, row_ok, count, stride_os, stride_od,
                                             stride_ls, MERGE_M, MERGE_BLOCK_S, BLOCK_D, MERGE_SPLITS, True, ".cg",
                                             False)
        o, lse2 = normalize_state(acc, shift, total)
        _store_final(O_FINAL, LSE_FINAL, o, lse2, b, t, head, row_ok, offs_d, d_ok,
                     stride_fb, stride_ft, stride_fh, stride_fd, stride_flb, stride_flt, stride_flh)
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")  # all tickets drawn: ready for the next launch


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
    stride) (batch stride 0 for (nheads,) slopes): the bias -slope * |qpos - key| (_alibi_log2).
    KV_QUANT > 0: kv_scales = (K_SCALE, V_SCALE, scale strides) of an 8-bit cache (_attend_split);
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
    # pre-wait length gives; the read after the wait decides whether that guess holds (see _attend_split)
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

    t, head, row_ok = _group_rows(m_block, hk, BLOCK_M, BLOCK_M, GROUP, SEQLEN_Q)
    # q before the length: its address does not depend on it, so both loads are in flight together (issued after
    # the length, behind the empty-split branch, q's round trip delayed the first K/V loads)
    q = _load_q(Q, b, t, head, row_ok, stride_qb, stride_qt, stride_qh, stride_qd, HEADDIM, BLOCK_D)
    alibi_log2 = _alibi_log2(alibi, b, head, row_ok, ALIBI)
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

    o, lse2 = _attend_split(q, K, V, bt_row, b, hk, t, seqlen, start, end, window_left, scales, num_pages, stride_k,
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
        _finish_split(O, LSE, O_FINAL, LSE_FINAL, TICKETS + b * DEVICE_SPLITS.kv_programs + pid_hm, o, lse2, b,
                      hk, m_block, split, t, head, row_ok, offs_d, d_ok, num_splits, stride_o, stride_l,
                      stride_final, GROUP, SEQLEN_Q, HEADDIM, TILE, SPLITS, MERGE)
    else:
        tl.store(o_ptrs, o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptrs, lse2, mask=row_ok)


@triton.jit
def _finish_split(O, LSE, O_FINAL, LSE_FINAL, ticket_ptr, o, lse2, b, hk, m_block, split, t, head, row_ok, offs_d,
                  d_ok, num_splits, stride_o, stride_l, stride_final, GROUP: tl.constexpr, SEQLEN_Q: tl.constexpr,
                  HEADDIM: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, MERGE: tl.constexpr):
    """The end of a work item of a launch that merges in-kernel (the persistent kernel; decode_split_kernel with
    MERGE): a sequence with one split writes its state (o (BLOCK_M, BLOCK_D) fp32, lse2 log2) as its result to
    O_FINAL / LSE_FINAL; split ``split`` of a longer one stores its partial in O / LSE and draws a ticket at
    ticket_ptr (its (sequence, kv head, row block)'s counter), the last split merging them all."""
    stride_f, stride_fl = stride_final
    stride_fb, stride_ft, stride_fh, stride_fd = stride_f
    stride_flb, stride_flt, stride_flh = stride_fl
    stride_ob, stride_ot, stride_oh, stride_os, stride_od = stride_o
    stride_lb, stride_lt, stride_lh, stride_ls = stride_l
    if num_splits == 1:
        _store_final(O_FINAL, LSE_FINAL, o, lse2, b, t, head, row_ok, offs_d, d_ok,
                     stride_fb, stride_ft, stride_fh, stride_fd, stride_flb, stride_flt, stride_flh)
    else:
        o_rows = O + b.to(tl.int64) * stride_ob + t * stride_ot + head * stride_oh + split * stride_os
        tl.store(o_rows[:, None] + offs_d[None, :] * stride_od, o, mask=row_ok[:, None] & d_ok[None, :])
        lse_rows = LSE + b.to(tl.int64) * stride_lb + t * stride_lt + head * stride_lh
        tl.store(lse_rows + split * stride_ls, lse2, mask=row_ok)
        _merge_if_last_ticket(O, LSE, O_FINAL, LSE_FINAL, ticket_ptr, num_splits, b, hk, m_block,
                              stride_ob, stride_ot, stride_oh, stride_os, stride_od,
                              stride_lb, stride_lt, stride_lh, stride_ls,
                              stride_fb, stride_ft, stride_fh, stride_fd, stride_flb, stride_flt, stride_flh,
                              GROUP, SEQLEN_Q, HEADDIM, TILE.block_m, TILE.block_d, SPLITS.num_splits,
                              MERGE.rows, SPLITS.merge_splits, MERGE.block_s)


@triton.jit
def _alibi_log2(alibi, b, head, row_ok, ALIBI: tl.constexpr):
    """(ROWS,) ALiBi slopes of the rows' query heads (head: (ROWS,)) of sequence b times log2(e) (the scores are in
    log2 units); 0.0 without ALIBI. alibi: (ALIBI_SLOPES, (batch stride, head stride)) of the fp32 slopes."""
    if ALIBI:
        ALIBI_SLOPES, stride_alibi = alibi
        ptrs = ALIBI_SLOPES + b.to(tl.int64) * stride_alibi[0] + head * stride_alibi[1]
        return tl.load(ptrs, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    else:
        return 0.0


@triton.jit
def _load_q(Q, b, t, head, row_ok, stride_qb, stride_qt, stride_qh, stride_qd, HEADDIM: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """(ROWS, BLOCK_D) query rows (t, head, row_ok: (ROWS,)) of sequence b; missing rows and columns load as 0."""
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b.to(tl.int64) * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh \
        + offs_d[None, :] * stride_qd
    return tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d < HEADDIM)[None, :], other=0.0)


@triton.jit
def _attend_split(q, K, V, bt_row, b, hk, t, seqlen, start, end, window_left, scales, num_pages, stride_k,
                  HEADDIM: tl.constexpr, TILE: tl.constexpr, PAGES: tl.constexpr, SEQLEN_Q: tl.constexpr,
                  SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                  OFFS_32: tl.constexpr, spec_pages=0, spec_start=0, spec_end=0, SPEC_PAGES: tl.constexpr = False,
                  alibi_log2=0.0, ALIBI: tl.constexpr = False, kv_scales=None, KV_QUANT: tl.constexpr = 0,
                  QUANT_TILES: tl.constexpr = QUANT_TILES_OFF):
    """One split of one (sequence b, kv head hk) row block: runs the unmasked then the masked KV loop of the rows'
    q (BLOCK_M, BLOCK_D) (_load_q; rows of new token t: (BLOCK_M,)) over keys [start, end). Returns the
    normalised state (o (BLOCK_M, BLOCK_D) fp32, lse2 (BLOCK_M,) log2; -inf for an empty range). K/V, scales,
    stride_k, TILE and PAGES as in decode_split_kernel (num_pages: the paged cache's page count). SPEC_PAGES:
    spec_pages (PRELOAD_PAGES,) are the page ids of the keys [spec_start, spec_end) (split_page_ids, read
    earlier); used where they cover the same pages as [start, end), else read again. ALIBI: alibi_log2 as in
    _attend_blocks. KV_QUANT: kv_scales = (K_SCALE, V_SCALE, (stride_sb, stride_st, stride_sh)), an 8-bit cache's
    float32 scales (kernels/kv_quant.py), element (sequence or page, token, kv head) at those strides."""
    score_scale, softcap_out = scales
    stride_kb, stride_kt, stride_kh = stride_k
    BLOCK_M: tl.constexpr = TILE.block_m
    BLOCK_N: tl.constexpr = TILE.block_n
    BLOCK_D: tl.constexpr = TILE.block_d
    PAGE_SIZE: tl.constexpr = PAGES.page_size
    PRELOAD_PAGES: tl.constexpr = PAGES.preload
    k_scale = None
    v_scale = None
    stride_sb = 0
    stride_st = 0
    if KV_QUANT > 0:
        K_SCALE, V_SCALE, stride_s = kv_scales
        stride_sb, stride_st, stride_sh = stride_s
        k_scale = K_SCALE
        v_scale = V_SCALE
    if KV_QUANT == 1:  # one scale per kv head: read once per split
        k_scale = tl.load(K_SCALE + hk * stride_sh)
        v_scale = tl.load(V_SCALE + hk * stride_sh)
    elif KV_QUANT >= 2:
        s_off = hk * stride_sh
        if PAGE_SIZE == 0:
            s_off = b.to(tl.int64) * stride_sb + s_off
        k_scale = K_SCALE + s_off
        v_scale = V_SCALE + s_off
    if USE_TMA:
        k_src = K
        v_src = V
        tma_row_base = b * stride_kb  # contiguous: the sequence's first row (stride_kb = max_seqlen there)
    else:
        if PAGE_SIZE == 0:
            kv_off = b.to(tl.int64) * stride_kb + hk * stride_kh
        else:
            kv_off = hk * stride_kh
        k_src = K + kv_off
        v_src = V + kv_off
        tma_row_base = 0
    tma_col = hk * HEADDIM
    first_page = 0
    split_pages = 0
    if PAGE_SIZE > 0 and PRELOAD_PAGES > 0:
        first_page = start // PAGE_SIZE
        if SPEC_PAGES:
            split_pages = spec_pages
            same = ((first_page == spec_start // PAGE_SIZE)
                    & (tl.cdiv(end, PAGE_SIZE) == tl.cdiv(spec_end, PAGE_SIZE)))
            if not same:  # the length changed across the wait (e.g. written by the kernel before): read again
                split_pages = split_page_ids(bt_row, start, end, PAGE_SIZE, PRELOAD_PAGES)
        else:
            split_pages = split_page_ids(bt_row, start, end, PAGE_SIZE, PRELOAD_PAGES)
    qpos = seqlen - SEQLEN_Q + t
    quant = None
    if KV_QUANT > 0:
        q_k = q
        q_unscale = 1.0
        # e4m3 K against fp16 (kv_quant.keys_operand); int8 too where its packed-PTX conversion to fp16 is on (else
        # int8 -> bf16 is a permute, logic ops and a packed subtract, no conversion-unit work)
        k_dtype: tl.constexpr = K.dtype.element_ty
        if k_dtype == tl.float8e4nv or (k_dtype == tl.int8 and QUANT_TILES.convert == CONVERT_BITS_ASM):
            q_k, q_unscale = keys_operand(q, QUANT_TILES.convert, k_dtype)
        quant = (k_scale, v_scale, stride_sb, stride_st, q_k, q_unscale)
    # Keys below seqlen - SEQLEN_Q + 1 are visible to every row (causal bound of row 0): no masks there.
    full_hi = start
    if not WINDOW:
        full_hi = start + tl.maximum(tl.minimum(end, seqlen - SEQLEN_Q + 1) - start, 0) // BLOCK_N * BLOCK_N
    WARPS: tl.constexpr = TILE.warps
    if WARPS > 0:  # an 8-bit cache's keys split across the warps, each with its own state (_attend_blocks_warps)
        o, lse2 = _attend_split_warps(q, quant, k_src, v_src, bt_row, start, full_hi, end, qpos, window_left,
                                      score_scale, softcap_out, num_pages, stride_kb, stride_kt, split_pages,
                                      first_page, HEADDIM, TILE, PAGE_SIZE, SOFTCAP, WINDOW, DOT_PRECISION,
                                      PRELOAD_PAGES, OFFS_32, alibi_log2, ALIBI, KV_QUANT, QUANT_TILES)
    else:
        o, lse2 = _attend_split_shared(q, quant, k_src, v_src, bt_row, start, full_hi, end, qpos, window_left,
                                       score_scale, softcap_out, num_pages, stride_kb, stride_kt, tma_row_base,
                                       tma_col, split_pages, first_page, HEADDIM, TILE, PAGE_SIZE, SOFTCAP, WINDOW,
                                       DOT_PRECISION, USE_TMA, PRELOAD_PAGES, OFFS_32, alibi_log2, ALIBI, KV_QUANT,
                                       QUANT_TILES)
    return o, lse2


@triton.jit
def _attend_split_shared(q, quant, k_src, v_src, bt_row, start, full_hi, end, qpos, window_left, score_scale,
                         softcap_out, num_pages, stride_kb, stride_kt, tma_row_base, tma_col, split_pages,
                         first_page, HEADDIM: tl.constexpr, TILE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         USE_TMA: tl.constexpr, PRELOAD_PAGES: tl.constexpr, OFFS_32: tl.constexpr, alibi_log2,
                         ALIBI: tl.constexpr, KV_QUANT: tl.constexpr, QUANT_TILES: tl.constexpr):
    """_attend_split's KV loops with the program's warps sharing each block (_attend_blocks): the unmasked blocks
    [start, full_hi), then the masked ones up to ``end``; returns the normalised state (o, lse2)."""
    BLOCK_M: tl.constexpr = TILE.block_m
    BLOCK_N: tl.constexpr = TILE.block_n
    BLOCK_D: tl.constexpr = TILE.block_d
    SUM_TILE: tl.constexpr = TILE.sum_tile
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if SUM_TILE:  # the row sums per key column, summed once after the loops (softmax_state)
        l_i = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, k_src, v_src, bt_row, start, full_hi, end, qpos,
                                   window_left, score_scale, softcap_out, num_pages, stride_kb, stride_kt,
                                   tma_row_base,
                                   tma_col, split_pages, first_page, HEADDIM, BLOCK_N, BLOCK_D, PAGE_SIZE, False,
                                   SOFTCAP, WINDOW, DOT_PRECISION, USE_TMA, PRELOAD_PAGES,
                                   OFFS_32, alibi_log2, ALIBI, quant, KV_QUANT, QUANT_TILES, SUM_TILE)
    acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, k_src, v_src, bt_row, full_hi, end, end, qpos,
                                   window_left, score_scale, softcap_out, num_pages, stride_kb, stride_kt,
                                   tma_row_base,
                                   tma_col, split_pages, first_page, HEADDIM, BLOCK_N, BLOCK_D, PAGE_SIZE, True,
                                   SOFTCAP, WINDOW, DOT_PRECISION, USE_TMA, PRELOAD_PAGES,
                                   OFFS_32, alibi_log2, ALIBI, quant, KV_QUANT, QUANT_TILES, SUM_TILE)
    if SUM_TILE:
        l_i = tl.sum(l_i, 1)
    return normalize_state(acc, m_i, l_i)


@triton.jit
def _attend_split_warps(q, quant, k_src, v_src, bt_row, start, full_hi, end, qpos, window_left, score_scale,
                        softcap_out, num_pages, stride_page, stride_tok, split_pages, first_page,
                        HEADDIM: tl.constexpr, TILE: tl.constexpr, PAGE_SIZE: tl.constexpr, SOFTCAP: tl.constexpr,
                        WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, PRELOAD_PAGES: tl.constexpr,
                        OFFS_32: tl.constexpr, alibi_log2, ALIBI: tl.constexpr, KV_QUANT: tl.constexpr,
                        QUANT_TILES: tl.constexpr):
    """_attend_split's KV loops with the keys split across TILE.warps warps (_attend_blocks_warps): the unmasked
    blocks [start, full_hi), then the masked ones up to ``end``; returns the merged normalised state (o, lse2)."""
    BLOCK_M: tl.constexpr = TILE.block_m
    BLOCK_D: tl.constexpr = TILE.block_d
    WARPS: tl.constexpr = TILE.warps
    KW: tl.constexpr = TILE.block_n // WARPS
    q_k = quant[4]
    q3 = tl.broadcast_to(q_k[None, :, :], (WARPS, BLOCK_M, BLOCK_D))  # each warp's copy of the QK^T operand
    m_i = tl.full([WARPS, BLOCK_M], float("-inf"), tl.float32)
    if TILE.sum_tile:
        l_i = tl.zeros([WARPS, BLOCK_M, KW], tl.float32)
    else:
        l_i = tl.zeros([WARPS, BLOCK_M], tl.float32)
    acc = tl.zeros([WARPS, BLOCK_M, BLOCK_D], tl.float32)
    acc, m_i, l_i = _attend_blocks_warps(acc, m_i, l_i, q3, k_src, v_src, bt_row, start, full_hi, end, qpos,
                                         window_left, score_scale, softcap_out, num_pages, stride_page, stride_tok,
                                         split_pages, first_page, quant, q.dtype, HEADDIM, TILE.block_n, BLOCK_D,
                                         WARPS, PAGE_SIZE, False, SOFTCAP, WINDOW, DOT_PRECISION, PRELOAD_PAGES,
                                         OFFS_32, alibi_log2, ALIBI, KV_QUANT, QUANT_TILES, TILE.sum_tile)
    acc, m_i, l_i = _attend_blocks_warps(acc, m_i, l_i, q3, k_src, v_src, bt_row, full_hi, end, end, qpos,
                                         window_left, score_scale, softcap_out, num_pages, stride_page, stride_tok,
                                         split_pages, first_page, quant, q.dtype, HEADDIM, TILE.block_n, BLOCK_D,
                                         WARPS, PAGE_SIZE, True, SOFTCAP, WINDOW, DOT_PRECISION, PRELOAD_PAGES,
                                         OFFS_32, alibi_log2, ALIBI, KV_QUANT, QUANT_TILES, TILE.sum_tile)
    return _merge_warp_states(acc, m_i, l_i, TILE.sum_tile)


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
        t, head, row_ok = _group_rows(m_block, hk, TILE.block_m, TILE.block_m, ROWS.group, ROWS.seqlen_q)
        # (an empty split - only possible where MIN_CHUNK rounds the chunks up - runs empty KV loops and stores
        # (0, -inf): it still draws its ticket)
        bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_btb
        q = _load_q(Q, b, t, head, row_ok, stride_qb, stride_qt, stride_qh, stride_qd, HEADDIM, TILE.block_d)
        alibi_log2 = _alibi_log2(alibi, b, head, row_ok, ALIBI)
        o, lse2 = _attend_split(q, K, V, bt_row, b, hk, t, seqlen, start, end, window_left, scales, num_pages,
                                stride_k, HEADDIM, TILE, PAGES, ROWS.seqlen_q, SOFTCAP, WINDOW, DOT_PRECISION, USE_TMA,
                                OFFS_32, 0, 0, 0, False, alibi_log2, ALIBI, kv_scales, KV_QUANT,
                                QUANT_TILES)
        _finish_split(O, LSE, O_FINAL, LSE_FINAL, TICKETS + b * KVP + pid_hm, o, lse2, b, hk, m_block, split, t,
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
