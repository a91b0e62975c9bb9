"""Workload for Nsight Compute: a few decode calls (or the flat read probe) of one shape, so that ncu can read the
hardware counters of stage 1 and the merge (GPU only; the numbers in benchmarks/results/ncu_decode_*.md came from
it). Inputs as `flashdecode bench decode` makes them (random, pages in a random permutation), through a DecodePlan
without programmatic dependent launches, so every kernel runs alone.

    ncu --clock-control none --cache-control all -k "regex:decode_split|merge_many|read_kernel" \\
        --launch-skip 4 --launch-count 2 --metrics gpu__time_duration.sum,sm__cycles_active.avg,... \\
        python3 scripts/ncu_decode.py LAYOUT CONTEXT [--batch B] [--heads 16,2] [--splits N | --device-splits]

LAYOUT: 0 (contiguous), a page size, a page size with an "i" suffix (block table in memory order), or "read" (the
flat read-only sweep of benchmarks/probes/stream.py over the same bytes, batch 1 at 2 kv heads).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import dataclasses

    from flashdecode import DecodePath
    from flashdecode.bench.decode import _make_set, _ours
    from benchmarks.probes.stream import _read_calls

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layout")
    ap.add_argument("context", type=int)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", default="16,2", help="q heads,kv heads")
    ap.add_argument("--splits", type=int, default=None, help="a fixed split count (default: the plan's policy)")
    ap.add_argument("--device-splits", action="store_true", help="force the device-split grid (config.path)")
    args = ap.parse_args()
    nheads, nheads_kv = (int(x) for x in args.heads.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.layout == "read":
        k = torch.randn(args.context, 2 * 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty(k.numel() // 8192, device="cuda")
        calls = _read_calls([(k, torch.randn_like(k))], 8192, 8, out) * 2  # as many launches as 2 decode sets
    else:
        page = int(args.layout.rstrip("i"))
        sets = [_make_set(args.batch, [args.context] * args.batch, nheads, nheads_kv, 128, page, torch.bfloat16,
                          gen) for _ in range(2)]
        if args.layout.endswith("i"):  # pages in memory order
            for s in sets:
                s["table"] = torch.arange(s["table"].numel(), device="cuda", dtype=torch.int32).view_as(s["table"])
        tweak = None
        if args.device_splits:
            def tweak(config):
                return dataclasses.replace(config, path=DecodePath.DEVICE_SPLIT_GRID)
        calls, info = _ours(sets, num_splits=args.splits, use_pdl=False, tweak=tweak)
        print(info)
    for _ in range(3):
        for call in calls:
            call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
