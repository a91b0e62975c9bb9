"""Host cost of one flash_attn call against its kernel time (short sequences are host-bound).

GPU (default; under a minute on an H100):

    PYTHONPATH=$PWD python3 scripts/host_overhead.py [--calls 300]

Rows (Triton autotuning off unless --autotune, to stay under a minute): 16 x 1024 tokens, 16 heads, bf16, head dim
128 and 64, causal or not, and 1 x 128 tokens (a kernel of a few microseconds: the host time shows in the loop), on
each forward path (``gluon``: the warp-specialised Hopper kernel flash_attn dispatches
to; ``triton``: the Triton kernel, forced by refusing the Gluon dispatch for the run), each with inputs that need no
gradient (``no_grad``: out only, so no lse is allocated), the same with return_lse=True (``lse``) and inputs that
require grad (``grad``: the forward through autograd, no backward). Columns: ``host`` = microseconds of Python per
call while the GPU runs behind (host clock around a loop of calls, no sync inside; the best of 3 loops, each from
an idle GPU after a garbage collection); ``loop`` = GPU time per call of
that loop (CUDA events around it: kernel plus any gap the host leaves); ``kernel`` = the same call replayed from a
CUDA graph (no host work); ``gap`` = loop - kernel. Then where the host time of one call goes (a no_grad gluon /
triton call; each part timed alone in a loop): the out allocation, an lse allocation (which a no_grad call without
return_lse no longer makes), the direct launch of the compiled kernel with ready arguments, and the rest (Python:
checks, cache lookup, argument building); then what each way of allocating out costs alone; then a cProfile of the
last row.

CPU (no GPU needed):

    PYTHONPATH=$PWD python3 scripts/host_overhead.py --cpu [--calls 2000]

The same rows on small CPU tensors (2 x 16 tokens: a CPU allocation of 16 x 1024 tokens costs far more than the
GPU's caching allocator), TRITON_INTERPRET=1 for the argument checks, the dispatch told it is not interpreting and
runs on a Hopper of 132 SMs, every kernel launch stubbed where Triton's C launch function would be called (Triton's
Python wrappers kept where a launch goes through them): the host time of everything flashdecode does in Python per
call (checks, the call cache, small CPU allocations, the argument tuple), median of ``--calls`` single calls, in
microseconds; then the same breakdown of one call as on the GPU (stub launches). benchmarks/probes/c_launcher_cpu.py
adds Triton's real C launchers over a stub driver.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import pstats
import statistics
import time

import torch

import flashdecode
from flashdecode.ops import attention_config, attention_plans, direct_launch, gluon_backward, gluon_plan, launch_cache, util
from flashdecode.ops import gluon_attention as ga

# (batch, tokens, head dim, causal), 16 heads: the 16 x 1k calls, and one call short enough that the host
# time shows in the loop (its kernel runs for a few microseconds)
SHAPES = [(16, 1024, 128, False), (16, 1024, 128, True), (16, 1024, 64, False), (1, 128, 128, False)]
PATHS = ("gluon", "triton")
GRADS = ("no_grad", "lse", "grad")  # the inputs column: no grad (out only), no grad with return_lse, grad


def _clear_caches():
    for cache in (gluon_plan.PLANS, attention_plans._FWD_PLANS, attention_plans._DENSE_CALLS):
        cache.clear()


@contextlib.contextmanager
def forward_path(path: str):
    """The Gluon dispatch as it is (``gluon``) or refused for every call (``triton``); launch caches cleared on
    the way in and out, so no call key keeps the other path's plan."""
    pays = ga.gluon_pays
    if path == "triton":
        ga.gluon_pays = lambda headdim, seqlen_k: False
    _clear_caches()
    try:
        yield
    finally:
        ga.gluon_pays = pays
        _clear_caches()


