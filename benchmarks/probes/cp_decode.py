"""Context-parallel decode vs one GPU: one attention layer's decode step, Llama-3-8B shape (32 / 8 heads, hd 128,
bf16), batch 1 by default, 128k .. 1M tokens, KV pages dealt round robin over the ranks.

    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/probes/cp_decode.py                 # 128k, 256k, 512k, 1M
    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/probes/cp_decode.py --layers 32 --contexts 1048576
    PYTHONPATH=. torchrun --nproc-per-node 1 benchmarks/probes/cp_decode.py                 # world 1: the overhead

Per context it times, as CUDA-graph replays (NCCL collectives captured in the graph, median of --reps):
  one GPU    rank 0 alone, flashdecode.DecodePlan on the whole cache (skipped, and said so, when it does not fit:
             --layers L allocates L layers' KV so the memory matches a whole model; the time is one layer's)
  cp         ContextParallelDecodePlan.run on every rank: local split-KV decode + one all_gather + merge
  local      the local decode alone;  exchange   the collective + merge alone (its share of cp)
and checks the cp output against the one-GPU output (same global cache: rank r's pages are logical pages r, r + W,
... of it). The cost model (flashdecode.distributed.cost, --link) is printed beside the measurements.
Prints a table last; writes JSON to $OUT (or --out) as cp_decode_w<W>.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import flashdecode
from flashdecode.timing import copy_bandwidth_bytes_per_s, cuda_graph_time_us, env_info
from flashdecode.distributed import ContextParallelDecodePlan, cost
from flashdecode.distributed.launch import init_distributed
from flashdecode.engine.kv_cache import cp_local_length

NHEADS, NHEADS_KV, HEADDIM, DTYPE = 32, 8, 128, torch.bfloat16
LINKS = {"nvlink": cost.NVLINK4, "pcie": cost.PCIE5}


def _args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="131072,262144,524288,1048576", help="comma-separated tokens per sequence")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=1, help="KV layers allocated (memory); one is attended")
    p.add_argument("--mode", default="all_gather", choices=("all_gather", "head_scatter"))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--calls-per-graph", type=int, default=10)
    p.add_argument("--link", default="nvlink", choices=sorted(LINKS), help="the cost model's link preset")
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON (default $OUT)")
    return p.parse_args()


def _shard(context, batch, page_size, world, rank, layers, seed):
    """Rank ``rank``'s paged shard of a (batch, context) cache: pool (layers, 2, pages, page_size, hk, d) with layer
    0 random (generated from (seed, rank), so rank 0 can rebuild every rank's shard), block table, lengths."""
    local = cp_local_length(context, page_size, world, rank)
    pps = max(1, -(-local // page_size))
    pool = torch.empty((layers, 2, batch * pps, page_size, NHEADS_KV, HEADDIM), dtype=DTYPE, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    pool[0].normal_(generator=gen)
    table = torch.arange(batch * pps, dtype=torch.int32, device="cuda").view(batch, pps)
    lens = torch.full((batch,), local, dtype=torch.int32, device="cuda")
    return pool, table, lens, pps


def _whole_cache(context, batch, page_size, world, layers, seed):
    """The global cache on one GPU (logical page j of sequence b = page j // W of rank j % W's shard for b), or
    None with the bytes it needed when it does not fit."""
    full_pages = -(-context // page_size)
    need = layers * 2 * batch * full_pages * page_size * NHEADS_KV * HEADDIM * 2
    try:
        pool = torch.empty((layers, 2, batch * full_pages, page_size, NHEADS_KV, HEADDIM), dtype=DTYPE,
                           device="cuda")
    except torch.cuda.OutOfMemoryError:
        return None, need
    for r in range(world):
        shard, _, _, pps = _shard(context, batch, page_size, world, r, 1, seed)
        for b in range(batch):
            js = torch.arange(r, full_pages, world, device="cuda")
            pool[0, :, b * full_pages + js] = shard[0, :, b * pps: b * pps + js.numel()]
        del shard
    table = torch.arange(batch * full_pages, dtype=torch.int32, device="cuda").view(batch, full_pages)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return (pool, table, lens), need


def _measure(args, context, world, rank, link, hbm_bw):
    seed = context % 100_003
    q = torch.randn(args.batch, NHEADS, HEADDIM, generator=torch.Generator().manual_seed(seed)).to("cuda", DTYPE)
    pool, table, lens, _ = _shard(context, args.batch, args.page_size, world, rank, args.layers, seed)
    k, v = pool[0, 0], pool[0, 1]
    local_max = cp_local_length(context, args.page_size, world, 0)
    plan = ContextParallelDecodePlan(args.batch, NHEADS, NHEADS_KV, HEADDIM, max_seqlen_k=local_max, dtype=DTYPE,
                                     device="cuda", mode=args.mode)
    time = dict(reps=args.reps, calls_per_graph=args.calls_per_graph)
    dist.barrier()
    t_cp = cuda_graph_time_us([lambda: plan.run(q, k, v, lens, block_table=table)], **time)
    out_cp = plan.run(q, k, v, lens, block_table=table).clone()
    dist.barrier()
    t_local = cuda_graph_time_us([lambda: plan.local.run(q, k, v, lens, block_table=table, return_lse=True)], **time)
    dist.barrier()
    t_exchange = cuda_graph_time_us([lambda: plan.exchange.collect(args.batch)], **time)
    del pool, k, v  # rank 0's one-GPU cache must find this memory free
    row = {"context": context, "world": world, "cp_us": t_cp, "local_us": t_local, "exchange_us": t_exchange,
           "exchange_share": t_exchange / t_cp, "one_gpu_us": None, "max_abs_diff": None,
           "exchange_bytes_per_rank": plan.exchange.bytes_received(args.batch)}
    model_shape = cost.AttentionShape(NHEADS, NHEADS_KV, HEADDIM, 2)
    model = cost.decode_layer_time(model_shape, args.batch, context, world, link, hbm_bw, args.mode)
    row.update(model_cp_us=model["total"] * 1e6, model_one_gpu_us=model["single"] * 1e6)
    dist.barrier()
    if rank == 0:
        whole, need = _whole_cache(context, args.batch, args.page_size, world, args.layers, seed)
        row["one_gpu_kv_gib"] = need / 2**30
        if whole is None:
            row["one_gpu_note"] = f"does not fit: {args.layers} layers need {need / 2**30:.1f} GiB"
        else:
            wpool, wtable, wlens = whole
            one = flashdecode.DecodePlan(args.batch, NHEADS, NHEADS_KV, HEADDIM, max_seqlen_k=context, dtype=DTYPE,
                                         device="cuda")
            wk, wv = wpool[0, 0], wpool[0, 1]
            row["one_gpu_us"] = cuda_graph_time_us([lambda: one.run(q, wk, wv, wlens, block_table=wtable)], **time)
            ref = one.run(q, wk, wv, wlens, block_table=wtable)
            row["max_abs_diff"] = (out_cp.float() - ref.float()).abs().max().item()
            row["speedup"] = row["one_gpu_us"] / t_cp
            del wpool, whole
        torch.cuda.empty_cache()
    dist.barrier()
    return row


def _table(rows, world, mode, link) -> str:
    head = (f"CP decode, Llama-3-8B attention (32/8 heads, hd128, bf16), one layer, world {world}, {mode}; model: "
            f"{link.name}\n| context | one GPU us | cp us | speedup | local us | exchange+merge us (share) | "
            f"model cp / one us | max abs diff |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        one = f"{r['one_gpu_us']:.1f}" if r["one_gpu_us"] is not None else r.get("one_gpu_note", "-")
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        diff = f"{r['max_abs_diff']:.1e}" if r["max_abs_diff"] is not None else "-"
        lines.append(f"| {r['context']} | {one} | {r['cp_us']:.1f} | {speed} | {r['local_us']:.1f} | "
                     f"{r['exchange_us']:.1f} ({100 * r['exchange_share']:.0f}%) | {r['model_cp_us']:.1f} / "
                     f"{r['model_one_gpu_us']:.1f} | {diff} |")
    return "\n".join(lines)


def main() -> int:
    args = _args()
    init_distributed(int(os.environ.get("WORLD_SIZE", "1")), backend="nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    link = LINKS[args.link]
    hbm_bw = copy_bandwidth_bytes_per_s()
    rows = [_measure(args, int(c), world, rank, link, hbm_bw) for c in args.contexts.split(",")]
    if rank == 0:
        result = {"env": env_info(), "world": world, "args": vars(args), "copy_bandwidth_Bps": hbm_bw,
                  "command": f"torchrun --nproc-per-node {world} benchmarks/probes/cp_decode.py "
                             f"--contexts {args.contexts} --batch {args.batch} --layers {args.layers} "
                             f"--mode {args.mode}", "rows": rows}
        if args.out:
            path = Path(args.out) / f"cp_decode_w{world}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: result[k] for k in ("env", "copy_bandwidth_Bps", "command")}))
        print(_table(rows, world, args.mode, link))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
