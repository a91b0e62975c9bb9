"""Context-parallel decode: each rank of a group holds a shard of every sequence's KV cache; flash_decode runs on
each shard and ONE collective merges the (out, lse) partial states exactly.

Flash-Decoding already splits a sequence's keys and merges the partial softmax states by their log-sum-exp; the merge
does not care whether the splits lived in one GPU's registers or in different GPUs' memory. So a sequence whose
keys are spread over ranks - any split, contiguous or paged, even empty on some rank - is attended exactly: every
rank computes (o_r, lse_r) over its keys (an empty shard gives o = 0, lse = -inf, which the merge ignores), the
ranks exchange these few KB (never the KV), and merge_states_many combines them. The order of keys inside a shard
does not matter (decode queries see every cached key), so shards may interleave pages (round-robin placement).
"""

from __future__ import annotations

import torch

from flashdecode.distributed.exchange import StateExchange
from flashdecode.ops.decode import DecodePlan, flash_decode

__all__ = ["context_parallel_decode", "ContextParallelDecodePlan"]


def _rows(q: torch.Tensor) -> int:
    """batch: the rows of q's (out, lse) state (one query token per sequence)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be (batch, nheads, headdim) or (batch, 1, nheads, headdim), got "
                         f"{tuple(q.shape)}")
    if q.dim() == 4 and q.shape[1] != 1:
        raise ValueError(f"q must hold one query token per sequence (seqlen_q = 1) for context-parallel decode, "
                         f"got seqlen_q = {q.shape[1]}")
    return q.shape[0] * (q.shape[1] if q.dim() == 4 else 1)


def _unflatten(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, nheads: int):
    """(rows, h, d) / (rows, h) states back to q's leading dims: out (batch, [seqlen_q,] h, d), lse (..., h)."""
    lead = tuple(q.shape[:-2])
    return out.view(*lead, nheads, q.shape[-1]), lse.view(*lead, nheads)


def context_parallel_decode(q, k_shard, v_shard, cache_seqlens_shard, *, group=None, block_table=None,
                            softmax_scale=None, softcap=0.0, return_lse=False, mode="all_gather"):
    """Decode attention over a KV cache sharded across the ranks of ``group`` (a torch.distributed group).

    Every rank calls it with the same q (replicated over the group) and its own shard of the cache.

    Args:
        q: (batch, nheads, headdim) (or (batch, 1, nheads, headdim)) fp16/bf16/fp32, the same on every rank. One
            query token per sequence: several new tokens would need a causal mask across shards, which the
            per-shard bottom-right rule of flash_decode cannot express.
        k_shard, v_shard: this rank's keys/values in flash_decode's layout: contiguous (batch, max_seqlen,
            nheads_kv, headdim) or paged (num_pages, page_size, nheads_kv, headdim) with ``block_table``.
        cache_seqlens_shard: int32 (batch,): this rank's live keys per sequence (0 = an empty shard).
        block_table: int32 (batch, max_pages_per_seq) for a paged shard.
        softmax_scale, softcap: as flash_decode (softcap applies per key, so sharding does not change it).
        return_lse: also return the merged lse (batch, [1,] nheads), float32 natural log.
        mode: "all_gather" (every rank gets every head) or "head_scatter" (rank r gets heads
            [r * nheads / world, (r + 1) * nheads / world): one all_to_all of 1/world of the bytes; see
            flashdecode.distributed.exchange).
    Returns:
        out (batch, [1,] nheads or nheads / world, headdim) in q's dtype (and lse): equal to flash_decode
        on the concatenation of all ranks' shards, within rounding (each partial is rounded to q's dtype once
        before the exchange).

    This convenience form allocates its exchange buffers per call; the decode loop of a server should hold a
    ContextParallelDecodePlan instead (no allocation, CUDA-graph capturable).
    """
    rows = _rows(q)
    exchange = StateExchange(max(rows, 1), q.shape[-2], q.shape[-1], q.dtype, q.device, group=group, mode=mode)
    return _run(exchange, None, q, k_shard, v_shard, cache_seqlens_shard, block_table, softmax_scale, softcap,
                return_lse)


def _run(exchange: StateExchange, plan, q, k_shard, v_shard, cache_seqlens_shard, block_table, softmax_scale,
         softcap, return_lse):
    """Local flash_decode (through ``plan`` when given) + exchange + merge."""
    rows = _rows(q)
    kw = dict(block_table=block_table, softmax_scale=softmax_scale, softcap=softcap, return_lse=True)

    def local(out):
        o, lse = flash_decode(q, k_shard, v_shard, cache_seqlens_shard, plan=plan,
                              out=None if out is None else out.view(q.shape), **kw)
        return o.reshape(rows, *o.shape[-2:]), lse.reshape(rows, -1)

    out, lse = exchange.merge_local(rows, local)
    out, lse = _unflatten(q, out, lse, out.shape[-2])
    return (out, lse) if return_lse else out


class ContextParallelDecodePlan:
    """context_parallel_decode with every buffer allocated once: a flashdecode.DecodePlan for the local shard plus
    a StateExchange for the collective. ``run`` allocates nothing and never syncs the host, so a decode step that
    calls it can be captured in a CUDA graph - NCCL collectives are capturable (the group's communicator must exist
    before capture: run once, e.g. a warm-up step, before capturing) and the merge is one Triton launch.

    Args:
        max_batch, nheads, nheads_kv, headdim, dtype, device: as DecodePlan (one query token per sequence).
        max_seqlen_k: the longest SHARD this rank expects (about the context / world size), which sizes the local
            split count.
        group, mode: as context_parallel_decode.
        num_splits: the local plan's split count (None: its heuristic).
    """

    def __init__(self, max_batch: int, nheads: int, nheads_kv: int, headdim: int, *, max_seqlen_k: int,
                 dtype=torch.bfloat16, device="cuda", group=None, mode: str = "all_gather",
                 num_splits: int | None = None):
        self.local = DecodePlan(max_batch, nheads, nheads_kv, headdim, max_seqlen_k=max_seqlen_k, dtype=dtype,
                                device=device, num_splits=num_splits)
        self.exchange = StateExchange(max_batch, nheads, headdim, dtype, self.local.device,
                                      group=group, mode=mode)

    def run(self, q, k_shard, v_shard, cache_seqlens_shard, *, block_table=None, softmax_scale=None, softcap=0.0,
            return_lse=False):
        """context_parallel_decode through the plan's buffers; the results are views, overwritten by the next run."""
        return _run(self.exchange, self.local, q, k_shard, v_shard, cache_seqlens_shard, block_table,
                    softmax_scale, softcap, return_lse)
