"""Probe: the warp-specialised Gluon attention backward on Hopper - correctness, then forward+backward speed.

    PYTHONPATH=. python benchmarks/probes/gluon_bwd.py [--quick] [--check/--no-check] [--bwd-only] [--ablation]
        [--headdim 64|128] [--config block_m=128,num_stages=2]

1. Correctness (a few shapes: odd lengths, GQA, causal, hd 64/128, bf16/fp16, deterministic and atomic dQ): dq, dk,
   dv of the Gluon kernel against the float64 reference with the FlashAttention rule for gradients (error <= 3x a
   same-dtype PyTorch implementation's), and the deterministic mode run twice bitwise equal.
   (Skipped by --quick, which times hd128 only with the Triton backward untuned: under a minute.)
2. Speed (bf16, 16k tokens: batch 1, 16 heads, hd 128 and 64, causal and not; triton.testing.do_bench median):
   forward + backward through flash_attn with the backward on the Gluon kernel (deterministic, and "gluon-nd"
   not), on the Triton kernel ("triton", "triton-nd": the Gluon dispatch switched off), and torch SDPA's cuDNN
   backend. TFLOP/s = 4 b h s^2 d x 3.5 (forward 1 + backward 2.5), halved for causal, as
   flashdecode bench prefill counts them; the forwards alone too, so that the table also gives each backward's
   own rate (fwd+bwd time minus fwd time, 2.5x the forward's flops). --bwd-only also times the Gluon backward
   by itself: dQ by TMA reduce-add (the default) and by the consumers' atomics (dq_tma=False), deterministic or
   not; --ablation times only those (three of them), at hd128 unless --headdim says otherwise.
--config overrides fields of the resolved GluonBwdConfig for the whole run (correctness pass, flash_attn's
dispatch, the ablation): an A/B of a tile shape is two runs, with and without it.
Writes gluon_bwd.json to $OUT (or the current directory) and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import triton

import flashdecode.ops.gluon_attention as ga
import flashdecode.ops.gluon_backward as gb
from flashdecode.ops.attention import AUTOTUNE_ENV, flash_attn
from flashdecode.reference import attention_ref

BWD_FACTOR = 3.5  # forward (1) + backward (2.5)


def _inputs(b, sq, sk, h, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda s, n: torch.randn(b, s, n, d, generator=gen).to("cuda", dtype)  # noqa: E731
    return make(sq, h), make(sk, hkv), make(sk, hkv), make(sq, h)


def _grads(q, k, v, dout, causal, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*leaves, causal=causal)
    out.backward(dout.to(dtype))
    return [x.grad for x in leaves]


def _override_bwd_config(overrides: dict) -> None:
    """Every backward of this process (the dispatch's and the probe's own) resolves to the config with overrides."""
    resolve = gb.resolve_gluon_bwd_config
    gb.resolve_gluon_bwd_config = lambda headdim: dataclasses.replace(resolve(headdim), **overrides)


def _parse_overrides(text: str) -> dict:
    """"block_m=128,num_stages=2" -> {"block_m": 128, "num_stages": 2} (ints and true / false)."""
    def value(word):
        return int(word) if word.isdigit() else {"true": True, "false": False}[word.lower()]

    return {key: value(v) for key, v in (item.split("=", 1) for item in text.split(",") if item)}


def check_correctness(headdims=(128, 64)) -> list[dict]:
    cases = [(2, 128, 128, 4, 4, 128, torch.bfloat16), (1, 333, 517, 4, 2, 128, torch.float16),
             (2, 517, 333, 8, 2, 64, torch.bfloat16), (3, 1, 300, 4, 1, 64, torch.float16),
             (1, 1000, 999, 2, 2, 128, torch.bfloat16), (1, 300, 100, 2, 2, 128, torch.bfloat16),
             (1, 4096, 4096, 8, 2, 128, torch.bfloat16)]
    rows = []
    for b, sq, sk, h, hkv, d, dtype in cases:
        if d not in headdims:
            continue
        for causal in (False, True):
            q, k, v, dout = _inputs(b, sq, sk, h, hkv, d, dtype, seed=sq + sk)
            ref = _grads(q, k, v, dout, causal, torch.float64)
            same = _grads(q, k, v, dout, causal, dtype)
            out, lse = ga.gluon_attention_forward(q, k, v, causal=causal)
            scale = d ** -0.5
            for det, dq_tma in ((True, True), (False, True), (True, False), (False, False)):
                cfg = dataclasses.replace(gb.resolve_gluon_bwd_config(d), dq_tma=dq_tma)
                grads = gb.gluon_attention_backward(dout, q, k, v, out, lse, scale, causal, det, cfg)
                torch.cuda.synchronize()
                row = dict(case=f"b{b} sq{sq} sk{sk} h{h}/{hkv} d{d} {str(dtype)[6:]} causal={causal}",
                           deterministic=det, dq_tma=dq_tma, ok=True)
                for name, g, g64, gs in zip(("dq", "dk", "dv"), grads, ref, same):
                    err = (g.double() - g64).abs().max().item()
                    base = (gs.double() - g64).abs().max().item()
                    row[name] = [err, base]
                    row["ok"] &= bool(not torch.isnan(g).any().item() and err <= 3 * base + 1e-4)
                if det:
                    again = gb.gluon_attention_backward(dout, q, k, v, out, lse, scale, causal, det, cfg)
                    row["reproducible"] = all(torch.equal(a, b_) for a, b_ in zip(grads, again))
                    row["ok"] &= row["reproducible"]
                rows.append(row)
    return rows


class _TritonBackward:
    """Context: the dense backward's Gluon dispatch switched off (the Triton kernels run)."""

    def __enter__(self):
        self.saved = gb.gluon_backward_if_supported
        gb.gluon_backward_if_supported = lambda *a, **kw: None

    def __exit__(self, *exc):
        gb.gluon_backward_if_supported = self.saved


