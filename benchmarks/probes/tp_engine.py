"""Tensor-parallel engine decode tokens/s vs one GPU, against each rank's bandwidth roofline (random bf16 weights,
KV caches filled with random values instead of a prefill, CUDA graphs, the flashdecode backend).

    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/probes/tp_engine.py                      # llama3-8b, b1 b16
    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/probes/tp_engine.py --model llama3-70b --layers 80

Per model and batch: tokens/s with tp = world (every rank), and with tp = 1 on rank 0 alone when the model fits one
GPU (else said so); the roofline of one rank = batch x copy bandwidth / (the bytes that rank reads per step: its
weight shard + the replicated embeddings/LM head + its KV heads' cache), and the cost model's all-reduce time
(flashdecode.distributed.cost.tp_decode_step_time, --link). Prints a table last; JSON to $OUT (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from flashdecode.bench.e2e import decode_tokens_per_s
from flashdecode.timing import copy_bandwidth_bytes_per_s, env_info
from flashdecode.distributed import cost
from flashdecode.distributed.groups import ParallelConfig, ParallelState
from flashdecode.distributed.launch import init_distributed
from flashdecode.engine.config import NAMED_CONFIGS, config_from_dict
from flashdecode.engine.models import model_class

# a Llama-3-70B-class shape (published sizes), on top of the llama3-8b entry's vocabulary and rotary settings
SHAPES = {"llama3-8b": {}, "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                              num_attention_heads=64, num_key_value_heads=8)}
LINKS = {"nvlink": cost.NVLINK4, "pcie": cost.PCIE5}


def _args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="keep N layers (memory); stated in the output")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--link", default="nvlink", choices=sorted(LINKS))
    p.add_argument("--out", default=os.environ.get("OUT"))
    return p.parse_args()


def _config(args):
    raw = dict(NAMED_CONFIGS["llama3-8b"], **SHAPES[args.model])
    if args.layers is not None:
        raw["num_hidden_layers"] = args.layers
    return config_from_dict(raw)


def _model(cfg, parallel, max_positions):
    model = model_class(cfg)(cfg, torch.bfloat16, "cuda", max_positions=max_positions, parallel=parallel)
    model.init_random_(0)
    return model


def _rank_bytes(model, context: int, batch: int) -> tuple[int, int]:
    """(weight bytes this rank reads per step, KV bytes per step) - its shard and replicated parts, its KV heads."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = batch * context * cfg.num_hidden_layers * 2 * model.cache_kv_heads * cfg.head_dim * 2
    return weights, kv


def _rate(model, args, batch):
    return decode_tokens_per_s(model, "flashdecode", args.context, batch, args.steps, args.repeats, args.page_size)


def main() -> int:
    args = _args()
    init_distributed(int(os.environ.get("WORLD_SIZE", "1")), backend="nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    parallel = ParallelState.create(ParallelConfig(tensor_parallel_size=world), "cuda")
    cfg = _config(args)
    bandwidth = copy_bandwidth_bytes_per_s()
    max_positions = args.context + (args.repeats + 1) * args.steps + 64
    batches = [int(b) for b in args.batches.split(",")]
    model = _model(cfg, parallel, max_positions)
    rows = []
    for batch in batches:
        rate = _rate(model, args, batch)
        weights, kv = _rank_bytes(model, args.context, batch)
        reduce = cost.tp_decode_step_time(weights * world, cfg.num_hidden_layers, cfg.hidden_size, batch, world,
                                          LINKS[args.link], bandwidth)["all_reduce"]
        rows.append({"batch": batch, "tp": world, "tokens_per_s": rate,
                     "roofline_tokens_per_s": batch * bandwidth / (weights + kv),
                     "rank_weight_gib": weights / 2**30, "model_all_reduce_ms": reduce * 1e3})
    del model
    torch.cuda.empty_cache()
    dist.barrier()
    if rank == 0 and world > 1:  # the one-GPU engine, where it fits
        try:
            single = _model(cfg, ParallelState.single(), max_positions)
        except torch.cuda.OutOfMemoryError:
            single = None
        for row in rows:
            if single is None:
                row["tp1_note"] = "does not fit one GPU"
                continue
            row["tp1_tokens_per_s"] = _rate(single, args, row["batch"])
            weights, kv = _rank_bytes(single, args.context, row["batch"])
            row["tp1_roofline_tokens_per_s"] = row["batch"] * bandwidth / (weights + kv)
            row["speedup"] = row["tokens_per_s"] / row["tp1_tokens_per_s"]
        del single
        torch.cuda.empty_cache()
    dist.barrier()
    if rank == 0:
        result = {"env": env_info(), "world": world, "args": vars(args), "copy_bandwidth_Bps": bandwidth,
                  "layers": cfg.num_hidden_layers, "rows": rows,
                  "command": f"torchrun --nproc-per-node {world} benchmarks/probes/tp_engine.py --model {args.model}"
                             f" --layers {cfg.num_hidden_layers} --batches {args.batches} --context {args.context}"}
        if args.out:
            path = Path(args.out) / f"tp_engine_{args.model}_w{world}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: result[k] for k in ("env", "copy_bandwidth_Bps", "command")}))
        print(f"TP engine decode, {args.model} shape ({cfg.num_hidden_layers} layers), context {args.context}, "
              f"random bf16 weights\n| batch | tp={world} tok/s (% roofline) | tp=1 tok/s (% roofline) | speedup | "
              f"modelled all-reduce ms/step |\n|---|---|---|---|---|")
        for r in rows:
            one = (f"{r['tp1_tokens_per_s']:.1f} ({100 * r['tp1_tokens_per_s'] / r['tp1_roofline_tokens_per_s']:.0f}%)"
                   if "tp1_tokens_per_s" in r else r.get("tp1_note", "-"))
            speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
            print(f"| {r['batch']} | {r['tokens_per_s']:.1f} ({100 * r['tokens_per_s'] / r['roofline_tokens_per_s']:.0f}%)"
                  f" | {one} | {speed} | {r['model_all_reduce_ms']:.2f} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