def _call(headdim: int, causal: bool, grad: str, device: str, batch: int = 16, tokens: int = 1024):
    """A flash_attn call on fresh bf16 inputs of (batch, tokens, 16 heads, headdim)."""
    q = torch.randn(batch, tokens, 16, headdim, device=device, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    if grad == "grad":
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    return_lse = grad == "lse"
    return lambda: flashdecode.flash_attn(q, k, v, causal=causal, return_lse=return_lse)


def _host_us(f, calls: int, sync=None, repeats: int = 3) -> float:
    """Host microseconds per call of ``f``: the best of ``repeats`` loops of ``calls`` calls, each loop after a
    garbage collection (a full collection of the process's import-time objects would otherwise land in some loops
    and not others) and ``sync`` (not timed: each loop starts from an idle GPU)."""
    best = float("inf")
    for _ in range(repeats):
        if sync is not None:
            sync()
        gc.collect()
        start = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def _median_us(f, calls: int) -> float:
    """Median of single calls (robust to a busy machine)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        f()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def _gpu_us(f, calls: int) -> float:
    gc.collect()
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
    with torch.cuda.stream(stream), torch.no_grad():
        f()
        with torch.cuda.graph(graph, stream=stream):
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return _gpu_us(graph.replay, calls)


def _profile(f, calls: int, rows: int):
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        f()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(rows)


class _LaunchSpy:
    """Wraps the compiled kernels' launchers: counts direct launches and keeps the last one's arguments, so that
    the launch alone can be replayed."""

    def __init__(self):
        self.last = None

    def wrap(self, run):
        def spy(*args):
            self.last = (run, args)
            return run(*args)
        return spy


def _direct_launchers():
    """(owner, attribute) of every launcher a direct launch calls in the caches: a Gluon plan's or a Triton
    kernel's C launcher (``direct``) or else Triton's launcher (``run``)."""
    for plan in gluon_plan.PLANS.values():
        if plan and plan.compiled is not None:
            yield plan, "direct" if plan.direct is not None else "run"
    for plan in attention_plans._FWD_PLANS.values():
        if plan.kernel.compiled is not None:
            yield plan.kernel, "direct" if plan.kernel.direct is not None else "run"


def _with_tensor_pointers(run, args: tuple, tensors: tuple):
    """A recorded direct launch's arguments with its int pointers (data_ptr()) replaced by tensors of the same
    layouts, ``tensors`` = (q, k, v, out, lse): the launch as the C launcher got it before (it then calls data_ptr()
    and cuPointerGetAttribute per tensor)."""
    if isinstance(run, direct_launch.TensormapLauncher):
        stream, bases, rest = args[:3]  # (the bases' pointers, if passed, are left for the launcher to read)
        return stream, bases, tensors[3:] + rest[2:]
    if isinstance(run, direct_launch.PlainLauncher):
        grid, stream, device, full = args
        return grid, stream, device, tensors + full[5:]
    return None


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def _breakdown(headdim: int, causal: bool, path: str, calls: int, device: str = "cuda", batch: int = 16,
               tokens: int = 1024) -> str:
    """One no_grad call's host time split into the out allocation, the launch alone and the rest; beside them what
    an lse allocation (which the call no longer makes) costs, and the launch with tensors for its pointers."""
    f = _call(headdim, causal, "no_grad", device, batch, tokens)
    for _ in range(5):
        f()
    spy = _LaunchSpy()
    for owner, attribute in list(_direct_launchers()):
        setattr(owner, attribute, spy.wrap(getattr(owner, attribute)))
    f()
    _sync(device)
    if spy.last is None:
        return f"| {path} | {headdim} | {causal} | no direct launch recorded | | | | | |"
    run, args = spy.last
    q = torch.empty(batch, tokens, 16, headdim, device=device, dtype=torch.bfloat16)
    lse_shape = (batch, 16, tokens)

    sync = (lambda: _sync(device))
    total = _host_us(f, calls, sync)
    alloc = _host_us(lambda: torch.empty_like(q, memory_format=torch.contiguous_format), calls, sync)
    template = direct_launch.empty_template(lse_shape, torch.float32, q.device)
    lse = _host_us(lambda: direct_launch.empty_from(template, lse_shape, torch.float32, q.device), calls, sync)
    launch = _host_us(lambda: run(*args), calls, sync)
    tensor_args = _with_tensor_pointers(run, args, (q, torch.empty_like(q), torch.empty_like(q), torch.empty_like(q),
                                                    torch.empty(lse_shape, dtype=torch.float32, device=q.device)))
    with_tensors = "-" if tensor_args is None else f"{_host_us(lambda: run(*tensor_args), calls, sync):.1f}"
    _sync(device)
    return (f"| {path} | {headdim} | {causal} | {total:.1f} | {alloc:.1f} | {lse:.1f} | {launch:.1f} | "
            f"{with_tensors} | {total - alloc - launch:.1f} |")


def _allocation_ways(calls: int):
    """Host us of each way of allocating a (16, 1024, 16, 128) bf16 out and a (16, 16, 1024) fp32 lse (allocated and
    freed per call)."""
    q = torch.empty(16, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
    shape, strides, dtype, device = tuple(q.shape), q.stride(), q.dtype, q.device
    ways = {
        "torch.empty_like(q, memory_format=torch.contiguous_format)":
            lambda: torch.empty_like(q, memory_format=torch.contiguous_format),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "torch.empty(shape, dtype=, device=)": lambda: torch.empty(shape, dtype=dtype, device=device),
        "q.new_empty(shape)": lambda: q.new_empty(shape),
        "torch.empty_strided(shape, strides, dtype=, device=)":
            lambda: torch.empty_strided(shape, strides, dtype=dtype, device=device),
    }
    lse_shape = (16, 16, 1024)
    template = direct_launch.empty_template(lse_shape, torch.float32, device)
    ways["lse: torch.empty(shape, dtype=, device=)"] = lambda: torch.empty(lse_shape, dtype=torch.float32,
                                                                           device=device)
    ways["lse: torch.empty_like(one element expanded, direct_launch.empty_template)"] = (
        lambda: torch.empty_like(template))
    print("\nOne out (or lse) allocation alone, host us per call")
    print("| allocation | host us |")
    print("|---|---|")
    for name, f in ways.items():
        for _ in range(20):
            f()
        print(f"| {name} | {_host_us(f, calls, torch.cuda.synchronize):.2f} |")


def _per_launch_reads(calls: int):
    """Host us of each read a direct launch makes per call (the current device, stream, capture status, launch
    hooks) and of the Triton path's scratch lookup."""
    index = torch.cuda.current_device()
    device = torch.device("cuda", index)
    stream = direct_launch.current_stream(index)
    reads = {
        "direct_launch.current_device()": direct_launch.current_device,
        "direct_launch.current_stream(index)": lambda: direct_launch.current_stream(index),
        "util.capturing()": util.capturing,
        "direct_launch.launch_hooks()": direct_launch.launch_hooks,
        "direct_launch.SCRATCH.get(64 KiB)": lambda: direct_launch.SCRATCH.get(65536, device, stream),
    }
    print("\nPer-launch reads alone, host us per call")
    print("| read | host us |")
    print("|---|---|")
    for name, f in reads.items():
        print(f"| {name} | {_host_us(f, calls):.2f} |")


def _print_breakdown(rows: list):
    print("\nOne no_grad call's host time, us: total, the out allocation alone, an lse allocation alone (not made "
          "by this call), the direct launch alone (ready arguments: pointers as ints), the same launch with tensors "
          "for the pointers (as before), the rest (total - out - launch: Python)")
    print("| path | head dim | causal | total | out | (lse) | launch | (launch, tensors) | rest |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def run_gpu(calls: int, autotune: bool):
    if not autotune:  # the first tile that fits: one compile per Triton row instead of a tuning sweep
        os.environ[util.AUTOTUNE_ENV] = "0"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, 16 x 1024 tokens, 16 heads, bf16, "
          f"{calls} calls per loop, Triton autotuning {'on' if autotune else 'off'}")
    print("| path | batch x tokens | head dim | causal | inputs | host us/call | loop us/call | kernel us/call | "
          "gap us/call |")
    print("|---|---|---|---|---|---|---|---|---|")
    breakdown = []
    for path in PATHS:
        with forward_path(path):
            for batch, tokens, headdim, causal in SHAPES:
                for grad in GRADS:
                    f = _call(headdim, causal, grad, "cuda", batch, tokens)
                    for _ in range(20):  # compile, autotune, cache the launch
                        f()
                    host = _host_us(f, calls, torch.cuda.synchronize)
                    torch.cuda.synchronize()
                    loop = _gpu_us(f, calls)
                    kernel = _kernel_us(f, calls)
                    print(f"| {path} | {batch} x {tokens} | {headdim} | {causal} | {grad} | {host:.1f} | {loop:.1f} | "
                          f"{kernel:.1f} | {loop - kernel:.1f} |", flush=True)
            breakdown.append(_breakdown(128, False, path, calls))
    _print_breakdown(breakdown)
    _allocation_ways(calls)
    _per_launch_reads(calls)
    print()
    _profile(f, calls, 15)


# ----------------------------------------------------------------------------------------------------------------
# CPU: small CPU tensors, a faked Hopper, launches stubbed where Triton's launcher would run
# ----------------------------------------------------------------------------------------------------------------

class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: launch_metadata does what Triton's does while a hook chain is set
    (a LazyDict of the launch); run (the launcher) does nothing."""

    function, packed_metadata, name = 0, (4, 1, 0), "stub"

    def launch_metadata(self, grid, stream, *args):
        from triton import knobs
        from triton.compiler.compiler import LazyDict

        if knobs.runtime.launch_enter_hook is None:
            return None
        return LazyDict({"name": self.name, "function": self.function, "stream": stream})

    def run(self, *args):
        return None


def _fake_gluon_compiled():
    """A fake compiled Gluon kernel whose launcher is Triton's own CudaLauncher Python (its scratch handling and
    the host-descriptor expansion) around a C launch that does nothing; the CUtensorMap fill is a stub too."""
    import triton
    from triton.backends.nvidia import driver as nv

    from flashdecode.kernels.gluon.attn_fwd import attn_fwd_ws_kernel

    class Driver:  # triton.runtime.driver.active as make_tensordesc_arg reads it
        class utils:
            fill_tma_descriptor = staticmethod(lambda *args: object())

    triton.runtime.driver.set_active(Driver())
    signature = {i: "tensordesc" if i < 3 else "i32" for i in range(len(attn_fwd_ws_kernel.arg_names))}
    metas = [dict(swizzle=128, elem_size=2, elem_type=6, block_size=[64, 128], fp4_padded=False)] * 3
    launcher = nv.CudaLauncher.__new__(nv.CudaLauncher)  # its constructor compiles the C launcher
    launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, False
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    launcher.launch = nv.wrap_handle_tensordesc(lambda *args: None, signature, metas)
    compiled = _FakeCompiled()
    compiled.run = launcher
    return compiled


def _fake_triton_compiled():
    """A fake compiled Triton kernel whose launcher is a CudaLauncher (not constructed: its constructor compiles C)
    around a C launch that does nothing, with a global scratch as the TMA forward has."""
    from triton.backends.nvidia import driver as nv

    launcher = nv.CudaLauncher.__new__(nv.CudaLauncher)
    launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, False
    launcher.global_scratch_size, launcher.profile_scratch_size = 128, 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 128
    launcher.launch = lambda *args: None
    compiled = _FakeCompiled()
    compiled.run = launcher
    return compiled


class _FakeTuned:
    """Stands in for the autotuner: a launch returns the fake compiled kernel; best_config is the first tile."""

    def __init__(self, fn, tiles, names):
        import triton

        tile = tiles[0]
        self.fn = fn
        self.best_config = triton.Config(dict(zip(names, tile)), num_warps=tile[len(names)],
                                         num_stages=tile[len(names) + 1])

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _fake_triton_compiled()


def _fake_device():
    """Patches (for the rest of the process) that make CPU tensors take the GPU's host path."""
    os.environ["TRITON_INTERPRET"] = "1"  # the argument checks take CPU tensors
    for module in (attention_config, attention_plans, launch_cache):
        module.interpreting_now = lambda: False  # the dispatch and launches do not interpret
    for module in (ga, gluon_backward):
        module.interpreting = lambda device=None: False
        module.is_hopper = lambda device: True
    gluon_plan.num_sms = lambda device: 132
    gluon_plan._jit_launch = lambda grid, args, constexprs: _fake_gluon_compiled()
    launch_cache.tuned = lambda fn, tiles, names, autotune, reset_dq: _FakeTuned(fn, tiles, names)
    attention_config.device_facts = lambda device: (227 * 1024, 9)
    for module in (gluon_plan, launch_cache):
        module._current_stream = lambda index: 0
        module._current_device = lambda: None  # a CPU tensor's device index
    launch_cache.ensure_triton_allocator()  # Triton's launcher asks for the fake kernel's global scratch