def _fwd_bwd(fn, inputs, dout, triton_bwd=False):
    def step():
        out = fn(*inputs)
        if triton_bwd:
            with _TritonBackward():
                torch.autograd.grad(out, inputs, dout)
        else:
            torch.autograd.grad(out, inputs, dout)
    return step


def _no_grad(fn, inputs):
    def step():
        with torch.no_grad():
            fn(*inputs)
    return step


def _backward_alone(cells: dict, total: str, fwd: str, fwd_flops: float) -> float:
    """TFLOP/s of a backward alone (2.5x the forward's flops) from its fwd+bwd and fwd times."""
    ms = cells[total]["ms"] - cells[fwd]["ms"]
    return fwd_flops * 2.5 / ms / 1e9 if ms > 0 else float("nan")


BWD_VARIANTS = {"bwd:gluon": (True, True), "bwd:gluon-nd": (False, True), "bwd:atomic": (True, False),
                "bwd:atomic-nd": (False, False)}  # name -> (deterministic, dq_tma) of the Gluon backward alone


def time_all(quick: bool, bwd_only: bool, headdims=(128, 64), ablation: bool = False) -> list[dict]:
    """fwd+bwd TFLOP/s rows at 16k tokens (batch 1, 16 heads), each printed as soon as it is measured. quick: the
    deterministic Gluon and Triton backwards and cuDNN (and the forwards alone); else the non-deterministic modes
    too. bwd_only adds the Gluon backward alone (BWD_VARIANTS); ablation times only the Gluon backward alone, the
    default, non-deterministic and atomic-dQ variants."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    rows = []
    b, s, h = 1, 16384, 16
    for d in headdims:
        for causal in (False, True):
            q, k, v, dout = _inputs(b, s, s, h, h, d, torch.bfloat16, seed=1)
            inputs = [x.requires_grad_() for x in (q, k, v)]
            qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
            dout_t = dout.transpose(1, 2).contiguous()
            fwd_flops = 4 * b * h * s * s * d / (2 if causal else 1)

            def cudnn(a, b_, c):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return scaled_dot_product_attention(a, b_, c, is_causal=causal)

            det = lambda a, b_, c: flash_attn(a, b_, c, causal=causal)  # noqa: E731
            nd = lambda a, b_, c: flash_attn(a, b_, c, causal=causal, deterministic=False)  # noqa: E731
            fns = {}
            if not ablation:
                fns = {"gluon": _fwd_bwd(det, inputs, dout), "triton": _fwd_bwd(det, inputs, dout, triton_bwd=True),
                       "cudnn": _fwd_bwd(cudnn, [qt, kt, vt], dout_t),
                       # the forwards alone: each backward's own time is the difference
                       "fwd:ours": _no_grad(det, inputs), "fwd:cudnn": _no_grad(cudnn, [qt, kt, vt])}
            if not quick and not ablation:
                fns["gluon-nd"] = _fwd_bwd(nd, inputs, dout)
                fns["triton-nd"] = _fwd_bwd(nd, inputs, dout, triton_bwd=True)
            if bwd_only or ablation:
                out, lse = ga.gluon_attention_forward(q.detach(), k.detach(), v.detach(), causal=causal)
                names = list(BWD_VARIANTS)[:3] if ablation else list(BWD_VARIANTS)
                for name in names:
                    det_mode, dq_tma = BWD_VARIANTS[name]
                    cfg = dataclasses.replace(gb.resolve_gluon_bwd_config(d), dq_tma=dq_tma)
                    fns[name] = (lambda m, c: lambda: gb.gluon_attention_backward(
                        dout, q.detach(), k.detach(), v.detach(), out, lse, d ** -0.5, causal, m, c))(det_mode, cfg)
            for name, fn in fns.items():
                flops = fwd_flops * {"bwd": 2.5, "fwd": 1.0}.get(name.split(":")[0], BWD_FACTOR)
                try:
                    fn()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100)
                    tf = flops / ms / 1e9
                except Exception as e:  # a peer missing on this build is reported, not fatal
                    print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                    ms, tf = float("nan"), float("nan")
                rows.append(dict(d=d, b=b, s=s, h=h, causal=causal, impl=name, ms=ms, tflops=tf))
                print(f"d{d} {'causal' if causal else 'full'} {name}: {tf:.1f} TFLOP/s ({ms:.3f} ms)", flush=True)
            del q, k, v, dout, inputs, qt, kt, vt, dout_t
            torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="hd128 only, no correctness pass, Triton backward without autotuning (under a minute)")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                    help="the correctness pass first (default: on unless --quick)")
    ap.add_argument("--bwd-only", action="store_true", help="also time the Gluon backward alone")
    ap.add_argument("--ablation", action="store_true",
                    help="only the Gluon backward alone: default, non-deterministic, atomic dQ (no correctness pass)")
    ap.add_argument("--headdim", type=int, choices=(64, 128), default=None,
                    help="one head dim (default: 128 with --quick / --ablation, else both)")
    ap.add_argument("--config", default="", help="GluonBwdConfig overrides for the run, e.g. block_m=128,num_stages=2")
    args = ap.parse_args()
    if args.config:
        _override_bwd_config(_parse_overrides(args.config))
    headdims = (args.headdim, ) if args.headdim else (128, ) if args.quick or args.ablation else (128, 64)
    if args.quick:
        os.environ[AUTOTUNE_ENV] = "0"  # the Triton backward's first (default) tile config, no autotuning
    dev = torch.cuda.get_device_name()
    print(f"device {dev}; torch {torch.__version__}; triton {triton.__version__}"
          + ("; Triton backward not autotuned" if args.quick else ""), flush=True)
    result = dict(device=dev, torch=torch.__version__, triton=triton.__version__, quick=args.quick,
                  config=args.config)
    if args.check if args.check is not None else not (args.quick or args.ablation):
        result["correctness"] = check_correctness(headdims)
        bad = [r for r in result["correctness"] if not r["ok"]]
        for r in result["correctness"]:
            mark = "ok " if r["ok"] else "BAD"
            errs = " ".join(f"{n} {r[n][0]:.2e}/{3 * r[n][1]:.2e}" for n in ("dq", "dk", "dv"))
            print(f"{mark} {r['case']:<44} det={r['deterministic']!s:<5} tma={r['dq_tma']!s:<5} {errs} "
                  f"repro={r.get('reproducible', '-')}")
        print(f"correctness: {len(result['correctness']) - len(bad)} ok, {len(bad)} bad (err / 3x same-dtype)",
              flush=True)
    result["timing"] = time_all(args.quick, args.bwd_only, headdims, args.ablation)
    with open(os.path.join(os.environ.get("OUT", "."), "gluon_bwd.json"), "w") as f:
        json.dump(result, f, indent=1)
    print_table(result["timing"])


def print_table(timing: list[dict]) -> None:
    """One line per shape: every row's TFLOP/s, then (where their rows were timed) the three backwards alone and
    Gluon's fwd+bwd over cuDNN's."""
    impls = list(dict.fromkeys(r["impl"] for r in timing))
    derived = {"bwd=gluon": ("gluon", "fwd:ours"), "bwd=triton": ("triton", "fwd:ours"),
               "bwd=cudnn": ("cudnn", "fwd:cudnn")}
    derived = {n: pair for n, pair in derived.items() if all(p in impls for p in pair)}
    ratio = "gluon" in impls and "cudnn" in impls
    print(f"\n{'shape':<26}" + "".join(f"{n[-12:]:>13}" for n in impls + list(derived))
          + (f"{'gluon/cudnn':>13}" if ratio else ""))
    for key in dict.fromkeys((r["d"], r["s"], r["h"], r["causal"]) for r in timing):
        cells = {r["impl"]: r for r in timing if (r["d"], r["s"], r["h"], r["causal"]) == key}
        fwd_flops = 4 * key[1] * key[1] * key[2] * key[0] / (2 if key[3] else 1)
        label = f"d{key[0]} 1x{key[1]} h{key[2]} {'causal' if key[3] else 'full'}"
        print(f"{label:<26}" + "".join(f"{cells[n]['tflops']:>13.1f}" for n in impls)
              + "".join(f"{_backward_alone(cells, *pair, fwd_flops):>13.1f}" for pair in derived.values())
              + (f"{cells['gluon']['tflops'] / cells['cudnn']['tflops']:>13.2f}" if ratio else ""))
    print("(TFLOP/s: fwd+bwd rows 3.5x the forward's flops, fwd: 1x, bwd: 2.5x - bwd=... from fwd+bwd minus fwd "
          "times; bf16, do_bench median)")


if __name__ == "__main__":
    main()
