"""One launch cache for every kernel the ops launch themselves: record a launch once per key, then launch the
compiled kernel directly. Three recorders share it, one per kind of kernel, each keeping in a ``PlanCache`` (a
bounded dict: key -> what was recorded) what its first launch of a key learnt:
- ``LaunchSite``: a @triton.jit kernel with fixed constexprs (decode, append_kv, merge), below;
- ``TunedKernel``: an autotuned @triton.jit kernel (the Triton prefill forward and backward): the first launch of
  a key runs the autotuner, the record keeps the winning tile's constexprs;
- ops/gluon_plan.py's ``GluonPlan``: a Gluon kernel over host tensor descriptors, whose record keeps the
  CUtensorMaps per address (direct_launch.TensormapLauncher).
Each launches later calls of a key through the compiled kernel's C launcher (direct_launch.PlainLauncher or
TensormapLauncher; Triton's own launcher where neither knows it, and while a launch hook is registered).

A ``LaunchSite`` wraps one @triton.jit kernel. A caller hands it, per launch, a key, the grid, the kernel's runtime
(non-constexpr) parameters as a tuple in signature order (``site.runtime_names``) and a function that builds the
constexprs and launch options (num_warps, num_stages, launch_pdl, ...). The first launch of a key goes through
Triton's JIT, which compiles the variant and binds the arguments; the site then records the compiled kernel's C
launcher (direct_launch.PlainLauncher; for launchers it does not know, e.g. with TMA descriptor arguments, Triton's
own CudaLauncher) and the full argument template (constexprs and defaults in place), so later launches of the key
skip the constexpr building, Triton's binder, its cache-key hashing and the launch-metadata record: a list fill
and one call of the launcher.

The key must fix everything the compiled kernel or its launch depends on besides the runtime values Triton does
not specialise on: dtypes, the device, every constexpr and option, and Triton's specialisation of each runtime
argument (pointer alignment to 16 bytes; integers equal to 1, divisible by 16, or beyond int32; None). Callers put
the shapes and strides their integer arguments come from, their tensors' alignment and their option values in it.
``check_keys(True)`` (or FLASHDECODE_CHECK_LAUNCH_KEYS=1) makes every launch compare Triton's specialisation of its
runtime arguments with the one recorded for the key and raise RuntimeError on a difference: a key that misses a
fact is then found by any test that varies it, on the GPU or in the CPU interpreter.

Under TRITON_INTERPRET=1 (no compiled kernel) every launch is Triton's normal call; keys are still recorded and
checked. While a launch hook is registered (Triton's profiler) launches go through Triton too, which hands the
hooks their metadata.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Callable

import torch

from flashdecode.ops import checks, direct_launch
from flashdecode.ops.util import interpreting_now

__all__ = ["LaunchSite", "BoundLaunch", "TunedKernel", "PlanCache", "check_keys", "clear", "sites", "tensor_key",
           "ensure_triton_allocator", "recordable", "launch_through_triton"]

_MAX_KEYS = 1024  # recorded keys per site (cleared when full: a workload of ever new shapes recompiles nothing)


class PlanCache(dict):
    """Launch key -> what its first launch recorded (a plan, a site's record), bounded: cleared when full (a record
    is cheap to rebuild, and a workload of ever new shapes must not grow it without end). Lookups are dict.get."""

    __slots__ = ("size",)

    def __init__(self, size: int = 4096):
        super().__init__()
        self.size = size

    def put(self, key, value):
        """Keep ``value`` under ``key`` (clearing the cache first where it is full); returns value."""
        if len(self) >= self.size:
            self.clear()
        self[key] = value
        return value

    def get_or_build(self, key, build: Callable[[], object]):
        """The value under ``key``, else ``build()``'s, kept (build must not return None)."""
        found = self.get(key)
        if found is None:
            found = self.put(key, build())
        return found
_SITES: list = []
_CHECK = [checks.env_value("FLASHDECODE_CHECK_LAUNCH_KEYS", "0") == "1"]


