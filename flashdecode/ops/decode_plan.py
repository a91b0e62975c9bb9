"""DecodePlan: CUDA-graph-capturable decode (``DecodePlan(...).run(...)``, or ``flash_decode(..., plan=plan)``).

The plan fixes the split count from a host-side length hint and owns every buffer; lengths and block tables are read
on the device, no host sync, no allocation. Capture once, change the contents of cache_seqlens / block_table,
replay. Its runs take flash_decode's arguments and checks (ops/decode.py) and the same launches (ops/decode_launch.py).
"""

from __future__ import annotations

import itertools

import torch

from flashdecode import heuristics
from flashdecode.config import DecodeConfig, DecodePath, check_decode_config
from flashdecode.ops import checks, decode_host
from flashdecode.ops.decode_checks import _check_batch_invariant, _check_metadata
from flashdecode.ops.decode_host import NO_WINDOW, window_key
from flashdecode.ops.decode_launch import DecodeLaunch, lse_view, num_tickets, plan_launch, run_decode
from flashdecode.ops.decode_policy import _DecodeShape, check_config_fits, decode_device
from flashdecode.ops.decode_workspace import QUEUE_SLOTS
from flashdecode.ops.kv_quant import QUANT_DTYPES
from flashdecode.ops.sinks import check_decode_sinks, decode_sinks_step

__all__ = ["DecodePlan"]

_PLAN_IDS = itertools.count()  # a key per DecodePlan that no later plan reuses (id() may be)
_PLAN_RUNS = 256  # exact call keys a DecodePlan keeps (cleared when full)


