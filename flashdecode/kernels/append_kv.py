"""append_kv: write new K/V tokens into a contiguous or paged KV cache in one launch.

Grid (batch, cdiv(max_new, BLOCK_T), nheads_kv). Sequence b's new tokens come from rows
[cu_new[b], cu_new[b + 1]) of the packed source (dense sources are described by cu_new[b] = b * seqlen_new, passed
as a stride) and land at cache positions cache_seqlens[b] + i. Nothing is read or written outside the tensors,
whatever the device-resident metadata holds (the launcher checks host-resident metadata and raises instead):
  - positions outside [0, capacity) are not written;
  - packed source rows outside [0, total_new) are neither read nor written (a cu_new that runs past k_new,
    decreases or starts below 0 cannot copy foreign memory into the cache);
  - page ids outside [0, num_pages) are not written (the token is dropped, as if its page were absent);
  - every offset is computed in int64, so page * page_stride cannot wrap at 2**31.
"""

import triton
import triton.language as tl

from flashdecode.kernels.kv_quant import quantize_new_tokens


@triton.jit
def append_kv_kernel(
    K_NEW, V_NEW, K_CACHE, V_CACHE, SEQLENS, CU_NEW, BLOCK_TABLE, capacity, dense_seqlen_new, total_new, num_pages,
    stride_nb, stride_nt, stride_nh, stride_vnb, stride_vnt, stride_vnh,
    stride_cb, stride_ct, stride_ch, stride_btb,
    HEADDIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    VARLEN: tl.constexpr,
    K_SCALE=None, V_SCALE=None, stride_sb=0, stride_st=0, stride_sh=0, QUANT: tl.constexpr = 0,
    QMAX: tl.constexpr = 1.0, SEEN=None,
):
    """K_NEW/V_NEW: dense (batch, dense_seqlen_new, nheads_kv, HEADDIM) via (stride_nb, stride_nt, stride_nh), or
    packed (total_new, nheads_kv, HEADDIM) rows (VARLEN; stride_nb unused), unit stride on the head dim.
    K_CACHE/V_CACHE share strides: contiguous (batch, max_seqlen, h, d) with stride_cb the batch stride
    (PAGE_SIZE == 0), or paged (num_pages, PAGE_SIZE, h, d) with stride_cb the page stride. SEQLENS int32 (batch,):
    lengths BEFORE the append. CU_NEW int32 (batch + 1,) when VARLEN. BLOCK_TABLE int32 (batch, pages_per_seq) with
    capacity = pages_per_seq * PAGE_SIZE (paged).
    QUANT (an 8-bit cache; kernels/kv_quant.py quantize_new_tokens): 2 writes each new token's float32 scales into
    K_SCALE / V_SCALE (sequence or page, token, kv head) at stride_sb / stride_st / stride_sh, 1 quantises with the
    given per-kv-head scales (stride_sh 0: one scalar); QMAX: the format's largest magnitude.
    SEEN: None, or int32 (batch,) that receives SEQLENS[b] + the sequence's new tokens (the lengths an attention
    after the append sees; written by the programs (b, 0, 0), so the attention needs no launch of its own for it)."""
    b = tl.program_id(0)
    t_block = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    offs_t = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
    if VARLEN:
        src_start = tl.load(CU_NEW + b)
        num_new = tl.load(CU_NEW + b + 1) - src_start
        src_row = src_start.to(tl.int64) + offs_t
        # device-resident cu_new is not validated: rows outside the packed source are never touched
        src_ok = (src_row >= 0) & (src_row < total_new)
        k_rows = src_row * stride_nt
        v_rows = src_row * stride_vnt
    else:
        num_new = dense_seqlen_new
        src_ok = offs_t >= 0
        k_rows = b.to(tl.int64) * stride_nb + offs_t.to(tl.int64) * stride_nt
        v_rows = b.to(tl.int64) * stride_vnb + offs_t.to(tl.int64) * stride_vnt
    seqlen = tl.load(SEQLENS + b)
    if SEEN is not None:
        if (t_block == 0) & (h == 0):
            tl.store(SEEN + b, seqlen + num_new)
    pos = seqlen.to(tl.int64) + offs_t  # int64: a huge device length must not wrap into range
    t_ok = (offs_t < num_new) & src_ok & (pos < capacity) & (pos >= 0)
    if PAGE_SIZE == 0:
        dst_rows = b.to(tl.int64) * stride_cb + pos * stride_ct
    else:
        page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_btb + pos // PAGE_SIZE, mask=t_ok, other=0)
        t_ok = t_ok & (page >= 0) & (page < num_pages)  # an out-of-range page id writes nothing
        dst_rows = page.to(tl.int64) * stride_cb + (pos % PAGE_SIZE) * stride_ct
    offs_d = tl.arange(0, BLOCK_D)
    mask = t_ok[:, None] & (offs_d < HEADDIM)[None, :]

    k = tl.load(K_NEW + k_rows[:, None] + h * stride_nh + offs_d[None, :], mask=mask)
    v = tl.load(V_NEW + v_rows[:, None] + h * stride_vnh + offs_d[None, :], mask=mask)
    dst = dst_rows[:, None] + h * stride_ch + offs_d[None, :]
    if QUANT > 0:
        s_rows = 0
        if QUANT == 2:
            if PAGE_SIZE == 0:
                s_rows = b.to(tl.int64) * stride_sb + pos * stride_st
            else:
                s_rows = page.to(tl.int64) * stride_sb + (pos % PAGE_SIZE) * stride_st
        k, v = quantize_new_tokens(k, v, mask, h, s_rows, t_ok, K_SCALE, V_SCALE, stride_sh, QUANT, QMAX,
                                   K_CACHE.dtype.element_ty)
    tl.store(K_CACHE + dst, k, mask=mask)
    tl.store(V_CACHE + dst, v, mask=mask)
