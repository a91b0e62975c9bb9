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

from flashdecode import heuristics
from flashdecode.ops import checks
from flashdecode.ops.append_kv import append_kv
from flashdecode.ops.decode_launch import _num_tickets, _run_decode
from flashdecode.ops.decode_policy import (_DecodeShape, _block_config, _choose_splits, _min_chunk, _pdl_capable)
from flashdecode.ops.decode_launch import _device_uniform_splits

__all__ = ["flash_decode", "DecodePlan", "append_kv"]

_DTYPES = checks.FLOAT_DTYPES
_full_device = checks.full_device


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
    if splits > 1 and shape.persistent:
        tickets = torch.zeros(_num_tickets(b, sq, h, shape.nheads_kv), dtype=torch.int32, device=q.device)
    _run_decode(shape, k_cache, v_cache, cache_seqlens, block_table, out4, lse3, partial_o, partial_lse, splits,
                _min_chunk(shape), tickets, policy_splits=num_splits is None)
    return (out, _lse_view(lse3, q)) if return_lse else out


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
    The one-launch path (the persistent kernel) merges after int32 ticket
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
        # the persistent kernel's ticket counters and work queue (zeros; every launch leaves them zero again). Row blocks per kv head
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
