"""Smoke: small launches of each Gluon probe variant (hd 128/64, causal or not) with more tiles than SMs, so
persistent CTAs loop; each variant in its own process under a timeout (a fault is sticky, a deadlock hangs).
Prints the variants that ran and matched the reference, comma-separated, on the last line.
    PYTHONPATH=. python benchmarks/probes/gluon_smoke.py [name,name]"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run_one(name):
    import torch

    from gluon_fwd import config_for
    from flashdecode.ops.gluon_attention import gluon_attention_forward
    from flashdecode.reference import attention_ref

    for d in (128, 64):
        for causal in (False, True):
            cfg = config_for(name, d, causal, 1100)
            if cfg is None:  # the variant does not apply at this head dim (gluon_fwd.VARIANT_HEAD_DIMS)
                continue
            q, k, v = (torch.randn(2, 1100, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            out, _ = gluon_attention_forward(q, k, v, causal=causal, config=cfg)
            torch.cuda.synchronize()
            ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=causal)
            same, _ = attention_ref(q, k, v, causal=causal)
            err, base = ((x.double() - ref).abs().max().item() for x in (out, same))
            print(f"{name} d{d} causal={causal} err {err:.2e} (2x torch bf16 {2 * base:.2e})", flush=True)
            if not err <= 2 * base + 1e-5:
                sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        run_one(sys.argv[2])
        sys.exit(0)
    from gluon_fwd import VARIANTS

    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
    ok = []
    for name in names:
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                                  timeout=60)
            print(proc.stdout.strip() or proc.stderr.strip()[-300:], flush=True)
            if proc.returncode == 0:
                ok.append(name)
        except subprocess.TimeoutExpired:
            print(f"{name}: TIMEOUT (deadlock?)", flush=True)
    print(",".join(ok))
