"""flash_decode, DecodePlan and append_kv: input checks, split policy and launches of kernels/decode.py,
kernels/merge.py and kernels/append_kv.py.

Two ways to call decode attention:
  - ``flash_decode(...)``: convenient. Without ``num_splits`` or ``max_seqlen_k`` it reads cache_seqlens once on
    the host to choose the split count from the live lengths (one device->host sync), and allocates its outputs.
  - ``DecodePlan(...).run(...)`` (or ``flash_decode(..., plan=plan)``): CUDA-graph capturable. The plan fixes the
    split count from a host-side length hint and owns every buffer; each call is two launches with a fixed grid
    (stage 1 and the merge), or on Hopper, when batch x kv heads fills half to all of the SMs, one persistent
    launch that picks each sequence's split count on the device and merges in-kernel; lengths and block tables
    are read on the device, no host sync, no allocation. Capture once, change the contents of cache_seqlens /
    block_table, replay.
"""

from __future__ import annotations


import torch
import triton

from flashdecode import heuristics
from flashdecode.kernels.append_kv import append_kv_kernel
from flashdecode.kernels.decode import decode_persistent_kernel, decode_split_kernel
from flashdecode.ops import checks
from flashdecode.ops.merge import launch_merge_many

__all__ = ["flash_decode", "DecodePlan", "append_kv"]

_DTYPES = checks.FLOAT_DTYPES
_MAX_HEADDIM = checks.MAX_HEAD_DIM
LOG2E = checks.LOG2E
_check_tensor, _check_device, _interpreting, _full_device = (checks.check_tensor, checks.check_device,
                                                             checks.interpreting, checks.full_device)


def _pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch needs a Hopper (sm_90) or newer GPU and no interpreter (inline asm)."""
    return not _interpreting(device) and torch.cuda.get_device_capability(device)[0] >= 9


# ----------------------------------------------------------------------------------------------------------------
# Input checks (ValueError / TypeError naming the argument; host metadata only, never a device sync)
# ----------------------------------------------------------------------------------------------------------------

def _check_cache_pair(k_cache, v_cache, dtype, device):
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, x, (4,))
        if x.dtype != dtype:
            raise TypeError(f"{name} dtype {x.dtype} must match q / k_new dtype {dtype}")
        _check_device(name, x, device)
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on its last (head) dim, got strides {x.stride()}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must have the same shape and strides, got {tuple(k_cache.shape)} / "
                         f"{k_cache.stride()} and {tuple(v_cache.shape)} / {v_cache.stride()}")


def _check_lengths_and_table(cache_seqlens, block_table, batch, device):
    _check_tensor("cache_seqlens", cache_seqlens, (1,))
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens must have shape ({batch},), got {tuple(cache_seqlens.shape)}")
    _check_device("cache_seqlens", cache_seqlens, device)
    if block_table is not None:
        _check_tensor("block_table", block_table, (2,))
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape ({batch}, max_pages_per_seq), got "
                             f"{tuple(block_table.shape)}")
        if block_table.stride(-1) != 1:
            raise ValueError("block_table must have unit stride on its last dim")
        _check_device("block_table", block_table, device)


def _cache_capacity(k_cache, block_table, batch) -> int:
    """Keys one sequence's cache can hold: max_seqlen (contiguous) or pages_per_seq * page_size (paged)."""
    if block_table is None:
        if k_cache.shape[0] < batch:
            raise ValueError(f"contiguous k_cache holds {k_cache.shape[0]} sequences, fewer than batch {batch}")
        return k_cache.shape[1]
    return block_table.shape[1] * k_cache.shape[1]


def _check_host_lengths(cache_seqlens, capacity, added=0, name="cache_seqlens"):
    """Lengths that live on the host are checked against the capacity (device lengths cannot be, without a sync:
    the kernels clamp them to the capacity instead)."""
    if not checks.host_resident(cache_seqlens) or cache_seqlens.numel() == 0:
        return
    lo, hi = int(cache_seqlens.min()), int((cache_seqlens + added).max())
    if lo < 0:
        raise ValueError(f"{name} must be >= 0, got a minimum of {lo}")
    if hi > capacity:
        raise ValueError(f"{name} asks for {hi} keys but the cache holds {capacity} per sequence")


