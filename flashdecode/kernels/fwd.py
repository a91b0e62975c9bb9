"""FlashAttention forward in Triton: FA-2 loop order (one program per (Q block, batch * head), KV blocks inner).

Math (docs/algorithms.md): S = scale * Q K^T (optionally soft-capped), online softmax over KV blocks with an
unnormalised accumulator, one division at the end. Everything inside the kernel is in log2 units: log2(e) is folded
into the scale so the exponentials are exp2; the natural-log LSE is produced at the store.

Masks are bottom-right aligned: query row i sits at key position i + seqlen_k - seqlen_q ("diag offset"). A Q block's
KV range is cut into three segments: [lo, full_lo) blocks at the left window edge (masked), [full_lo, full_hi)
blocks every row sees entirely (no mask, no bounds checks), [full_hi, hi) the diagonal / right edge / ragged tail
(masked). Blocks outside the band are never visited.

The score transform (logits in log2 units with the softcap, the ALiBi bias, the visibility mask) is kernels/score.py's;
the helpers below (block ranges, row loads, sequence bounds) are shared with kernels/bwd.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashdecode.kernels.decode_gather import kv_rows
from flashdecode.kernels.dot import dot
from flashdecode.kernels.score import alibi_bias_log2, alibi_slope_log2, logits_log2, visible

# FP8 forward: P (in [0, 1]) is multiplied by 2**8 before rounding to e4m3, so that probabilities down to 2**-17
# stay representable (e4m3's smallest subnormal is 2**-9) instead of flushing to zero. The kernel gets it for free by
# shifting the row max by 8 in the exponent: the row sum carries the same factor, which cancels in acc / l.
FP8_P_LOG2_SCALE = tl.constexpr(8.0)


# ----------------------------------------------------------------------------------------------------------------
# Small helpers (inlined by Triton)
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def round_to_e4m3(x):
    """x (fp32, 0 <= x < 448) rounded to the nearest float8_e4m3fn value, ties to even, in fp32 arithmetic: the
    GPU's cvt.rn.satfinite.e4m3 result. The CPU interpreter's own fp32 -> e4m3 cast halves values that round up
    to the next power of two, so there the launcher asks for this first (after it the cast is exact); adding and
    subtracting 1.5 * 2**23 ulp rounds to a multiple of the ulp (2**(exponent - 3), 2**-9 for subnormals)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0
    return (x + magic) - magic


