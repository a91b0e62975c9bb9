"""Flash-Decoding stage 1's attention bodies: one split's KV loops over a row block (kernels.decode's kernels call
attend_split). The program's warps either share each K/V block (_attend_blocks, the tensor-core path) or, for an
8-bit cache, split the keys between them with a state each (_attend_blocks_warps, merged at the end). Masks and
score transforms as kernels.decode's module docstring says (the transform itself: kernels/score.py's decode
family)."""

import triton
import triton.language as tl

from flashdecode.kernels.decode_args import QUANT_TILES_OFF
from flashdecode.kernels.decode_gather import (ids_in_loop_ok, kv_rows, load_kv_tile, split_page_ids,
                                               tma_row)
from flashdecode.kernels.dot import dot
from flashdecode.kernels.kv_quant import CONVERT_BITS_ASM, key_scales, keys_operand, keys_tile, to_dot_dtype
from flashdecode.kernels.score import decode_alibi_log2, decode_logits_log2, decode_visible
from flashdecode.kernels.softmax_state import (normalize_state, online_softmax_step, online_softmax_step_sum_tile,
                                               safe_max)


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
        s = decode_logits_log2(qk, score_scale, softcap_out, SOFTCAP)
        if ALIBI:
            s = decode_alibi_log2(s, qpos[:, None], offs_n[None, :], alibi_log2[:, None])
        if MASKED:
            visible = decode_visible(qpos[:, None], offs_n, end, window_left, WINDOW, True)
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
        s = decode_logits_log2(qk, score_scale, softcap_out, SOFTCAP)
        keys3 = offs_n[:, None, :]
        if ALIBI:
            s = decode_alibi_log2(s, qpos[None, :, None], keys3, alibi_log2[None, :, None])
        if MASKED:
            visible = decode_visible(qpos[None, :, None], keys3, end, window_left, WINDOW, False)
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
def attend_split(q, K, V, bt_row, b, hk, t, seqlen, start, end, window_left, scales, num_pages, stride_k,
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
    """attend_split's KV loops with the program's warps sharing each block (_attend_blocks): the unmasked blocks
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
    """attend_split's KV loops with the keys split across TILE.warps warps (_attend_blocks_warps): the unmasked
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