def check_keys(on: bool) -> bool:
    """Turn the key check on or off (see the module doc); returns the previous setting."""
    before, _CHECK[0] = _CHECK[0], bool(on)
    return before


def clear() -> None:
    """Forget every recorded launch of every site (tests that patch the launch policy call it)."""
    for site in _SITES:
        site.records.clear()
        site.plans.clear()


def sites() -> list:
    """The launch sites made so far (tests and the warm-up read their counters)."""
    return list(_SITES)


def recordable(compiled) -> bool:
    """Whether ``compiled`` (Triton's CompiledKernel) has what a recorded launch calls later: its launcher (run),
    function handle, packed metadata and launch-metadata builder (anything else stays on Triton's JIT path)."""
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))


def launch_through_triton(recorded, grid: tuple, stream, args: tuple, enter, exit_) -> None:
    """A recorded launch (TunedKernel, gluon_plan.GluonPlan: .compiled, .run, .function, .packed) through the
    compiled kernel's own launcher, as Triton's JIT calls it: the launch metadata and the hook chains where a hook
    is registered (enter not None), else neither. The path of keys whose launcher no direct launcher knows, and of
    every launch while a hook (e.g. Triton's profiler) is registered."""
    meta = None if enter is None else recorded.compiled.launch_metadata(grid, stream, *args)
    recorded.run(grid[0], grid[1], grid[2], stream, recorded.function, recorded.packed, meta, enter, exit_, *args)


def tensor_key(x):
    """What a launch key holds of a tensor argument (None passes): shape, strides, dtype, device and whether its
    data pointer is 16-byte aligned (Triton specialises pointers on it)."""
    if x is None:
        return None
    return x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0


def specialization(args: tuple) -> tuple:
    """Triton's specialisation of runtime arguments (its binder's (type, attribute) per argument, tuples nested):
    what two launches under one key must agree on."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return tuple(native_specialize_impl(BaseBackend, a, False, True, True) for a in args)


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


class _Record:
    """One key's launch: the compiled kernel's launcher, the full argument list with the constexprs in place, and
    where the runtime arguments go in it."""

    __slots__ = ("direct", "template", "runs", "spec", "launches")

    def __init__(self, direct, template: list, runs: tuple, spec):
        self.direct, self.template, self.runs, self.spec = direct, template, runs, spec
        self.launches = 0  # direct launches (tests read it)

    def check(self, key, name: str, runtime: tuple) -> None:
        spec = specialization(runtime)
        if self.spec is None:  # recorded while the check was off
            self.spec = spec
        elif spec != self.spec:
            raise RuntimeError(f"launch cache of {name}: key {key!r} was recorded for arguments specialised as "
                               f"{self.spec}, now {spec}: the key misses a fact")

    def arguments(self, runtime: tuple) -> list:
        full = self.template.copy()
        for start, first, count in self.runs:  # a slice per run of consecutive runtime slots (_slot_runs)
            full[start:start + count] = runtime[first:first + count]
        return full


def _slot_runs(slots: tuple) -> tuple:
    """The runtime parameters' places in the full argument list as runs (start in the list, first runtime index,
    count) of consecutive slots: a launch fills each run with one slice assignment."""
    runs: list = []
    for index, slot in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][2] == slot:
            runs[-1][2] += 1
        else:
            runs.append([slot, index, 1])
    return tuple(map(tuple, runs))


def _launch_direct(record: _Record, grid: tuple, args: list, device: torch.device) -> None:
    """A record's direct launch of the full argument list ``args`` on the current stream of ``device``."""
    if device.index == direct_launch.current_device():
        record.direct(grid, direct_launch.current_stream(device.index), device, args)
    else:
        with torch.cuda.device(device):
            record.direct(grid, direct_launch.current_stream(device.index), device, args)
    record.launches += 1