class _DecodeShape:
    """The host-side facts of one decode call, validated."""

    def __init__(self, q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, softcap, window_size,
                 grid_batch=None, split_keys=None):
        """grid_batch: the batch the tile config is chosen for (a plan's max_batch, so that one plan always
        launches one kernel variant); default q's batch. split_keys: host estimate of live keys per split (None:
        not known yet; see configure)."""
        _check_tensor("q", q, (3, 4), _DTYPES)
        self.q4 = q.unsqueeze(1) if q.dim() == 3 else q
        self.batch, self.seqlen_q, self.nheads, self.headdim = self.q4.shape
        self.device = q.device
        _check_cache_pair(k_cache, v_cache, q.dtype, self.device)
        self.nheads_kv = k_cache.shape[2]
        if k_cache.shape[3] != self.headdim:
            raise ValueError(f"k_cache head dim {k_cache.shape[3]} must match q head dim {self.headdim}")
        if not 1 <= self.headdim <= _MAX_HEADDIM:
            raise ValueError(f"head dim must be in 1..{_MAX_HEADDIM}, got {self.headdim}")
        if self.nheads % self.nheads_kv != 0:
            raise ValueError(f"q heads ({self.nheads}) must be a multiple of the cache's kv heads ({self.nheads_kv})")
        if self.seqlen_q < 1:
            raise ValueError("q must hold at least one token per sequence")
        _check_lengths_and_table(cache_seqlens, block_table, self.batch, self.device)
        self.paged = block_table is not None
        self.page_size = k_cache.shape[1] if self.paged else 0
        self.capacity = _cache_capacity(k_cache, block_table, self.batch)
        _check_host_lengths(cache_seqlens, self.capacity)
        self.softcap = checks.check_softcap(softcap)
        self.window_left = checks.check_window(window_size)[0]
        self.scale = checks.resolve_scale(softmax_scale, self.headdim)
        # stage 1's logit scale (softcap: tanh's argument, else log2 units for exp2) and the softcap in log2 units
        self.score_scale = self.scale / self.softcap if self.softcap > 0 else self.scale * LOG2E
        self.softcap_log2 = self.softcap * LOG2E
        self.group = self.nheads // self.nheads_kv
        self.block_m = heuristics.decode_block_m(self.group * self.seqlen_q)
        self.num_m_blocks = heuristics.cdiv(self.group * self.seqlen_q, self.block_m)
        self.grid_batch = grid_batch or self.batch
        self.kv_pairs = self.grid_batch * self.nheads_kv * self.num_m_blocks
        self.block_d = heuristics.next_power_of_2(max(16, self.headdim))
        self._k_cache = k_cache
        self.configure(split_keys)

    def configure(self, split_keys):
        """(Re)choose the stage-1 launch config (heuristics.decode_block_config) for an estimate of the live keys
        per split (None: unknown); split-dependent choices (tile at batch for gathered pages, the merge's early
        trigger) need it, so the convenience path calls this again once it has picked its split count."""
        k_cache = self._k_cache
        cfg = heuristics.decode_block_config(self.headdim, k_cache.element_size(), _interpreting(self.device),
                                             kv_pairs=self.kv_pairs, num_sms=heuristics.num_sms(self.device),
                                             page_size=self.page_size, split_keys=split_keys)
        self.block_n, self.num_warps, self.num_stages = cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]
        # deeper software pipeline where the KV loop reads page ids from the block table (see _pipeline_stages)
        self.table_read_extra_stages = int(cfg.get("TABLE_READ_EXTRA_STAGES", 0))
        self.table_read_min_split_blocks = int(cfg.get("TABLE_READ_MIN_SPLIT_BLOCKS", 0))
        # pages smaller than DECODE_MIN_PRELOAD_PAGE (1, 2, 4 keys) preload their ids too (gather path only)
        self.preload_key_ids = bool(cfg.get("PRELOAD_KEY_IDS", False))
        self.use_tma = cfg.get("USE_TMA", False) and _tma_compatible(k_cache, self.page_size, self.block_n,
                                                                    self.block_d)
        self.use_pdl = cfg.get("USE_PDL", False) and _pdl_capable(self.device)
        self.pdl_wait = cfg.get("PDL_WAIT", False) and _pdl_capable(self.device)
        self.preload_max = cfg.get("PRELOAD_PAGES_MAX", 0)
        # pages smaller than a block whose ids are gathered (PAGE_GATHER: a shared-memory lookup, not a select
        # over every preloaded id) may preload more of them
        self.preload_gather_max = cfg.get("PRELOAD_GATHER_MAX", self.preload_max)
        self.fused_merge = bool(cfg.get("FUSED_MERGE", False))
        # L2 prefetch before the PDL wait (inline asm: GPU only) and the merge's early trigger that gives it time
        self.prefetch_blocks = int(cfg.get("PREFETCH_BLOCKS", 0)) if not _interpreting(self.device) else 0
        self.merge_early_trigger = bool(cfg.get("MERGE_EARLY_TRIGGER", False))
        self.merge_d_chunks = int(cfg.get("MERGE_D_CHUNKS", 1))
        self.merge_max_rows = int(cfg.get("MERGE_MAX_ROWS", 0))
        # one launch with device-side split counts (decode_persistent_kernel; the default on Hopper for half to
        # all of the SMs' worth of pairs); programs of its fixed grid (None: the SMs). Pages smaller than a block
        # only with PERSISTENT_GATHERED (heuristics: with the work queue; static shares measured slower on mixed
        # batches).
        self.persistent = (bool(cfg.get("PERSISTENT", False)) and not self.fused_merge
                           and (self.page_size % self.block_n == 0 or cfg.get("PERSISTENT_GATHERED", False)))
        self.persistent_programs = cfg.get("PERSISTENT_PROGRAMS") or heuristics.num_sms(self.device)
        # the persistent programs take work items from a queue (atomic counter) instead of static shares; split
        # counts divide persistent_slots slots per program, and equal lengths split up to queue_splits ways where
        # the queue's last round would idle the bandwidth (heuristics: more pairs than SMs, small pages from 3/4
        # of them, tile-multiple pages from 0.45)
        self.persistent_dynamic = bool(cfg.get("PERSISTENT_DYNAMIC", False))
        self.persistent_slots = int(cfg.get("PERSISTENT_SLOTS", 1)) if self.persistent_dynamic else 1
        self.queue_splits = int(cfg.get("PERSISTENT_QUEUE_SPLITS", 0)) if self.persistent_dynamic else 0
        # block-multiple pages whose whole-sequence ids do not fit the preload: bounded splits (see
        # _persistent_preload) rather than one block-table read per block in the loop
        self.persistent_bound_pages = bool(cfg.get("PERSISTENT_BOUND_PAGES", False))
        # each key's page id by one tl.gather from the split's preloaded ids (else select-and-sum steps)
        self.page_gather = bool(cfg.get("PAGE_GATHER", True))
        # the split grid with split counts chosen on the device from all lengths, one program per work item (for
        # a policy split count at batch > 1, where a plan's count is sized for the worst mix; see _run_decode)
        self.device_splits = (bool(cfg.get("DEVICE_SPLITS", False)) and not self.persistent
                              and not self.fused_merge)
        self.device_split_slots = int(cfg.get("DEVICE_SPLIT_SLOTS") or heuristics.num_sms(self.device))
        # 32-bit gather offsets where the cache allows them (_offsets_fit_int32); the config can turn them off
        self.offs_32 = bool(cfg.get("OFFS_32", True)) and _offsets_fit_int32(k_cache)
        # the split's page ids read beside its length after the PDL wait, for the range the pre-wait length gives
        self.spec_pages = bool(cfg.get("SPEC_PAGES", False))

    def check_out(self, out, q):
        if out is None:
            return
        _check_tensor("out", out, (q.dim(),))
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} "
                             f"{out.dtype} on {out.device}")
        if q.dim() == 4 and self.seqlen_q > 1 and out.stride(0) != self.seqlen_q * out.stride(1):
            raise ValueError("out must have collapsible (batch, seqlen_q) dims (e.g. be contiguous)")


