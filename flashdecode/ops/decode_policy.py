"""The decode launch policy on the host: a call's validated shape facts (_DecodeShape), its stage-1 launch
config (heuristics.decode_block_config) and its split count."""

from __future__ import annotations

import torch

from flashdecode import heuristics
from flashdecode.ops import checks
from flashdecode.ops.decode_checks import (_cache_capacity, _check_cache_pair, _check_host_lengths,
                                           _check_lengths_and_table, check_out)

_DTYPES = checks.FLOAT_DTYPES
_MAX_HEADDIM = checks.MAX_HEAD_DIM
LOG2E = checks.LOG2E
_check_tensor, _interpreting = checks.check_tensor, checks.interpreting


def _pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch needs a Hopper (sm_90) or newer GPU and no interpreter (inline asm)."""
    return not _interpreting(device) and torch.cuda.get_device_capability(device)[0] >= 9


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
        # pages smaller than a block whose ids are gathered (a shared-memory lookup) may preload more of them
        self.preload_gather_max = cfg.get("PRELOAD_GATHER_MAX", self.preload_max)
        # L2 prefetch before the PDL wait (inline asm: GPU only) and the merge's early trigger that gives it time
        self.prefetch_blocks = int(cfg.get("PREFETCH_BLOCKS", 0)) if not _interpreting(self.device) else 0
        self.merge_early_trigger = bool(cfg.get("MERGE_EARLY_TRIGGER", False))
        self.merge_d_chunks = int(cfg.get("MERGE_D_CHUNKS", 1))
        self.merge_max_rows = int(cfg.get("MERGE_MAX_ROWS", 0))
        # one launch with device-side split counts (decode_persistent_kernel; the default on Hopper for half to
        # all of the SMs' worth of pairs); programs of its fixed grid (None: the SMs). Pages smaller than a block
        # only with PERSISTENT_GATHERED (heuristics: with the work queue; static shares measured slower on mixed
        # batches).
        self.persistent = (bool(cfg.get("PERSISTENT", False))
                           and (self.page_size % self.block_n == 0 or cfg.get("PERSISTENT_GATHERED", False)))
        self.persistent_programs = cfg.get("PERSISTENT_PROGRAMS") or heuristics.num_sms(self.device)
        # the persistent programs take work items from a queue (atomic counter) instead of static shares; split
        # counts divide persistent_slots slots per program, and equal lengths split up to queue_splits ways where
        # the queue's last round would idle the bandwidth (heuristics: more pairs than SMs, small pages from 3/4
        # of them, tile-multiple pages from 0.45)
        self.persistent_dynamic = bool(cfg.get("PERSISTENT_DYNAMIC", False))
        self.persistent_slots = int(cfg.get("PERSISTENT_SLOTS", 1)) if self.persistent_dynamic else 1
        self.queue_splits = int(cfg.get("PERSISTENT_QUEUE_SPLITS", 0)) if self.persistent_dynamic else 0
        # the split grid with split counts chosen on the device from all lengths, one program per work item (for
        # a policy split count at batch > 1, where a plan's count is sized for the worst mix; see _run_decode)
        self.device_splits = bool(cfg.get("DEVICE_SPLITS", False)) and not self.persistent
        self.device_split_slots = int(cfg.get("DEVICE_SPLIT_SLOTS") or heuristics.num_sms(self.device))
        # 32-bit gather offsets where the cache allows them (_offsets_fit_int32); the config can turn them off
        self.offs_32 = bool(cfg.get("OFFS_32", True)) and _offsets_fit_int32(k_cache)
        # the split's page ids read beside its length after the PDL wait, for the range the pre-wait length gives
        self.spec_pages = bool(cfg.get("SPEC_PAGES", False))

    def check_out(self, out, q):
        check_out(out, q, self.seqlen_q)



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