class BoundLaunch:
    """One key's launch with every argument the caller's key fixes in place: the full argument list (the kernel's
    parameters in order, ``LaunchSite.index``) holding the record's constexprs and the caller's ``fixed`` runtime
    values, into which a call writes only its own values by index before the record's direct launcher runs it. For
    callers whose key fixes all but a few tensors and extents (decode): no runtime tuple, no argument merge, one
    record lookup. ``blank()`` is the list with the fixed values alone (the caller fills it and launches through
    LaunchSite.launch with ``runtime_of``: the first launch of the key, the interpreter, a launch hook)."""

    __slots__ = ("site", "key", "fixed", "record", "template")

    def __init__(self, site: "LaunchSite", key, fixed: dict):
        self.site, self.key, self.fixed = site, key, tuple((site.index[n], v) for n, v in fixed.items())
        self.record = self.template = None

    def blank(self) -> list:
        full = [None] * len(self.site.param_names)
        for i, value in self.fixed:
            full[i] = value
        return full

    def full(self):
        """A copy of the full list to fill, or None where this launch must go through LaunchSite.launch (the key
        has no record yet, or one that launches through Triton; a launch hook registered)."""
        record = None if self.key is None else self.site.records.get(self.key)
        if record is None or record.direct is None or direct_launch.launch_hooks()[0] is not None:
            return None
        if record is not self.record:  # (a record made again after the site was cleared)
            template = record.template.copy()
            for i, value in self.fixed:
                template[i] = value
            self.record, self.template = record, template
        return self.template.copy()

    def launch(self, grid: tuple, full: list, device: torch.device) -> None:
        """Launch ``full`` (a filled ``full()``) on ``grid``; with the key check on, its runtime values are first
        checked against the record's specialisation, as LaunchSite.launch checks them."""
        if _CHECK[0]:
            self.record.check(self.key, self.site.name, self.site.runtime_of(full))
        _launch_direct(self.record, grid, full, device)


class _TritonLauncher:
    """A compiled kernel's own launcher (Triton's CudaLauncher: it expands host tensor descriptors and allocates
    the scratch), called as Triton's JIT calls it but without the binder, the cache-key hashing and the launch
    metadata: for kernels whose launcher PlainLauncher does not know (e.g. TMA descriptor arguments)."""

    __slots__ = ("run", "function", "packed")

    def __init__(self, compiled):
        self.run, self.function, self.packed = compiled.run, compiled.function, compiled.packed_metadata

    def __call__(self, grid: tuple, stream, device: torch.device, args: list):
        self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed, None, None, None, *args)


