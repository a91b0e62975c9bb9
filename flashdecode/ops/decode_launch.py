"""Decode launches: stage 1 (decode_split_kernel, also with device-chosen split counts), the persistent kernel
(decode_persistent_kernel) and the merge, for a configured _DecodeShape (ops/decode_policy.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashdecode import heuristics
from flashdecode.kernels.decode import decode_persistent_kernel, decode_split_kernel
from flashdecode.ops.merge import launch_merge_many

if TYPE_CHECKING:
    from flashdecode.ops.decode_policy import _DecodeShape


def _kv_sources(shape, k_cache, v_cache):
    """(K, V, stride_kb) for the kernel: raw tensors, or TMA descriptors over (rows, nheads_kv * headdim)."""
    if not shape.use_tma:
        return k_cache, v_cache, k_cache.stride(0)
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = k_cache.shape[0] * k_cache.shape[1]
    width = k_cache.shape[2] * k_cache.shape[3]
    box = [shape.block_n, shape.headdim]
    k_desc, v_desc = (TensorDescriptor(x, [rows, width], [width, 1], box) for x in (k_cache, v_cache))
    return k_desc, v_desc, k_cache.shape[1]


def _launch_stage1(shape: _DecodeShape, k_cache, v_cache, cache_seqlens, block_table, o4, lse3, num_splits,
                   final: bool, min_chunk: int, device_preload=None):
    """o4/lse3: (batch, seqlen_q, nheads[, splits], headdim) views (final output, or fp32 partials).
    device_preload: None, or the page preload of a DEVICE_SPLITS launch (_device_split_preload): split counts
    chosen on the device, <= num_splits per sequence, one program per work item."""
    q4 = shape.q4
    bt = block_table if block_table is not None else cache_seqlens
    stride_os = 0 if final else o4.stride(3)
    stride_od = o4.stride(3) if final else o4.stride(4)
    stride_ls = 0 if final else lse3.stride(3)
    kv_programs = shape.nheads_kv * shape.num_m_blocks
    grid = (num_splits, kv_programs, shape.batch)
    k_src, v_src, stride_kb = _kv_sources(shape, k_cache, v_cache)
    pdl_wait = shape.pdl_wait  # this launch may overlap the previous kernel's tail (it waits on the device)
    prefetch_keys, line_elems, num_lines = _prefetch_shape(shape, k_cache, num_splits, min_chunk)
    preload_pages = _preload_pages(shape, num_splits, min_chunk)
    split_keys_max = _max_split_keys(shape, num_splits, min_chunk)
    device = {}
    if device_preload is not None:
        grid = (_device_split_programs(shape, num_splits), 1, 1)
        preload_pages, split_keys_max = device_preload, shape.capacity
        device = dict(DEVICE_SPLITS=True, SPLIT_SLOTS=shape.device_split_slots, KV_PROGRAMS=kv_programs,
                      BATCH_PAD=heuristics.next_power_of_2(max(shape.grid_batch, shape.batch)))
    launch = lambda num_stages: decode_split_kernel[grid](  # noqa: E731
        q4, k_src, v_src, cache_seqlens, bt, o4, lse3, k_cache, v_cache,
        shape.score_scale, shape.softcap_log2, max(shape.window_left, 0), shape.capacity, k_cache.shape[0],
        k_cache.stride(0), shape.batch,
        q4.stride(0), q4.stride(1), q4.stride(2), q4.stride(3),
        stride_kb, k_cache.stride(1), k_cache.stride(2),
        bt.stride(0) if block_table is not None else 0,
        o4.stride(0), o4.stride(1), o4.stride(2), stride_os, stride_od,
        lse3.stride(0), lse3.stride(1), lse3.stride(2), stride_ls,
        SEQLEN_Q=shape.seqlen_q, GROUP=shape.group, NUM_M_BLOCKS=shape.num_m_blocks,
        HEADDIM=shape.headdim, BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, BLOCK_D=shape.block_d,
        NUM_SPLITS=num_splits, MIN_CHUNK=min_chunk, PAGE_SIZE=shape.page_size,
        SOFTCAP=shape.softcap > 0, WINDOW=shape.window_left >= 0, FINAL=final,
        DOT_PRECISION="ieee" if q4.dtype == torch.float32 else "tf32", USE_TMA=shape.use_tma,
        USE_PDL=shape.use_pdl and not final, PDL_WAIT=pdl_wait,
        PRELOAD_PAGES=preload_pages, MERGE_SPLITS=heuristics.next_power_of_2(num_splits),
        PREFETCH_KEYS=prefetch_keys, LINE_ELEMS=line_elems, NUM_LINES=num_lines,
        OFFS_32=shape.offs_32, SPEC_PAGES=shape.spec_pages, **device,
        num_warps=shape.num_warps, num_stages=num_stages,
        **({"launch_pdl": True} if pdl_wait else {}),
    )
    stages = _pipeline_stages(shape, preload_pages, split_keys_max)
    _launch_within_shared_memory(launch, stages, (shape.block_m, shape.block_n, shape.block_d, q4.dtype,
                                                  shape.use_tma))


def _launch_persistent(shape, k_cache, v_cache, cache_seqlens, block_table, out4, lse3, o5, lse4, tickets,
                       num_splits, min_chunk):
    """All of decode in one decode_persistent_kernel launch: a fixed grid of shape.persistent_programs programs;
    each sequence's split count (<= num_splits) is chosen on the device from the live lengths. Writes out4
    (batch, seqlen_q, nheads, headdim) and lse3 (batch, seqlen_q, nheads) fp32 natural log; o5 (batch, seqlen_q,
    nheads, num_splits, headdim) / lse4 fp32 partials and tickets (int32 zeros, >= batch * nheads_kv * row
    blocks + _QUEUE_SLOTS; left zero again) serve the sequences that split, and its last _QUEUE_SLOTS entries
    the work queue of shape.persistent_dynamic."""
    q4 = shape.q4
    queue = tickets[tickets.numel() - _QUEUE_SLOTS:]
    bt = block_table if block_table is not None else cache_seqlens
    k_src, v_src, stride_kb = _kv_sources(shape, k_cache, v_cache)
    preload = _persistent_preload(shape, num_splits, min_chunk)
    launch = lambda num_stages: decode_persistent_kernel[(shape.persistent_programs,)](  # noqa: E731
        q4, k_src, v_src, cache_seqlens, bt, o5, lse4, out4, lse3, tickets, queue,
        shape.batch, shape.score_scale, shape.softcap_log2, max(shape.window_left, 0), shape.capacity,
        *q4.stride(), stride_kb, k_cache.stride(1), k_cache.stride(2),
        bt.stride(0) if block_table is not None else 0, *o5.stride(), *lse4.stride(), *_final_strides(out4, lse3),
        SEQLEN_Q=shape.seqlen_q, GROUP=shape.group, NUM_M_BLOCKS=shape.num_m_blocks, NHEADS_KV=shape.nheads_kv,
        HEADDIM=shape.headdim, BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, BLOCK_D=shape.block_d,
        NUM_SPLITS=num_splits, MIN_CHUNK=min_chunk,
        PAGE_SIZE=shape.page_size, SOFTCAP=shape.softcap > 0, WINDOW=shape.window_left >= 0,
        DOT_PRECISION="ieee" if q4.dtype == torch.float32 else "tf32", USE_TMA=shape.use_tma,
        USE_PDL=shape.use_pdl, PDL_WAIT=shape.pdl_wait,
        **preload,
        BATCH_PAD=heuristics.next_power_of_2(max(shape.grid_batch, shape.batch)),
        OFFS_32=shape.offs_32, **_merge_tile(shape, num_splits),
        DYNAMIC=shape.persistent_dynamic,
        SLOTS_PER_PROGRAM=shape.persistent_slots,
        QUEUE_SPLITS=shape.queue_splits, QUEUE_FULL_FRACTION=heuristics.DECODE_QUEUE_FULL_FRACTION,
        QUEUE_SPLIT_COST=heuristics.DECODE_QUEUE_SPLIT_COST,
        num_warps=shape.num_warps, num_stages=num_stages, **({"launch_pdl": True} if shape.pdl_wait else {}),
    )
    # a work item may be a whole sequence unless the splits are bounded
    stages = _pipeline_stages(shape, preload["PRELOAD_PAGES"], preload["MAX_SPLIT_KEYS"] or shape.capacity)
    _launch_within_shared_memory(launch, stages, (shape.block_m, shape.block_n, shape.block_d, q4.dtype,
                                                  shape.use_tma, "persistent"))


def _device_split_programs(shape, num_splits) -> int:
    """Programs of a DEVICE_SPLITS launch: enough for every work item _planned_item can make. A sequence's split
    count is its floor'd share of device_split_slots items (kv programs each), at least 1 and at most num_splits,
    so all of them hold at most slots + batch x kv programs items."""
    kv_programs = shape.nheads_kv * shape.num_m_blocks
    return kv_programs * min(shape.batch * num_splits, shape.device_split_slots // kv_programs + shape.batch)


def _device_uniform_splits(shape, num_splits) -> int:
    """Splits per sequence that a DEVICE_SPLITS launch gives a batch of equal lengths (kernels/decode.py
    _device_split_counts: each sequence's floor'd share of the slots), for the host's tile choice."""
    kv_programs = shape.nheads_kv * shape.num_m_blocks
    return max(1, min(num_splits, shape.device_split_slots // (kv_programs * shape.batch)))


def _device_split_preload(shape, num_splits, min_chunk):
    """PRELOAD_PAGES of a DEVICE_SPLITS launch (a split may span a whole sequence), or None where that does not
    fit the preload while the kernel relies on it (pages smaller than a block whose ids outgrow it: the split
    grid's fixed counts then keep the splits short enough)."""
    preload = _persistent_preload(shape, num_splits, min_chunk)
    return None if preload["MAX_SPLIT_KEYS"] else preload["PRELOAD_PAGES"]


def _pipeline_stages(shape, preload_pages, split_keys_max) -> int:
    """num_stages of a stage-1 launch: the config's, plus shape.table_read_extra_stages when the KV loop reads page
    ids from the block table (paged, nothing preloaded) and a split may hold at least
    shape.table_read_min_split_blocks blocks (``split_keys_max`` keys). Triton's pipeliner issues such a read a
    stage ahead of the K/V loads whose addresses it feeds, so at 3 stages K and V are single-buffered and every
    block waits for all loads in flight (sm_90 TTGIR: ``async_wait {num = 0}`` at the top of the loop, for pages of
    1 key and 128-key pages alike); at 5 they are double-buffered, two blocks ahead, as with preloaded ids at 3.
    Short splits keep 3: their prologue costs more than it hides, and single-buffered programs take a third of
    the shared memory, so that more of them share an SM (heuristics.DECODE_TABLE_READ_EXTRA_STAGES)."""
    long_splits = split_keys_max >= shape.table_read_min_split_blocks * shape.block_n
    if shape.paged and preload_pages == 0 and long_splits:
        return shape.num_stages + shape.table_read_extra_stages
    return shape.num_stages


def _final_strides(out4, lse3) -> tuple:
    """The kernels' stride_f* / stride_fl* arguments: out4 (batch, seqlen_q, nheads, headdim) and lse3 (batch,
    seqlen_q, nheads), where the in-kernel merges write the finished states."""
    return (*out4.stride()[:3], out4.stride(-1), *lse3.stride()[:3])


def _max_split_keys(shape, num_splits, min_chunk) -> int:
    """The most keys one of num_splits splits can hold (kernels/decode.py split_range at the cache capacity)."""
    return max(heuristics.cdiv(shape.capacity, num_splits * shape.block_n) * shape.block_n, min_chunk)


def _persistent_preload(shape, num_splits, min_chunk) -> dict:
    """PRELOAD_PAGES / MAX_SPLIT_KEYS of the persistent kernel. A sequence may run as one split, so pages preload a
    whole sequence's ids when they fit; otherwise a num_splits-th of the capacity, each split bounded to as many
    keys (num_splits splits always fit) for pages smaller than a block, or, when even that is too many, the loop
    reads the ids (one per block for block-multiple pages, one per key for smaller ones)."""
    whole = _preload_pages(shape, 1, min_chunk)
    small_pages = shape.paged and shape.page_size < shape.block_n
    if not shape.paged or whole > 0 or not small_pages:
        return {"PRELOAD_PAGES": whole, "MAX_SPLIT_KEYS": 0}
    pages = _preload_pages(shape, num_splits, min_chunk)
    return {"PRELOAD_PAGES": pages, "MAX_SPLIT_KEYS": _max_split_keys(shape, num_splits, min_chunk) if pages else 0}


def _merge_tile(shape, num_splits) -> dict:
    """MERGE_M / MERGE_SPLITS / MERGE_BLOCK_S of the persistent kernel's in-kernel merge (kernels/decode.py
    _merge_if_last_ticket): the real rows of a row block padded to a power of two, the splits padded likewise, and
    the splits folded per step so that one step's tile holds _PERSISTENT_MERGE_TILE_ELEMS fp32 values, >= one
    split."""
    merge_m = min(shape.block_m, heuristics.next_power_of_2(shape.group * shape.seqlen_q))
    merge_splits = heuristics.next_power_of_2(num_splits)
    tile_elems = _PERSISTENT_MERGE_TILE_ELEMS
    return {"MERGE_M": merge_m, "MERGE_SPLITS": merge_splits,
            "MERGE_BLOCK_S": max(1, min(merge_splits, tile_elems // (merge_m * shape.block_d)))}


def _prefetch_shape(shape, k_cache, num_splits, min_chunk):
    """(PREFETCH_KEYS, LINE_ELEMS, NUM_LINES) of stage 1's pre-wait L2 prefetch: the first PREFETCH_BLOCKS blocks of
    a split, no more than a split can hold (a power of two, so a short split does not prefetch past its end
    repeatedly); 128-byte lines of one head-dim row."""
    if shape.prefetch_blocks <= 0:
        return 0, 64, 1
    chunk_max = _max_split_keys(shape, num_splits, min_chunk)
    keys = heuristics.next_power_of_2(min(shape.prefetch_blocks * shape.block_n, chunk_max))
    line_elems = 128 // k_cache.element_size()
    return keys, line_elems, heuristics.next_power_of_2(heuristics.cdiv(shape.headdim, line_elems))


# fp32 elements of the (rows, splits, headdim) tile the persistent kernel's merge folds per step: small, so that
# ptxas keeps every step's loads in flight without spilling (sm_90, bf16 hd128, 128-key tiles, 4 or 8 rows: 2048
# values per step compile without spills, 4096 spill 40-152 bytes).
_PERSISTENT_MERGE_TILE_ELEMS = 2048


# Pipeline depth that fitted in shared memory, per tile shape (only set after an OutOfResources).
_STAGES_THAT_FIT: dict = {}


def _launch_within_shared_memory(launch, num_stages, key):
    """launch(num_stages); if the tiles do not fit in shared memory (e.g. hd256 with 64 query rows), retry with
    fewer stages. The failure comes at compile/load time, before anything is enqueued, so this is safe during
    warm-up; the depth that fitted is remembered, so later (captured) calls launch directly."""
    from triton.runtime.errors import OutOfResources

    stages = min(num_stages, _STAGES_THAT_FIT.get(key, num_stages))
    while True:
        try:
            launch(stages)
            return
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            _STAGES_THAT_FIT[key] = stages


def _preload_pages(shape, num_splits, min_chunk) -> int:
    """Block-table entries one split can span (power of two), to hold in registers; 0 when too many (then the
    loop reads the block table). The bound comes from the capacity, a host-side shape: no sync."""
    page, block_n = shape.page_size, shape.block_n
    if not shape.paged or shape.preload_max <= 0:
        return 0
    key_ids = shape.preload_key_ids  # 1-, 2-, 4-key pages: one gathered id per key
    small_pages = (page < block_n and block_n % page == 0
                   and (page >= heuristics.DECODE_MIN_PRELOAD_PAGE or key_ids))
    if not (small_pages or page % block_n == 0):
        return 0  # e.g. pages of 3 keys: the loop reads page ids from memory
    chunk_max = _max_split_keys(shape, num_splits, min_chunk)
    # splits start at multiples of BLOCK_N: on a page boundary for pages that divide it, else possibly mid-page
    # (one page more)
    straddle = 0 if small_pages else 1
    pages = heuristics.next_power_of_2(max(heuristics.cdiv(chunk_max, page) + straddle, block_n // page))
    limit = shape.preload_gather_max if small_pages else shape.preload_max
    return pages if pages <= limit else 0


def _run_decode(shape, k_cache, v_cache, cache_seqlens, block_table, out4, lse3, partial_o, partial_lse,
                num_splits, min_chunk, tickets=None, policy_splits=False):
    """Stage 1 (+ stage 2 when num_splits > 1) into out4 (batch, seqlen_q, nheads, headdim) and lse3.
    With shape.persistent and num_splits > 1, one launch: the kernel merges in the last split of each row block,
    using ``tickets`` (int32 zeros, >= batch * nheads_kv * num_m_blocks; left zero again by the
    kernel). policy_splits: num_splits came from the split policy (not the caller), so that with
    shape.device_splits and more than one sequence the split grid may choose each sequence's count on the device
    (<= num_splits) instead."""
    if num_splits == 1:  # no partials, no second kernel
        _launch_stage1(shape, k_cache, v_cache, cache_seqlens, block_table, out4, lse3, 1, True, min_chunk)
        return
    if shape.persistent:  # one launch: the kernel merges the sequences that split
        _launch_persistent(shape, k_cache, v_cache, cache_seqlens, block_table, out4, lse3, partial_o, partial_lse,
                           tickets, num_splits, min_chunk)
        return
    device_preload = None
    if policy_splits and shape.device_splits and shape.batch > 1:
        device_preload = _device_split_preload(shape, num_splits, min_chunk)
    _launch_stage1(shape, k_cache, v_cache, cache_seqlens, block_table, partial_o, partial_lse, num_splits,
                   False, min_chunk, device_preload=device_preload)
    b, sq, h = shape.batch, shape.seqlen_q, shape.nheads
    launch_merge_many(
        partial_o.view(b * sq, h, num_splits, shape.headdim), partial_lse.view(b * sq, h, num_splits),
        _collapse_bt(out4), lse3.view(b * sq, h), states_dim=2, lse_log2=True, use_pdl=shape.use_pdl,
        early_trigger=shape.merge_early_trigger and shape.pdl_wait, d_chunks=shape.merge_d_chunks,
        max_rows=shape.merge_max_rows)


def _collapse_bt(x4):
    """(b, sq, h, d) -> (b * sq, h, d) as a view (checked collapsible by _DecodeShape.check_out), never a copy:
    the merge writes through it."""
    b, sq, h, d = x4.shape
    outer = x4.stride(1) if sq > 1 else x4.stride(0)
    return x4.as_strided((b * sq, h, d), (outer, x4.stride(2), x4.stride(3)), x4.storage_offset())


def _num_tickets(batch, seqlen_q, nheads, nheads_kv) -> int:
    """In-kernel merge counters: one per (batch, kv head, stage-1 row block) of a launch with seqlen_q new tokens,
    then the persistent kernel's work queue (_QUEUE_SLOTS counters)."""
    group_rows = (nheads // nheads_kv) * seqlen_q
    return batch * nheads_kv * heuristics.cdiv(group_rows, heuristics.decode_block_m(group_rows)) + _QUEUE_SLOTS


# the persistent kernel's work queue: the next item, and the programs that found none (kernels/decode.py DYNAMIC)
_QUEUE_SLOTS = 2