def _block_config(headdim, elem_bytes, device, kv_pairs) -> dict:
    """heuristics.decode_block_config for this device and (batch x kv heads x row blocks) programs per split."""
    return heuristics.decode_block_config(headdim, elem_bytes, _interpreting(device), kv_pairs=kv_pairs,
                                          num_sms=heuristics.num_sms(device))


def _offsets_fit_int32(k_cache) -> bool:
    """Whether every element offset into the cache (K and V share its shape and strides) is below 2**31, so that
    the kernels may address it with 32-bit offsets from its base pointer."""
    last = sum((n - 1) * st for n, st in zip(k_cache.shape, k_cache.stride()) if n > 0)
    return k_cache.numel() > 0 and last < 2**31


def _tma_compatible(k_cache, page_size, block_n, block_d) -> bool:
    """The TMA path views the cache as 2-D (rows, nheads_kv * headdim): rows of one sequence (or page) must be
    consecutive, the head dim a power of two (one box), and a block must not straddle a page."""
    _, rows, hk, d = k_cache.shape
    dense = k_cache.stride(2) == d and k_cache.stride(1) == hk * d and k_cache.stride(0) == rows * hk * d
    aligned = k_cache.data_ptr() % 16 == 0 and (hk * d * k_cache.element_size()) % 16 == 0
    pages_ok = page_size == 0 or page_size % block_n == 0
    return dense and aligned and pages_ok and d == block_d


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


# ----------------------------------------------------------------------------------------------------------------
# Launches
# ----------------------------------------------------------------------------------------------------------------

