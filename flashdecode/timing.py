"""GPU timing for every benchmark: CUDA-graph replays for microsecond kernels, inputs rotated beyond L2, medians,
and the ceilings (copy bandwidth, read-stream bandwidth, matmul rate) measured on the same GPU in the same run."""

from __future__ import annotations

import datetime
import functools
import platform
import statistics
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl


def env_info() -> dict:
    """Device, versions and date: printed and stored beside every figure."""
    import triton

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(device=props.name, sm_count=props.multi_processor_count,
                    l2_bytes=getattr(props, "L2_cache_size", None), cuda=torch.version.cuda,
                    gpu_memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info["device"] = "cpu"
    return info


def l2_bytes() -> int:
    if not torch.cuda.is_available():
        return 50 * 2**20
    return int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 50 * 2**20))


def rotation_count(bytes_per_set: int, min_total_factor: float = 4.0, max_sets: int = 64) -> int:
    """How many input sets to rotate so that together they exceed L2 by ``min_total_factor``."""
    want = int(min_total_factor * l2_bytes() / max(1, bytes_per_set)) + 1
    return max(2, min(max_sets, want))


def cuda_graph_time_us(fns: Sequence[Callable[[], object]], reps: int = 20, calls_per_graph: int | None = None,
                       warmup: int = 3) -> float:
    """Median microseconds per call of ``fns`` (one closure per rotated input set), timed as CUDA-graph replays.

    One graph captures ``calls_per_graph`` calls cycling through ``fns`` (so consecutive calls touch different
    buffers and L2 holds none of them); it is replayed ``reps`` times and the median replay / calls is returned.
    """
    n = len(fns)
    calls = calls_per_graph or max(n, 32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):  # compile / autotune outside the capture
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % n]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def do_bench_ms(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of ``fn`` via triton.testing.do_bench (events, L2 flushed between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


@functools.lru_cache(maxsize=None)
def copy_bandwidth_bytes_per_s(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth counting bytes read + written (the decode floor's denominator)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = do_bench_ms(lambda: dst.copy_(src), warmup_ms=20, rep_ms=200)
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


READ_BLOCK = 8192  # elements a read_sum_kernel program sums (16 KiB of bf16, as a copy kernel's block)


@triton.jit
def read_sum_kernel(X, OUT, BLOCK: tl.constexpr):
    """A read-only stream (the read-stream bandwidth, the denominator of bench e2e's read-stream roofline):
    program p sums elements [p * BLOCK, (p + 1) * BLOCK) of the flat X (unmasked: the launcher passes whole
    blocks) into OUT[p] (float32), so the loads cannot be optimised away; a flat sweep by as many small programs as
    a copy kernel launches. A measurement kernel, so it lives with the timing code rather than in kernels/."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + tl.program_id(0), tl.sum(tl.load(X + offs).to(tl.float32), 0))


def read_sum(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Sums of ``x``'s READ_BLOCK-element blocks into ``out`` (float32, >= numel / READ_BLOCK): a read-only stream
    over x (contiguous, numel a multiple of READ_BLOCK)."""
    if not x.is_contiguous() or x.numel() % READ_BLOCK:
        raise ValueError(f"x must be contiguous with a multiple of {READ_BLOCK} elements, got {tuple(x.shape)}")
    blocks = x.numel() // READ_BLOCK
    if out.dtype != torch.float32 or out.numel() < blocks:
        raise ValueError(f"out must be float32 with >= {blocks} elements, got {out.dtype} {out.numel()}")
    read_sum_kernel[(blocks,)](x, out, BLOCK=READ_BLOCK, num_warps=8)
    return out


@functools.lru_cache(maxsize=None)
def read_stream_rates(nbytes: int = 2 * 2**30) -> dict[str, float]:
    """Bytes read per second by two read-only streams over one ``nbytes`` bf16 buffer (40x an H100's L2, and
    do_bench flushes L2 between calls, so every byte comes from memory): torch.sum (float32 accumulation) and a flat
    Triton block sum (read_sum_kernel). Keys "torch_sum", "triton_block_sum"."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    partial = torch.empty(src.numel() // READ_BLOCK, dtype=torch.float32, device="cuda")
    readers = {"torch_sum": lambda: src.sum(dtype=torch.float32), "triton_block_sum": lambda: read_sum(src, partial)}
    rates = {name: nbytes / (do_bench_ms(fn, warmup_ms=20, rep_ms=200) * 1e-3) for name, fn in readers.items()}
    del src, partial
    return rates


def read_bandwidth_bytes_per_s(nbytes: int = 2 * 2**30) -> float:
    """The faster of the read streams of read_stream_rates: the read-stream roofline's denominator (a ceiling, so the
    best reader sets it)."""
    return max(read_stream_rates(nbytes).values())


@functools.lru_cache(maxsize=None)
def matmul_flops_per_s(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense matmul rate on random data (the prefill floor's denominator)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = do_bench_ms(lambda: a @ b, warmup_ms=50, rep_ms=300)
    return 2 * n**3 / (ms * 1e-3)
