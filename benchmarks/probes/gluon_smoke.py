"""Smoke: one small launch of each Gluon probe variant, with more tiles than SMs so persistent CTAs loop (catches a
pipeline deadlock fast when run under `timeout`). PYTHONPATH=. python benchmarks/probes/gluon_smoke.py"""
import sys

import torch

sys.path.insert(0, "benchmarks/probes")
from gluon_fwd import VARIANTS, config_for  # noqa: E402

from flashdecode.ops.gluon_attention import gluon_attention_forward  # noqa: E402
from flashdecode.reference import attention_ref  # noqa: E402

for d in (128, 64):
    for name in VARIANTS:
        for causal in (False, True):
            q, k, v = (torch.randn(2, 1100, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            out, lse = gluon_attention_forward(q, k, v, causal=causal, config=config_for(name, d))
            torch.cuda.synchronize()
            ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=causal)
            print(f"d{d} {name} causal={causal} err {(out.double() - ref).abs().max().item():.2e}", flush=True)