def _launch_stage1(shape: _DecodeShape, k_cache, v_cache, cache_seqlens, block_table, o4, lse3, num_splits,
                   final: bool, min_chunk: int, fused=None, device_preload=None):
    """o4/lse3: (batch, seqlen_q, nheads[, splits], headdim) views (final output, or fp32 partials).
    fused: None, or (out4 (batch, seqlen_q, nheads, headdim), lse_out (batch, seqlen_q, nheads) fp32, tickets int32
    (>= batch * nheads_kv * num_m_blocks,) zeros) for the single-launch FUSED_MERGE path.
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
    fo4, flse3, tickets = fused if fused is not None else (o4, lse3, cache_seqlens)  # unused when not fused
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
        q4, k_src, v_src, cache_seqlens, bt, o4, lse3, fo4, flse3, tickets, k_cache, v_cache,
        shape.score_scale, shape.softcap_log2, max(shape.window_left, 0), shape.capacity, k_cache.shape[0],
        k_cache.stride(0), shape.batch,
        q4.stride(0), q4.stride(1), q4.stride(2), q4.stride(3),
        stride_kb, k_cache.stride(1), k_cache.stride(2),
        bt.stride(0) if block_table is not None else 0,
        o4.stride(0), o4.stride(1), o4.stride(2), stride_os, stride_od,
        lse3.stride(0), lse3.stride(1), lse3.stride(2), stride_ls, *_final_strides(fo4, flse3),
        SEQLEN_Q=shape.seqlen_q, GROUP=shape.group, NUM_M_BLOCKS=shape.num_m_blocks,
        HEADDIM=shape.headdim, BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, BLOCK_D=shape.block_d,
        NUM_SPLITS=num_splits, MIN_CHUNK=min_chunk, PAGE_SIZE=shape.page_size,
        SOFTCAP=shape.softcap > 0, WINDOW=shape.window_left >= 0, FINAL=final,
        DOT_PRECISION="ieee" if q4.dtype == torch.float32 else "tf32", USE_TMA=shape.use_tma,
        USE_PDL=shape.use_pdl and not final and fused is None, PDL_WAIT=pdl_wait,
        PRELOAD_PAGES=preload_pages,
        FUSED_MERGE=fused is not None, **_merge_tile(shape, num_splits),
        PREFETCH_KEYS=prefetch_keys, LINE_ELEMS=line_elems, NUM_LINES=num_lines,
        PAGE_GATHER=shape.page_gather, OFFS_32=shape.offs_32, SPEC_PAGES=shape.spec_pages, **device,
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
        PAGE_GATHER=shape.page_gather, OFFS_32=shape.offs_32,
        **_merge_tile(shape, num_splits, tile_elems=_PERSISTENT_MERGE_TILE_ELEMS),
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
    keys (num_splits splits always fit), or, when even that is too many, the loop reads the ids (one per block for
    block-multiple pages, one per key for smaller ones). Block-multiple pages are bounded only with the config's
    PERSISTENT_BOUND_PAGES (heuristics: 64-key pages in 64-key tiles beyond the SMs). H100, Llama 32/8 32k, us,
    bounded vs one id read per block in the loop (decodetune T1949): page 64 b32 1457.8 vs 1627.2, b8 (forced
    persistent) 383.3 vs 410.4; but page 128 b16 735.7 vs 705.4 and b32 1426.9 vs 1411.0."""
    whole = _preload_pages(shape, 1, min_chunk)
    small_pages = shape.paged and shape.page_size < shape.block_n
    if not shape.paged or whole > 0 or not (small_pages or shape.persistent_bound_pages):
        return {"PRELOAD_PAGES": whole, "MAX_SPLIT_KEYS": 0}
    pages = _preload_pages(shape, num_splits, min_chunk)
    return {"PRELOAD_PAGES": pages, "MAX_SPLIT_KEYS": _max_split_keys(shape, num_splits, min_chunk) if pages else 0}


def _merge_tile(shape, num_splits, tile_elems=None) -> dict:
    """MERGE_M / MERGE_SPLITS / MERGE_BLOCK_S of the in-kernel merge (kernels/decode.py _merge_if_last_ticket): the
    real rows of a row block padded to a power of two, the splits padded likewise, and the splits folded per step
    so that one step's tile holds ``tile_elems`` (default _FUSED_MERGE_TILE_ELEMS) fp32 values, >= one split."""
    merge_m = min(shape.block_m, heuristics.next_power_of_2(shape.group * shape.seqlen_q))
    merge_splits = heuristics.next_power_of_2(num_splits)
    tile_elems = _FUSED_MERGE_TILE_ELEMS if tile_elems is None else tile_elems
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


# fp32 elements of the (rows, splits, headdim) tile the FUSED_MERGE epilogue folds per unrolled step: small, so that
# ptxas can keep the loads of every step in flight at once without spilling (sm_90 compile: 8192 spills at 32+ splits).
_FUSED_MERGE_TILE_ELEMS = 4096