def run_cpu(calls: int):
    _fake_device()
    print(f"CPU tensors on a faked Hopper, launches stubbed, torch {torch.__version__}, 2 x 16 tokens, 16 heads, "
          f"bf16; median of {calls} calls")
    print("| path | head dim | causal | inputs | host us/call |")
    print("|---|---|---|---|---|")
    breakdown = []
    for path in PATHS:
        with forward_path(path):
            for _, _, headdim, causal in SHAPES[:3]:
                for grad in GRADS:
                    f = _call(headdim, causal, grad, "cpu", batch=2, tokens=16)
                    for _ in range(10):
                        f()
                    print(f"| {path} | {headdim} | {causal} | {grad} | {_median_us(f, calls):.1f} |", flush=True)
            breakdown.append(_breakdown(128, False, path, calls, "cpu", batch=2, tokens=16))
    _print_breakdown(breakdown)
    f0 = _call(128, False, "no_grad", "cpu", batch=2, tokens=16)
    f0()
    _profile(f0, calls, 14)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU tensors on a faked Hopper, launches stubbed")
    parser.add_argument("--calls", type=int, default=None, help="calls per loop (GPU 300, CPU 2000)")
    parser.add_argument("--autotune", action="store_true", help="GPU: autotune the Triton rows' tiles (slower)")
    args = parser.parse_args()
    if args.cpu:
        run_cpu(args.calls or 2000)
    else:
        run_gpu(args.calls or 300, args.autotune)


if __name__ == "__main__":
    main()
