"""Probe: a target for Nsight Compute - our decode on one cache per case, the profiled call alone inside
cudaProfilerStart / Stop (compile and warm-up calls outside it).

Why: the 8-bit decode's time could not be placed by timing variants alone (docs/decisions.md, "8-bit cache tiles");
ncu's warp-state sampling says where a kernel's warps wait. Each case is KIND:BATCH:CONTEXT:NHEADS:NHEADS_KV with
KIND bf16 (a bf16 cache) or e4m3 (per-token-head scales, benchmarks/probes/fp8_decode.py's _quant_set); hd128,
contiguous, equal lengths, the resolved DecodePlan. On a GPU machine whose ncu reads the counters:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section SchedulerStats --section WarpStateStats --section SourceCounters \\
        python -m benchmarks.probes.ncu_decode e4m3:1:32768:16:2,e4m3:16:8192:32:8

(add ``--kernel-name decode_split_kernel -o REPORT`` and ``ncu --import REPORT.ncu-rep --page source --print-source
sass --csv`` for the stall samples per SASS instruction). ncu flushes the caches before each profiled kernel, so
its durations are cold-L2 single launches, not the CUDA-graph times of the benchmarks.
"""

from __future__ import annotations

import sys

import torch


def run_cases(spec: str) -> None:
    from benchmarks.probes.fp8_decode import _ours, _quant_set
    from flashdecode.bench.decode import _make_set

    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in spec.split(","):
        kind, batch, context, nheads, nheads_kv = case.split(":")
        if kind not in ("bf16", "e4m3"):
            raise SystemExit(f"{case}: KIND must be bf16 or e4m3")
        batch, context, nheads, nheads_kv = int(batch), int(context), int(nheads), int(nheads_kv)
        cache = _make_set(batch, [context] * batch, nheads, nheads_kv, 128, 0, torch.bfloat16, gen)
        fns, info = _ours([cache] if kind == "bf16" else [_quant_set(cache, True)])
        for _ in range(3):  # compile and warm up outside the profiled range
            fns[0]()
        torch.cuda.synchronize()
        print(case, info, flush=True)
        torch.cuda.profiler.start()
        fns[0]()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        del cache, fns
        torch.cuda.empty_cache()


def main() -> int:
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        print(__doc__)
        return 2
    run_cases(sys.argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
