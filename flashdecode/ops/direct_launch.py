"""Direct launches of compiled Triton kernels (ops/launch_cache.py, ops/gluon_plan.py): the current device, stream
and launch hooks, each read per launch as cheaply as Triton allows, the C launchers called without Triton's Python
wrappers, and the device buffers those launches need (global scratch, discarded outputs).

A launch key's first launch goes through Triton's JIT (or autotuner), which compiles and binds the arguments; later
launches call the compiled kernel's launcher with the same argument layout. Triton's own launch path builds a
launch-metadata record and calls both hook chains on every launch, even while no hook is registered (the chains are
objects, never None); a direct launch passes None instead, so the launcher skips both calls, and only a registered
hook (e.g. Triton's profiler) gets the metadata.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from flashdecode.ops import checks
from flashdecode.ops.util import call_scoped, capturing


@functools.lru_cache(maxsize=None)
def _stream_getter():
    import triton  # imported on first use: CPU-only users of the package never load Triton's driver

    return triton.runtime.driver.active.get_current_stream


def current_stream(index: int):
    """The raw handle of the current CUDA stream of device ``index``."""
    return _stream_getter()(index)


_CUDA_BUILD = torch.version.cuda is not None  # CPU-only builds of torch lack (or stub) the C functions below
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None) if _CUDA_BUILD else None


def current_device() -> int:
    """torch.cuda.current_device() without its Python-level lazy-initialisation check (the C call initialises
    CUDA itself where needed)."""
    return torch.cuda.current_device() if _cuda_get_device is None else _cuda_get_device()


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
# Whether LaunchSite records take DescriptorLauncher (kernels with host tensor descriptors: decode stage 1 over a
# TMA-read cache, the dense Gluon backward). Off: its GPU tests ran on an H100 without a failure, but two H100 host
# samples disagreed on whether it saves time (docs/decisions.md); off, those kernels keep Triton's own launcher (one
# map fill per call). FLASHDECODE_DESCRIPTOR_LAUNCHER=1 turns it on (the GPU check runs the decode tests so).
DESCRIPTOR_LAUNCHER = checks.env_value("FLASHDECODE_DESCRIPTOR_LAUNCHER", "0") == "1"


def _descriptor_launch(compiled, scratch_ok: bool = False):
    """(C launcher, descriptor parameter indices, TMA metadata per descriptor, cooperative grid, PDL, global scratch
    bytes per program, its alignment) of a compiled kernel whose launcher is Triton 3.6's CudaLauncher over
    wrap_handle_tensordesc with TMA metadata for every descriptor parameter, no profile scratch and (unless
    scratch_ok; never with PDL) no global scratch; None otherwise."""
    run = getattr(compiled, "run", None)
    inner = getattr(run, "launch", None)
    code, closure = getattr(inner, "__code__", None), getattr(inner, "__closure__", None)
    scratch = [getattr(run, a, None) for a in ("global_scratch_size", "global_scratch_align", "num_ctas")]
    if code is None or not closure or getattr(run, "profile_scratch_size", 1) or not all(
            type(x) is int for x in scratch) or (scratch[0] and not scratch_ok):
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure)))
    launcher, indices, metas = cells.get("launcher"), cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
    if (not callable(launcher) or not isinstance(indices, set) or not indices or not isinstance(metas, list)
            or len(metas) != len(indices) or not all(metas)):
        return None
    coop, pdl = getattr(run, "launch_cooperative_grid", None), getattr(run, "launch_pdl", None)
    if not isinstance(coop, bool) or not isinstance(pdl, bool) or (pdl and scratch[0]):
        return None
    return launcher, indices, metas, coop, pdl, scratch[0] * scratch[2], scratch[1]


class DescriptorLauncher:
    """Triton's C launcher of a compiled kernel with host tensor descriptor parameters anywhere in its list (a
    LaunchSite kernel: decode stage 1 reads the cache's rows through two), called as PlainLauncher calls a kernel
    without them: not through CudaLauncher.__call__ and wrap_handle_tensordesc's loop over every argument, which
    fills a CUtensorMap per descriptor and launch. Each descriptor's launcher arguments (make_tensordesc_arg: the
    CUtensorMap, shape and strides) are kept per parameter and (base address, shape, strides, padding) - everything
    the map encodes besides the block shape and swizzle, which the compiled kernel fixes - and the argument list is
    spliced around the descriptors by slices. The launcher copies a map into the kernel's parameters at each launch
    (and a CUDA graph at capture), so a kept map is only read. Built by ``of`` only where the launcher has exactly
    this layout and needs no scratch; LaunchSite keeps Triton's launcher otherwise."""

    __slots__ = ("launcher", "at", "mid", "maps", "fills", "launches")

    def __init__(self, launcher, indices, metas: list, coop: bool, pdl: bool, function, packed):
        self.launcher = launcher
        self.at = tuple(zip(sorted(indices), metas))  # (parameter index, its TMA metadata), in parameter order
        # the C launcher's arguments between the stream and the kernel's: no scratch, no launch metadata, no hooks
        self.mid = (function, coop, pdl, None, None, packed, None, None, None)
        self.maps = tuple({} for _ in self.at)  # per descriptor: (address, shape, strides, padding) -> arguments
        self.fills = 0  # CUtensorMaps filled (the tests read it)
        self.launches = 0

    @classmethod
    def of(cls, compiled):
        if not DESCRIPTOR_LAUNCHER:
            return None
        found = _descriptor_launch(compiled)
        if found is None:
            return None
        launcher, indices, metas, coop, pdl, _, _ = found
        return cls(launcher, indices, metas, coop, pdl, compiled.function, compiled.packed_metadata)

    def _arguments(self, i: int, desc) -> tuple:
        """Descriptor i's launcher arguments for ``desc`` (a host TensorDescriptor)."""
        maps = self.maps[i]
        key = (desc.base.data_ptr(), *desc.shape, *desc.strides, desc.padding)
        found = maps.get(key)
        if found is None:
            from triton.backends.nvidia.driver import make_tensordesc_arg

            if len(maps) >= _TENSORMAPS_PER_OPERAND:
                maps.clear()
            found = maps[key] = tuple(make_tensordesc_arg(desc, self.at[i][1]))
            self.fills += 1
        return found

    def __call__(self, grid: tuple, stream, device: torch.device, args: list):
        """Launch on ``grid`` on ``stream`` with the kernel's parameters ``args`` (as PlainLauncher takes them, the
        descriptors as TensorDescriptor objects)."""
        spliced, start = [], 0
        for i, (index, _) in enumerate(self.at):
            spliced += args[start:index]
            spliced += self._arguments(i, args[index])
            start = index + 1
        spliced += args[start:]
        self.launcher(grid[0], grid[1], grid[2], stream, *self.mid, *spliced)
        self.launches += 1


