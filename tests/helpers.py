"""Shared test helpers: random inputs, the FlashAttention tolerance rule and the sm_90 compile-on-CPU checks.

The rule (flash-attn's tests): a kernel's error against the float64 reference must be at most ``factor`` times
the error of a plain PyTorch implementation run in the kernel's own dtype, plus a small atol. factor is 2 for
forward outputs, 3 for gradients and decode.
"""

from __future__ import annotations

import inspect
import itertools
import os

import pytest
import torch

from conftest import DEVICE, HAS_CUDA  # noqa: F401  (re-exported for tests)

from flashdecode.bench.prefill_ragged import V_BOUND_OPT_IN

# The Triton interpreter casts fp32 to bf16 toward zero (a GPU rounds to nearest) and would multiply bf16 tl.dot
# operands as raw bits (kernels/dot.py upcasts them there): the parametrised CPU kernel tests use fp16/fp32, and
# tests/test_bf16.py runs bf16 through the README's tour on the CPU (the FP8 forward's bf16 output:
# quant_helpers.check_fp8).
KERNEL_DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float16, torch.float32]

# GluonFwdConfig.v_bound (the ragged forward's last V blocks through the producer's bounded descriptors) runs its GPU
# tests only when asked for (FLASHDECODE_V_BOUND=1) until it has run whole on a GPU: a fault or a hang there would
# stop the rest of the suite. docs/decisions.md has the state of it.
needs_v_bound_opt_in = pytest.mark.skipif(os.environ.get(V_BOUND_OPT_IN) != "1",
                                          reason="v_bound is an experiment not yet run on a GPU: run with "
                                                 "FLASHDECODE_V_BOUND=1")


def pairwise(*axes) -> list[tuple]:
    """Cases covering every pair of values of any two axes (a greedy covering array, in a fixed order): on the CPU
    interpreter, where a full grid of slow kernel cases costs minutes, a parametrisation runs these; on a GPU,
    grid() runs the whole cartesian product."""
    every = list(itertools.product(*axes))
    pairs = lambda case: {(i, a, j, b) for i, a in enumerate(case) for j, b in enumerate(case) if i < j}  # noqa: E731
    missing, cases = set().union(*map(pairs, every)), []
    while missing:
        best = max(every, key=lambda case: len(pairs(case) & missing))  # the first of the most new pairs
        cases.append(best)
        missing -= pairs(best)
    return cases


def grid(*axes) -> list[tuple]:
    """A parametrisation's cases: the cartesian product of the axes on a GPU, a pairwise covering on the CPU."""
    return list(itertools.product(*axes)) if HAS_CUDA else pairwise(*axes)


def pack_present_keys(k, v, lens, present):
    """Caches holding only the present keys of each sequence, packed to the front (for a reference of one new token
    without a window, where the order of keys does not matter): (k, v, packed lengths as a list). k, v (batch,
    max_len, nheads_kv, headdim); present (batch, >= max(lens)) bool; slots past a packed length hold 0."""
    kp, vp = torch.zeros_like(k), torch.zeros_like(v)
    packed = []
    for b, n in enumerate(lens):
        keep = present[b, :n].nonzero().squeeze(1).to(k.device)
        kp[b, :keep.numel()], vp[b, :keep.numel()] = k[b, keep], v[b, keep]
        packed.append(keep.numel())
    return kp, vp, packed


# The time-out of a test's subprocess (an sm_90 compile script, the demo, a CLI run, spawned ranks): sized for a
# 2-core machine that runs the suite's two xdist workers beside other load, where the slowest (an sm_90 compile
# script, ~20 s alone) has taken over 300 s; a hung child still ends the test.
SUBPROCESS_TIMEOUT_S = 1200


