"""Probe for the Gluon / Triton dispatch rule (flashdecode.ops.gluon_attention.gluon_pays): per-call forward time
(triton.testing.do_bench of plain calls: its L2 flush between calls hides host work shorter than itself, so short
shapes compare kernel times; gluon_host_overhead.py compares the host paths) of the Gluon kernel, our Triton
flash_attn and torch SDPA's cuDNN backend on short, GQA, chunked-prefill and long shapes, bf16, causal and not.
SDPA's is_causal is top-left aligned: where seqlen_q < seqlen_k its causal cuDNN row does less work than ours
(bottom-right), so compare those rows only between Gluon and Triton.
    PYTHONPATH=. python benchmarks/probes/gluon_dispatch.py [--quick]
Writes gluon_dispatch.json to $OUT (or the current directory) and prints a table last (microseconds per call,
triton.testing.do_bench median, and Gluon's speed-up over Triton)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

from flashdecode.ops.attention import flash_attn
from flashdecode.ops.gluon_attention import gluon_attention_forward

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv): 16 x 1k and 16k as in the issue; a short batch; one tiny
# prompt; a prefill chunk against a long cache (bottom-right causal); few queries against a long cache
SHAPES = {128: [(16, 1024, 1024, 16, 16), (1, 16384, 16384, 16, 16), (4, 512, 512, 32, 8), (1, 128, 128, 32, 8),
                (1, 512, 4096, 32, 8), (8, 64, 2048, 32, 8)],
          64: [(16, 1024, 1024, 16, 16), (4, 512, 512, 32, 8), (1, 128, 128, 32, 8), (8, 64, 2048, 32, 8)]}


def _cudnn(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    group = q.shape[2] // k.shape[2]
    # heads expanded outside the timed call (GQA support of the cuDNN backend varies across torch builds)
    qt, kt, vt = (x.repeat_interleave(n, dim=2).transpose(1, 2) for x, n in ((q, 1), (k, group), (v, group)))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rows = []
    for d, shapes in SHAPES.items():
        for b, sq, sk, h, hkv in shapes:
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(b, sq, h, d, generator=gen).to("cuda", torch.bfloat16)
            k, v = (torch.randn(b, sk, hkv, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
            for causal in (False, True):
                fns = {"gluon": lambda: gluon_attention_forward(q, k, v, causal=causal),
                       "triton": lambda: flash_attn(q, k, v, causal=causal),
                       "cudnn": _cudnn(q, k, v, causal)}
                row = dict(d=d, b=b, sq=sq, sk=sk, h=h, hkv=hkv, causal=causal)
                for name, fn in fns.items():
                    try:
                        row[name] = triton.testing.do_bench(fn, warmup=10 if args.quick else 25,
                                                            rep=30 if args.quick else 100) * 1e3
                    except Exception as e:  # a peer missing on this build is reported, not fatal
                        print(f"{name} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                        row[name] = float("nan")
                rows.append(row)
                print(row, flush=True)
    dev = torch.cuda.get_device_name()
    with open(os.path.join(os.environ.get("OUT", "."), "gluon_dispatch.json"), "w") as f:
        json.dump(dict(device=dev, torch=torch.__version__, triton=triton.__version__, rows=rows), f, indent=1)
    print(f"\ndevice {dev}; bf16; microseconds per direct call (do_bench median)")
    print(f"{'d':>4} {'b x sq x sk':<18}{'h/hkv':>7}{'causal':>7}{'gluon':>10}{'triton':>10}{'cudnn':>10}"
          f"{'g/t':>7}")
    for r in rows:
        shape, heads = f"{r['b']}x{r['sq']}x{r['sk']}", f"{r['h']}/{r['hkv']}"
        print(f"{r['d']:>4} {shape:<18}{heads:>7}{str(r['causal']):>7}{r['gluon']:>10.1f}{r['triton']:>10.1f}{r['cudnn']:>10.1f}{r['triton'] / r['gluon']:>7.2f}")


if __name__ == "__main__":
    main()
