"""Flat GEMM vs cuBLAS (torch.matmul) for the decode linears of Llama-3-8B at M = 1..64 (GPU only).

    python benchmarks/probes/flat_gemm.py [--m 2,4,8,16,32,64] [--dtype bfloat16] [--quick]

For each linear of the model (qkv, o, gate_up, down, lm_head: (N, K)) and each decode batch M, times cuBLAS
(F.linear) and every candidate flat-GEMM config (flashdecode.engine.layers.flat_gemm.CANDIDATE_CONFIGS; --quick:
a handful), CUDA-graph replays cycling through weight copies that together exceed L2 four times. Prints a markdown
table - M, N, K, cuBLAS us, best flat us, speed-up, best config, and the weight-read bandwidth of each as a
fraction of the device's copy bandwidth (measured in the same run) - and, for M = 1, the batch-1 GEMV beside
cuBLAS. Writes the record flat_gemm_<device>_<date>.json (the ChoiceTable rows + env) to $OUT (else
benchmarks/results/latest).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashdecode.bench.report import markdown_table  # noqa: E402
from flashdecode.timing import copy_bandwidth_bytes_per_s, cuda_graph_time_us, env_info, rotation_count  # noqa: E402,E501
from flashdecode.engine.config import named_config  # noqa: E402
from flashdecode.engine.layers import flat_gemm as fg  # noqa: E402
from flashdecode.engine.layers.gemv import gemv  # noqa: E402


def llama_linears(name: str) -> dict[str, tuple[int, int]]:
    cfg = named_config(name)
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, h), "o": (h, cfg.q_size), "gate_up": (2 * i, h),
            "down": (h, i), "lm_head": (cfg.vocab_size, h)}


def gemv_row(n: int, k: int, dtype, bandwidth: float) -> dict:
    """M = 1: the engine's GEMV vs cuBLAS on the same rotated weights."""
    size = torch.empty((), dtype=dtype).element_size()
    ws = [(torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype) for _ in range(rotation_count(n * k * size))]
    x = torch.randn(1, k, device="cuda").to(dtype)
    cublas = cuda_graph_time_us([lambda w=w: F.linear(x, w) for w in ws])
    ours = cuda_graph_time_us([lambda w=w: gemv(x, w) for w in ws])
    return {"M": 1, "N": n, "K": k, "kernel": "gemv" if ours < cublas else "cublas", "flat_us": ours,
            "cublas_us": cublas, "speedup": cublas / ours, "config": None,
            "flat_bw": n * k * size / (ours * 1e-6) / bandwidth, "cublas_bw": n * k * size / (cublas * 1e-6) / bandwidth}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help="a named config (its linear shapes)")
    parser.add_argument("--m", default="2,4,8,16,32,64", help="decode batch sizes")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--quick", action="store_true", help=f"{len(fg.QUICK_CONFIGS)} configs instead of "
                                                              f"{len(fg.CANDIDATE_CONFIGS)}")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("flat_gemm probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    ms = [int(v) for v in args.m.split(",")]
    env = env_info()
    bandwidth = copy_bandwidth_bytes_per_s()
    shapes = llama_linears(args.model)
    configs = fg.QUICK_CONFIGS if args.quick else fg.CANDIDATE_CONFIGS
    size = torch.empty((), dtype=dtype).element_size()
    rows = []
    for layer, (n, k) in shapes.items():
        rows.append({"layer": layer, **gemv_row(n, k, dtype, bandwidth)})
        table = fg.ChoiceTable().measure([(n, k)], dtype, "cuda", m_values=ms, configs=configs)
        for r in table.rows():
            nbytes = n * k * size  # the weight read dominates at these M
            rows.append({"layer": layer, **r, "flat_bw": nbytes / (r["flat_us"] * 1e-6) / bandwidth,
                         "cublas_bw": nbytes / (r["cublas_us"] * 1e-6) / bandwidth})
        torch.cuda.empty_cache()
    for r in rows:
        r["best_config"] = ("-" if r["config"] is None else
                            "{block_n}x{block_k} w{num_warps} s{num_stages}".format(**r["config"]))
    print(f"{env.get('device')}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, {args.dtype}, {args.model} linears; "
          f"'flat' column = best of {len(configs)} flat-GEMM configs (M = 1: the GEMV)")
    print(markdown_table(rows, ["layer", "M", "N", "K", "cublas_us", "flat_us", "speedup", "kernel", "best_config",
                                "cublas_bw", "flat_bw"],
                         {"cublas_us": ".1f", "flat_us": ".1f", "speedup": ".2f", "cublas_bw": ".0%",
                          "flat_bw": ".0%"}))
    from flashdecode.bench.report import result_stem, results_dir, write_json

    out = write_json(results_dir(None) / f"{result_stem('flat_gemm', env)}.json", "flat_gemm", env, rows,
                     dict(copy_bandwidth=bandwidth, dtype=args.dtype, model=args.model))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