class TensormapLauncher:
    """Triton's C launcher of a compiled kernel whose first parameters are host tensor descriptors, called without
    Triton's Python wrappers (Triton 3.6: CudaLauncher.__call__, which allocates the scratch buffers, and
    wrap_handle_tensordesc's per-argument loop, which fills a CUtensorMap per descriptor and launch), on one grid.

    A CUtensorMap encodes the base address, shape, strides, block shape and swizzle of one descriptor: a caller
    whose launch key fixes everything but the address (a launch plan, given the views) keeps one per address and
    operand, filled by Triton's own make_tensordesc_arg on the first launch that uses that address, and the
    launcher arguments of all descriptors per tuple of addresses (one lookup per launch). The launcher copies the
    map into the kernel's parameters at each launch (and a CUDA graph at capture), so a kept map is only read.
    Built by ``of`` only where the compiled kernel has exactly the layout described here; callers keep Triton's
    path otherwise, and while a launch hook is registered (the hooks need the launch metadata). A kernel that makes
    descriptors on the device (global scratch; given ``device``) gets its scratch from SCRATCH at each launch."""

    __slots__ = ("launcher", "metas", "views", "grid", "mid", "maps", "descs", "fills", "scratch")

    def __init__(self, launcher, metas: list, views: tuple, coop: bool, pdl: bool, grid: tuple, function, packed,
                 scratch: tuple = ()):
        self.launcher, self.metas, self.views, self.grid = launcher, metas, views, tuple(grid)
        # the C launcher's arguments between the stream and the kernel's: no scratch, no launch metadata, no hooks
        self.mid = (function, coop, pdl, None, None, packed, None, None, None)
        self.maps = tuple({} for _ in views)  # per operand: address -> its launcher arguments
        self.descs: dict = {}  # addresses of all operands -> the launcher arguments of all descriptors
        self.fills = 0  # CUtensorMaps filled (the launch-cache tests read it)
        # () without global scratch, else (bytes for the whole grid, alignment, device)
        self.scratch = scratch

    @classmethod
    def of(cls, compiled, views: tuple, grid: tuple, device: torch.device | None = None):
        """For ``compiled`` (a CompiledKernel) whose first len(views) parameters are host tensor descriptors read
        through ``views`` ((shape, strides) lists per descriptor), launched on ``grid``, or None where its launcher
        is not Triton 3.6's CudaLauncher over wrap_handle_tensordesc with TMA metadata for exactly those
        parameters, or needs global scratch and no ``device`` is given (or profile scratch)."""
        found = _descriptor_launch(compiled, scratch_ok=device is not None)
        if found is None or found[1] != set(range(len(views))):
            return None
        launcher, _, metas, coop, pdl, per_program, align = found
        scratch = (per_program * grid[0] * grid[1] * grid[2], align, device) if per_program else ()
        return cls(launcher, metas, views, coop, pdl, grid, compiled.function, compiled.packed_metadata, scratch)

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

    def _descs(self, ptrs: tuple, bases: tuple) -> tuple:
        descs = ()
        for i, x in enumerate(bases):
            descs += self._map(i, x)
        if len(self.descs) >= _TENSORMAPS_PER_OPERAND:
            self.descs.clear()
        self.descs[ptrs] = descs
        return descs

    def __call__(self, stream, bases: tuple, rest: tuple, ptrs: Optional[tuple] = None):
        """Launch on ``stream``: descriptors over ``bases`` (one tensor per view), then ``rest`` (the kernel's
        other parameters: pointers as tensors or ints, scalars, constexprs). ptrs: the bases' data_ptr() where the
        caller has them."""
        if ptrs is None:
            ptrs = tuple([x.data_ptr() for x in bases])
        descs = self.descs.get(ptrs)
        if descs is None:
            descs = self._descs(ptrs, bases)
        grid = self.grid
        if not self.scratch:
            self.launcher(grid[0], grid[1], grid[2], stream, *self.mid, *descs, *rest)
            return
        nbytes, align, device = self.scratch
        # held until the launch is enqueued: a buffer that another thread replaces meanwhile is freed after it
        buffer = SCRATCH.get(nbytes + align, device, stream)
        address = buffer.data_ptr()
        mid = self.mid  # its fourth entry is the global scratch
        self.launcher(grid[0], grid[1], grid[2], stream, *mid[:3], address + -address % align, *mid[4:], *descs,
                      *rest)
        del buffer


