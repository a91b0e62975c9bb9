"""Host time per forward call of the Gluon launcher's entry points beside flash_attn's (with and without lse), on a
tiny shape (the GPU never holds the host back): a loop of asynchronous calls timed on the host clock and with CUDA
events, beside the kernel alone (CUDA-graph replay).
    PYTHONPATH=. python benchmarks/probes/gluon_host_overhead.py
Writes gluon_host_overhead.json to $OUT (or the current directory) and prints a table last."""
import json
import os
import time

import torch
import triton

from flashdecode.ops.attention import flash_attn
from flashdecode.ops.gluon_attention import gluon_attention_forward, gluon_forward_if_supported


def _host_and_event_us(fn, calls: int) -> tuple[float, float]:
    """(host microseconds per call, CUDA-event microseconds per call) over a loop of ``calls`` calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_us = (time.perf_counter() - start) / calls * 1e6
    end_ev.record()
    torch.cuda.synchronize()
    return host_us, start_ev.elapsed_time(end_ev) / calls * 1e3


def _graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay) * 1e3


def main(calls: int = 500):
    rows = []
    for b, s, h, hkv, d in ((1, 128, 2, 2, 128), (16, 1024, 16, 16, 128), (16, 1024, 32, 8, 64)):
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        scale = d ** -0.5
        for causal in (False, True):
            fns = {
                "gluon_attention_forward": lambda: gluon_attention_forward(q, k, v, causal=causal),
                "gluon_forward_if_supported": lambda: gluon_forward_if_supported(q, k, v, scale, -1,
                                                                                 0 if causal else -1),
                "flash_attn": lambda: flash_attn(q, k, v, causal=causal),  # no lse allocated
                "flash_attn return_lse": lambda: flash_attn(q, k, v, causal=causal, return_lse=True),
            }
            for name, fn in fns.items():
                host_us, event_us = _host_and_event_us(fn, calls if s <= 128 else 100)
                rows.append(dict(shape=f"{b}x{s} h{h}/{hkv} d{d}", causal=causal, impl=name, host_us=host_us,
                                 event_us=event_us, graph_us=_graph_us(fn)))
    dev = torch.cuda.get_device_name()
    with open(os.path.join(os.environ.get("OUT", "."), "gluon_host_overhead.json"), "w") as f:
        json.dump(dict(device=dev, rows=rows), f, indent=1)
    print(f"device {dev}; per call, microseconds: host = host clock over a loop of calls, events = CUDA events "
          "around that loop, graph = CUDA-graph replay (kernels alone)")
    print(f"{'shape':<22}{'causal':>7} {'impl':<28}{'host':>9}{'events':>9}{'graph':>9}")
    for r in rows:
        print(f"{r['shape']:<22}{str(r['causal']):>7} {r['impl']:<28}{r['host_us']:>9.1f}{r['event_us']:>9.1f}"
              f"{r['graph_us']:>9.1f}")


if __name__ == "__main__":
    main()
