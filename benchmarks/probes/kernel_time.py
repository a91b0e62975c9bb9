"""Probe: prefill forward kernel time per implementation, read from the CUDA activity trace (CUPTI, through
torch.profiler) rather than wall-clock events - host work, allocations and do_bench's L2 flush between calls stay out
of the figure, and the implementations are timed in rotated rounds (each round a different one goes first), the
median reported. Our forward (flash_attn, the dispatch) beside cuDNN (SDPA) and FlashAttention-3 (FlashInfer's fa3
backend, when importable), bf16, and our FP8 forward (e4m3 q, k, v; the V transpose it needs counted in).
--modes fwd+bwd: forward and backward (torch.autograd.grad of q, k, v; every kernel of the step counted), for the
implementations that have a backward (ours, cuDNN). --impls gluon:<variant> adds our Gluon forward with one of
benchmarks/probes/gluon_fwd.py's VARIANTS (e.g. gluon:no-overlap, gluon:lpt+overlap) beside them.

    PYTHONPATH=. python benchmarks/probes/kernel_time.py [--shapes 1x16384x16] [--headdims 128,64] [--rounds 5]
        [--modes fwd,fwd+bwd]

Writes the record kernel_time_<device>_<date>.json (flashdecode/bench/report.py: kind, env, git commit, command,
rows) to --out, $OUT or benchmarks/results/latest, and prints TFLOP/s (4 b h s^2 d, halved for causal,
x2.5 more for forward + backward, flashdecode.bench.prefill.tflops), and each row's share of the bf16 matmul rate
measured the same way in the same run (cuBLAS, 8192^3, kernel time: the record's bf16_matmul_tflops).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flashdecode.bench import report
from flashdecode.bench.prefill import BUILDERS, FORWARD_ONLY, _with_backward, tflops
from flashdecode.timing import env_info


def kernel_us_per_call(fn, args, calls: int) -> float:
    """Sum of the device time of every kernel fn(*args) launches, per call, over `calls` back-to-back calls."""
    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0)
    return total / calls


def matmul_tflops(n: int = 8192, rounds: int = 3, calls: int = 10) -> float:
    """The bf16 matmul rate (cuBLAS, n x n x n) by the same kernel-time method as the attention rows: TFLOP/s of
    the median of `rounds` rounds."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    us = statistics.median(kernel_us_per_call(torch.matmul, (a, b), calls) for _ in range(rounds))
    return 2 * n**3 / (us * 1e-6) / 1e12


def with_matmul_share(rows: list[dict], peak_tflops: float) -> list[dict]:
    """rows with pct_matmul: each row's TFLOP/s as a percentage of the matmul rate peak_tflops."""
    return [dict(r, pct_matmul=100.0 * r["tflops"] / peak_tflops) for r in rows]


def _gluon_variant(name: str):
    """Builder of "gluon:<variant>": our Gluon forward with one of benchmarks/probes/gluon_fwd.py's VARIANTS (its
    overrides on top of the resolved config of each shape), forward only."""
    import dataclasses

    from flashdecode.ops import gluon_attention as ga

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gluon_fwd import VARIANTS

    overrides = VARIANTS[name.split(":", 1)[1]]

    def build(q, k, v, causal):
        cfg = dataclasses.replace(ga.resolve_gluon_config(q.shape[-1], causal, k.shape[1]), **overrides)
        return (lambda a, b, c: ga.gluon_attention_forward(a, b, c, causal=causal, config=cfg)[0]), (q, k, v)
    return build


def _step(name: str, mode: str, q, k, v, causal):
    """(fn, args) of one call of implementation ``name``: its forward, or forward + torch.autograd.grad."""
    fn, inputs = (_gluon_variant(name) if name.startswith("gluon:") else BUILDERS[name])(q, k, v, causal)
    if mode == "fwd":
        return fn, inputs
    inputs = tuple(x.detach().requires_grad_() for x in inputs)
    dout = torch.randn_like(fn(*inputs))
    return _with_backward(fn, inputs, dout), ()


def time_point(args, mode: str, d: int, b: int, s: int, h: int, hkv: int, causal: bool) -> list[dict]:
    """One shape: every implementation's kernel time per call in rotated rounds, the median, as rows."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, n, d, generator=gen).to("cuda", torch.bfloat16) for n in (h, hkv, hkv))
    calls = {}
    for name in args.impls.split(","):
        if mode != "fwd" and (name in FORWARD_ONLY or name.startswith("gluon:")):
            continue
        try:
            fn, inputs = _step(name, mode, q, k, v, causal)
            fn(*inputs)
            calls[name] = (fn, inputs)
        except Exception as e:  # a peer missing on this machine is reported, not fatal
            print(f"{name} unavailable: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
    times = {name: [] for name in calls}
    names = list(calls)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(kernel_us_per_call(*calls[name], args.calls))
    rows = []
    for name, us in times.items():
        med = statistics.median(us)
        rows.append(dict(mode=mode, d=d, b=b, s=s, h=h, hkv=hkv, causal=causal, impl=name, us=med, us_rounds=us,
                         tflops=tflops(b, h, s, d, causal, mode, med * 1e-3)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x16384x16", help="BxSxH[/HKV],...")
    ap.add_argument("--headdims", default="128,64")
    ap.add_argument("--impls", default="ours,cuDNN,FA3,fp8",
                    help="names of flashdecode.bench.prefill BUILDERS, or gluon:<name of gluon_fwd.py's VARIANTS>")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--modes", default="fwd", help="fwd and / or fwd+bwd")
    ap.add_argument("--out", default=None, help="result folder (default $OUT, else benchmarks/results/latest)")
    args = ap.parse_args()
    rows = []
    for mode in args.modes.split(","):
        for d in (int(x) for x in args.headdims.split(",")):
            for item in args.shapes.split(","):
                bsh, _, hkv = item.partition("/")
                b, s, h = (int(x) for x in bsh.split("x"))
                hkv = int(hkv) if hkv else h
                for causal in (False, True):
                    rows += time_point(args, mode, d, b, s, h, hkv, causal)
    peak = matmul_tflops(rounds=args.rounds, calls=args.calls)
    env = env_info()
    result = dict(device=env["device"], torch=env["torch"], rounds=args.rounds,
                  calls=args.calls, bf16_matmul_tflops=peak)
    path = report.results_dir(args.out) / f"{report.result_stem('kernel_time', env)}.json"
    report.write_json(path, "kernel_time", env, with_matmul_share(rows, peak), result)
    print(f"wrote {path}")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    print(f"{result['device']}, torch {result['torch']}; kernel time from the CUDA trace, median of {args.rounds} "
          f"rotated rounds of {args.calls} calls")
    print(f"{'shape':<30}" + "".join(f"{n:>10}" for n in impls))
    fields = ("mode", "d", "b", "s", "h", "hkv", "causal")
    for key in dict.fromkeys(tuple(r[f] for f in fields) for r in rows):
        cells = {r["impl"]: r["tflops"] for r in rows if tuple(r[f] for f in fields) == key}
        label = f"{key[0]} d{key[1]} {key[2]}x{key[3]} h{key[4]}/{key[5]} {'causal' if key[6] else 'full'}"
        print(f"{label:<30}" + "".join(f"{cells[n]:>10.1f}" if n in cells else f"{'-':>10}" for n in impls))
    print(f"(TFLOP/s; the bf16 matmul, 8192^3, {peak:.1f} TFLOP/s by the same method)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
