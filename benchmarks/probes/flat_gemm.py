"""Flat GEMM vs cuBLAS (torch.matmul) for the decode linears of Llama-3-8B at M = 1..64 (GPU only).

    python benchmarks/probes/flat_gemm.py [--m 2,4,8,16,32,64] [--dtype bfloat16] [--quick] [--gated-silu]

For each linear of the model (qkv, o, gate_up, down, lm_head: (N, K)) and each decode batch M, times cuBLAS
(F.linear) and every candidate flat-GEMM config (flashdecode.engine.layers.flat_gemm.CANDIDATE_CONFIGS; --quick:
a handful), CUDA-graph replays cycling through weight copies that together exceed L2 four times. Prints a markdown
table - M, N, K, cuBLAS us, best flat us, speed-up, best config, and the weight-read bandwidth of each as a
fraction of the device's copy bandwidth (measured in the same run) - and, for M = 1, the batch-1 GEMV beside
cuBLAS. Writes the record flat_gemm_<device>_<date>.json (the ChoiceTable rows + env) to $OUT (else
benchmarks/results/latest).

--gated-silu: instead, the MLP's gate_up_proj + silu*mul only ((2 I, H) weight), three ways per M: cuBLAS then
fused.silu_and_mul (the engine's batched decode today where the table keeps cuBLAS), the flat GEMM then silu_and_mul
(where it keeps the flat GEMM), and the flat GEMM with the silu*mul epilogue (one launch, (M, I) out). Both flat
columns are the best of one config set (the candidates plus GATED_EXTRA_CONFIGS), timed the same way; configs whose
gated variant needs more shared memory than the device has are skipped. Also: silu_and_mul alone, and whether the
fused output equals silu_and_mul of the epilogue-free GEMM bit for bit at the fused column's config. Record:
flat_gemm_gated_silu_<device>_<date>.json.
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
from flashdecode.engine.layers.fused import silu_and_mul  # noqa: E402
from flashdecode.engine.layers.gemv import gemv  # noqa: E402

# The gated epilogue reads 2 BLOCK_N weight rows per program: BLOCK_N 16 reads as many rows per program (and launches
# as many programs) as the plain GEMM's BLOCK_N 32, so the gated sweep adds it (16 is the smallest N tile tl.dot takes)
GATED_EXTRA_CONFIGS = (fg.FlatGemmConfig(16, 128, 4, 3), fg.FlatGemmConfig(16, 256, 4, 3),
                       fg.FlatGemmConfig(16, 256, 4, 4), fg.FlatGemmConfig(16, 256, 8, 3))


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


def _config_name(c: fg.FlatGemmConfig | None) -> str:
    return "-" if c is None else f"{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"


def _best(make, ws, configs) -> tuple[float, fg.FlatGemmConfig | None]:
    """(us, config) of the fastest config, ``make(w, config)`` the closure timed per weight copy (configs that do
    not fit the device's shared memory skipped: fg.fastest_config); nan where none fits."""
    us, config = fg.fastest_config(cuda_graph_time_us, configs, lambda c: [make(w, c) for w in ws])
    return (float("nan"), None) if config is None else (us, config)


def gated_silu_rows(n: int, k: int, dtype, ms: list[int], configs, bandwidth: float) -> list[dict]:
    """gate_up (n = 2 I, k) + silu*mul per M: cuBLAS + silu_and_mul, flat GEMM + silu_and_mul, the flat GEMM's silu*mul
    epilogue (module docstring), on rotated weight copies as the ChoiceTable times them."""
    size = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).to(dtype)
          for _ in range(rotation_count(n * k * size))]
    gated = fg.EPILOGUE_SILU_MUL
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
        cublas = cuda_graph_time_us([lambda w=w: silu_and_mul(F.linear(x, w)) for w in ws])
        flat, flat_cfg = _best(lambda w, c: lambda: silu_and_mul(fg.flat_gemm(x, w, config=c)), ws, configs)
        fused, fused_cfg = _best(lambda w, c: lambda: fg.flat_gemm(x, w, config=c, epilogue=gated), ws, configs)
        gate_up = F.linear(x, ws[0])
        silu = cuda_graph_time_us([lambda: silu_and_mul(gate_up)])
        same, err = False, float("nan")
        if fused_cfg is not None:
            out = fg.flat_gemm(x, ws[0], config=fused_cfg, epilogue=gated)
            same = torch.equal(out, silu_and_mul(fg.flat_gemm(x, ws[0], config=fused_cfg)))
            err = (out.float() - silu_and_mul(gate_up).float()).abs().max().item()
        rows.append({"M": m, "N": n, "K": k, "cublas_silu_us": cublas, "flat_silu_us": flat, "fused_us": fused,
                     "silu_us": silu, "cublas_over_fused": cublas / fused, "flat_over_fused": flat / fused,
                     "flat_config": _config_name(flat_cfg), "fused_config": _config_name(fused_cfg),
                     "fused_bw": n * k * size / (fused * 1e-6) / bandwidth, "bitwise": same,
                     "max_err_vs_cublas": err})
    return rows


def gated_silu_main(args, dtype, ms: list[int], env: dict, bandwidth: float) -> int:
    """--gated-silu: the table and record of gated_silu_rows at the model's gate_up shape."""
    n, k = llama_linears(args.model)["gate_up"]
    base = fg.QUICK_CONFIGS if args.quick else fg.CANDIDATE_CONFIGS
    configs = base + tuple(c for c in GATED_EXTRA_CONFIGS if c not in base)
    rows = gated_silu_rows(n, k, dtype, ms, configs, bandwidth)
    print(f"{env.get('device')}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, {args.dtype}, {args.model} gate_up "
          f"({n}, {k}) + silu*mul; flat columns = best of the same {len(configs)} configs; ratios > 1: fused faster")
    print(markdown_table(rows, ["M", "cublas_silu_us", "flat_silu_us", "fused_us", "silu_us", "cublas_over_fused",
                                "flat_over_fused", "flat_config", "fused_config", "fused_bw", "bitwise",
                                "max_err_vs_cublas"],
                         {"cublas_silu_us": ".1f", "flat_silu_us": ".1f", "fused_us": ".1f", "silu_us": ".1f",
                          "cublas_over_fused": ".3f", "flat_over_fused": ".3f", "fused_bw": ".0%",
                          "max_err_vs_cublas": ".2e"}))
    from flashdecode.bench.report import result_stem, results_dir, write_json

    out = write_json(results_dir(None) / f"{result_stem('flat_gemm_gated_silu', env)}.json", "flat_gemm_gated_silu",
                     env, rows, dict(copy_bandwidth=bandwidth, dtype=args.dtype, model=args.model,
                                     configs=[_config_name(c) for c in configs]))
    print(f"wrote {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help="a named config (its linear shapes)")
    parser.add_argument("--m", default="2,4,8,16,32,64", help="decode batch sizes")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--quick", action="store_true", help=f"{len(fg.QUICK_CONFIGS)} configs instead of "
                                                              f"{len(fg.CANDIDATE_CONFIGS)}")
    parser.add_argument("--gated-silu", action="store_true",
                        help="gate_up + silu*mul: cuBLAS / flat GEMM + silu_and_mul vs the silu*mul epilogue")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("flat_gemm probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    ms = [int(v) for v in args.m.split(",")]
    env = env_info()
    bandwidth = copy_bandwidth_bytes_per_s()
    if args.gated_silu:
        return gated_silu_main(args, dtype, ms, env, bandwidth)
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
