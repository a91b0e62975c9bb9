"""Probe: the warp-specialised Gluon attention forward on Hopper - correctness, then speed beside its peers.

    PYTHONPATH=. python benchmarks/probes/gluon_fwd.py [--variants all|name,name] [--quick]

1. Correctness: every supported feature (causal or not, GQA, odd lengths, hd 64/128, fp16/bf16) against the float64
   reference with the FlashAttention rule (error <= 2x a same-dtype PyTorch implementation's).
2. Speed (triton.testing.do_bench median, bf16): 16k tokens (batch 1, 16 heads) and 16 x 1k, hd 128 and 64, causal
   and not; the Gluon kernel (resolved config; --variants adds the VARIANTS ablations) beside our Triton flash_attn and
   torch SDPA's cuDNN and FLASH (FlashAttention-2) backends. TFLOP/s = 4 b h sq sk d, halved for causal.
Writes gluon_fwd.json to $OUT (or the current directory) and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import triton

from flashdecode.ops.attention import flash_attn
from flashdecode.ops.gluon_attention import GluonFwdConfig, gluon_attention_forward, resolve_gluon_config
from flashdecode.reference import attention_ref


def _inputs(b, sq, sk, h, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda s, n: torch.randn(b, s, n, d, generator=gen).to("cuda", dtype)  # noqa: E731
    return make(sq, h), make(sk, hkv), make(sk, hkv)


VARIANTS = {  # name -> overrides of the resolved config (ablations and candidates)
    "resolved": {},
    "pingpong": dict(pingpong=True),
    "persistent": dict(persistent=True),
    "one-cta-per-tile": dict(persistent=False),
    "persist+pp": dict(persistent=True, pingpong=True),
    "overlap+pp": dict(overlap=True, pingpong=True),
    "bn64": dict(block_n=64, num_stages=3),
    "1wg": dict(num_consumers=1),
}


def config_for(name: str, d: int, causal: bool = False, seqlen_k: int = 0) -> GluonFwdConfig:
    return dataclasses.replace(resolve_gluon_config(d, causal, seqlen_k), **VARIANTS[name])


def check_correctness(names) -> list[dict]:
    """Each case on each config (the resolved one on all cases, others on the bf16 ones); one row per pair."""
    cases = [(2, 128, 128, 4, 4, 128, torch.bfloat16, False), (2, 128, 128, 4, 4, 128, torch.bfloat16, True),
             (1, 333, 517, 4, 2, 128, torch.float16, False), (1, 333, 517, 4, 2, 128, torch.float16, True),
             (2, 517, 333, 8, 2, 64, torch.bfloat16, True), (3, 77, 1000, 4, 1, 64, torch.bfloat16, False),
             (1, 1000, 999, 2, 2, 128, torch.bfloat16, True), (2, 1, 300, 4, 4, 128, torch.float16, True),
             (1, 4096, 4096, 2, 1, 128, torch.bfloat16, True)]
    rows = []
    for b, sq, sk, h, hkv, d, dtype, causal in cases:
        q, k, v = _inputs(b, sq, sk, h, hkv, d, dtype, seed=sq + sk)
        ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=causal)
        same, _ = attention_ref(q, k, v, causal=causal)
        base = (same.double() - ref).abs().max().item()
        for name in names:
            if name != "resolved" and dtype != torch.bfloat16:
                continue
            out, lse = gluon_attention_forward(q, k, v, causal=causal, config=config_for(name, d, causal, sk))
            torch.cuda.synchronize()
            err = (out.double() - ref).abs().max().item()
            fin = torch.isfinite(ref_lse)
            lse_err = (lse.double() - ref_lse)[fin].abs().max().item() if fin.any() else 0.0
            ok = (not torch.isnan(out).any().item() and err <= 2 * base + 1e-5 and lse_err < 1e-3
                  and torch.equal(torch.isinf(lse), ~fin))
            rows.append(dict(case=f"b{b} sq{sq} sk{sk} h{h}/{hkv} d{d} {str(dtype)[6:]} causal={causal}", config=name,
                             err=err, base=base, lse_err=lse_err, ok=bool(ok)))
    return rows


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def _gluon_call(q, k, v, causal, cfg):
    return lambda: gluon_attention_forward(q, k, v, causal=causal, config=cfg)


def _graphed(fn):
    """fn captured in a CUDA graph: its replay times the kernels alone, without the host's launch work (at 1k
    tokens the kernels run for ~0.1 ms, comparable to a Python launcher's overhead)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def time_all(names, quick: bool, graph: bool = False) -> list[dict]:
    from torch.nn.attention import SDPBackend

    shapes = [(1, 16384, 16), (16, 1024, 16)]
    rows = []
    for d in (128, 64):
        for b, s, h in shapes:
            for causal in (False, True):
                q, k, v = _inputs(b, s, s, h, h, d, torch.bfloat16, seed=1)
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                fns = {f"gluon:{n}": _gluon_call(q, k, v, causal, config_for(n, d, causal, s)) for n in names}
                fns["triton"] = lambda: flash_attn(q, k, v, causal=causal)
                fns["cudnn"] = lambda: _sdpa(SDPBackend.CUDNN_ATTENTION)(qt, kt, vt, causal)
                fns["fa2"] = lambda: _sdpa(SDPBackend.FLASH_ATTENTION)(qt, kt, vt, causal)
                for name, fn in fns.items():
                    try:
                        if graph:
                            fn = _graphed(fn)
                        ms = triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100)
                        tf = flops / ms / 1e9
                    except Exception as e:  # a peer missing on this build is reported, not fatal
                        print(f"{name} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                        ms, tf = float("nan"), float("nan")
                    rows.append(dict(d=d, b=b, s=s, h=h, causal=causal, impl=name, ms=ms, tflops=tf, graph=graph))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="resolved", help="comma-separated names from VARIANTS, or 'all'")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--graph", action="store_true", help="also time CUDA-graph replays (kernels without host work)")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    dev = torch.cuda.get_device_name()
    print(f"device {dev}; torch {torch.__version__}; triton {triton.__version__}")
    result = dict(device=dev, torch=torch.__version__, triton=triton.__version__,
                  configs={n: {d: dataclasses.asdict(config_for(n, d)) for d in (64, 128)} for n in names})
    if not args.no_check:
        result["correctness"] = check_correctness(names)
        bad = [r for r in result["correctness"] if not r["ok"]]
        for r in result["correctness"]:
            if r["ok"]:
                continue
            print(f"BAD {r['config']:>16} {r['case']:<48} err {r['err']:.2e} "
                  f"(2x base {2 * r['base']:.2e}) lse {r['lse_err']:.1e}")
        print(f"correctness: {len(result['correctness']) - len(bad)} ok, {len(bad)} bad")
    result["timing"] = time_all(names, args.quick)
    if args.graph:
        result["timing"] += time_all(names, args.quick, graph=True)
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "gluon_fwd.json"), "w") as f:
        json.dump(result, f, indent=1)
    for graph in (False, True) if args.graph else (False, ):
        timing = [r for r in result["timing"] if r["graph"] == graph]
        print(f"\n{'CUDA-graph replay' if graph else 'direct calls'}\n{'shape':<28}"
              + "".join(f"{n[-12:]:>13}" for n in dict.fromkeys(r["impl"] for r in timing)))
        keys = dict.fromkeys((r["d"], r["b"], r["s"], r["h"], r["causal"]) for r in timing)
        for key in keys:
            cells = [r for r in timing if (r["d"], r["b"], r["s"], r["h"], r["causal"]) == key]
            label = f"d{key[0]} {key[1]}x{key[2]} h{key[3]} {'causal' if key[4] else 'full'}"
            print(f"{label:<28}" + "".join(f"{c['tflops']:>13.1f}" for c in cells))
    print("(TFLOP/s, bf16, do_bench median)")


if __name__ == "__main__":
    main()
