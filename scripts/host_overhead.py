"""Host cost of one flash_attn call against its kernel time (short sequences are host-bound).

GPU (default):

    PYTHONPATH=. python3 scripts/host_overhead.py [--calls 300]

Per shape (16 x 1024 tokens, 16 heads, bf16): ``host`` = microseconds of Python per call while the GPU runs behind
(perf_counter around a loop of calls, no sync inside); ``loop`` = GPU time per call of that loop (CUDA events around
it: kernel plus any gap the host leaves); ``kernel`` = the same call replayed from a CUDA graph (no host work), CUDA
events around the replays; ``gap`` = loop - kernel. Then a cProfile of the last shape's calls, by own time.

CPU (no GPU needed):

    PYTHONPATH=. TRITON_INTERPRET=1 python3 scripts/host_overhead.py --cpu

The same calls with small CPU tensors (2 x 16 tokens: a CPU allocation of 16 x 1024 tokens costs far more than the
GPU's caching allocator), the kernel launch replaced by a stub that does the direct launch's Python work (grid,
argument tuple): the host time of the checks, the launch-plan lookup, the allocations and the argument building, in CPU time of the calling thread.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import flashdecode
from flashdecode.ops import attention as attn_ops

SHAPES = [(64, True), (128, True), (128, False)]  # (head dim, causal); 16 x 1024 tokens, 16 heads


def _host_us(f, calls: int, clock=time.perf_counter) -> float:
    start = clock()
    for _ in range(calls):
        f()
    return (clock() - start) / calls * 1e6


def _gpu_us(f, calls: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        f()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / calls * 1e3


def _kernel_us(f, calls: int) -> float:
    """The call's GPU time without host work: replays of a CUDA graph that captured it."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        f()
        with torch.cuda.graph(graph, stream=stream):
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return _gpu_us(graph.replay, calls)


def _call(headdim: int, causal: bool, batch: int, tokens: int, device: str):
    """A flash_attn call on fresh bf16 inputs of (batch, tokens, 16 heads, headdim)."""
    q = torch.randn(batch, tokens, 16, headdim, device=device, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    return lambda: flashdecode.flash_attn(q, k, v, causal=causal)


def _profile(f, calls: int, rows: int):
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        f()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(rows)


def _stub_launch(self, grid_fn, args, device):
    """What a cached direct launch does in Python besides the C launcher call."""
    meta = dict(zip(self.names, self.tiles[0]))
    grid_fn(meta)
    return args + (None,) * 8


def run_gpu(calls: int):
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, 16 x 1024 tokens, 16 heads, bf16, {calls} calls")
    print("| head dim | causal | host us/call | loop us/call | kernel us/call | gap us/call |")
    print("|---|---|---|---|---|---|")
    for headdim, causal in SHAPES:
        f = _call(headdim, causal, 16, 1024, "cuda")
        for _ in range(30):  # compile, autotune, cache the launch plan
            f()
        torch.cuda.synchronize()
        host = _host_us(f, calls)
        torch.cuda.synchronize()
        loop = _gpu_us(f, calls)
        kernel = _kernel_us(f, calls)
        print(f"| {headdim} | {causal} | {host:.1f} | {loop:.1f} | {kernel:.1f} | {loop - kernel:.1f} |", flush=True)
    _profile(f, calls, 15)


def run_cpu(calls: int):
    attn_ops._Kernel.__call__ = _stub_launch
    print(f"CPU, launch stubbed, torch {torch.__version__}, 2 x 16 tokens, 16 heads, bf16, {calls} calls")
    print("| head dim | causal | host us/call |")
    print("|---|---|---|")
    for headdim, causal in SHAPES:
        f = _call(headdim, causal, 2, 16, "cpu")
        for _ in range(10):
            f()
        host = min(_host_us(f, calls, time.thread_time) for _ in range(3))  # CPU time: robust to a busy machine
        print(f"| {headdim} | {causal} | {host:.1f} |", flush=True)
    _profile(f, calls, 12)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU tensors (TRITON_INTERPRET=1), launch stubbed")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    if args.cpu:
        run_cpu(args.calls)
    else:
        run_gpu(args.calls)


if __name__ == "__main__":
    main()
