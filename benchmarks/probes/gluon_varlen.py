"""Probe: which Gluon forward launch suits ragged batches - the candidate GluonFwdConfigs on `bench prefill
--ragged`'s rows, kernel calls timed with do_bench (median, TFLOP/s), the resolved one marked.

    python -m benchmarks.probes.gluon_varlen [--rows random,16x1k,64x256,2x8k] [--headdims 128,64]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from flashdecode.bench.prefill_ragged import HEADS, ROWS, _inputs, random_lengths, ragged_flops
from flashdecode.ops.gluon_attention import GluonFwdConfig, gluon_varlen_forward_into, resolve_gluon_varlen_config
from flashdecode.timing import do_bench_ms

CANDIDATES = {
    "plain": dict(),
    "overlap": dict(overlap=True, split_release=True),
    "persist": dict(persistent=True, q_buffers=2),
    "pairs": dict(persistent=True, q_buffers=2, tile_order="pairs"),
    "persist3": dict(persistent=True, q_buffers=2, num_stages=3),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--headdims", default="128,64")
    parser.add_argument("--rep-ms", type=int, default=60)
    args = parser.parse_args()
    results = []
    for d in (int(x) for x in args.headdims.split(",")):
        h, hkv = HEADS[d]
        for causal in (True, False):
            for name in args.rows.split(","):
                lengths = ROWS[name] or random_lengths()
                (q, k, v), cu = _inputs(lengths, h, hkv, d, torch.bfloat16, seed=0)
                out = torch.empty_like(q)
                lse = torch.empty(h, q.shape[0], device="cuda", dtype=torch.float32)
                flops = ragged_flops(lengths, h, d, causal, "fwd")
                resolved = resolve_gluon_varlen_config(d, causal, -(-sum(lengths) // len(lengths)))
                line = {"row": name, "d": d, "causal": causal, "resolved": str(resolved)}
                for label, overrides in CANDIDATES.items():
                    if d == 64 and overrides.get("num_stages") == 3:
                        continue
                    stages = overrides.pop("num_stages", 2 if d > 64 else 3)
                    cfg = GluonFwdConfig(num_stages=stages, **overrides)
                    overrides["num_stages"] = stages

                    def call():
                        assert gluon_varlen_forward_into(q, k, v, out, lse, cu, cu, max(lengths), d ** -0.5,
                                                         window_right=0 if causal else -1, config=cfg)
                    try:
                        call()
                        torch.cuda.synchronize()
                        ms = do_bench_ms(call, warmup_ms=25, rep_ms=args.rep_ms)
                        line[label] = round(flops / (ms * 1e-3) / 1e12, 1)
                    except Exception as e:  # noqa: BLE001 - a candidate that fails is reported
                        line[label] = f"{type(e).__name__}"
                    if cfg == resolved:
                        line["resolved_label"] = label
                print(json.dumps(line), flush=True)
                results.append(line)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gluon_varlen_probe.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
