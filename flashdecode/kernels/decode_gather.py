"""Decode's K/V fetches: where a block of keys lives in a contiguous or paged cache (block_page,
block_token_pages, kv_rows, tma_row, split_page_ids), the masked tile loads (load_kv_tile) and the L2 prefetch of a
split's first block (prefetch_l2, prefetch_split_head). Page ids outside [0, num_pages) read as absent keys: nothing
here touches memory outside the cache."""

import triton
import triton.language as tl


@triton.jit
def block_page(bt_row, start_n, split_pages, first_page, PAGE_SIZE: tl.constexpr, PRELOAD_PAGES: tl.constexpr):
    """Page id of the block starting at key start_n (pages that are multiples of BLOCK_N: one page per block).
    With PRELOAD_PAGES, picked from the split's page ids already in registers instead of a memory read in the loop."""
    if PRELOAD_PAGES > 0:
        pick = tl.arange(0, PRELOAD_PAGES) == (start_n // PAGE_SIZE - first_page)
        return tl.sum(tl.where(pick, split_pages, 0), 0)
    return tl.load(bt_row + start_n // PAGE_SIZE)


@triton.jit
def block_token_pages(start_n, split_pages, first_page, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRELOAD_PAGES: tl.constexpr):
    """Page id of each of the BLOCK_N keys of the block at start_n, from the split's preloaded page ids, for pages
    that divide BLOCK_N (the block covers whole pages): one tl.gather of each key's id (sm_90 PTX at BLOCK_N 64,
    PRELOAD_PAGES 64: 26 shuffles and 29 barriers per kernel, vs 62 and 35 for select-and-sum steps)."""
    # start_n and first_page * PAGE_SIZE are block-aligned split offsets: every index is < PRELOAD_PAGES
    # (the launcher sizes it to the pages one split spans); the clamp only guards the tail block's padding
    # (unsigned: the offsets are >= 0, and a power-of-two page divides by one shift, not a signed rounding)
    idx = ((start_n - first_page * PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.uint32) // PAGE_SIZE).to(tl.int32)
    return tl.gather(split_pages, tl.minimum(idx, PRELOAD_PAGES - 1), 0)


@triton.jit
def kv_rows(bt_row, start_n, offs_n, end, num_pages, stride_page, stride_tok, split_pages, first_page,
             PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRELOAD_PAGES: tl.constexpr,
             OFFS_32: tl.constexpr):
    """(rows, key_ok): element offsets (BLOCK_N,) of key positions ``offs_n`` relative to the sequence/head base
    pointer, int64 or int32 with OFFS_32 (the launcher's promise that every offset into the cache is < 2**31; the
    64-bit address math cost the page-16 loop 57 of its 372 sm_90 instructions per 64-key block); key_ok (BLOCK_N,)
    marks keys whose page id lies in [0, num_pages).

    PAGE_SIZE == 0: contiguous cache (token stride; key_ok unused). PAGE_SIZE a multiple of BLOCK_N: the block lies
    in one page, one page id. Otherwise (pages of 1, 3, 16 ... tokens): one page id per key, from the preloaded
    split_pages (registers) when PRELOAD_PAGES (pages that divide BLOCK_N), else read from the block table in
    memory. A block table on the device is not validated on the host: for an id outside [0, num_pages) key_ok is
    false, and the caller's loads are predicated off there (its offset, which may even wrap in 32 bits, is never
    dereferenced) and its keys read as absent.
    """
    key_ok = offs_n >= 0
    if PAGE_SIZE == 0:
        rows = offs_n * stride_tok if OFFS_32 else offs_n.to(tl.int64) * stride_tok
    else:
        if PAGE_SIZE % BLOCK_N == 0:
            # blocks start at multiples of BLOCK_N, so a block never straddles a page
            page = block_page(bt_row, start_n, split_pages, first_page, PAGE_SIZE, PRELOAD_PAGES)
        elif PRELOAD_PAGES > 0:
            page = block_token_pages(start_n, split_pages, first_page, PAGE_SIZE, BLOCK_N, PRELOAD_PAGES)
        elif MASKED:
            page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=offs_n < end, other=0)
        else:
            page = tl.load(bt_row + offs_n // PAGE_SIZE)
        page_ok = (page >= 0) & (page < num_pages)
        if PAGE_SIZE % BLOCK_N == 0:
            # one flag for the block, made (BLOCK_N,) by a select: Triton 3.9's interpreter rejects a load mask
            # made by AND-ing a scalar flag into a vector
            key_ok = tl.where(page_ok, key_ok, offs_n < 0)
        else:
            key_ok = key_ok & page_ok  # (BLOCK_N,)
        in_page = (offs_n.to(tl.uint32) % PAGE_SIZE).to(tl.int32) * stride_tok  # offs_n >= 0: unsigned is cheaper
        if OFFS_32:
            rows = page * stride_page + in_page
        else:
            rows = page.to(tl.int64) * stride_page + in_page.to(tl.int64)
    return rows, key_ok


@triton.jit
def ids_in_loop_ok(bt_row, start_n, offs_n, end, num_pages, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   MASKED: tl.constexpr):
    """Whether the page ids of the block at start_n lie in [0, num_pages): one flag for pages that are multiples of
    BLOCK_N, else (BLOCK_N,) per key - the score mask of absent keys where the loop reads the ids from the block
    table. The ids are read a second time (L1 hits; ".ca" keeps the read a load of its own): a score mask fed by
    the same load as the K / V addresses made Triton's pipeliner read the ids synchronously and buffer four K / V
    stages instead of two (sm_90, Llama-3-8B b16 pages of 16: 270 KiB of shared memory, over the SM's 227)."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(bt_row + start_n // PAGE_SIZE, cache_modifier=".ca")
    elif MASKED:
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=offs_n < end, other=0, cache_modifier=".ca")
    else:
        page = tl.load(bt_row + offs_n // PAGE_SIZE, cache_modifier=".ca")
    return (page >= 0) & (page < num_pages)


@triton.jit
def load_kv_tile(ptr_base, rows, offs_d, offs_n, end, key_ok, HEADDIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  MASKED: tl.constexpr, PAGED: tl.constexpr):
    """(BLOCK_N, BLOCK_D) tile of K or V; masked keys, keys of absent pages (PAGED: key_ok false) and padded
    head-dim columns load as 0 (never garbage, so a NaN left in an unused cache slot cannot leak through 0 * NaN).
    The KV loop masks the scores of absent keys by key_ok itself: a score is never tested for NaN, so a NaN in a
    live key reaches the rows that read it."""
    ptrs = ptr_base + rows[:, None] + offs_d[None, :]
    d_ok = offs_d < HEADDIM
    if PAGED:
        keys = key_ok
        if MASKED:
            keys = keys & (offs_n < end)
        return tl.load(ptrs, mask=keys[:, None] & d_ok[None, :], other=0.0)
    elif MASKED:
        return tl.load(ptrs, mask=(offs_n < end)[:, None] & d_ok[None, :], other=0.0)
    elif BLOCK_D == HEADDIM:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(offs_d < HEADDIM)[None, :], other=0.0)


@triton.jit
def tma_row(bt_row, start_n, tma_row_base, split_pages, first_page, num_pages, PAGE_SIZE: tl.constexpr,
             PRELOAD_PAGES: tl.constexpr):
    """(row, page_ok): the row of the 2-D (tokens, nheads_kv * headdim) TMA view where the block at key start_n
    begins, and whether its page id lies in [0, num_pages) (contiguous: always). A page id outside that range gives
    the rows just past the view's end, which the TMA unit fills with zeros, so the id never enters the address math
    and cannot wrap onto another page; the KV loop masks that block's scores by page_ok."""
    if PAGE_SIZE == 0:
        return tma_row_base + start_n, start_n >= 0
    page = block_page(bt_row, start_n, split_pages, first_page, PAGE_SIZE, PRELOAD_PAGES)
    page_ok = (page >= 0) & (page < num_pages)
    return tl.where(page_ok, page * PAGE_SIZE + start_n % PAGE_SIZE, num_pages * PAGE_SIZE), page_ok


@triton.jit
def split_page_ids(bt_row, start, end, PAGE_SIZE: tl.constexpr, PRELOAD_PAGES: tl.constexpr):
    """The block-table entries of keys [start, end): (PRELOAD_PAGES,) int32 from page start // PAGE_SIZE on, 0
    past the last page the range touches (so no read runs past the sequence's row)."""
    page_idx = start // PAGE_SIZE + tl.arange(0, PRELOAD_PAGES)
    return tl.load(bt_row + page_idx, mask=page_idx < tl.cdiv(end, PAGE_SIZE), other=0)


@triton.jit
def prefetch_l2(ptrs):
    """Hint: bring the 128-byte lines at ``ptrs`` into L2 (no data, no fault semantics needed: callers clamp every
    address into the cache's allocation). Not a memory read in the memory model, so it may run before gdc_wait."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_split_head(K_RAW, V_RAW, bt_row, b, hk, start, end, num_pages, stride_rb, stride_kt, stride_kh,
                         PAGE_SIZE: tl.constexpr, HEADDIM: tl.constexpr, PREFETCH_KEYS: tl.constexpr,
                         LINE_ELEMS: tl.constexpr, NUM_LINES: tl.constexpr):
    """L2 prefetch of the first PREFETCH_KEYS keys of this split's K and V rows (kv head hk), issued BEFORE
    gdc_wait, while the previous kernel still runs: the DRAM latency of the first tiles then overlaps it.

    [start, end): the split's keys as the stale lengths place it (stale_split_range). The block table read here
    may be stale too - the previous kernel may still be writing it - so it only steers the hint (.cg, as the
    lengths); every address is clamped into the cache (keys into [start, end) within the capacity, page ids into
    [0, num_pages)), whatever the stale values. stride_rb: the raw cache's batch (contiguous) or page stride.
    """
    if start < end:
        keys = tl.minimum(start + tl.arange(0, PREFETCH_KEYS), end - 1)
        if PAGE_SIZE == 0:
            rows = b.to(tl.int64) * stride_rb + keys.to(tl.int64) * stride_kt
        else:
            page = tl.load(bt_row + keys // PAGE_SIZE, cache_modifier=".cg")
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
            rows = page.to(tl.int64) * stride_rb + ((keys % PAGE_SIZE) * stride_kt).to(tl.int64)
        cols = tl.minimum(tl.arange(0, NUM_LINES) * LINE_ELEMS, HEADDIM - 1)
        offs = rows[:, None] + (hk * stride_kh + cols)[None, :]
        prefetch_l2(K_RAW + offs)
        prefetch_l2(V_RAW + offs)