def randn(*shape, gen, dtype=torch.float32, device=DEVICE, scale=1.0):
    """Standard-normal tensor drawn on the CPU from ``gen`` (reproducible), then moved."""
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| over entries where ref is finite; x must be -inf exactly where ref is -inf."""
    x, ref = x.double().cpu(), ref.double().cpu()
    inf = torch.isinf(ref)
    if inf.any():
        assert torch.equal(torch.isinf(x), inf), "-inf pattern differs from the reference"
        x, ref = x[~inf], ref[~inf]
    return (x - ref).abs().max().item() if ref.numel() else 0.0


def assert_fa_close(out: torch.Tensor, ref64: torch.Tensor, same_dtype: torch.Tensor, *, factor: float = 2.0,
                    atol: float = 1e-5, name: str = "out"):
    """FlashAttention rule: err(out) <= factor * err(same-dtype PyTorch) + atol, both against the float64 ref."""
    assert not torch.isnan(out).any(), f"{name} has NaN"
    err = max_err(out, ref64)
    base = max_err(same_dtype, ref64)
    assert err <= factor * base + atol, f"{name}: error {err:.3e} > {factor} x {base:.3e} + {atol:.1e}"
    return err, base


def _cuobjdump(kernel, flag: str) -> str:
    """cuobjdump (bundled with Triton) ``flag``'s output on a kernel compiled for a GPU target."""
    import os
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    out = subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    return out


def spilled_bytes(kernel) -> int:
    """Stack bytes (register spills) of a kernel compiled for a GPU target, from cuobjdump (bundled with Triton) on
    its cubin: the sm_90 compile-on-CPU checks use it to prove a tile configuration holds its state in registers."""
    import re

    return int(re.search(r"STACK:(\d+)", _cuobjdump(kernel, "--dump-resource-usage")).group(1))


def registers(kernel) -> int:
    """Registers per thread of a kernel compiled for a GPU target (cuobjdump's resource usage)."""
    import re

    return int(re.search(r"REG:(\d+)", _cuobjdump(kernel, "--dump-resource-usage")).group(1))


def sass_opcodes(kernel) -> list[str]:
    """The SASS opcodes (predicates dropped, modifiers kept: "HMUL2.BF16_V2") of a kernel compiled for a GPU
    target, in program order."""
    import re

    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", _cuobjdump(kernel, "-sass"))


# the decode kernels' tuple arguments: element types (i32 elements are strides, specialised divisible by 16 as the
# launcher's usually are)
DECODE_TUPLES = dict(stride_q=("i32",) * 4, stride_k=("i32",) * 3, stride_o=("i32",) * 5, stride_l=("i32",) * 4,
                     stride_final=(("i32",) * 4, ("i32",) * 3), scales=("fp32", "fp32"))

# decode_split_kernel's and decode_persistent_kernel's grouped constexprs (kernels/decode_args.py) from the flat names
# their bodies use, with the defaults a flat name takes when a script leaves it out
_DECODE_GROUPS = dict(
    ROWS=("Rows", ("SEQLEN_Q", "GROUP", "NUM_M_BLOCKS")),
    TILE=("Tile", ("BLOCK_M", "BLOCK_N", "BLOCK_D", "SUM_TILE", "TILE_WARPS")),
    SPLITS=("Splits", ("NUM_SPLITS", "MIN_CHUNK", "MERGE_SPLITS", "SPLIT_KEYS")),
    PAGES=("Pages", ("PAGE_SIZE", "PRELOAD_PAGES")),
    PDL=("Pdl", ("USE_PDL", "PDL_WAIT")),
    PREFETCH=("Prefetch", ("PREFETCH_KEYS", "LINE_ELEMS", "NUM_LINES")),
    DEVICE_SPLITS=("DeviceSplits", ("SPLIT_SLOTS", "BATCH_PAD", "MAX_SPLIT_KEYS", "KV_PROGRAMS")),
    SCHEDULE=("WorkSchedule", ("NHEADS_KV", "BATCH_PAD", "MAX_SPLIT_KEYS", "DYNAMIC", "SLOTS_PER_PROGRAM",
                               "QUEUE_SPLITS", "QUEUE_FULL_FRACTION", "QUEUE_SPLIT_COST")),
    MERGE=("MergeTile", ("MERGE_M", "MERGE_BLOCK_S")),
    QUANT_TILES=("QuantTiles", ("V_CONVERT_FIRST", "QUANT_CONVERT", "K_CONVERT_FIRST")),
)
_DECODE_DEFAULTS = dict(SPLIT_KEYS=0, PREFETCH_KEYS=0, LINE_ELEMS=64, NUM_LINES=2, BATCH_PAD=1, MAX_SPLIT_KEYS=0, DYNAMIC=False,
                        SLOTS_PER_PROGRAM=1, QUEUE_SPLITS=0, QUEUE_FULL_FRACTION=0.5, QUEUE_SPLIT_COST=0.03,
                        V_CONVERT_FIRST=False, QUANT_CONVERT=0, K_CONVERT_FIRST=False, SUM_TILE=False,
                        TILE_WARPS=0)


