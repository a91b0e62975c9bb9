"""Decode argument checks (ValueError / TypeError naming the argument): the cache pair, lengths and block
table, the cache capacity, host-resident lengths and ``out``. Host metadata only, never a device sync."""

from __future__ import annotations

import torch

from flashdecode.ops import checks
from flashdecode.ops.checks import check_device as _check_device, check_tensor as _check_tensor

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


def _check_lengths_and_table(cache_seqlens, block_table, batch, device, name="cache_seqlens"):
    """int32 (batch,) lengths (called ``name``) and an optional int32 (batch, max_pages_per_seq) block table with a
    unit last stride, both on ``device``."""
    _check_tensor(name, cache_seqlens, (1,))
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cache_seqlens.dtype}")
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"{name} must have shape ({batch},), got {tuple(cache_seqlens.shape)}")
    _check_device(name, cache_seqlens, device)
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
    if checks.host_resident(cache_seqlens):
        checks.check_host_lengths(name, cache_seqlens, capacity, added)


def check_out(out, q, seqlen_q):
    """``out`` (optional) must be like q; with seqlen_q > 1 its (batch, seqlen_q) dims must collapse into one."""
    if out is None:
        return
    _check_tensor("out", out, (q.dim(),))
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    if q.dim() == 4 and seqlen_q > 1 and out.stride(0) != seqlen_q * out.stride(1):
        raise ValueError("out must have collapsible (batch, seqlen_q) dims (e.g. be contiguous)")


def _check_metadata(shape, cache_seqlens, block_table, validate):
    """Block-table ids (and, with validate, device-resident lengths) of the keys a decode call reads (``shape``: the
    call's checked ops.decode_policy._DecodeShape)."""
    checks.check_cache_metadata(cache_seqlens, block_table, capacity=shape.capacity, page_size=shape.page_size,
                                num_pages=shape.num_pages, validate=validate)


def _check_batch_invariant(batch_invariant, num_splits, config):
    """batch_invariant as a bool; it fixes the launch itself, so it excludes num_splits > 1 and config= (a config
    of the FIXED_SPLIT path is batch-invariant by itself: pass it without the flag)."""
    checks.check_bool("batch_invariant", batch_invariant)
    if batch_invariant and config is not None:
        raise ValueError("batch_invariant=True chooses the config itself; do not pass config= with it (a "
                         "FIXED_SPLIT config, e.g. dataclasses.replace of decode_config(..., batch_invariant=True), "
                         "is batch-invariant without the flag)")
    if batch_invariant and num_splits not in (None, 1):
        raise ValueError(f"batch_invariant=True splits every sequence at fixed key offsets (None) or not at all "
                         f"(1); num_splits must be None or 1, got {num_splits}")
    return batch_invariant