# ----------------------------------------------------------------------------------------------------------------
# Device buffers of direct launches
# ----------------------------------------------------------------------------------------------------------------

def empty_template(shape: tuple, dtype: torch.dtype, device: torch.device):
    """A tensor ``t`` for which torch.empty_like(t) is a new contiguous ``shape`` tensor of ``dtype`` on ``device``
    (what torch.empty(shape, dtype=dtype, device=device) makes, without parsing shape, dtype and device per call:
    6.7 against 4.1 us on the H100 host, scripts/host_overhead.py): one element expanded over the shape (all strides 0:
    not dense, so empty_like lays the new tensor out contiguously), or None where the shape has at most one element
    or more than 3 dims (empty_like would keep the expanded strides, or could pick channels-last), or inside
    util.call_scoped_buffers (the template would be a kept tensor made in the call; the plan that asked then
    allocates with torch.empty)."""
    numel = 1
    for n in shape:
        numel *= n
    if numel <= 1 or len(shape) > 3 or call_scoped():
        return None
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def empty_from(template, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new contiguous ``shape`` tensor of ``dtype`` on ``device``: torch.empty_like(template) where ``template``
    (empty_template's answer for them) is not None."""
    return torch.empty(shape, dtype=dtype, device=device) if template is None else torch.empty_like(template)


DISCARD_MAX_BYTES = 64 * 2 ** 20  # a discarded output larger than this is allocated per call instead
_DISCARD: dict = {}  # device -> the buffers handed out so far (the last is the largest; none is ever freed)


def discard_buffer(device: torch.device, nbytes: int) -> torch.Tensor:
    """A uint8 buffer of at least ``nbytes`` on ``device`` for an output a kernel must write but nobody reads (e.g.
    the lse of a call that asked for none), or None where nbytes > DISCARD_MAX_BYTES (allocate that per call).

    Every such output of ``device`` goes to the same memory, written by any number of kernels at once, on any
    stream: harmless because nothing reads it. Buffers are never freed (a larger request adds one of at least twice
    the size), so an address handed out stays valid for every launch that got it, including CUDA graphs that
    captured it; what is held stays below four times the largest request (each buffer at least doubles the last).
    None too inside util.call_scoped_buffers (a buffer made there must not be kept; the caller allocates, and does
    not remember that answer)."""
    if nbytes > DISCARD_MAX_BYTES or call_scoped():
        return None
    held = _DISCARD.setdefault(device, [])
    if not held or held[-1].numel() < nbytes:
        size = max(nbytes, 2 * held[-1].numel() if held else 4096)
        held.append(torch.empty(min(size, DISCARD_MAX_BYTES), dtype=torch.uint8, device=device))
    return held[-1]


def discard_address(device: torch.device, nbytes: int):
    """What a plan keeps for an output it must write but nobody reads: discard_buffer(device, nbytes)'s address;
    False where nbytes is too large (allocate it every call); None inside util.call_scoped_buffers (allocate it
    this call, and ask again on the next)."""
    if call_scoped():
        return None
    buffer = discard_buffer(device, nbytes)
    return False if buffer is None else buffer.data_ptr()


class StreamScratch:
    """Global scratch of the kernels launched directly (Triton's device-side tensor descriptors live there): one
    buffer per (device, stream), grown as needed. A kernel reads what it wrote there, so a buffer is shared only by
    launches on one stream, which run one after another (callers use it only for launches without programmatic
    dependent launch, whose next kernel may start before the previous one ends). While the stream is capturing a
    CUDA graph, every launch gets a buffer of its own (the graph keeps it; its replays may overlap other work on
    any stream), as Triton's own launcher does; so does every launch inside util.call_scoped_buffers (nothing made
    there is kept). A replaced buffer goes back to the caching allocator, which hands
    it out again in the order of the stream it was allocated on: the stream of every launch that used it."""

    def __init__(self):
        self.buffers: dict = {}
        self.allocations = 0  # buffers allocated (the launch-cache tests read it)

    def get(self, nbytes: int, device: torch.device, stream):
        """The scratch (a device tensor of at least nbytes) for one launch on ``stream`` of ``device``."""
        if capturing() or call_scoped():
            self.allocations += 1
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        key = (device, stream)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            self.allocations += 1
            buffer = self.buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer


SCRATCH = StreamScratch()


class PlainLauncher:
    """Triton's C launcher of a compiled kernel without host tensor descriptors, called without Triton's Python
    wrapper (Triton 3.6: CudaLauncher.__call__, which defines and calls a scratch allocator per launch and asks the
    allocator of the calling thread for the global scratch). The global scratch (grid size * num_ctas *
    global_scratch_size bytes) comes from SCRATCH. Pointer arguments may be ints (data_ptr()): the C launcher then
    skips its data_ptr() call and cuPointerGetAttribute for them. Built by ``of`` only where the compiled kernel's
    launcher has exactly this layout and needs no profile scratch, and no global scratch where it is a programmatic
    dependent launch (the scratch of one stream is shared by launches that must not overlap); callers keep Triton's
    path otherwise, and while a launch hook is registered."""

    __slots__ = ("launch", "function", "packed", "coop", "pdl", "scratch_bytes", "scratch_align", "launches")

    def __init__(self, launch, function, packed, coop: bool, scratch_bytes: int, scratch_align: int,
                 pdl: bool = False):
        self.launch, self.function, self.packed, self.coop, self.pdl = launch, function, packed, coop, pdl
        self.scratch_bytes, self.scratch_align = scratch_bytes, scratch_align  # per program
        self.launches = 0  # direct launches (the launch-cache tests read it)

    @classmethod
    def of(cls, compiled):
        """For ``compiled`` (a CompiledKernel), or None where its launcher is not Triton 3.6's CudaLauncher over the
        bare C function, or needs profile scratch, or global scratch with programmatic dependent launch."""
        run = getattr(compiled, "run", None)
        launch = getattr(run, "launch", None)
        # Triton wraps the C function in a Python closure where host tensor descriptors are to be expanded
        if not callable(launch) or getattr(launch, "__closure__", None) is not None:
            return None
        sizes = [getattr(run, a, None) for a in ("global_scratch_size", "global_scratch_align", "profile_scratch_size",
                                                 "num_ctas")]
        coop, pdl = getattr(run, "launch_cooperative_grid", None), getattr(run, "launch_pdl", None)
        if not all(type(x) is int for x in sizes) or sizes[2] != 0 or not isinstance(coop, bool) \
                or not isinstance(pdl, bool) or (pdl and sizes[0]):
            return None
        return cls(launch, compiled.function, compiled.packed_metadata, coop, sizes[0] * sizes[3], sizes[1], pdl)

    def __call__(self, grid: tuple, stream, device: torch.device, args: tuple):
        """Launch on ``grid`` (3 entries) on ``stream`` (current on ``device``, the current device) with the
        kernel's parameters ``args`` (runtime arguments, then constexprs, as the JIT binds them)."""
        buffer = scratch = None
        if self.scratch_bytes:
            nbytes = grid[0] * grid[1] * grid[2] * self.scratch_bytes
            # held until the launch is enqueued: a buffer that another thread replaces meanwhile is freed after it
            buffer = SCRATCH.get(nbytes + self.scratch_align, device, stream)
            scratch = buffer.data_ptr()
            scratch += -scratch % self.scratch_align
        self.launch(grid[0], grid[1], grid[2], stream, self.function, self.coop, self.pdl, scratch, None, self.packed,
                    None, None, None, *args)
        del buffer
        self.launches += 1
