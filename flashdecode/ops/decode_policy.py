"""The decode launch policy on the host: a call's validated shape facts (_DecodeShape), the problem description
and device facts handed to heuristics.resolve_decode_config, and the checks of a ``config=`` override against
them."""

from __future__ import annotations

import dataclasses

import torch

from flashdecode import heuristics
from flashdecode.config import DecodeConfig, DecodePath, check_decode_config
from flashdecode.ops import checks, score_transform
from flashdecode.ops.decode_checks import (_cache_capacity, _check_cache_pair, _check_host_lengths,
                                           _check_lengths_and_table, check_out)
from flashdecode.ops.kv_quant import resolve_kv_quant
from flashdecode.ops.util import cache_rows_tma_ok, hopper_or_newer, num_sms

_DTYPES = checks.FLOAT_DTYPES
_MAX_HEADDIM = checks.MAX_HEAD_DIM
_check_tensor, _interpreting = checks.check_tensor, checks.interpreting


def _pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch needs a Hopper (sm_90) or newer GPU and no interpreter (inline asm)."""
    return not _interpreting(device) and hopper_or_newer(device)


def decode_device(device: torch.device) -> heuristics.DecodeDevice:
    """The facts of ``device`` the decode policy uses."""
    interpret = _interpreting(device)
    return heuristics.DecodeDevice(num_sms=num_sms(device), interpret=interpret,
                                   hopper=not interpret and hopper_or_newer(device),
                                   pdl=_pdl_capable(device))


class _DecodeShape:
    """The host-side facts of one decode call, validated (no launch decision: see problem())."""

    def __init__(self, q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, softcap, window_size,
                 grid_batch=None, k_scale=None, v_scale=None):
        """grid_batch: the batch the tiles are chosen for (a plan's max_batch, so that one plan always launches
        one kernel variant); default q's batch. k_scale / v_scale: an 8-bit cache's scales (ops/kv_quant.py)."""
        _check_tensor("q", q, (3, 4), _DTYPES)
        checks.check_kernel_device("q", q)
        self.q4 = q.unsqueeze(1) if q.dim() == 3 else q
        self.batch, self.seqlen_q, self.nheads, self.headdim = self.q4.shape
        self.device = q.device
        self.kv_quant = resolve_kv_quant(q.dtype, k_cache, v_cache, k_scale, v_scale)
        _check_cache_pair(k_cache, v_cache, q.dtype if self.kv_quant is None else k_cache.dtype, self.device)
        self.nheads_kv = k_cache.shape[2]
        if k_cache.shape[3] != self.headdim:
            raise ValueError(f"k_cache head dim {k_cache.shape[3]} must match q head dim {self.headdim}")
        if not 1 <= self.headdim <= _MAX_HEADDIM:
            raise ValueError(f"head dim must be in 1..{_MAX_HEADDIM}, got {self.headdim}")
        if self.nheads_kv < 1 or self.nheads % self.nheads_kv != 0:
            raise ValueError(f"q heads ({self.nheads}) must be a multiple of the cache's kv heads ({self.nheads_kv})")
        if self.seqlen_q < 1:
            raise ValueError("q must hold at least one token per sequence")
        _check_lengths_and_table(cache_seqlens, block_table, self.batch, self.device)
        self.paged = block_table is not None
        self.page_size = k_cache.shape[1] if self.paged else 0
        self.num_pages = k_cache.shape[0]
        self.capacity = _cache_capacity(k_cache, block_table, self.batch)
        _check_host_lengths(cache_seqlens, self.capacity)
        # the score transform (checked): its logit_scales are stage 1's (softcap: tanh's argument scale, else
        # log2 units for exp2; the softcap in log2 units)
        self.score = score_transform.build_for_decode(self.headdim, softmax_scale, softcap, window_size)
        self.group = self.nheads // self.nheads_kv
        self.block_m = heuristics.decode_block_m(self.group * self.seqlen_q)
        self.num_m_blocks = heuristics.cdiv(self.group * self.seqlen_q, self.block_m)
        self.grid_batch = grid_batch or self.batch
        self.block_d = heuristics.next_power_of_2(max(16, self.headdim))
        self.elem_bytes = k_cache.element_size()
        # 8-bit caches take the pointer path (their scales are read beside each block; kernels/kv_quant.py)
        self.cache_tma_ok = cache_rows_tma_ok(k_cache) and self.kv_quant is None
        self.cache_offsets_fit_int32 = _offsets_fit_int32(k_cache) and (self.kv_quant is None
                                                                        or self.kv_quant.offsets_fit_int32())
        self.alibi_slopes = None  # with_alibi
        self.launch_key = None  # the launch cache's key of this call (ops/decode_host.py); None: not recorded

    def with_alibi(self, alibi_slopes) -> "_DecodeShape":
        """Attach the call's ALiBi slopes: None, or fp32 (nheads,) / (batch, nheads) on q's device (checked)."""
        self.alibi_slopes = checks.check_alibi_slopes(alibi_slopes, self.batch, self.nheads, self.device)
        if self.score.alibi != (alibi_slopes is not None):
            self.score = dataclasses.replace(self.score, alibi=alibi_slopes is not None)
        return self

    def problem(self, live_keys, **kw) -> heuristics.DecodeProblem:
        """The description heuristics.resolve_decode_config takes; ``kw``: its split and PDL fields."""
        return heuristics.DecodeProblem(
            batch=self.batch, grid_batch=self.grid_batch, seqlen_q=self.seqlen_q, group=self.group,
            nheads_kv=self.nheads_kv, headdim=self.headdim, elem_bytes=self.elem_bytes, page_size=self.page_size,
            capacity=self.capacity, window_left=self.score.window_left, live_keys=live_keys,
            cache_tma_ok=self.cache_tma_ok, cache_offsets_fit_int32=self.cache_offsets_fit_int32, **kw)

    def check_out(self, out, q):
        check_out(out, q, self.seqlen_q)


def _offsets_fit_int32(k_cache) -> bool:
    """Whether every element offset into the cache (K and V share its shape and strides) is below 2**31, so that
    the kernels may address it with 32-bit offsets from its base pointer."""
    last = sum((n - 1) * st for n, st in zip(k_cache.shape, k_cache.stride()) if n > 0)
    return k_cache.numel() > 0 and last < 2**31


def choose_live_keys(shape: _DecodeShape, cache_seqlens, num_splits, max_seqlen_k, in_capture: bool):
    """(live keys bound, total keys or None) for a call's split policy and tiles: max_seqlen_k if given; with
    neither it nor num_splits, the lengths of host-resident cache_seqlens, or the cache capacity where they live on
    the device (no call reads device lengths on the host: that sync would stall the host behind the GPU on every
    eager call; the device-split paths then give each sequence the splits its live length needs) or ``in_capture``;
    else the cache capacity."""
    if max_seqlen_k is not None:
        max_seqlen_k = checks.check_int("max_seqlen_k", max_seqlen_k, minimum=0)
        return min(max_seqlen_k, shape.capacity), None
    if num_splits is not None or in_capture or not checks.host_resident(cache_seqlens):
        return shape.capacity, None
    lengths = cache_seqlens.to("cpu", torch.int64)
    longest, total = (int(lengths.max()), int(lengths.sum())) if lengths.numel() else (0, 0)
    if longest > shape.capacity:
        raise ValueError(f"cache_seqlens asks for {longest} keys but the cache holds {shape.capacity}")
    return longest, total


def check_config_fits(config: DecodeConfig, problem: heuristics.DecodeProblem,
                      dev: heuristics.DecodeDevice) -> DecodeConfig:
    """A ``config=`` override (check_decode_config) that this call's cache and device can run (ValueError naming
    the field otherwise)."""
    check_decode_config(config)
    if config.use_tma and not heuristics.decode_tma_fits(problem, config.block_n):
        raise ValueError("config.use_tma: this cache cannot be read through tensor descriptors (it needs a dense, "
                         "16-byte aligned cache, a power-of-two head dim and pages that are multiples of block_n)")
    if config.quant_warp_split and problem.elem_bytes != 1:
        raise ValueError("config.quant_warp_split: only an 8-bit (float8_e4m3fn / int8) cache splits its keys "
                         "across the warps")
    if config.offs_32 and not problem.cache_offsets_fit_int32:
        raise ValueError("config.offs_32: this cache has element offsets of 2**31 or more")
    for field in ("use_pdl", "pdl_wait", "merge_early_trigger", "prefetch_blocks"):
        if getattr(config, field) and not dev.pdl:
            raise ValueError(f"config.{field} needs a Hopper (sm_90+) GPU outside the interpreter")
    if config.merge_max_rows & (config.merge_max_rows - 1):
        raise ValueError(f"config.merge_max_rows must be 0 or a power of two, got {config.merge_max_rows}")
    if config.path is DecodePath.DEVICE_SPLIT_GRID and heuristics.decode_persistent_preload(
            problem, heuristics.PageIdPreload.of(config), config.num_splits)[1]:
        raise ValueError("config.path DEVICE_SPLIT_GRID: a whole sequence's page ids do not fit the preload "
                         "(config.preload_gather_max) for these pages")
    return config