def _decode_kernel_args(fn, types: dict, consts: dict) -> tuple[dict, dict]:
    """(types, consts) of a decode kernel from a script's flat names: the constexprs grouped as _DECODE_GROUPS (a flat
    DEVICE_SPLITS=True turns the device-split fields into DeviceSplits, else None), K_SCALE / V_SCALE types into
    kv_scales = (K_SCALE, V_SCALE, strides) and ALIBI_SLOPES into alibi = (ALIBI_SLOPES, strides); without KV_QUANT /
    ALIBI those are None (the float cache without ALiBi)."""
    from flashdecode.kernels import decode_args

    flat = dict(_DECODE_DEFAULTS, **consts)
    grouped = {n: v for n, v in consts.items() if n in fn.arg_names}
    # stage 1's optional groups: DEVICE_SPLITS with a flat DEVICE_SPLITS=True, its in-kernel MERGE (and the final
    # outputs it writes) with IN_KERNEL_MERGE=True; None otherwise
    optional = {"DEVICE_SPLITS": flat.get("DEVICE_SPLITS")}
    if "DEVICE_SPLITS" in fn.arg_names:
        optional["MERGE"] = flat.get("IN_KERNEL_MERGE")
    for name, (cls, fields) in _DECODE_GROUPS.items():
        if name in fn.arg_names and optional.get(name, True):
            grouped[name] = getattr(decode_args, cls)(*(flat[f] for f in fields))
    for name, on in optional.items():
        if name in fn.arg_names and not on:
            grouped[name] = None
    if "kv_raw" in fn.arg_names:  # the L2 prefetch's cache tensors and their batch / page stride
        types = dict(types, kv_raw=(types.get("K_RAW", "*bf16"), types.get("V_RAW", "*bf16"), "i32"))
    if "final" in fn.arg_names:
        if flat.get("IN_KERNEL_MERGE"):
            types = dict(types, final=(types.get("O_FINAL", "*bf16"), "*fp32", "*i32", DECODE_TUPLES["stride_final"]))
        else:
            grouped["final"] = None
    scale_types = (types.get("K_SCALE", "*fp32"), types.get("V_SCALE", "*fp32"), ("i32",) * 3)
    alibi_types = (types.get("ALIBI_SLOPES", "*fp32"), ("i32", "i32"))
    types = {n: t for n, t in types.items() if n in fn.arg_names}
    if flat.get("KV_QUANT"):
        types["kv_scales"] = scale_types
    else:
        grouped.update(kv_scales=None, KV_QUANT=0)
    if flat.get("ALIBI"):
        types["alibi"] = alibi_types
    else:
        grouped.update(alibi=None, ALIBI=False)
    return types, grouped


def _divisible(path: tuple, ty, attrs: dict):
    """Divisibility-16 attributes on the pointers and i32 strides of a (possibly nested) tuple argument's type."""
    if isinstance(ty, tuple):
        for j, t in enumerate(ty):
            _divisible(path + (j,), t, attrs)
    elif ty.startswith("*") or ty == "i32":
        attrs[path] = [["tt.divisibility", 16]]


