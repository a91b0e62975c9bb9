"""Host time of one gluon_attention_forward call (a loop of asynchronous calls on a tiny shape, so the GPU never
holds the host back) beside the kernel alone (CUDA-graph replay).
    PYTHONPATH=. python benchmarks/probes/gluon_host_overhead.py"""
import time

import torch
import triton

from flashdecode.ops.gluon_attention import gluon_attention_forward


def main(calls: int = 200):
    q, k, v = (torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        gluon_attention_forward(q, k, v)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        gluon_attention_forward(q, k, v)
    host_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gluon_attention_forward(q, k, v)
    kernel_us = triton.testing.do_bench(graph.replay) * 1e3
    print(f"host time per call {host_us:.1f} us; kernel alone (graph replay) {kernel_us:.1f} us")


if __name__ == "__main__":
    main()