class LaunchSite:
    """The launches of one @triton.jit kernel, recorded per key (module doc)."""

    def __init__(self, fn, name: str = ""):
        self.fn, self.name = fn, name or getattr(fn, "__name__", "kernel")
        params = list(inspect.signature(getattr(fn, "fn", fn)).parameters.values())
        self.param_names = tuple(p.name for p in params)
        self.defaults = tuple(p.default for p in params)
        self.runtime_names = tuple(p.name for p in params if not _is_constexpr(p))
        self.slots = tuple(i for i, p in enumerate(params) if not _is_constexpr(p))
        self.runs = _slot_runs(self.slots)
        self.index = {name: i for i, name in enumerate(self.param_names)}  # parameter -> place in the full list
        self.records = PlanCache(_MAX_KEYS)
        self.plans = PlanCache(_MAX_KEYS)  # what a caller derives per key beside the record (cleared with it)
        self.jit_launches = 0  # launches through Triton's JIT (first of a key, interpreter, hooks)
        _SITES.append(self)

    def launch(self, key, grid: tuple, runtime: tuple, constexprs: Callable[[], dict], device: torch.device):
        """Launch on ``grid`` (3 entries) with ``runtime`` (the runtime parameters in signature order: tensors,
        ints, floats, tuples of them, None) and, on a key's first launch, ``constexprs()`` (constexpr parameters
        by name plus Triton's launch options). key None: Triton's launch, nothing recorded."""
        if key is not None and self.launch_recorded(key, grid, runtime, device):
            return
        self._jit_launch(key, grid, runtime, constexprs(), device, None if key is None else self.records.get(key))

    def launch_recorded(self, key, grid: tuple, runtime: tuple, device: torch.device) -> bool:
        """``launch`` of a key whose record launches directly now (True); False where it has none, or its kernel
        must go through Triton's JIT (the interpreter, a launch hook registered): call ``launch`` then. For
        callers that build their constexprs only where they are needed."""
        record = self.records.get(key)
        if record is None:
            return False
        if _CHECK[0]:
            record.check(key, self.name, runtime)
        if record.direct is None or direct_launch.launch_hooks()[0] is not None:
            return False
        _launch_direct(record, grid, record.arguments(runtime), device)
        return True

    def positions(self, *names: str) -> tuple:
        """The places of parameters ``names`` in the full argument list (BoundLaunch fills them by index)."""
        return tuple(self.index[name] for name in names)

    def runtime_of(self, full: list) -> tuple:
        """The runtime arguments (``launch``'s tuple) of a full argument list."""
        return tuple([full[i] for i in self.slots])

    def _jit_launch(self, key, grid, runtime, constexprs: dict, device, record):
        self.jit_launches += 1
        kwargs = dict(zip(self.runtime_names, runtime))
        kwargs.update(constexprs)
        if device.type != "cuda" or device.index == direct_launch.current_device():
            compiled = self.fn[grid](**kwargs)
        else:
            with torch.cuda.device(device):
                compiled = self.fn[grid](**kwargs)
        if record is None and key is not None:
            self._record(key, runtime, constexprs, compiled)

    def _record(self, key, runtime, constexprs: dict, compiled):
        """Keep what a direct launch needs (nothing but the key check where the kernel was interpreted or its
        launcher is not the layout PlainLauncher knows)."""
        if hasattr(compiled, "result"):  # asynchronous compilation
            compiled = compiled.result()
        direct = None
        if compiled is not None and not checks.interpreting() and all(
                hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            direct = (direct_launch.PlainLauncher.of(compiled) or direct_launch.DescriptorLauncher.of(compiled)
                      or _TritonLauncher(compiled))
        template = []
        for name, default in zip(self.param_names, self.defaults):
            if name in constexprs:
                template.append(constexprs[name])
            elif default is not inspect.Parameter.empty:
                template.append(default)
            else:
                template.append(None)  # a runtime slot
        self.records.put(key, _Record(direct, template, self.runs, specialization(runtime) if _CHECK[0] else None))


# ----------------------------------------------------------------------------------------------------------------
# Autotuned kernels (the Triton prefill): autotuned on the GPU (one autotuner per tile list, shared by the launch
# keys that use it), one fixed tile in the interpreter; after its first GPU launch a key calls the compiled kernel
# directly
# ----------------------------------------------------------------------------------------------------------------

TUNE_KEY = ["bucket_q", "bucket_k", "HEAD_DIM", "IS_VARLEN", "HAS_LEFT", "HAS_RIGHT", "SOFTCAP", "DOT_PRECISION",
            "USE_TMA", "ATOMIC_DQ", "FUSED_DQ", "HAS_ALIBI", "PAGE_SIZE"]


@functools.lru_cache(maxsize=None)
def tuned(fn, tiles: tuple, names: tuple, autotune: bool, reset_dq: bool):
    """fn autotuned over ``tiles`` (only the first without autotune), keyed by shape buckets and mask flags.
    reset_dq: the atomic dQ buffer accumulates across launches, so it is zeroed before every timed candidate."""
    import triton

    configs = [triton.Config(dict(zip(names, t)), num_warps=t[len(names)], num_stages=t[len(names) + 1])
               for t in tiles]
    if not autotune:
        configs = configs[:1]
    return triton.autotune(configs=configs, key=TUNE_KEY, reset_to_zero=["DQ"] if reset_dq else None)(fn)


_current_stream = direct_launch.current_stream
_current_device = direct_launch.current_device


class TunedKernel:
    """One autotuned kernel with its constexprs under one launch key (everything its compilation depends on is in
    the key; the caller keeps one per key in a PlanCache, inside its plan).

    The first GPU launch goes through the autotuner and Triton's JIT and records the compiled kernel, the tile it
    ran and the constexpr tail of its argument list; later launches call the compiled kernel's launcher with the
    same arguments, skipping the per-call binding (tens of microseconds of host time). Launch arguments: the
    kernel's runtime parameters in order, as a tuple.
    """

    __slots__ = ("name", "fn", "tiles", "names", "autotune", "reset_dq", "constexprs", "use_tma", "meta", "tail",
                 "run", "function", "packed", "compiled", "direct")

    def __init__(self, name: str, fn, tiles: tuple, names: tuple, autotune: bool, constexprs: dict,
                 reset_dq: bool = False):
        self.name = name  # fwd, bwd_atomic, bwd_fused, bwd_dkdv or bwd_dq
        self.fn, self.tiles, self.names, self.autotune, self.reset_dq = fn, tiles, names, autotune, reset_dq
        self.constexprs = constexprs
        self.use_tma = bool(constexprs.get("USE_TMA"))  # descriptors need the allocator of the calling thread
        self.compiled = self.direct = None

    def __call__(self, grid_fn: Callable[[dict], tuple], args: tuple, device: torch.device):
        if self.compiled is not None:
            self.launch(grid_fn(self.meta), args + self.tail, device)
            return
        if self.use_tma:
            ensure_triton_allocator()
        if interpreting_now():
            meta = dict(zip(self.names, self.tiles[0]))
            self.fn[grid_fn(meta)](*args, **self.constexprs, **meta)
            return
        autotuned = tuned(self.fn, self.tiles, self.names, self.autotune, self.reset_dq)
        if device.index == _current_device():
            compiled = autotuned[grid_fn](*args, **self.constexprs)
        else:
            with torch.cuda.device(device):
                compiled = autotuned[grid_fn](*args, **self.constexprs)
        self._record(autotuned, compiled, len(args))

    def launch(self, grid: tuple, full: tuple, device: torch.device):
        """A launch of the compiled kernel (after the first) on ``grid`` (3 entries) with every kernel parameter
        (``full``: the runtime arguments, pointers as tensors or data_ptr() ints, then self.tail)."""
        if device.index == _current_device():
            self._launch_compiled(grid, full, device)
        else:
            with torch.cuda.device(device):
                self._launch_compiled(grid, full, device)

    def _launch_compiled(self, grid: tuple, full: tuple, device: torch.device):
        stream = _current_stream(device.index)
        enter, exit_ = direct_launch.launch_hooks()
        if enter is None and self.direct is not None:
            self.direct(grid, stream, device, full)
            return
        if self.use_tma:
            ensure_triton_allocator()
        launch_through_triton(self, grid, stream, full, enter, exit_)

    def _record(self, autotuned, compiled, nargs: int):
        """Keep what a direct launch needs; anything unexpected leaves the key on the autotuner's path."""
        if hasattr(compiled, "result"):  # asynchronous compilation
            compiled = compiled.result()
        best = getattr(autotuned, "best_config", None)
        if best is None or not recordable(compiled):
            return
        values = {**self.constexprs, **best.kwargs}
        tail = []
        for param in self.fn.params[nargs:]:
            if param.name in values:
                tail.append(values[param.name])
            elif param.has_default:
                tail.append(param.default)
            else:
                return
        self.meta, self.tail = dict(best.kwargs), tuple(tail)
        self.run, self.function, self.packed = compiled.run, compiled.function, compiled.packed_metadata
        self.direct = direct_launch.PlainLauncher.of(compiled)  # None: Triton's launcher (self.run)
        self.compiled = compiled


_ALLOCATOR_SET = threading.local()


@functools.lru_cache(maxsize=None)
def _scratch_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"  # "cuda": the current device (Triton's convention)


def _scratch_allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device=_scratch_device())


def ensure_triton_allocator():
    """Device-side tensor descriptors live in a small global scratch that Triton asks an allocator for.

    Triton keeps the allocator in a ContextVar, i.e. per thread: autograd runs the backward of CUDA tensors on its
    own worker thread, which never saw the forward's set_allocator, so the flag is per thread too."""
    if not getattr(_ALLOCATOR_SET, "done", False):
        import triton

        triton.set_allocator(_scratch_allocator)
        _ALLOCATOR_SET.done = True
