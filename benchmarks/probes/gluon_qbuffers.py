"""Two Q buffer sets vs one for persistent Gluon forward launches (GluonFwdConfig.q_buffers), H100 only: the error
against float64 on the small shapes and CUDA-graph TFLOP/s of both settings, forced persistent.

    PYTHONPATH=. python3 -m benchmarks.probes.gluon_qbuffers
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from flashdecode.ops.gluon_attention import gluon_attention_forward, resolve_gluon_config
from flashdecode.reference import attention_ref

SHAPES = [(2, 333, 4, 128, False), (2, 333, 4, 128, True), (1, 1000, 3, 64, False), (16, 1024, 16, 128, False),
          (16, 1024, 16, 64, False), (16, 1024, 16, 128, True), (1, 16384, 16, 128, False)]


def _time_and_error(q, k, v, causal: bool, cfg) -> tuple[float, float, bool]:
    """(ms per call from CUDA-graph replays, max |error| vs float64 (nan for big shapes), all outputs finite)."""
    fn = lambda: gluon_attention_forward(q, k, v, causal=causal, config=cfg)  # noqa: E731
    out, _ = fn()
    err = float("nan")
    if q.shape[0] * q.shape[1] <= 4096:
        ref = attention_ref(q.double(), k.double(), v.double(), causal=causal)
        err = (out.double() - (ref[0] if isinstance(ref, tuple) else ref)).abs().max().item()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=40), err, bool(torch.isfinite(out).all())


def main() -> int:
    for b, s, h, d, causal in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(s + d)
        q, k, v = (torch.randn(b, s, h, d, generator=gen, device="cuda").bfloat16() for _ in range(3))
        base = dataclasses.replace(resolve_gluon_config(d, causal, s), persistent=True)
        one = _time_and_error(q, k, v, causal, dataclasses.replace(base, q_buffers=1))
        two = _time_and_error(q, k, v, causal, dataclasses.replace(base, q_buffers=2))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        print(f"b{b} s{s} h{h} d{d} causal={causal}: one {flops / one[0] / 1e9:.0f} TFLOP/s (err {one[1]:.2e}, "
              f"finite {one[2]}), two {flops / two[0] / 1e9:.0f} TFLOP/s (err {two[1]:.2e}, finite {two[2]}), "
              f"two/one {one[0] / two[0]:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