class DecodePlan:
    """Workspace and launch decisions for CUDA-graph-capturable decode (FlashInfer's plan/run idea).

    Sized once for (max_batch, max_seqlen_q, nheads, headdim) and a split count chosen on the host from
    ``max_seqlen_k`` (the longest context the plan expects; lengths beyond it stay correct, only the split count
    may be less than ideal). With ``balance_mixed=True`` the split count also covers one long sequence among
    short ones (about num_sms / nheads_kv splits; the device paths give short sequences fewer by themselves);
    large uniform batches of long sequences then split where they need not (docs/decisions.md,
    DecodePlan balance_mixed). Each run shape (batch, seqlen_q, the cache's page size and layout) resolves its
    DecodeConfig once (``config_for``) and then only launches: a fixed grid + the merge, a grid whose split counts
    follow the live lengths on the device, or one persistent launch (docs/architecture.md, "Decode dispatch") -
    reading cache_seqlens / block_table on the device and writing into buffers owned by the plan: no host sync, no
    allocation, capturable. The returned tensors are views of those buffers and are overwritten by the next run.
    ``use_pdl`` forces the programmatic dependent launches on or off (False also stops stage 1 from being a
    dependent of the kernel before it; None: the heuristics' defaults; ignored where the GPU cannot do it).
    ``config``: a DecodeConfig used for every run instead of the resolved ones (its num_splits sizes the plan).
    The persistent paths merge after int32 ticket counters owned by the plan, zero at rest.
    ``batch_invariant=True``: every run uses heuristics.batch_invariant_config (splits of a fixed number of keys, fixed
    tiles, an in-order merge; with num_splits=1 unsplit), so a sequence's out and lse do not depend on the batch or
    the other lengths, and equal flash_decode(batch_invariant=True)'s (excludes num_splits > 1 and config=; a
    FIXED_SPLIT ``config`` makes the plan batch-invariant too). The plan holds partials for the splits of
    max_seqlen_k keys; a run whose cache capacity needs more raises ValueError (make it with max_seqlen_k >= the
    capacity, as the engine does).
    ``kv_dtype``: the cache's dtype (default ``dtype``; torch.float8_e4m3fn or torch.int8 for an 8-bit cache whose
    runs pass k_scale / v_scale): the split count and tiles are chosen for its element size.
    """

    def __init__(self, max_batch: int, nheads: int, nheads_kv: int, headdim: int, *, max_seqlen_k: int,
                 dtype=torch.bfloat16, device="cuda", max_seqlen_q: int = 1, num_splits: int | None = None,
                 balance_mixed: bool = True, use_pdl: bool | None = None, config: DecodeConfig | None = None,
                 batch_invariant: bool = False, kv_dtype=None):
        max_batch, nheads, nheads_kv, max_seqlen_q = (checks.check_int(name, value, 1) for name, value in (
            ("max_batch", max_batch), ("nheads", nheads), ("nheads_kv", nheads_kv), ("max_seqlen_q", max_seqlen_q)))
        headdim = checks.check_int("headdim", headdim, 1, checks.MAX_HEAD_DIM)
        max_seqlen_k = checks.check_int("max_seqlen_k", max_seqlen_k, 0)
        if nheads % nheads_kv:
            raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
        dtype = checks.check_dtype("dtype", dtype, checks.FLOAT_DTYPES)
        checks.check_bool("balance_mixed", balance_mixed)
        if use_pdl is not None:
            checks.check_bool("use_pdl", use_pdl)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in (dtype,) + QUANT_DTYPES:
            raise TypeError(f"kv_dtype must be dtype ({dtype}) or one of {QUANT_DTYPES}, got {kv_dtype}")
        self.kv_dtype = kv_dtype
        self.max_batch, self.nheads, self.nheads_kv, self.headdim = max_batch, nheads, nheads_kv, headdim
        self.max_seqlen_q, self.dtype = max_seqlen_q, dtype
        self.device = checks.check_device_arg("device", device)
        self.max_seqlen_k = max_seqlen_k
        self._dev = decode_device(self.device)
        self.use_pdl = use_pdl if use_pdl is None else bool(use_pdl) and self._dev.pdl
        num_splits = checks.check_num_splits(num_splits)
        self.batch_invariant = _check_batch_invariant(batch_invariant, num_splits, config)
        if config is not None:
            check_decode_config(config)
            self.batch_invariant = config.path is DecodePath.FIXED_SPLIT
            if num_splits is not None and num_splits != config.num_splits:
                raise ValueError(f"num_splits ({num_splits}) disagrees with config.num_splits "
                                 f"({config.num_splits})")
            num_splits = config.num_splits
        self._config = config
        self._policy_splits = num_splits is None  # the device may then choose fewer per sequence
        problem = heuristics.decode_plan_problem(
            max_batch, nheads_kv, nheads // nheads_kv, max_seqlen_q, headdim,
            torch.empty((), dtype=kv_dtype).element_size(), max_seqlen_k)
        fixed = config  # a FIXED_SPLIT config (split_keys > 0) sizes the partials from max_seqlen_k
        if config is None and batch_invariant and num_splits is None:
            fixed = heuristics.batch_invariant_config(problem, self._dev)  # what every run resolves
        self._fixed_split = fixed is not None and fixed.split_keys > 0
        if self._fixed_split:  # partials for the splits of max_seqlen_k keys (runs check their cache fits)
            self.num_splits = heuristics.decode_fixed_split_partials(max_seqlen_k, fixed)
        else:
            self.num_splits = num_splits if num_splits is not None else heuristics.decode_plan_splits(
                problem, self._dev, balance_mixed)
        self._launches: dict = {}  # run shape -> DecodeLaunch, resolved once each
        self._runs: dict = {}  # a run's exact call key -> what it launches (_checked_run)
        self._views: dict = {}  # (q shape, id of a launch in _launches) -> views of the buffers (_buffer_views)
        self._key_tag = ("DecodePlan", next(_PLAN_IDS))  # the host path's key of its runs (ops/decode_host.py)
        rows = max_batch * max_seqlen_q * nheads
        f32 = dict(dtype=torch.float32, device=self.device)
        self._out = torch.empty(rows * headdim, dtype=dtype, device=self.device)
        self._lse = torch.empty(rows, **f32)
        splits = self.num_splits if self.num_splits > 1 or self._fixed_split else 0
        self._partial_o = torch.empty(rows * splits * headdim, **f32)
        self._partial_lse = torch.empty(rows * splits, **f32)
        # the in-kernel merges' ticket counters and the persistent queue (zeros; every launch leaves them zero
        # again). Row blocks per kv head never decrease with seqlen_q, so sizing for max_seqlen_q covers every run.
        self._tickets = torch.zeros(num_tickets(max_batch, max_seqlen_q, nheads, nheads_kv),
                                    dtype=torch.int32, device=self.device)
        self._queue = self._tickets[self._tickets.numel() - QUEUE_SLOTS:]

    def _launch_for(self, shape: _DecodeShape) -> DecodeLaunch:
        key = (shape.batch, shape.seqlen_q, shape.page_size, shape.capacity, shape.cache_tma_ok,
               shape.cache_offsets_fit_int32)
        launch = self._launches.get(key)
        if launch is None:
            # (FIXED_SPLIT: num_splits sizes the partials only; 1 would ask batch_invariant_config for UNSPLIT)
            problem = shape.problem(self.max_seqlen_k, num_splits=None if self._fixed_split else self.num_splits,
                                    device_may_reduce_splits=self._policy_splits, retile_for_device_splits=True,
                                    use_pdl=self.use_pdl, batch_invariant=self.batch_invariant)
            if self._config is None:
                config = heuristics.resolve_decode_config(problem, self._dev)
            else:
                config = check_config_fits(self._config, problem, self._dev)
            launch = plan_launch(config, problem)
            if launch.grid_splits > self.num_splits:
                raise ValueError(f"this cache holds {shape.capacity} keys per sequence: {launch.grid_splits} "
                                 f"splits of {config.split_keys} keys, but the plan holds partials for "
                                 f"{self.num_splits} (max_seqlen_k {self.max_seqlen_k}); make the plan with "
                                 f"max_seqlen_k >= the cache's capacity")
            self._launches[key] = launch
        return launch

    def _shape(self, q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, softcap=0.0,
               window_size=NO_WINDOW, k_scale=None, v_scale=None) -> _DecodeShape:
        shape = _DecodeShape(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, softcap, window_size,
                             grid_batch=self.max_batch, k_scale=k_scale, v_scale=v_scale)
        if k_cache.dtype != self.kv_dtype:
            raise TypeError(f"k_cache dtype {k_cache.dtype} does not match this plan's kv_dtype {self.kv_dtype}")
        b, sq, h, d = shape.q4.shape
        if b > self.max_batch or sq > self.max_seqlen_q or h != self.nheads or d != self.headdim \
                or shape.nheads_kv != self.nheads_kv or q.dtype != self.dtype or q.device != self.device:
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} on {q.device} does not fit this plan (max_batch "
                             f"{self.max_batch}, max_seqlen_q {self.max_seqlen_q}, heads {self.nheads}/"
                             f"{self.nheads_kv}, headdim {self.headdim}, {self.dtype} on {self.device})")
        return shape

    def _buffer_views(self, q_shape, q4_shape, launch: DecodeLaunch) -> tuple:
        """(out like q, lse3, partial_o, partial_lse) views of the plan's buffers for a run of this shape (the
        buffers never change, so each run shape's views are made once)."""
        b, sq, h, d = q4_shape
        rows = b * sq * h
        s = launch.grid_splits
        split = launch.config.path is not DecodePath.UNSPLIT
        return (self._out[: rows * d].view(q_shape), self._lse[:rows].view(b, sq, h),
                self._partial_o[: rows * s * d].view(b, sq, h, s, d) if split else None,
                self._partial_lse[: rows * s].view(b, sq, h, s) if split else None)

    def config_for(self, q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_scale=None,
                   v_scale=None) -> DecodeConfig:
        """The DecodeConfig ``run`` uses for tensors of these shapes (resolved once per run shape)."""
        return self._launch_for(self._shape(q, k_cache, v_cache, cache_seqlens, block_table, k_scale=k_scale,
                                            v_scale=v_scale)).config

    def run(self, q, k_cache, v_cache, cache_seqlens, *, block_table=None, softmax_scale=None, softcap=0.0,
            window_size=NO_WINDOW, return_lse=False, out=None, validate=False, sinks=None, alibi_slopes=None,
            k_scale=None, v_scale=None):
        """flash_decode with the plan's split count and buffers (same arguments, checks and results; validate=True
        syncs, so it is for eager debugging runs, not captured ones)."""
        checks.check_bool("return_lse", return_lse)
        if sinks is not None:
            check_decode_sinks(sinks, q)
        key = found = None
        if validate is False and k_scale is None and v_scale is None and isinstance(cache_seqlens, torch.Tensor) \
                and not checks.host_resident(cache_seqlens):  # the checks read no value: keep them per key
            key = decode_host.call_key(self._key_tag, (q, k_cache, v_cache, cache_seqlens, block_table, out,
                                                       alibi_slopes), (softmax_scale, softcap,
                                                                       window_key(window_size)))
            found = decode_host.lookup(self._runs, key)
        if found is None:
            found = self._checked_run(key, q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, softcap,
                                      window_size, out, validate, alibi_slopes, k_scale, v_scale)
        shape, launch, plan_out, lse3, partial_o, partial_lse = found
        result = plan_out if out is None else out
        run_decode(shape, launch, q, alibi_slopes, k_cache, v_cache, cache_seqlens, block_table, result, lse3,
                   partial_o, partial_lse, self._tickets, self._queue)
        if sinks is not None:  # the result is then a new tensor (or out), not a plan buffer
            return decode_sinks_step(result, lse_view(lse3, q), sinks, out, return_lse)
        return (result, lse_view(lse3, q)) if return_lse else result

    def _checked_run(self, key, q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, softcap, window_size,
                     out, validate, alibi_slopes, k_scale, v_scale) -> tuple:
        """Every check of a run and what it launches: (shape, launch, out like q, lse3, partial_o, partial_lse) -
        the views of the plan's buffers for its shape (_buffer_views) -, kept under ``key`` (None: not kept, the
        checks read values)."""
        shape = self._shape(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, softcap, window_size,
                            k_scale, v_scale)
        shape.with_alibi(alibi_slopes)
        shape.check_out(out, q)
        _check_metadata(shape, cache_seqlens, block_table, validate)
        launch = self._launch_for(shape)
        decode_host.remember(key, shape, launch.config, launch)
        # (id: hashing the launch's config per run would cost more than the views; the plan keeps its launches)
        views = self._views.get((q.shape, id(launch)))
        if views is None:
            views = self._views[(q.shape, id(launch))] = self._buffer_views(q.shape, shape.q4.shape, launch)
        run = (decode_host.detach(shape), launch) + views
        if key is not None and shape.launch_key is not None:  # (an unhashable key was not remembered)
            if len(self._runs) >= _PLAN_RUNS:
                self._runs.clear()
            self._runs[key] = run
        return run
