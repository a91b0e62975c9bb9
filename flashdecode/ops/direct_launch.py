"""Direct launches of compiled Triton kernels (ops/attention.py, ops/gluon_attention.py): the current stream and the
launch hooks, each read per launch as cheaply as Triton allows.

A launch key's first launch goes through Triton's JIT (or autotuner), which compiles and binds the arguments; later
launches call the compiled kernel's launcher with the same argument layout. Triton's own launch path builds a
launch-metadata record and calls both hook chains on every launch, even while no hook is registered (the chains are
objects, never None); a direct launch passes None instead, so the launcher skips both calls, and only a registered
hook (e.g. Triton's profiler) gets the metadata.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def _stream_getter():
    import triton  # imported on first use: CPU-only users of the package never load Triton's driver

    return triton.runtime.driver.active.get_current_stream


def current_stream(index: int):
    """The raw handle of the current CUDA stream of device ``index``."""
    return _stream_getter()(index)


@functools.lru_cache(maxsize=None)
def _runtime_knobs():
    from triton import knobs

    return knobs.runtime


def launch_hooks():
    """(enter, exit) hooks to hand a compiled kernel's launcher: Triton's hook chains while a hook is registered on
    either, else (None, None). The caller builds the launch metadata only when enter is not None."""
    runtime = _runtime_knobs()
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    if not getattr(enter, "calls", True) and not getattr(exit_, "calls", True):  # two empty HookChains
        return None, None
    return enter, exit_
