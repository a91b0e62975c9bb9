"""Probe: prefill forward kernel time per implementation, read from the CUDA activity trace (CUPTI, through
torch.profiler) rather than wall-clock events - host work, allocations and do_bench's L2 flush between calls stay out
of the figure, and the implementations are timed in rotated rounds (each round a different one goes first), the
median reported. Our forward (flash_attn, the dispatch) beside cuDNN (SDPA) and FlashAttention-3 (FlashInfer's fa3
backend, when importable), bf16, and our FP8 forward (e4m3 q, k, v; the V transpose it needs counted in).

    PYTHONPATH=. python benchmarks/probes/kernel_time.py [--shapes 1x16384x16] [--headdims 128,64] [--rounds 5]

Writes kernel_time.json to $OUT (or the current directory) and prints TFLOP/s (4 b h s^2 d, halved for causal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flashdecode.bench.prefill import BUILDERS


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x16384x16", help="BxSxH[/HKV],...")
    ap.add_argument("--headdims", default="128,64")
    ap.add_argument("--impls", default="ours,cuDNN,FA3,fp8", help="names of flashdecode.bench.prefill BUILDERS")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    rows = []
    for d in (int(x) for x in args.headdims.split(",")):
        for item in args.shapes.split(","):
            bsh, _, hkv = item.partition("/")
            b, s, h = (int(x) for x in bsh.split("x"))
            hkv = int(hkv) if hkv else h
            for causal in (False, True):
                gen = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(b, s, n, d, generator=gen).to("cuda", torch.bfloat16) for n in (h, hkv, hkv))
                calls = {}
                for name in args.impls.split(","):
                    try:
                        fn, inputs = BUILDERS[name](q, k, v, causal)
                        fn(*inputs)
                        calls[name] = (fn, inputs)
                    except Exception as e:  # a peer missing on this machine is reported, not fatal
                        print(f"{name} unavailable: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
                times = {name: [] for name in calls}
                names = list(calls)
                for r in range(args.rounds):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        times[name].append(kernel_us_per_call(*calls[name], args.calls))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                for name, us in times.items():
                    med = statistics.median(us)
                    rows.append(dict(d=d, b=b, s=s, h=h, hkv=hkv, causal=causal, impl=name, us=med, us_rounds=us,
                                     tflops=flops / med / 1e6))
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rounds=args.rounds,
                  calls=args.calls, rows=rows)
    with open(os.path.join(os.environ.get("OUT", "."), "kernel_time.json"), "w") as f:
        json.dump(result, f, indent=1)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    print(f"{result['device']}, torch {result['torch']}; kernel time from the CUDA trace, median of {args.rounds} "
          f"rotated rounds of {args.calls} calls")
    print(f"{'shape':<30}" + "".join(f"{n:>10}" for n in impls))
    for key in dict.fromkeys((r["d"], r["b"], r["s"], r["h"], r["hkv"], r["causal"]) for r in rows):
        cells = {r["impl"]: r["tflops"] for r in rows if (r["d"], r["b"], r["s"], r["h"], r["hkv"], r["causal"]) == key}
        label = f"d{key[0]} {key[1]}x{key[2]} h{key[3]}/{key[4]} {'causal' if key[5] else 'full'}"
        print(f"{label:<30}" + "".join(f"{cells[n]:>10.1f}" if n in cells else f"{'-':>10}" for n in impls))
    print("(TFLOP/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