@triton.jit
def clamp_segments(lo, full_lo, full_hi, hi):
    """Order the four loop bounds so that lo <= full_lo <= full_hi <= hi (empty segments where needed)."""
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def kv_segments(m_start, seqlen_q, seqlen_k, window_left, window_right,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """KV loop bounds for the Q block starting at row m_start: (lo, full_lo, full_hi, hi), multiples of BLOCK_N
    except hi. Blocks in [full_lo, full_hi) are visible to every row of the Q block and lie inside seqlen_k."""
    diag = seqlen_k - seqlen_q
    first = m_start + diag  # key-aligned position of the block's first and last rows
    last = m_start + BLOCK_M - 1 + diag
    lo = 0
    full_lo = 0
    hi = seqlen_k
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = (tl.maximum(first - window_left, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last - window_left, 0), BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.maximum(tl.minimum(last + window_right + 1, seqlen_k), 0)
        full_hi = tl.minimum((tl.maximum(first + window_right + 1, 0) // BLOCK_N) * BLOCK_N, full_hi)
    return clamp_segments(lo, full_lo, full_hi, hi)


@triton.jit
def load_rows(ptrs, row_idx, nrows, d_mask, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (rows, HEAD_DIM_PAD) tile; out-of-range rows and padded head-dim columns read as 0."""
    if CHECK_ROWS:
        if EVEN_D:
            return tl.load(ptrs, mask=row_idx[:, None] < nrows, other=0.0)
        else:
            return tl.load(ptrs, mask=(row_idx[:, None] < nrows) & d_mask[None, :], other=0.0)
    else:
        if EVEN_D:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def load_page_rows(base, rows, offs_d, key_ok, d_mask):
    """(BLOCK_N, HEAD_DIM_PAD) tile of a paged cache (unit head-dim stride) at element offsets ``rows`` from base;
    keys that are not key_ok and padded head-dim columns read as 0 (their addresses are never dereferenced)."""
    return tl.load(base + rows[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def page_key_scales(kv_quant, bt_row, start_n, keys, seqlen_k, num_pages, key_ok, PAGE_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """(ks, vs): (BLOCK_N,) float32 k and v scales of an 8-bit paged cache's block (kv_quant as attn_fwd_inner's);
    keys that are not key_ok get 0 (their scores are masked by their ids, their values weigh nothing)."""
    k_scale, v_scale, stride_spage, stride_stok = kv_quant
    srows, _ = kv_rows(bt_row, start_n, keys, seqlen_k, num_pages, stride_spage, stride_stok, 0, 0, PAGE_SIZE, BLOCK_N,
                       MASKED, 0, False)
    return tl.load(k_scale + srows, mask=key_ok, other=0.0), tl.load(v_scale + srows, mask=key_ok, other=0.0)


@triton.jit
def paged_block_row(bt_row, start_n, num_pages, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row, key_ok) of the block at key start_n in a cache viewed as (num_pages * PAGE_SIZE) rows, for pages that
    hold whole blocks: the row where its page's keys start, and (BLOCK_N,) whether the page id is a page of the
    cache. An absent page's block starts at row num_pages * PAGE_SIZE, past the view: a descriptor reads zeros
    there, so a wrong id never becomes an address."""
    page = tl.load(bt_row + start_n // PAGE_SIZE)
    page_ok = (page >= 0) & (page < num_pages)
    row = tl.where(page_ok, page * PAGE_SIZE + start_n % PAGE_SIZE, num_pages * PAGE_SIZE)
    return row, (tl.arange(0, BLOCK_N) >= 0) & page_ok


@triton.jit
def sequence_bounds(batch, cu_seqlens, seqlen_dense, total, IS_VARLEN: tl.constexpr):
    """(start, length) of sequence ``batch``: from int32 cu_seqlens (packed varlen, clamped into the ``total``
    packed rows: cu_seqlens the host never checked may give wrong rows, never rows outside the tensor) or the
    dense seqlen."""
    if IS_VARLEN:
        start = tl.minimum(tl.maximum(tl.load(cu_seqlens + batch), 0), total)
        end = tl.minimum(tl.maximum(tl.load(cu_seqlens + batch + 1), start), total)
        return start, end - start
    else:
        return seqlen_dense * 0, seqlen_dense  # a runtime zero (seqlen is never specialised), so .to() works


@triton.jit
def head_base(X, strides, batch, row0, head):
    """Pointer to row ``row0`` of head ``head`` of sequence ``batch`` in X with (batch, seq, head, dim) strides
    (64-bit offsets)."""
    return X + batch.to(tl.int64) * strides[0] + row0.to(tl.int64) * strides[1] + head.to(tl.int64) * strides[2]


@triton.jit
def lse_row_base(Lse, strides, batch, head, row0):
    """Pointer to the lse-like fp32 row of (batch, head) at query row ``row0``: (batch, head) strides, unit row
    stride."""
    return Lse + batch.to(tl.int64) * strides[0] + head.to(tl.int64) * strides[1] + row0.to(tl.int64)


# ----------------------------------------------------------------------------------------------------------------
# Inner loop: one segment of KV blocks, running softmax state (acc, m_i, l_i) in and out
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_kd, stride_vn, stride_vd,
                   start, end, q_pos, offs_n, offs_d, d_mask, seqlen_k, window_left, window_right,
                   qk_scale, softcap_log2, alibi_slope,
                   MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                   USE_TMA: tl.constexpr, IS_FP8: tl.constexpr = False, HAS_ALIBI: tl.constexpr = False,
                   FP8_SOFT_ROUND: tl.constexpr = False, V_TMA: tl.constexpr = False, pages=None,
                   PAGE_SIZE: tl.constexpr = 0, kv_quant=None, KV_QUANT: tl.constexpr = False):
    """Stream KV blocks [start, end) (start a multiple of BLOCK_N) into the state.

    acc: (BLOCK_M, HEAD_DIM_PAD) fp32 unnormalised output; m_i, l_i: (BLOCK_M,) fp32 running max (log2 units) and
    running sum. MASKED blocks apply the visibility mask and guard rows that have seen no key yet (m = -inf) so
    that exp2(-inf - -inf) never happens; unmasked blocks skip both. USE_TMA loads K/V through tensor descriptors
    (k_desc/v_desc, bounded by the sequence, zero-filled outside), else through pointers from k_base/v_base;
    V_TMA: V through v_desc too (else V through pointers).
    IS_FP8: q and K are float8_e4m3fn (their descales folded into qk_scale), V is stored transposed (seq stride 1;
    v_desc, if V_TMA, covers (HEAD_DIM, seqlen_k)), and P, computed as P * 2**FP8_P_LOG2_SCALE (so is l_i), is
    rounded to e4m3 for the fp8 PV dot (the factor cancels in acc / l_i; the epilogue takes it out of the lse).
    HAS_ALIBI: alibi_slope (log2 units) times -|q_pos - k_pos| is added to the logits after the softcap.
    PAGE_SIZE > 0 (paged cache, unit head-dim stride): pages = (bt_row, num_pages, stride_page): the sequence's
    block-table row, the cache's page count and page stride (shared by K and V, whose token stride is stride_kn).
    Pointer path: k_base / v_base point at the kv head's first element of page 0, and each block's keys find their
    page ids in the table (kernels.decode_gather.kv_rows: one id per block where pages hold whole blocks, one per
    key otherwise). USE_TMA (pages that hold whole blocks): k_desc / v_desc cover the kv head's column of the
    whole cache as (num_pages * PAGE_SIZE, HEAD_DIM) rows, and a block reads its page's rows (an absent page reads
    the zero-filled rows past the end). Keys whose id lies outside [0, num_pages) score -inf and add no value, in
    every block.
    KV_QUANT (paged, pointer path): the cache is 8-bit (float8_e4m3fn or int8); kv_quant = (k_scale, v_scale,
    stride_spage, stride_stok): this kv head's float32 scale pointers and their page / token strides (0 along
    broadcast dims). Tiles are converted to q's dtype for the dots (exact: 8-bit values are a subset of fp16 /
    bf16), the scores multiplied by each key's k scale and the probabilities by its v scale before the PV dot
    (the row sum takes them unscaled).
    """
    PAGED: tl.constexpr = PAGE_SIZE > 0
    # blocks that may hold keys with no score (masked, or on an absent page) guard rows that have seen none yet
    GUARD: tl.constexpr = MASKED or PAGED
    if PAGED:
        bt_row, num_pages, stride_page = pages
    k_ptrs = k_base + start.to(tl.int64) * stride_kn + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + start.to(tl.int64) * stride_vn + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for start_n in tl.range(start, end, BLOCK_N):
        if PAGED and USE_TMA:
            row0, key_ok = paged_block_row(bt_row, start_n, num_pages, PAGE_SIZE, BLOCK_N)
            if MASKED:
                key_ok = key_ok & (start_n + offs_n < seqlen_k)
            k = k_desc.load([row0, 0])
        elif PAGED:
            rows, key_ok = kv_rows(bt_row, start_n, start_n + offs_n, seqlen_k, num_pages, stride_page, stride_kn,
                                   0, 0, PAGE_SIZE, BLOCK_N, MASKED, 0, False)
            if MASKED:  # (kv_rows reads the table only below seqlen_k there; keys past it may name page 0)
                key_ok = key_ok & (start_n + offs_n < seqlen_k)
            k = load_page_rows(k_base, rows, offs_d, key_ok, d_mask)
            if KV_QUANT:
                ks, vs = page_key_scales(kv_quant, bt_row, start_n, start_n + offs_n, seqlen_k, num_pages, key_ok,
                                         PAGE_SIZE, BLOCK_N, MASKED)
                k = k.to(q.dtype)
        elif USE_TMA:
            k = k_desc.load([start_n, 0])
        else:
            k = load_rows(k_ptrs, start_n + offs_n, seqlen_k, d_mask, MASKED, EVEN_D)
        qk = dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if KV_QUANT:
            qk = qk * ks[None, :]
        s = logits_log2(qk, qk_scale, softcap_log2, SOFTCAP)
        if HAS_ALIBI:
            s = s + alibi_bias_log2(q_pos[:, None], (start_n + offs_n)[None, :], alibi_slope)
        if MASKED:
            vis = visible(q_pos[:, None], (start_n + offs_n)[None, :], seqlen_k, window_left, window_right,
                          HAS_LEFT, HAS_RIGHT)
            s = tl.where(vis, s, float("-inf"))
        if PAGED:  # keys of absent pages (a block table the host never checked): no score, by their ids
            s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if GUARD:
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        alpha = tl.exp2(m_i - m_shift)
        if IS_FP8:  # P * 2**8 (module note at FP8_P_LOG2_SCALE): a per-row shift, no per-element multiply
            p = tl.exp2(s - (m_shift - FP8_P_LOG2_SCALE)[:, None])
        else:
            p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if PAGED and USE_TMA:
            v = v_desc.load([row0, 0])
            if MASKED:  # a page's rows past the sequence may hold anything, and 0 * NaN = NaN
                v = tl.where(key_ok[:, None], v, 0.0)
        elif PAGED:
            v = load_page_rows(v_base, rows, offs_d, key_ok, d_mask)
            if KV_QUANT:  # sum_j p_j * v_scale_j * v_j: the scale goes on the probabilities
                v = v.to(q.dtype)
                p = p * vs[None, :]
        elif V_TMA:
            if IS_FP8:  # V^T tile (HEAD_DIM_PAD, BLOCK_N): K-major for the fp8 wgmma
                v = tl.trans(v_desc.load([0, start_n]))
            else:
                v = v_desc.load([start_n, 0])
        else:
            v = load_rows(v_ptrs, start_n + offs_n, seqlen_k, d_mask, MASKED, EVEN_D)
        acc = acc * alpha[:, None]
        if IS_FP8:
            if FP8_SOFT_ROUND:
                acc = dot(round_to_e4m3(p).to(v.dtype), v, acc)
            else:
                acc = dot(p.to(v.dtype), v, acc)
        else:
            acc = dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, m_i, l_i


@triton.jit
def sequence_descriptor(base, nrows, row_stride, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                        HEAD_DIM_PAD: tl.constexpr):
    """TMA descriptor over one head of one sequence: (nrows, HEAD_DIM) at ``base`` with unit column stride.
    Reads outside it (rows past the sequence, padded head-dim columns) return 0; stores there are dropped."""
    return tl.make_tensor_descriptor(base, shape=[nrows, HEAD_DIM], strides=[row_stride, 1],
                                     block_shape=[BLOCK_ROWS, HEAD_DIM_PAD])


# ----------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k", "window_left", "window_right"])
def attn_fwd_kernel(
    Q, K, V, Out, Lse, cu_seqlens_q, cu_seqlens_k, fp8_descales, AlibiSlopes,
    q_strides, k_strides, v_strides, o_strides, lse_strides,
    group_size, seqlen_q, seqlen_k, total_q, total_k,
    logit_scales, window_left, window_right, alibi_batch_stride,
    bucket_q, bucket_k, kv_pages,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr = False, IS_FP8: tl.constexpr = False,
    HAS_ALIBI: tl.constexpr = False, FP8_SOFT_ROUND: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 0,
):
    """Grid (cdiv(max_seqlen_q, BLOCK_M), nheads, batch) (3-D: batch * nheads may exceed the 65535 limit of
    grid dims 1 and 2).

    Dense: Q (batch, seqlen_q, nheads, HEAD_DIM), K/V (batch, seqlen_k, nheads_kv, HEAD_DIM), Lse (batch, nheads,
    seqlen_q) fp32. Varlen (IS_VARLEN): Q (total_q, nheads, HEAD_DIM) etc. with batch strides 0, the sequence start
    read from int32 cu_seqlens_q/k (contiguous) and clamped to the total_q / total_k packed rows (so that
    unchecked cu_seqlens never move a program outside the tensors), Lse (nheads, total_q). Out has Q's shape.
    *_strides: (batch, seq, head, dim) strides of each tensor; lse_strides (batch, head) with a unit seq stride.
    Query head h reads kv head h // group_size. bucket_q/bucket_k only key the autotuner (log2 buckets of the max
    lengths). USE_TMA (Hopper): Q/K/V/Out move through device-side tensor descriptors (needs unit head-dim stride,
    16-byte aligned rows and a triton allocator).

    logit_scales: (qk_scale, softcap_log2) as score.logits_log2 takes them (the host's ScoreTransform.logit_scales).
    IS_FP8 (forward only): Q, K, V float8_e4m3fn, Out bfloat16; fp8_descales = (QKDescale, VDescale) (None
    otherwise): QKDescale contiguous fp32 (batch, nheads):
    q_descale * k_descale of (sequence, head), folded into qk_scale; VDescale contiguous fp32 (batch, nheads_kv),
    applied to the output. V is stored transposed: v_strides' seq stride is 1 (the launcher's padded copy).
    FP8_SOFT_ROUND (the CPU interpreter only): P rounded by round_to_e4m3 before its cast.
    HAS_ALIBI: AlibiSlopes fp32, slope of (batch, head) at batch * alibi_batch_stride + head (batch stride 0 for
    one slope per head); the bias -slope * |i + seqlen_k - seqlen_q - j| joins the
    logits after the softcap (flash-attn's order).

    PAGE_SIZE > 0 (paged prefill; IS_VARLEN, forward only, not FP8): K and V are caches (num_pages, PAGE_SIZE,
    nheads_kv, HEAD_DIM) with one set of strides (k_strides = (page, token, head, dim), unit dim stride; v_strides
    equal) read through pointers; kv_pages = (BlockTable, SeqUsedK, bt_strides, max_pages, num_pages): int32
    BlockTable (batch, max_pages) with (batch, page) strides bt_strides, int32 SeqUsedK (batch,) the keys of each
    sequence (clamped into [0, max_pages * PAGE_SIZE]: no key past the table), num_pages the cache's page count
    (ids outside [0, num_pages) are absent keys); cu_seqlens_k and total_k are unused. kv_pages is None otherwise.
    USE_TMA with PAGE_SIZE: Q and Out through descriptors, and K/V too where PAGE_SIZE is a multiple of BLOCK_N (the
    launcher sets USE_TMA only for a cache whose layout allows that: page stride = PAGE_SIZE * token stride, 16-byte
    aligned bases and strides, fewer than 2**31 cache rows), else through pointers.
    8-bit cache (K's element type differs from Q's; paged, pointers): K and V float8_e4m3fn or int8, and kv_pages
    has a sixth entry, kv_scales = (KScale, VScale, s_strides): float32 scales of (page, token, kv head) at strides
    s_strides (0 along broadcast dims); the attended key is K * KScale (kernels/kv_quant.py's convention), the value
    V * VScale.
    """
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    head_kv = head // group_size
    q_start, seqlen_q = sequence_bounds(batch, cu_seqlens_q, seqlen_q, total_q, IS_VARLEN)
    qk_scale, softcap_log2 = logit_scales
    PAGED: tl.constexpr = PAGE_SIZE > 0
    KV_QUANT: tl.constexpr = PAGED and K.dtype.element_ty != Q.dtype.element_ty  # an 8-bit cache
    if PAGED:
        if KV_QUANT:
            block_table, seqused_k, bt_strides, max_pages, num_pages, kv_scales = kv_pages
            k_scale, v_scale, s_strides = kv_scales
            kv_quant = (k_scale + head_kv.to(tl.int64) * s_strides[2], v_scale + head_kv.to(tl.int64) * s_strides[2],
                        s_strides[0], s_strides[1])
        else:
            block_table, seqused_k, bt_strides, max_pages, num_pages = kv_pages
            kv_quant = None
        k_start = seqlen_q * 0
        seqlen_k = tl.minimum(tl.maximum(tl.load(seqused_k + batch), 0), max_pages * PAGE_SIZE)
        pages = (block_table + batch.to(tl.int64) * bt_strides[0], num_pages, k_strides[0])
    else:
        k_start, seqlen_k = sequence_bounds(batch, cu_seqlens_k, seqlen_k, total_k, IS_VARLEN)
        pages = None
        kv_quant = None
    if HAS_RIGHT:  # causal-like: the last Q blocks have the most keys; start them first (load balance)
        pid_m = tl.num_programs(0) - 1 - pid_m
    m_start = pid_m * BLOCK_M
    if m_start >= seqlen_q:
        return

    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM

    q_base = head_base(Q, q_strides, batch, q_start, head)
    if PAGED:  # the kv head's column of page 0: blocks add their page and token offsets
        k_base = K + head_kv.to(tl.int64) * k_strides[2]
        v_base = V + head_kv.to(tl.int64) * v_strides[2]
    else:
        k_base = head_base(K, k_strides, batch, k_start, head_kv)
        v_base = head_base(V, v_strides, batch, k_start, head_kv)
    # K/V descriptors cover one sequence of a contiguous tensor, or the kv head's column of a paged cache whose pages
    # hold whole blocks (the launcher found the cache's layout fit); other pages and 8-bit caches take pointers (Q
    # and Out keep their descriptors)
    KV_TMA: tl.constexpr = USE_TMA and (not PAGED or (PAGE_SIZE % BLOCK_N == 0 and not KV_QUANT))
    # FP8 varlen: V^T columns of a sequence start at any packed row, which a descriptor cannot address (its
    # column offsets must be 16-byte aligned), so V goes through pointers there (Q, K, Out keep descriptors)
    V_TMA: tl.constexpr = KV_TMA and not (IS_FP8 and IS_VARLEN)
    if IS_FP8:  # descales: q * k of (sequence, head) into the logit scale, v of (sequence, kv head) at the end
        QKDescale, VDescale = fp8_descales
        qk_scale = qk_scale * tl.load(QKDescale + batch * tl.num_programs(1) + head)
        v_descale = tl.load(VDescale + batch * (tl.num_programs(1) // group_size) + head_kv)
    alibi_slope = alibi_slope_log2((AlibiSlopes, (alibi_batch_stride, 1)), batch, head, HAS_ALIBI)
    if KV_TMA and PAGED:  # (num_pages * PAGE_SIZE, HEAD_DIM) rows of this kv head
        k_desc = sequence_descriptor(k_base, num_pages * PAGE_SIZE, k_strides[1], HEAD_DIM, BLOCK_N, HEAD_DIM_PAD)
        v_desc = sequence_descriptor(v_base, num_pages * PAGE_SIZE, v_strides[1], HEAD_DIM, BLOCK_N, HEAD_DIM_PAD)
    elif KV_TMA:
        k_desc = sequence_descriptor(k_base, seqlen_k, k_strides[1], HEAD_DIM, BLOCK_N, HEAD_DIM_PAD)
        if not V_TMA:
            v_desc = v_base
        elif IS_FP8:  # V^T (HEAD_DIM, seqlen_k) of this (sequence, kv head), zero-filled outside
            v_desc = tl.make_tensor_descriptor(v_base, shape=[HEAD_DIM, seqlen_k], strides=[v_strides[3], 1],
                                               block_shape=[HEAD_DIM_PAD, BLOCK_N])
        else:
            v_desc = sequence_descriptor(v_base, seqlen_k, v_strides[1], HEAD_DIM, BLOCK_N, HEAD_DIM_PAD)
    else:
        k_desc = k_base
        v_desc = v_base
    if USE_TMA:
        q = sequence_descriptor(q_base, seqlen_q, q_strides[1], HEAD_DIM, BLOCK_M, HEAD_DIM_PAD).load([m_start, 0])
    else:
        q = load_rows(q_base + offs_m[:, None] * q_strides[1] + offs_d[None, :] * q_strides[3], offs_m, seqlen_q,
                      d_mask, True, EVEN_D)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    q_pos = offs_m + (seqlen_k - seqlen_q)
    lo, full_lo, full_hi, hi = kv_segments(m_start, seqlen_q, seqlen_k, window_left, window_right,
                                           BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if HAS_LEFT:  # left edge of a sliding window: masked
        acc, m_i, l_i = attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, k_strides[1], k_strides[3],
                                       v_strides[1], v_strides[3], lo, full_lo, q_pos, offs_n, offs_d, d_mask,
                                       seqlen_k, window_left, window_right, qk_scale, softcap_log2,
                                       alibi_slope, True, EVEN_D, HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION,
                                       BLOCK_N, KV_TMA, IS_FP8, HAS_ALIBI, FP8_SOFT_ROUND, V_TMA, pages,
                                       PAGE_SIZE, kv_quant, KV_QUANT)
    # the bulk: blocks every row sees completely
    acc, m_i, l_i = attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, k_strides[1], k_strides[3],
                                   v_strides[1], v_strides[3], full_lo, full_hi, q_pos, offs_n, offs_d, d_mask,
                                   seqlen_k, window_left, window_right, qk_scale, softcap_log2, alibi_slope,
                                   False, EVEN_D, HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_N, KV_TMA,
                                   IS_FP8, HAS_ALIBI, FP8_SOFT_ROUND, V_TMA, pages, PAGE_SIZE, kv_quant,
                                   KV_QUANT)
    # diagonal / right window edge / ragged tail: masked
    acc, m_i, l_i = attn_fwd_inner(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, k_strides[1], k_strides[3],
                                   v_strides[1], v_strides[3], full_hi, hi, q_pos, offs_n, offs_d, d_mask,
                                   seqlen_k, window_left, window_right, qk_scale, softcap_log2, alibi_slope,
                                   True, EVEN_D, HAS_LEFT, HAS_RIGHT, SOFTCAP, DOT_PRECISION, BLOCK_N, KV_TMA,
                                   IS_FP8, HAS_ALIBI, FP8_SOFT_ROUND, V_TMA, pages, PAGE_SIZE, kv_quant,
                                   KV_QUANT)

    # epilogue: one division; rows that saw no key give out 0 and lse -inf (l == 0: a NaN l, from a NaN the row
    # read, gives NaN out and lse)
    has_keys = l_i != 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    m_lse = m_i
    if IS_FP8:
        out = acc * (v_descale / l_safe)[:, None]
        m_lse = m_i - FP8_P_LOG2_SCALE  # l_i summed P * 2**8
    else:
        out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(has_keys, (m_lse + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_base = head_base(Out, o_strides, batch, q_start, head)
    if USE_TMA:
        sequence_descriptor(o_base, seqlen_q, o_strides[1], HEAD_DIM, BLOCK_M, HEAD_DIM_PAD).store(
            [m_start, 0], out.to(Out.dtype.element_ty))
    else:
        tl.store(o_base + offs_m[:, None] * o_strides[1] + offs_d[None, :] * o_strides[3],
                 out.to(Out.dtype.element_ty), mask=(offs_m < seqlen_q)[:, None] & d_mask[None, :])
    tl.store(lse_row_base(Lse, lse_strides, batch, head, q_start) + offs_m, lse, mask=offs_m < seqlen_q)