# The same for the persistent kernel, whose work-item loop keeps more registers live: sm_90, bf16 hd128, 128-key
# tiles, 4 or 8 rows: 2048 values per step compile without spills, 4096 spill 40-152 bytes.
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
    key_ids = shape.preload_key_ids and shape.page_gather  # 1-, 2-, 4-key pages: one gathered id per key
    small_pages = (page < block_n and block_n % page == 0
                   and (page >= heuristics.DECODE_MIN_PRELOAD_PAGE or key_ids))
    if not (small_pages or page % block_n == 0):
        return 0  # e.g. pages of 3 keys: the loop reads page ids from memory
    chunk_max = _max_split_keys(shape, num_splits, min_chunk)
    # splits start at multiples of BLOCK_N: on a page boundary for pages that divide it, else possibly mid-page
    # (one page more)
    straddle = 0 if small_pages else 1
    pages = heuristics.next_power_of_2(max(heuristics.cdiv(chunk_max, page) + straddle, block_n // page))
    limit = shape.preload_gather_max if small_pages and shape.page_gather else shape.preload_max
    return pages if pages <= limit else 0


def _run_decode(shape, k_cache, v_cache, cache_seqlens, block_table, out4, lse3, partial_o, partial_lse,
                num_splits, min_chunk, tickets=None, policy_splits=False):
    """Stage 1 (+ stage 2 when num_splits > 1) into out4 (batch, seqlen_q, nheads, headdim) and lse3.
    With shape.fused_merge or shape.persistent and num_splits > 1, one launch: stage 1 merges in its last program
    per row block, using ``tickets`` (int32 zeros, >= batch * nheads_kv * num_m_blocks; left zero again by the
    kernel). policy_splits: num_splits came from the split policy (not the caller), so that with
    shape.device_splits and more than one sequence the split grid may choose each sequence's count on the device
    (<= num_splits) instead."""
    if num_splits == 1:  # no partials, no second kernel
        _launch_stage1(shape, k_cache, v_cache, cache_seqlens, block_table, out4, lse3, 1, True, min_chunk)
        return
    if shape.fused_merge:
        _launch_stage1(shape, k_cache, v_cache, cache_seqlens, block_table, partial_o, partial_lse, num_splits,
                       False, min_chunk, fused=(out4, lse3, tickets))
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


def _min_chunk(shape) -> int:
    """Fewest keys a non-empty split holds (the kernel's MIN_CHUNK): with a plan's fixed split count, short
    sequences then use fewer splits instead of many tiny ones."""
    return shape.block_n * heuristics.DECODE_MIN_BLOCKS_PER_SPLIT


def _choose_splits(shape, cache_seqlens, num_splits, max_seqlen_k):
    """(splits, live keys bound). splits as given, else from the live lengths: max_seqlen_k if given, else one read
    of cache_seqlens. The bound is max_seqlen_k (or the cache capacity when neither it nor the policy read the
    lengths), for split-dependent launch choices."""
    if num_splits is not None:
        if int(num_splits) < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        bound = shape.capacity if max_seqlen_k is None else min(int(max_seqlen_k), shape.capacity)
        return int(num_splits), bound
    total = None
    if max_seqlen_k is None:
        lengths = cache_seqlens.to("cpu", torch.int64)  # the one host sync of the convenience path
        max_seqlen_k, total = int(lengths.max()) if lengths.numel() else 0, int(lengths.sum())
        if max_seqlen_k > shape.capacity:
            raise ValueError(f"cache_seqlens asks for {max_seqlen_k} keys but the cache holds {shape.capacity}")
    live = min(int(max_seqlen_k), shape.capacity)
    return _policy_splits(shape, live, total, shape.batch), live


def _policy_splits(shape, max_seqlen_k, total_seqlen_k, batch):
    if shape.window_left >= 0:  # only the window's keys are live
        max_seqlen_k = min(max_seqlen_k, shape.window_left + shape.seqlen_q)
        total_seqlen_k = None
    return heuristics.decode_num_splits(
        batch, shape.nheads_kv * shape.num_m_blocks, max_seqlen_k, heuristics.num_sms(shape.device),
        block_n=shape.block_n, min_blocks_per_split=heuristics.DECODE_MIN_BLOCKS_PER_SPLIT,
        total_seqlen_k=total_seqlen_k, max_splits=heuristics.DECODE_MAX_SPLITS)


def _lse_view(lse3, q):
    return lse3[:, 0] if q.dim() == 3 else lse3


def flash_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None, num_splits=None,
                 softcap=0.0, window_size=(-1, -1), return_lse=False, out=None, max_seqlen_k=None, plan=None):
    """Flash-Decoding: attention of a few new query tokens against a KV cache, split over the KV length.

    Args:
        q: (batch, nheads, headdim) or (batch, seqlen_q, nheads, headdim) fp16/bf16/fp32; the seqlen_q tokens are
            the LAST seqlen_q positions of each sequence and are causal among themselves (bottom-right aligned).
        k_cache, v_cache: same dtype as q, same shape and strides, unit stride on headdim. Contiguous
            (batch_cache >= batch, max_seqlen, nheads_kv, headdim), or paged (num_pages, page_size, nheads_kv,
            headdim) when ``block_table`` is given. nheads % nheads_kv == 0 (GQA/MQA, any group size).
        cache_seqlens: int32 (batch,) on q's device: live keys per sequence INCLUDING the seqlen_q new ones
            (call append_kv first). 0 is allowed (out 0, lse -inf). Values on the host are checked against the
            capacity; values on the device are clamped to it by the kernel (too-long lengths cannot be detected
            without a sync).
        block_table: int32 (batch, max_pages_per_seq) page ids (paged cache only); any page_size >= 1.
        softmax_scale: default headdim ** -0.5. softcap: logits -> softcap * tanh(logits / softcap), 0 = off.
        window_size: (left, right); left >= 0 restricts row i to keys >= its position - left. right is moot:
            decode rows see no keys after their own position.
        num_splits: KV splits per sequence; None = heuristic from the live lengths, 1 = one kernel, no merge.
        max_seqlen_k: optional host-side bound on cache_seqlens for the heuristic (avoids its one host sync).
        plan: a DecodePlan; the call then runs plan.run(...) (capturable, buffers owned by the plan).
        out: optional output tensor like q.
    Returns:
        out like q, and if return_lse, lse float32 (batch, [seqlen_q,] nheads), natural log.
    """
    if plan is not None:
        if num_splits is not None or max_seqlen_k is not None:
            raise ValueError("num_splits / max_seqlen_k are fixed by the plan; do not pass them with plan=")
        return plan.run(q, k_cache, v_cache, cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
                        softcap=softcap, window_size=window_size, return_lse=return_lse, out=out)
    shape = _DecodeShape(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, softcap, window_size)
    shape.check_out(out, q)
    splits, live_keys = _choose_splits(shape, cache_seqlens, num_splits, max_seqlen_k)
    shape.configure(heuristics.cdiv(max(live_keys, 1), splits))
    b, sq, h, d = shape.q4.shape
    out = torch.empty_like(q) if out is None else out
    out4 = out.unsqueeze(1) if q.dim() == 3 else out
    lse3 = torch.empty((b, sq, h), dtype=torch.float32, device=q.device)
    partial_o = partial_lse = None
    if splits > 1:
        partial_o = torch.empty((b, sq, h, splits, d), dtype=torch.float32, device=q.device)
        partial_lse = torch.empty((b, sq, h, splits), dtype=torch.float32, device=q.device)
    tickets = None
    if splits > 1 and (shape.fused_merge or shape.persistent):
        tickets = torch.zeros(_num_tickets(b, sq, h, shape.nheads_kv), dtype=torch.int32, device=q.device)
    _run_decode(shape, k_cache, v_cache, cache_seqlens, block_table, out4, lse3, partial_o, partial_lse, splits,
                _min_chunk(shape), tickets, policy_splits=num_splits is None)
    return (out, _lse_view(lse3, q)) if return_lse else out


def _num_tickets(batch, seqlen_q, nheads, nheads_kv) -> int:
    """In-kernel merge counters: one per (batch, kv head, stage-1 row block) of a launch with seqlen_q new tokens,
    then the persistent kernel's work queue (_QUEUE_SLOTS counters)."""
    group_rows = (nheads // nheads_kv) * seqlen_q
    return batch * nheads_kv * heuristics.cdiv(group_rows, heuristics.decode_block_m(group_rows)) + _QUEUE_SLOTS


# the persistent kernel's work queue: the next item, and the programs that found none (kernels/decode.py DYNAMIC)
_QUEUE_SLOTS = 2


class DecodePlan:
    """Workspace for CUDA-graph-capturable decode (FlashInfer's plan/run idea).

    Sized once for (max_batch, max_seqlen_q, nheads, headdim) and a split count chosen on the host from
    ``max_seqlen_k`` (the longest context the plan expects; lengths beyond it stay correct, only the split count
    may be less than ideal). With ``balance_mixed=True`` the split count also covers one long sequence among
    short ones (about num_sms / nheads_kv splits; the kernel gives short sequences fewer splits by itself). The
    price is paid by large uniform batches of long sequences, which then split when they need not: measured on the
    H100 at 32/8 heads, 8k context, +8% at batch 16 and +5% at batch 64 vs num_splits=1, while one 128k sequence
    among 15 of 1k ran 9.5x faster than unsplit. Every ``run`` then launches a fixed grid (num_splits, nheads_kv,
    batch) + the merge - or, where the heuristics say so, a grid whose split counts (<= num_splits) follow the live
    lengths on the device (contiguous caches and tile-multiple pages at a quarter to a third of the SMs' worth of
    (batch, kv head) pairs), or on Hopper with more pairs one persistent launch of num_sms programs that does the
    same and merges in-kernel, so uniform batches do not pay for balance_mixed - reads cache_seqlens / block_table
    on the device, and writes into buffers owned by the plan: no host sync, no allocation, capturable. The returned
    tensors are views of those buffers and are overwritten by the next run. ``use_pdl`` forces the programmatic
    dependent launches on or off (the merge after stage 1; False also stops stage 1 from being a dependent of the
    kernel before it; None: the heuristics' defaults; ignored where the GPU or the interpreter cannot do it).
    The one-launch paths (the persistent kernel, or the config's opt-in FUSED_MERGE) merge after int32 ticket
    counters owned by the plan, zero at rest (each run leaves them zero again).
    """

    def __init__(self, max_batch: int, nheads: int, nheads_kv: int, headdim: int, *, max_seqlen_k: int,
                 dtype=torch.bfloat16, device="cuda", max_seqlen_q: int = 1, num_splits: int | None = None,
                 balance_mixed: bool = True, use_pdl: bool | None = None):
        if max_batch < 1 or nheads < 1 or nheads_kv < 1 or max_seqlen_q < 1:
            raise ValueError("max_batch, nheads, nheads_kv and max_seqlen_q must be >= 1")
        if nheads % nheads_kv:
            raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
        if dtype not in _DTYPES:
            raise TypeError(f"dtype must be one of {_DTYPES}, got {dtype}")
        self.max_batch, self.nheads, self.nheads_kv, self.headdim = max_batch, nheads, nheads_kv, headdim
        self.max_seqlen_q, self.dtype, self.device = max_seqlen_q, dtype, _full_device(device)
        self.max_seqlen_k = max_seqlen_k
        # Programmatic dependent launch of the merge (Hopper+): None = the heuristics' default.
        self.use_pdl = use_pdl if use_pdl is None else bool(use_pdl) and _pdl_capable(self.device)
        self.num_splits = num_splits if num_splits is not None else self._default_splits(balance_mixed)
        self._policy_splits = num_splits is None  # the device may then choose fewer per sequence
        if self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        rows = max_batch * max_seqlen_q * nheads
        f32 = dict(dtype=torch.float32, device=self.device)
        self._out = torch.empty(rows * headdim, dtype=dtype, device=self.device)
        self._lse = torch.empty(rows, **f32)
        splits = self.num_splits if self.num_splits > 1 else 0
        self._partial_o = torch.empty(rows * splits * headdim, **f32)
        self._partial_lse = torch.empty(rows * splits, **f32)
        # FUSED_MERGE ticket counters (zeros; every fused launch leaves them zero again). Row blocks per kv head
        # never decrease with seqlen_q, so sizing for max_seqlen_q covers every run.
        self._tickets = torch.zeros(_num_tickets(max_batch, max_seqlen_q, nheads, nheads_kv),
                                    dtype=torch.int32, device=self.device)

    def _default_splits(self, balance_mixed):
        group_rows = (self.nheads // self.nheads_kv) * self.max_seqlen_q
        kv_programs = self.nheads_kv * heuristics.cdiv(group_rows, heuristics.decode_block_m(group_rows))
        cfg = _block_config(self.headdim, torch.empty((), dtype=self.dtype).element_size(), self.device,
                            self.max_batch * kv_programs)
        sms = heuristics.num_sms(self.device)
        kw = dict(block_n=cfg["BLOCK_N"], max_splits=heuristics.DECODE_MAX_SPLITS,
                  min_blocks_per_split=heuristics.DECODE_MIN_BLOCKS_PER_SPLIT)
        splits = heuristics.decode_num_splits(self.max_batch, kv_programs, self.max_seqlen_k, sms, **kw)
        if balance_mixed:  # the worst mix: one max-length sequence, the others nearly empty
            splits = max(splits, heuristics.decode_num_splits(self.max_batch, kv_programs, self.max_seqlen_k, sms,
                                                              total_seqlen_k=self.max_seqlen_k, **kw))
        return splits

    def run(self, q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None, softcap=0.0,
            window_size=(-1, -1), return_lse=False, out=None):
        """flash_decode with the plan's split count and buffers (same arguments and results)."""
        shape = _DecodeShape(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, softcap, window_size,
                             grid_batch=self.max_batch,
                             split_keys=heuristics.cdiv(max(self.max_seqlen_k, 1), self.num_splits))
        shape.check_out(out, q)
        if self._policy_splits and shape.device_splits and shape.batch > 1:
            # tiles for the splits the device gives equal lengths, not for the plan's count (sized for a mix)
            shape.configure(heuristics.cdiv(max(self.max_seqlen_k, 1), _device_uniform_splits(shape, self.num_splits)))
        if self.use_pdl is not None:  # False also keeps stage 1 from waiting on the previous kernel
            shape.use_pdl = self.use_pdl
            shape.pdl_wait = shape.pdl_wait and self.use_pdl
        b, sq, h, d = shape.q4.shape
        if b > self.max_batch or sq > self.max_seqlen_q or h != self.nheads or d != self.headdim \
                or shape.nheads_kv != self.nheads_kv or q.dtype != self.dtype or q.device != self.device:
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} on {q.device} does not fit this plan (max_batch "
                             f"{self.max_batch}, max_seqlen_q {self.max_seqlen_q}, heads {self.nheads}/"
                             f"{self.nheads_kv}, headdim {self.headdim}, {self.dtype} on {self.device})")
        rows = b * sq * h
        if out is None:
            out = self._out[: rows * d].view(q.shape)
        out4 = out.unsqueeze(1) if q.dim() == 3 else out
        lse3 = self._lse[:rows].view(b, sq, h)
        s = self.num_splits
        partial_o = self._partial_o[: rows * s * d].view(b, sq, h, s, d) if s > 1 else None
        partial_lse = self._partial_lse[: rows * s].view(b, sq, h, s) if s > 1 else None
        _run_decode(shape, k_cache, v_cache, cache_seqlens, block_table, out4, lse3, partial_o, partial_lse, s,
                    _min_chunk(shape), self._tickets, policy_splits=self._policy_splits)
        return (out, _lse_view(lse3, q)) if return_lse else out


# ----------------------------------------------------------------------------------------------------------------
# append_kv
# ----------------------------------------------------------------------------------------------------------------

def append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=None, *, cu_seqlens_new=None,
              max_seqlen_new=None):
    """Write new K/V tokens into a contiguous or paged cache, one launch, in place.

    Args:
        k_cache, v_cache: contiguous (batch_cache, max_seqlen, nheads_kv, headdim) or paged (num_pages,
            page_size, nheads_kv, headdim) with ``block_table`` int32 (batch, max_pages_per_seq).
        k_new, v_new: same dtype. Dense: (batch, seqlen_new, nheads_kv, headdim). Varlen/packed (e.g. a whole
            ragged prefill): (total, nheads_kv, headdim) with ``cu_seqlens_new`` int32 (batch + 1,) giving each
            sequence's rows [cu[b], cu[b+1]).
        cache_seqlens: int32 (batch,): each sequence's length BEFORE the append. Token i of sequence b is written
            at position cache_seqlens[b] + i. cache_seqlens is NOT modified (the caller advances it, e.g. before
            flash_decode, whose cache_seqlens counts the new tokens).
        max_seqlen_new: optional host bound on the varlen lengths (sizes the grid; default the packed total, which
            is always enough but launches idle programs).
    Positions past the cache's capacity raise ValueError when cache_seqlens (and cu_seqlens_new) are on the host;
    with device tensors they are skipped by the kernel (not written), since checking would need a host sync.
    """
    _check_tensor("k_new", k_new, (3, 4), _DTYPES)
    device = k_new.device
    _check_cache_pair(k_cache, v_cache, k_new.dtype, device)
    _check_tensor("v_new", v_new, (k_new.dim(),))
    if v_new.shape != k_new.shape or v_new.dtype != k_new.dtype or v_new.device != device:
        raise ValueError(f"v_new must match k_new ({tuple(k_new.shape)}, {k_new.dtype}), got "
                         f"{tuple(v_new.shape)}, {v_new.dtype} on {v_new.device}")
    if k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
        raise ValueError("k_new and v_new must have unit stride on their last (head) dim")
    varlen = cu_seqlens_new is not None
    if varlen != (k_new.dim() == 3):
        raise ValueError("k_new must be (total, nheads_kv, headdim) with cu_seqlens_new, or (batch, seqlen_new, "
                         f"nheads_kv, headdim) without it; got shape {tuple(k_new.shape)} and cu_seqlens_new "
                         f"{'given' if varlen else 'None'}")
    if tuple(k_new.shape[-2:]) != tuple(k_cache.shape[-2:]):
        raise ValueError(f"k_new (nheads_kv, headdim) {tuple(k_new.shape[-2:])} must match the cache's "
                         f"{tuple(k_cache.shape[-2:])}")
    if varlen:
        _check_tensor("cu_seqlens_new", cu_seqlens_new, (1,))
        if cu_seqlens_new.dtype != torch.int32:
            raise TypeError(f"cu_seqlens_new must be int32, got {cu_seqlens_new.dtype}")
        _check_device("cu_seqlens_new", cu_seqlens_new, device)
        batch = cu_seqlens_new.shape[0] - 1
        max_new = int(max_seqlen_new) if max_seqlen_new is not None else k_new.shape[0]
        added = (cu_seqlens_new[1:] - cu_seqlens_new[:-1]) if checks.host_resident(cu_seqlens_new) else 0
    else:
        batch, max_new, added = k_new.shape[0], k_new.shape[1], k_new.shape[1]
    _check_lengths_and_table(cache_seqlens, block_table, batch, device)
    capacity = _cache_capacity(k_cache, block_table, batch)
    _check_host_lengths(cache_seqlens, capacity, added)
    if batch == 0 or max_new == 0:
        return
    page_size = k_cache.shape[1] if block_table is not None else 0
    headdim, nheads_kv = k_new.shape[-1], k_new.shape[-2]
    block_t = 16 if _interpreting(device) else 32
    bt = block_table if block_table is not None else cache_seqlens
    cu = cu_seqlens_new if varlen else cache_seqlens
    kb = (0, k_new.stride(0), k_new.stride(1)) if varlen else (k_new.stride(0), k_new.stride(1), k_new.stride(2))
    vb = (0, v_new.stride(0), v_new.stride(1)) if varlen else (v_new.stride(0), v_new.stride(1), v_new.stride(2))
    grid = (batch, triton.cdiv(max_new, block_t), nheads_kv)
    append_kv_kernel[grid](
        k_new, v_new, k_cache, v_cache, cache_seqlens, cu, bt, capacity, 0 if varlen else k_new.shape[1],
        k_new.shape[0], k_cache.shape[0],
        *kb, *vb, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        bt.stride(0) if block_table is not None else 0,
        HEADDIM=headdim, BLOCK_T=block_t, BLOCK_D=heuristics.next_power_of_2(max(16, headdim)),
        PAGE_SIZE=page_size, VARLEN=varlen, num_warps=4,
    )
