"""Decode launches for a resolved DecodeConfig: stage 1 (decode_split_kernel: unsplit, the split grid or the
device-split grid), the persistent kernel (decode_persistent_kernel) and the merge. ``DecodeLaunch`` holds the
geometry that follows from a config and the shapes (computed once, by plan_launch); nothing here chooses,
except the one named fallback of a pipeline depth that does not fit in shared memory
(_launch_fitting_shared_memory)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from flashdecode import heuristics
from flashdecode.config import DecodeConfig, DecodePath
from flashdecode.kernels.decode import decode_persistent_kernel, decode_split_kernel
from flashdecode.kernels.decode_args import (DeviceSplits, MergeTile, Pages, Pdl, Prefetch, QuantTiles, Rows, Splits,
                                             Tile, WorkSchedule)
from flashdecode.ops.decode_workspace import QUEUE_SLOTS
from flashdecode.ops.kv_quant import kv_quant_kernel_args
from flashdecode.ops.launch_cache import BoundLaunch, LaunchSite
from flashdecode.ops.merge import launch_merge_many, relaunch_merge

if TYPE_CHECKING:
    from flashdecode.ops.decode_policy import _DecodeShape

_PERSISTENT_PATHS = (DecodePath.PERSISTENT, DecodePath.PERSISTENT_QUEUE)

# fp32 elements of the (rows, splits, headdim) tile the persistent kernel's merge folds per step: small, so that
# ptxas keeps every step's loads in flight without spilling (sm_90, bf16 hd128, 128-key tiles, 4 or 8 rows: 2048
# values per step compile without spills, 4096 spill 40-152 bytes).
_PERSISTENT_MERGE_TILE_ELEMS = 2048


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """Geometry of one decode launch: what follows from a DecodeConfig and the shapes."""

    config: DecodeConfig
    min_chunk: int        # MIN_CHUNK: fewest keys of a non-empty split
    preload_pages: int    # PRELOAD_PAGES: block-table ids a split holds in registers (0: read in the loop)
    max_split_keys: int   # MAX_SPLIT_KEYS of the persistent / device-split kernels (0: unbounded)
    num_stages: int       # the config's stages plus the table-read ones where they apply
    programs: int         # grid size of the persistent and device-split launches
    batch_pad: int        # BATCH_PAD: the batch padded to a power of two (device-side split counts)
    prefetch: tuple       # (keys, line_elems, num_lines) of kernels/decode_args.Prefetch
    grid_splits: int      # the split grid's splits per sequence (FIXED_SPLIT: from the cache; else num_splits)
    # what a call of the problem's shape draws from a workspace pool: the partials' (batch, seqlen_q, nheads,
    # grid_splits, headdim) (None: unsplit) and the merge tickets (0: none drawn)
    partial_shape: tuple | None = None
    tickets: int = 0


def plan_launch(config: DecodeConfig, problem: heuristics.DecodeProblem) -> DecodeLaunch:
    """The geometry of running ``config`` on ``problem`` (pure: heuristics' decode geometry functions)."""
    path, splits = config.path, config.num_splits
    programs, max_split_keys = 0, 0
    ids = heuristics.PageIdPreload.of(config)
    if path in _PERSISTENT_PATHS or path is DecodePath.DEVICE_SPLIT_GRID:
        preload, max_split_keys = heuristics.decode_persistent_preload(problem, ids, splits)
        split_keys_max = max_split_keys or problem.capacity  # a work item may be a whole sequence
        if path is DecodePath.DEVICE_SPLIT_GRID:
            programs = _device_split_programs(problem, config)
        else:
            programs = config.persistent_programs
    else:
        preload = heuristics.decode_preload_pages(problem, ids, splits)
        split_keys_max = heuristics.decode_max_split_keys(problem, config.block_n, splits, config.split_keys)
    grid_splits = fixed_split_grid(problem, config) if path is DecodePath.FIXED_SPLIT else splits
    nheads = problem.group * problem.nheads_kv
    tickets_drawn = path in _PERSISTENT_PATHS or config.merge_in_kernel
    return DecodeLaunch(
        config=config, min_chunk=heuristics.decode_min_chunk(config.block_n), preload_pages=preload,
        grid_splits=grid_splits,
        partial_shape=None if path is DecodePath.UNSPLIT else (problem.batch, problem.seqlen_q, nheads, grid_splits,
                                                               problem.headdim),
        tickets=num_tickets(problem.batch, problem.seqlen_q, nheads, problem.nheads_kv) if tickets_drawn else 0,
        max_split_keys=max_split_keys,
        num_stages=heuristics.decode_pipeline_stages(problem, config, preload, split_keys_max),
        programs=programs, batch_pad=heuristics.next_power_of_2(max(problem.grid_batch, problem.batch)),
        prefetch=heuristics.decode_prefetch_shape(problem, config, splits))


def fixed_split_grid(problem: heuristics.DecodeProblem, config: DecodeConfig) -> int:
    """Splits per sequence of a FIXED_SPLIT launch: enough split_keys-key splits for the most keys a sequence of
    this cache can attend (its capacity; with a window, the window's rows and the block its start rounds down
    into), from host-side shapes only (no sync). Only the grid and the merge's state count follow from it: the
    splits past a sequence's end are empty and change no bit of its result. ValueError where more than
    config.num_splits would be needed."""
    keys = problem.capacity
    if problem.window_left >= 0:
        keys = min(keys, problem.window_left + problem.seqlen_q + config.block_n - 1)
    splits = max(1, heuristics.cdiv(keys, config.split_keys))
    if splits > config.num_splits:
        raise ValueError(f"the cache holds {problem.capacity} keys per sequence: {splits} splits of "
                         f"{config.split_keys} keys, more than config.num_splits ({config.num_splits})")
    return splits


def _device_split_programs(problem: heuristics.DecodeProblem, config: DecodeConfig) -> int:
    """Programs of a DEVICE_SPLIT_GRID launch: enough for every work item that kernels.decode_schedule's
    planned_item can make. A sequence's split count is its floor'd share of device_split_slots items (kv programs
    each), at least 1 and at most num_splits, so all of them hold at most slots + batch x kv programs items."""
    kvp = problem.kv_programs
    return kvp * min(problem.batch * config.num_splits, config.device_split_slots // kvp + problem.batch)


def num_tickets(batch, seqlen_q, nheads, nheads_kv) -> int:
    """In-kernel merge counters: one per (batch, kv head, stage-1 row block) of a launch with seqlen_q new tokens,
    then the persistent kernel's work queue (QUEUE_SLOTS counters)."""
    group_rows = (nheads // nheads_kv) * seqlen_q
    return batch * nheads_kv * heuristics.cdiv(group_rows, heuristics.decode_block_m(group_rows)) + QUEUE_SLOTS


def lse_view(lse3, q):
    """The lse a call returns from the (batch, seqlen_q, nheads) buffer run_decode writes: (batch, nheads) for a
    3-d q, else lse3 itself."""
    return lse3[:, 0] if q.dim() == 3 else lse3


def run_decode(shape: _DecodeShape, launch: DecodeLaunch, q, alibi_slopes, k_cache, v_cache, cache_seqlens,
               block_table, out, lse3, partial_o, partial_lse, tickets=None, queue=None):
    """Decode into out (like q: (batch, [seqlen_q,] nheads, headdim)) and lse3 (batch, seqlen_q, nheads) fp32
    natural log, on launch.config.path. partial_o (batch, seqlen_q, nheads, launch.grid_splits, headdim) /
    partial_lse (..., splits) fp32: the split paths' partials; tickets int32 zeros (>= num_tickets(...); left zero
    again): the persistent paths' and config.merge_in_kernel's merge counters, and the persistent queue (the last
    QUEUE_SLOTS of them; ``queue``, that view where the caller keeps one, else sliced here). ``shape``
    holds the checked facts (the capacity of this cache, the launch key); q and alibi_slopes are the call's, of the
    layouts ``shape`` was checked for. The kernels take pointers and explicit strides, so no tensor is reshaped per
    call: each launch key keeps the strides of the views it stands for (_Stage1Args, _PersistentArgs)."""
    path = launch.config.path
    if path is DecodePath.UNSPLIT:  # no partials, no second kernel
        _launch_stage1(shape, launch, q, alibi_slopes, k_cache, v_cache, cache_seqlens, block_table, out, lse3,
                       final=True)
    elif path in _PERSISTENT_PATHS:  # one launch: the kernel merges the sequences that split
        if queue is None:
            queue = tickets[tickets.numel() - QUEUE_SLOTS:]
        _launch_persistent(shape, launch, q, alibi_slopes, k_cache, v_cache, cache_seqlens, block_table, out, lse3,
                           partial_o, partial_lse, tickets, queue)
    elif launch.config.merge_in_kernel:  # one launch: one-split sequences write out, the last split merges
        _launch_stage1(shape, launch, q, alibi_slopes, k_cache, v_cache, cache_seqlens, block_table, partial_o,
                       partial_lse, final=False, merged=(out, lse3, tickets))
    else:
        _launch_stage1(shape, launch, q, alibi_slopes, k_cache, v_cache, cache_seqlens, block_table, partial_o,
                       partial_lse, final=False)
        _launch_merge(shape, launch, partial_o, partial_lse, out, lse3)


def _launch_merge(shape, launch: DecodeLaunch, partial_o, partial_lse, out, lse3):
    """The split paths' merge into out (like q) and lse3: relaunched from its key's plan with the buffers as they
    are (the plan holds the strides of the row views below), else planned from those views."""
    key = _site_key(shape, ("merge",))
    if key is not None and relaunch_merge(key, partial_o, partial_lse, out, lse3):
        return
    config = launch.config
    b, sq, h, s = shape.batch, shape.seqlen_q, shape.nheads, launch.grid_splits
    launch_merge_many(
        partial_o.view(b * sq, h, s, shape.headdim), partial_lse.view(b * sq, h, s),
        _collapse_bt(_as4(out)), lse3.view(b * sq, h), states_dim=2, lse_log2=True, use_pdl=config.use_pdl,
        early_trigger=config.merge_early_trigger and config.pdl_wait, d_chunks=config.merge_d_chunks,
        max_rows=config.merge_max_rows, block_s=config.merge_block_s,
        skip_empty=config.path is DecodePath.FIXED_SPLIT, live_only=config.merge_live_only, key=key)


def _as4(x):
    """A decode output like q as its (batch, seqlen_q, nheads, headdim) view (3-d: seqlen_q 1)."""
    return x.unsqueeze(1) if x.dim() == 3 else x


def _kv_sources(config: DecodeConfig, k_cache, v_cache, k_shape, k_stride):
    """(K, V, stride_kb) for the kernel: raw tensors, or TMA descriptors over (rows, nheads_kv * headdim), which
    read rows past the end as zeros (paged: the blocks of page ids outside the pool, whose scores the kernel masks
    by the ids)."""
    if not config.use_tma:
        return k_cache, v_cache, k_stride[0]
    rows = k_shape[0] * k_shape[1]
    width = k_shape[2] * k_shape[3]
    box = [config.block_n, k_shape[3]]
    return _descriptor(k_cache, rows, width, box), _descriptor(v_cache, rows, width, box), k_shape[1]


def _descriptor(base, rows: int, width: int, box: list):
    """A host TensorDescriptor over base viewed as (rows, width), built without Triton's __post_init__ assertions
    (per call they cost about as much as the rest of the launch): what they assert - a 16-byte aligned base and
    row stride, a power-of-two box, a unit last stride - the policy checked before it chose the TMA path
    (util.cache_rows_tma_ok, heuristics.decode_tma_fits), on the layout the call key fixes."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.padding = base, [rows, width], [width, 1], box, "zero"
    return desc


class _Stage1Args:
    """What one stage-1 launch key fixes (the call key fixes every tensor's layout): the grid and the runtime
    arguments that follow from shapes and strides, computed once from the views the kernel reads (q and a final
    out as (batch, seqlen_q, nheads, headdim)), in a BoundLaunch; ``fill`` writes a call's tensors (the launch
    reads only their data pointers) and what follows from the cache itself (a growing cache's capacity and
    strides)."""

    __slots__ = ("grid", "num_splits", "kv_programs", "alibi", "final", "bound")

    def __init__(self, key, shape: _DecodeShape, launch: DecodeLaunch, q, alibi_slopes, block_table, o, lse3,
                 final: bool, merged):
        config = launch.config
        self.num_splits = 1 if final else launch.grid_splits
        o4 = _as4(o) if final else o
        self.kv_programs = shape.nheads_kv * shape.num_m_blocks
        self.grid = (self.num_splits, self.kv_programs, shape.batch)
        if config.path is DecodePath.DEVICE_SPLIT_GRID:
            self.grid = (launch.programs, 1, 1)
        self.alibi = _alibi_strides(alibi_slopes)
        self.final = None if merged is None else _final_strides(_as4(merged[0]), merged[1])
        self.bound = BoundLaunch(_STAGE1, key, dict(
            scales=shape.score.logit_scales, window_left=shape.score.kernel_window[0], batch=shape.batch,
            stride_q=tuple(_as4(q).stride()), stride_btb=block_table.stride(0) if block_table is not None else 0,
            stride_o=(o4.stride(0), o4.stride(1), o4.stride(2), 0 if final else o4.stride(3),
                      o4.stride(3) if final else o4.stride(4)),
            stride_l=(lse3.stride(0), lse3.stride(1), lse3.stride(2), 0 if final else lse3.stride(3))))

    def fill(self, full: list, shape, config, q, alibi_slopes, k_cache, v_cache, cache_seqlens, block_table, o, lse,
             merged) -> list:
        """``full`` (a BoundLaunch list) with this call's arguments of decode_split_kernel in place."""
        _fill_shared(full, _STAGE1_SHARED, shape, config, q, alibi_slopes, self.alibi, k_cache, v_cache,
                     cache_seqlens, block_table)
        at_o, at_lse, at_raw, at_final = _STAGE1_CALL
        full[at_o], full[at_lse] = o, lse
        full[at_raw] = (k_cache, v_cache, k_cache.stride(0))
        full[at_final] = None if merged is None else (merged[0], merged[1], merged[2], self.final)
        return full


def _fill_shared(full: list, at: tuple, shape, config, q, alibi_slopes, alibi_strides, k_cache, v_cache,
                 cache_seqlens, block_table) -> None:
    """Write into ``full`` the arguments both decode kernels take alike (``at``: their places, _SHARED_CALL's
    order): q, the cache (raw, or TMA descriptors) with its extent and strides, lengths, block table, ALiBi, an
    8-bit cache's scales."""
    k_shape, k_stride = k_cache.shape, k_cache.stride()
    k_src, v_src, stride_kb = _kv_sources(config, k_cache, v_cache, k_shape, k_stride)
    at_q, at_k, at_v, at_lens, at_bt, at_capacity, at_pages, at_stride_k, at_alibi, at_scales = at
    full[at_q], full[at_k], full[at_v], full[at_lens] = q, k_src, v_src, cache_seqlens
    full[at_bt] = cache_seqlens if block_table is None else block_table
    full[at_capacity], full[at_pages] = shape.capacity, k_shape[0]
    full[at_stride_k] = (stride_kb, k_stride[1], k_stride[2])
    full[at_alibi] = (q if alibi_slopes is None else alibi_slopes, alibi_strides)
    full[at_scales] = _kv_scales_arg(shape, k_cache)


def _launch_args(site: LaunchSite, key, build):
    """The per-key launch arguments (_Stage1Args, _PersistentArgs) kept beside ``site``'s record of ``key``, made
    by ``build()`` on the key's first launch (key None: made for this call alone)."""
    return build() if key is None else site.plans.get_or_build(key, build)


def _launch_stage1(shape: _DecodeShape, launch: DecodeLaunch, q, alibi_slopes, k_cache, v_cache, cache_seqlens,
                   block_table, o, lse3, final: bool, merged=None):
    """decode_split_kernel. o / lse3: the final output (like q) and (batch, seqlen_q, nheads) lse, or the fp32
    partials (batch, seqlen_q, nheads, splits[, headdim]). On DEVICE_SPLIT_GRID the split counts are chosen on the
    device (<= num_splits per sequence), one program per work item. FIXED_SPLIT: the grid's splits follow from the
    cache, while the kernel's NUM_SPLITS (unused there: every split holds SPLIT_KEYS keys) stays the config's, so a
    new capacity never compiles a new variant. merged (DEVICE_SPLIT_GRID with config.merge_in_kernel): (out like q,
    lse3, tickets), where the kernel writes the results itself (kernels/decode.py MERGE). Launched through the launch
    cache under shape.launch_key (the call's metadata), the launch geometry and the outputs' layout."""
    config = launch.config
    key = _site_key(shape, ("stage1", final, merged is not None))
    args = _launch_args(_STAGE1, key, lambda: _Stage1Args(key, shape, launch, q, alibi_slopes, block_table, o, lse3,
                                                          final, merged))
    full = args.bound.full()
    if full is not None:  # the key's recorded launch: its argument list, this call's values written in
        args.bound.launch(args.grid, args.fill(full, shape, config, q, alibi_slopes, k_cache, v_cache, cache_seqlens,
                                               block_table, o, lse3, merged), shape.device)
        return
    runtime = _STAGE1.runtime_of(args.fill(args.bound.blank(), shape, config, q, alibi_slopes, k_cache, v_cache,
                                           cache_seqlens, block_table, o, lse3, merged))

    def constexprs(num_stages):
        device_splits = merge = None
        if config.path is DecodePath.DEVICE_SPLIT_GRID:
            device_splits = DeviceSplits(slots=config.device_split_slots, batch_pad=launch.batch_pad,
                                         max_split_keys=launch.max_split_keys, kv_programs=args.kv_programs)
            merge = _merge_tile(shape, config.num_splits) if merged is not None else None
        return dict(
            FINAL=final, PDL=Pdl(launch_dependents=config.use_pdl and not final, wait=config.pdl_wait),
            PREFETCH=Prefetch(*launch.prefetch), DEVICE_SPLITS=device_splits, SPEC_PAGES=config.spec_pages,
            **({"MERGE": merge} if merge is not None else {}),
            **_shared_constexprs(shape, launch, config.num_splits if config.split_keys else args.num_splits, q,
                                 k_cache),
            num_warps=config.num_warps, num_stages=num_stages, **_register_cap(config),
            **({"launch_pdl": True} if config.pdl_wait else {}))

    _launch_fitting_shared_memory(
        lambda num_stages: _STAGE1.launch(key, args.grid, runtime, lambda: constexprs(num_stages), shape.device),
        launch.num_stages)


class _PersistentArgs:
    """What one persistent launch key fixes: the runtime arguments that follow from shapes and strides, in a
    BoundLaunch (as _Stage1Args); ``fill`` writes a call's tensors."""

    __slots__ = ("alibi", "bound")

    def __init__(self, key, shape: _DecodeShape, q, alibi_slopes, block_table, out, lse3, o5, lse4):
        self.alibi = _alibi_strides(alibi_slopes)
        self.bound = BoundLaunch(_PERSISTENT, key, dict(
            batch=shape.batch, scales=shape.score.logit_scales, window_left=shape.score.kernel_window[0],
            stride_q=tuple(_as4(q).stride()), stride_btb=block_table.stride(0) if block_table is not None else 0,
            stride_o=tuple(o5.stride()), stride_l=tuple(lse4.stride()), stride_final=_final_strides(_as4(out), lse3)))

    def fill(self, full: list, shape, config, q, alibi_slopes, k_cache, v_cache, cache_seqlens, block_table, out,
             lse3, o5, lse4, tickets, queue) -> list:
        """``full`` (a BoundLaunch list) with this call's arguments of decode_persistent_kernel in place."""
        _fill_shared(full, _PERSISTENT_SHARED, shape, config, q, alibi_slopes, self.alibi, k_cache, v_cache,
                     cache_seqlens, block_table)
        at_o, at_lse, at_out, at_lse_final, at_tickets, at_queue = _PERSISTENT_CALL
        full[at_o], full[at_lse], full[at_out], full[at_lse_final] = o5, lse4, out, lse3
        full[at_tickets], full[at_queue] = tickets, queue
        return full


def _launch_persistent(shape: _DecodeShape, launch: DecodeLaunch, q, alibi_slopes, k_cache, v_cache, cache_seqlens,
                       block_table, out, lse3, o5, lse4, tickets, queue):
    """All of decode in one decode_persistent_kernel launch: a fixed grid of launch.programs programs; each
    sequence's split count (<= num_splits) is chosen on the device from the live lengths. Writes out (like q) and
    lse3; o5 / lse4 fp32 partials and tickets (int32 zeros, >= num_tickets(...); left zero again) serve the
    sequences that split, and the last QUEUE_SLOTS tickets (``queue``) are the PERSISTENT_QUEUE path's work
    queue."""
    config = launch.config
    key = _site_key(shape, ("persistent",))
    args = _launch_args(_PERSISTENT, key, lambda: _PersistentArgs(key, shape, q, alibi_slopes, block_table, out,
                                                                  lse3, o5, lse4))
    full = args.bound.full()
    if full is not None:  # the key's recorded launch: its argument list, this call's values written in
        args.bound.launch((launch.programs, 1, 1), args.fill(full, shape, config, q, alibi_slopes, k_cache, v_cache,
                                                             cache_seqlens, block_table, out, lse3, o5, lse4,
                                                             tickets, queue), shape.device)
        return
    runtime = _PERSISTENT.runtime_of(args.fill(args.bound.blank(), shape, config, q, alibi_slopes, k_cache, v_cache,
                                               cache_seqlens, block_table, out, lse3, o5, lse4, tickets, queue))

    def constexprs(num_stages):
        dynamic = config.path is DecodePath.PERSISTENT_QUEUE
        schedule = WorkSchedule(
            nheads_kv=shape.nheads_kv, batch_pad=launch.batch_pad, max_split_keys=launch.max_split_keys,
            dynamic=dynamic, slots_per_program=config.persistent_slots if dynamic else 1,
            queue_splits=config.queue_splits if dynamic else 0,
            queue_full_fraction=config.queue_full_fraction, queue_split_cost=config.queue_split_cost)
        return dict(
            PDL=Pdl(launch_dependents=config.use_pdl, wait=config.pdl_wait), SCHEDULE=schedule,
            MERGE=_merge_tile(shape, config.num_splits),
            **_shared_constexprs(shape, launch, config.num_splits, q, k_cache),
            num_warps=config.num_warps, num_stages=num_stages, **_register_cap(config),
            **({"launch_pdl": True} if config.pdl_wait else {}))

    _launch_fitting_shared_memory(
        lambda num_stages: _PERSISTENT.launch(key, (launch.programs, 1, 1), runtime, lambda: constexprs(num_stages),
                                              shape.device),
        launch.num_stages)


_STAGE1 = LaunchSite(decode_split_kernel, "decode_split_kernel")
_PERSISTENT = LaunchSite(decode_persistent_kernel, "decode_persistent_kernel")
# the parameters a call writes (_Stage1Args.fill, _PersistentArgs.fill): its tensors, and what the cache decides;
# those both kernels take alike first (_fill_shared), then each kernel's own
_SHARED_CALL = ("Q", "K", "V", "SEQLENS", "BLOCK_TABLE", "capacity", "num_pages", "stride_k", "alibi", "kv_scales")
_STAGE1_SHARED = _STAGE1.positions(*_SHARED_CALL)
_STAGE1_CALL = _STAGE1.positions("O", "LSE", "kv_raw", "final")
_PERSISTENT_SHARED = _PERSISTENT.positions(*_SHARED_CALL)
_PERSISTENT_CALL = _PERSISTENT.positions("O", "LSE", "O_FINAL", "LSE_FINAL", "TICKETS", "QUEUE")


def _site_key(shape, tag: tuple):
    """The launch-cache key of one decode launch: the call's launch id (ops/decode_host.py; None: launch without
    recording), which fixes every argument's layout, and which of its launches this is."""
    return None if shape.launch_key is None else (shape.launch_key,) + tag


def _register_cap(config) -> dict:
    """The stage-1 launch's maxnreg (config.max_registers; none at 0; the CPU interpreter ignores it): fewer
    registers per thread so that more programs share an SM (ptxas spills what does not fit)."""
    return {"maxnreg": config.max_registers} if config.max_registers else {}


def _shared_constexprs(shape, launch: DecodeLaunch, num_splits: int, q, k_cache) -> dict:
    """The constexprs both decode kernels take alike, by keyword: the query rows, tiles, splits and pages
    (kernels/decode_args.py), the score options, the K/V read path, ALiBi and an 8-bit cache's mode."""
    config = launch.config
    return dict(
        ROWS=Rows(seqlen_q=shape.seqlen_q, group=shape.group, num_m_blocks=shape.num_m_blocks),
        HEADDIM=shape.headdim,
        TILE=Tile(block_m=shape.block_m, block_n=config.block_n, block_d=shape.block_d,
                  sum_tile=config.softmax_sum_tile, warps=config.num_warps if config.quant_warp_split else 0),
        SPLITS=Splits(num_splits=num_splits, min_chunk=launch.min_chunk,
                      merge_splits=heuristics.next_power_of_2(num_splits), split_keys=config.split_keys),
        PAGES=Pages(page_size=shape.page_size, preload=launch.preload_pages),
        SOFTCAP=shape.score.softcap > 0, WINDOW=shape.score.window_left >= 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_TMA=config.use_tma,
        OFFS_32=config.offs_32, ALIBI=shape.score.alibi,
        **{name: value for name, value in kv_quant_kernel_args(shape.kv_quant, k_cache, QuantTiles(
            config.quant_v_convert_first, config.quant_convert, config.quant_k_convert_first)).items()
           if name != "kv_scales"})


def _kv_scales_arg(shape, k_cache):
    """The kernels' kv_scales argument: an 8-bit cache's (k_scale, v_scale, strides); None for a float cache."""
    if shape.kv_quant is None:
        return None
    return kv_quant_kernel_args(shape.kv_quant, k_cache)["kv_scales"]


def _alibi_strides(alibi_slopes) -> tuple:
    """The strides of the kernels' alibi argument (slopes, strides): fp32 slopes (batch, nheads) - a (nheads,)
    tensor with batch stride 0 -; without ALiBi (0, 0), beside q as an unread placeholder."""
    if alibi_slopes is None:
        return (0, 0)
    return (0, alibi_slopes.stride(0)) if alibi_slopes.dim() == 1 else tuple(alibi_slopes.stride())


def _final_strides(out4, lse3) -> tuple:
    """The persistent kernel's stride_final, (stride_f, stride_fl): out4 (batch, seqlen_q, nheads, headdim) and lse3
    (batch, seqlen_q, nheads), where the in-kernel merge writes the finished states."""
    return (*out4.stride()[:3], out4.stride(-1)), tuple(lse3.stride()[:3])


def _merge_tile(shape, num_splits) -> MergeTile:
    """MERGE of the persistent kernel's in-kernel merge (kernels/decode_epilogue.py _merge_if_last_ticket): the real
    rows of a row block padded to a power of two, and the splits (padded likewise) folded per step so that one step's
    tile holds _PERSISTENT_MERGE_TILE_ELEMS fp32 values, >= one split."""
    merge_m = min(shape.block_m, heuristics.next_power_of_2(shape.group * shape.seqlen_q))
    merge_splits = heuristics.next_power_of_2(num_splits)
    return MergeTile(rows=merge_m,
                     block_s=max(1, min(merge_splits, _PERSISTENT_MERGE_TILE_ELEMS // (merge_m * shape.block_d))))


def _launch_fitting_shared_memory(launch, num_stages: int):
    """The decode launcher's one fallback from its DecodeLaunch: launch(num_stages), and where the tiles at that
    pipeline depth do not fit in shared memory (e.g. hd256 with 64 query rows; Triton knows a depth's shared memory
    only once it has compiled it), launch(num_stages - 1), ... down to 1 stage, then the OutOfResources. The
    failure comes at compile / load time, before anything is enqueued, so this is safe during warm-up and capture.
    Nothing is remembered here: the launch site records the launch that ran under its key (which holds no stage
    count), so a recorded call launches the depth that fitted directly; an unrecorded one (key None) retries."""
    for stages in range(num_stages, 0, -1):
        try:
            return launch(stages)
        except OutOfResources:
            if stages == 1:
                raise


def _collapse_bt(x4):
    """(b, sq, h, d) -> (b * sq, h, d) as a view (checked collapsible by _DecodeShape.check_out), never a copy:
    the merge writes through it."""
    b, sq, h, d = x4.shape
    outer = x4.stride(1) if sq > 1 else x4.stride(0)
    return x4.as_strided((b * sq, h, d), (outer, x4.stride(2), x4.stride(3)), x4.storage_offset())
