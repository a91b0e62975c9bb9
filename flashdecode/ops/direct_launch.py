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


class HostDescriptor:
    """The fields of a host TensorDescriptor that a compiled kernel's launcher reads to fill the CUtensorMap
    (base.data_ptr(), shape, strides, padding). Built per call from a plan's cached lists: a TensorDescriptor's
    constructor re-validates, field by field in Python, what the launch key already fixes."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, view: tuple):
        self.base, (self.shape, self.strides), self.padding = base, view, "zero"


_TENSORMAPS_PER_OPERAND = 64  # base addresses kept per descriptor operand (a dict cleared when full)


class TensormapLauncher:
    """Triton's C launcher of a compiled kernel whose first parameters are host tensor descriptors, called without
    Triton's Python wrappers (Triton 3.6: CudaLauncher.__call__, which allocates the scratch buffers, and
    wrap_handle_tensordesc's per-argument loop, which fills a CUtensorMap per descriptor and launch).

    A CUtensorMap encodes the base address, shape, strides, block shape and swizzle of one descriptor: a caller
    whose launch key fixes everything but the address (a launch plan, given the views) keeps one per address and
    operand, filled by Triton's own make_tensordesc_arg on the first launch that uses that address. The launcher
    copies the map into the kernel's parameters at each launch (and a CUDA graph at capture), so a kept map is only
    read. Built by ``of`` only where the compiled kernel has exactly the layout described here; callers keep
    Triton's path otherwise, and while a launch hook is registered (the hooks need the launch metadata)."""

    __slots__ = ("launcher", "metas", "views", "coop", "pdl", "maps", "fills")

    def __init__(self, launcher, metas: list, views: tuple, coop: bool, pdl: bool):
        self.launcher, self.metas, self.views, self.coop, self.pdl = launcher, metas, views, coop, pdl
        self.maps = tuple({} for _ in views)
        self.fills = 0  # CUtensorMaps filled (the launch-cache tests read it)

    @classmethod
    def of(cls, compiled, views: tuple):
        """For ``compiled`` (a CompiledKernel) whose first len(views) parameters are host tensor descriptors read
        through ``views`` ((shape, strides) lists per descriptor), or None where its launcher is not Triton 3.6's
        CudaLauncher over wrap_handle_tensordesc with TMA metadata for exactly those parameters, or needs scratch."""
        run = getattr(compiled, "run", None)
        inner = getattr(run, "launch", None)
        code, closure = getattr(inner, "__code__", None), getattr(inner, "__closure__", None)
        if code is None or not closure or getattr(run, "global_scratch_size", 1) or getattr(
                run, "profile_scratch_size", 1):
            return None
        cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure)))
        launcher, metas = cells.get("launcher"), cells.get("tensordesc_meta")
        if (not callable(launcher) or cells.get("tensordesc_indices") != set(range(len(views)))
                or not isinstance(metas, list) or len(metas) != len(views) or not all(metas)):
            return None
        coop, pdl = getattr(run, "launch_cooperative_grid", None), getattr(run, "launch_pdl", None)
        if not isinstance(coop, bool) or not isinstance(pdl, bool):
            return None
        return cls(launcher, metas, views, coop, pdl)

    def _map(self, i: int, x) -> tuple:
        """(CUtensorMap, *shape, *strides): descriptor i's launcher arguments for tensor x."""
        maps = self.maps[i]
        ptr = x.data_ptr()
        found = maps.get(ptr)
        if found is None:
            from triton.backends.nvidia.driver import make_tensordesc_arg

            if len(maps) >= _TENSORMAPS_PER_OPERAND:
                maps.clear()
            found = maps[ptr] = tuple(make_tensordesc_arg(HostDescriptor(x, self.views[i]), self.metas[i]))
            self.fills += 1
        return found

    def __call__(self, grid: tuple, stream, function, packed, bases: tuple, rest: tuple):
        """Launch on ``grid`` (3 entries): descriptors over ``bases`` (one tensor per view), then ``rest``."""
        descs = ()
        for i, x in enumerate(bases):
            descs += self._map(i, x)
        self.launcher(grid[0], grid[1], grid[2], stream, function, self.coop, self.pdl, None, None, packed, None,
                      None, None, *descs, *rest)