def compile_for_sm90(fn, types: dict, consts: dict, num_stages: int = 3, num_warps: int = 4,
                     maxnreg: int | None = None):
    """``fn`` compiled for sm_90 (Triton's ptxas, no GPU) with argument types ``types`` (default i32; the decode
    kernels' tuples as DECODE_TUPLES) and constexprs ``consts``, pointers and strides specialised divisible by 16 as
    the launcher does. The decode kernels take the flat constexpr names their bodies use (SEQLEN_Q, BLOCK_N, ...:
    _decode_kernel_args groups them). For the scripts of run_sm90_compile_script (a fresh Python without
    TRITON_INTERPRET). maxnreg: a register cap per thread for ptxas, as a launch's maxnreg= gives it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "ROWS" in fn.arg_names:
        types, consts = _decode_kernel_args(fn, types, consts)
    # constexpr parameters a script leaves out take their defaults, as at a launch
    consts = dict({p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty},
                  **consts)
    # runtime parameters defaulting to None that a script neither types nor sets are None, as at a launch that
    # leaves them out (Triton specialises a None argument as a constexpr)
    consts.update({p.name: None for p in fn.params if not p.is_constexpr and p.default is None
                   and p.name not in types and p.name not in DECODE_TUPLES and p.name not in consts})
    sig = {n: "constexpr" if n in consts else types.get(n, DECODE_TUPLES.get(n, "i32")) for n in fn.arg_names}
    attrs = {}
    for i, n in enumerate(fn.arg_names):
        if isinstance(sig[n], tuple):
            _divisible((i,), sig[n], attrs)
        elif n not in consts and (sig[n].startswith("*") or "stride" in n):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       **({} if maxnreg is None else dict(maxnreg=maxnreg))))


def run_sm90_compile_script(script: str) -> None:
    """Run a script that compiles kernels for sm_90 with Triton's bundled ptxas (no GPU needed) in a fresh Python
    without TRITON_INTERPRET, from the repository root; it must print "compiled". Skips only where Triton ships no
    ptxas for this platform (CI's x86-64 wheels do ship it, so there the check always runs)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=SUBPROCESS_TIMEOUT_S,
                          cwd=root)
    if "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("Triton's ptxas is not available here")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


class FakeCompiled:
    """Stands in for Triton's CompiledKernel in the Gluon launchers' CPU tests: records the direct launches."""

    def __init__(self):
        self.launches = []
        self.function, self.packed_metadata = "function-handle", "packed"
        self.run = lambda *a: self.launches.append(a)

    def launch_metadata(self, grid, stream, *args):
        return None


class FakeTmaDriver:
    """triton.runtime.driver.active as Triton's make_tensordesc_arg reads it: fill_tma_descriptor returns its inputs
    (as the CUtensorMap stand-in) and counts the fills."""

    def __init__(self):
        self.fills = []
        self.utils = self

    def fill_tma_descriptor(self, ptr, swizzle, elem_size, elem_type, block_size, shape, strides, padding):
        self.fills.append(ptr)
        return ("tensormap", ptr, swizzle, elem_size, elem_type, tuple(block_size), tuple(shape), tuple(strides),
                padding)


def triton_launcher(c_calls: list, signature: dict, metas: list):
    """Triton 3.6's own CudaLauncher (its __call__, scratch handling and wrap_handle_tensordesc) around a recording
    C launch (each call's arguments appended to c_calls), for a kernel of ``signature`` (parameter index -> Triton
    type, "tensordesc<...>" for a host tensor descriptor) and TMA metadata ``metas`` (one per descriptor)."""
    from triton.backends.nvidia import driver as nv

    launcher = nv.CudaLauncher.__new__(nv.CudaLauncher)  # its constructor compiles the C launcher: not here
    launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, False
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    launcher.launch = nv.wrap_handle_tensordesc(lambda *args: c_calls.append(args), signature, metas)
    return launcher
