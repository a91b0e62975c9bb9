"""The cost model of context-parallel decode (docs/distributed.md), as pure functions.

One decode step of one attention layer, batch B sequences of C cached tokens each, spread over W ranks:

    KV bytes read       = 2 * B * C * nheads_kv * headdim * e                 (e = bytes per element)
    single GPU          t1 = KV / hbm_bw
    context parallel    tW = KV / (W * hbm_bw)  +  latency + X / link_bw  +  merge
    exchanged X (in per rank): all_gather    (W - 1)     * B * nheads * (headdim * e + 4)
                               head_scatter  (W - 1) / W * B * nheads * (headdim * e + 4)

The exchange is tiny (8.3 KB per layer for Llama-3-8B at B = 1, W = 2) next to the KV (4 KB per cached token per
layer), so the link's bandwidth hardly matters and its latency (one collective per layer) sets where context
parallelism starts to pay: t1 > tW  <=>  C > C* with

    C* = (latency + merge + X / link_bw) * hbm_bw / ((1 - 1/W) * 2 * B * nheads_kv * headdim * e)

The link presets are assumptions to be checked against benchmarks/probes/cp_decode.py (nominal bandwidths;
latencies of a small NCCL collective inside a CUDA graph).
"""

from __future__ import annotations

import dataclasses

__all__ = ["Link", "NVLINK4", "PCIE5", "H100_HBM_BW", "AttentionShape", "LLAMA3_8B", "kv_bytes_per_layer",
           "exchange_bytes_per_layer", "decode_layer_time", "breakeven_context", "tp_decode_step_time"]


@dataclasses.dataclass(frozen=True)
class Link:
    """A GPU-to-GPU link: bytes/s into one GPU and the fixed cost of one small collective (s)."""

    name: str
    bandwidth: float
    latency: float


NVLINK4 = Link("NVLink 4 (H100 SXM, NVSwitch)", 450e9, 10e-6)
PCIE5 = Link("PCIe Gen5 x16", 50e9, 25e-6)
H100_HBM_BW = 3.0e12  # bytes/s a decode kernel reaches on an H100 SXM (of 3.35 nominal)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    nheads: int
    nheads_kv: int
    headdim: int
    elem_bytes: int = 2  # bf16 / fp16


LLAMA3_8B = AttentionShape(32, 8, 128)


def _check(batch: int, world: int, context: float = 0) -> None:
    if batch < 1 or world < 1 or context < 0:
        raise ValueError(f"batch and world must be >= 1 and context >= 0, got {batch}, {world}, {context}")


def kv_bytes_per_layer(shape: AttentionShape, batch: int, context: float) -> float:
    """K and V bytes one decode step reads in one layer, over all ranks together."""
    _check(batch, 1, context)
    return 2.0 * batch * context * shape.nheads_kv * shape.headdim * shape.elem_bytes


def exchange_bytes_per_layer(shape: AttentionShape, batch: int, world: int, mode: str = "all_gather") -> float:
    """(out, lse) bytes arriving at one rank per layer and step (payload; flashdecode.distributed.exchange)."""
    _check(batch, world)
    state = batch * shape.nheads * (shape.headdim * shape.elem_bytes + 4)
    if mode == "all_gather":
        return (world - 1) * state
    if mode == "head_scatter":
        return (world - 1) / world * state
    raise ValueError(f"mode must be 'all_gather' or 'head_scatter', got {mode!r}")


def decode_layer_time(shape: AttentionShape, batch: int, context: float, world: int, link: Link = NVLINK4,
                      hbm_bandwidth: float = H100_HBM_BW, mode: str = "all_gather",
                      merge_s: float = 3e-6) -> dict:
    """Modelled seconds of one layer's decode attention: ``attention`` (the KV read on one rank),
    ``exchange`` (collective: latency + bytes / bandwidth; 0 on one rank), ``merge`` (one small kernel; 0 on
    one rank), ``total`` and ``single`` (the same step on one GPU) and ``speedup`` = single / total."""
    _check(batch, world, context)
    kv = kv_bytes_per_layer(shape, batch, context)
    single = kv / hbm_bandwidth
    attention = kv / (world * hbm_bandwidth)
    exchange = 0.0 if world == 1 else link.latency + exchange_bytes_per_layer(shape, batch, world, mode) / link.bandwidth
    merge = 0.0 if world == 1 else merge_s
    total = attention + exchange + merge
    return {"attention": attention, "exchange": exchange, "merge": merge, "total": total, "single": single,
            "speedup": single / total if total > 0 else 1.0}


def breakeven_context(shape: AttentionShape, batch: int, world: int, link: Link = NVLINK4,
                      hbm_bandwidth: float = H100_HBM_BW, mode: str = "all_gather", merge_s: float = 3e-6) -> float:
    """Tokens per sequence above which ``world`` ranks decode one layer faster than one GPU (inf for world 1)."""
    _check(batch, world)
    if world == 1:
        return float("inf")
    fixed = link.latency + merge_s + exchange_bytes_per_layer(shape, batch, world, mode) / link.bandwidth
    saved_per_token = (1.0 - 1.0 / world) * kv_bytes_per_layer(shape, batch, 1) / hbm_bandwidth
    return fixed / saved_per_token


def tp_decode_step_time(weight_bytes: float, num_layers: int, hidden_size: int, batch: int, tp: int,
                        link: Link = NVLINK4, hbm_bandwidth: float = H100_HBM_BW, elem_bytes: int = 2) -> dict:
    """Modelled seconds of the weight-bound part of one decode step under tensor parallelism: every rank reads
    1/tp of the (sharded) weights, and each layer ends its attention and its MLP with an all-reduce of the
    (batch, hidden) activations (a ring all-reduce moves 2 (tp - 1) / tp of them through each GPU's link).
    Returns ``weights``, ``all_reduce`` (all layers), ``total`` and ``single`` (tp = 1)."""
    _check(batch, tp)
    single = weight_bytes / hbm_bandwidth
    weights = single / tp
    if tp == 1:
        reduce = 0.0
    else:
        per = link.latency + 2 * (tp - 1) / tp * batch * hidden_size * elem_bytes / link.bandwidth
        reduce = 2 * num_layers * per
    return {"weights": weights, "all_reduce": reduce, "total": weights + reduce, "single": single}
