"""flash_attn's direct launches (the Triton forward and the Gluon forward) through Triton's real generated C
launchers, on the CPU: a stub libcuda.so.1 (built here with the C compiler Triton uses) stands in for the driver, so
each C launcher parses every argument, reads every pointer and CUtensorMap (filled by Triton's own cuda_utils) and
calls cuLaunchKernelEx exactly as on the GPU, and the stub records what the kernel would get. Checks that the dense
call cache's launches (pointers as data_ptr() ints, the per-stream global scratch, the CUtensorMaps kept per
address, the fixed argument tuples) reach the kernel's parameters intact, then times the Triton launcher's per-call
parsing: with int vs tensor pointers, and with vs without the constexpr arguments (which it parses and drops).

    PYTHONPATH=$PWD python3 benchmarks/probes/c_launcher_cpu.py [--check]

(--check: the checks only, no timings; tests/test_flash_attn_host_path.py runs it.)
No GPU; needs gcc (or clang). The driver calls cost nothing here: on a GPU each tensor pointer also costs a
cuPointerGetAttribute, and the launch a cuLaunchKernelEx.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
import timeit

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

STUB = r"""
#include <stdint.h>
#include <string.h>
typedef int CUresult;
typedef struct { unsigned gridDimX, gridDimY, gridDimZ; } CUlaunchConfigHead;
static int context;
unsigned long long stub_launches = 0, stub_grid[3];
int stub_nparams = 0;
uint64_t stub_params[256];
CUresult cuGetErrorString(CUresult e, const char** s) { *s = "stub"; return 0; }
CUresult cuPointerGetAttribute(void* data, int attr, uint64_t ptr) { *(uint64_t*)data = ptr; return 0; }
CUresult cuCtxGetCurrent(void** c) { *c = &context; return 0; }
CUresult cuDeviceGet(int* d, int o) { *d = 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** c, int d) { *c = &context; return 0; }
CUresult cuCtxSetCurrent(void* c) { return 0; }
CUresult cuFuncSetAttribute(void* f, int attr, int value) { return 0; }
CUresult cuFuncGetAttribute(int* v, int attr, void* f) { *v = 0; return 0; }
CUresult cuFuncSetCacheConfig(void* f, int c) { return 0; }
CUresult cuCtxGetLimit(size_t* v, int limit) { *v = 0; return 0; }
CUresult cuCtxSetLimit(int limit, size_t v) { return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, int d) { *v = 0; return 0; }
CUresult cuModuleLoadData(void** m, const void* image) { *m = &context; return 0; }
CUresult cuModuleGetFunction(void** f, void* m, const char* name) { *f = &context; return 0; }
CUresult cuOccupancyMaxActiveClusters(int* n, void* f, const void* config) { *n = 1; return 0; }
/* a CUtensorMap's first 8 bytes: its global address (the probe reads it back from the kernel's parameters) */
CUresult cuTensorMapEncodeTiled(void* map, int type, unsigned rank, void* address, const uint64_t* dims,
                                const uint64_t* strides, const unsigned* box, const unsigned* element_strides,
                                int interleave, int swizzle, int l2, int fill) {
  memcpy(map, &address, 8); return 0;
}
CUresult cuLaunchKernelEx(const CUlaunchConfigHead* config, void* f, void** params, void** extra) {
  stub_launches++;
  stub_grid[0] = config->gridDimX; stub_grid[1] = config->gridDimY; stub_grid[2] = config->gridDimZ;
  for (int i = 0; i < stub_nparams && i < 256; i++) { stub_params[i] = 0; memcpy(&stub_params[i], params[i], 8); }
  return 0;
}
"""


def _stub_driver(workdir: str):
    """Builds and loads the stub libcuda.so.1 (global symbols, so the launcher binds to it)."""
    src = os.path.join(workdir, "stub.c")
    with open(src, "w") as f:
        f.write(STUB)
    lib = os.path.join(workdir, "libcuda.so.1")
    cc = os.environ.get("CC") or "gcc"
    subprocess.check_call([cc, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o", lib, src])
    return ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def _type_of(value, pointer: bool):
    """The signature type Triton's binder gives a runtime argument (1 and None specialise to constexpr)."""
    if pointer:
        return "*bf16"
    if value is None or (type(value) is int and value == 1):
        return "constexpr"
    if isinstance(value, tuple):
        return tuple(_type_of(x, False) for x in value)
    if type(value) is float:
        return "fp32"
    if type(value) is bool:
        return "u1"
    return "i32"


def _flat(types) -> list:
    out = []
    for t in types:
        out.extend(_flat(t) if isinstance(t, tuple) else [t])
    return out


def _launcher(types: list, workdir: str, stub_dir: str):
    from triton.backends.nvidia import driver as nv
    from triton.runtime.build import compile_module_from_src

    src = nv.make_launcher({}, dict(enumerate(types)), None)
    return compile_module_from_src(src=src, name="__triton_launcher", library_dirs=[stub_dir],
                                   include_dirs=nv.include_dirs, libraries=nv.libraries)


def _gluon_check(stub, workdir: str):
    """The Gluon forward's direct launch (TensormapLauncher) through the real C launcher and real CUtensorMaps."""
    import triton
    from triton.backends.nvidia import driver as nv
    from triton.runtime.build import compile_module_from_src

    import flashdecode
    from flashdecode.ops import attention_plans, gluon_plan

    with open(os.path.join(os.path.dirname(nv.__file__), "driver.c")) as f:
        utils = compile_module_from_src(src=f.read(), name="cuda_utils", library_dirs=[workdir],
                                        include_dirs=nv.include_dirs, libraries=nv.libraries)
    nv.PyCUtensorMap = utils.PyCUtensorMap  # the launcher module's type check reads it at import

    class Driver:  # triton.runtime.driver.active as make_tensordesc_arg reads it
        pass
    Driver.utils = utils
    q, k, v = (torch.randn(2, 16, 16, 128, dtype=torch.bfloat16) for _ in range(3))
    flashdecode.flash_attn(q, k, v)  # the key's first (JIT, faked) launch
    triton.runtime.driver.set_active(Driver())
    plan, = [p for p in gluon_plan.PLANS.values() if p]
    direct = plan.direct
    metas = [dict(swizzle=128, elem_size=2, elem_type=10, block_size=[rows, 128], fp4_padded=False)
             for rows in (64, plan.cfg.block_n, plan.cfg.block_n)]
    direct.metas, direct.maps, direct.descs = metas, tuple({} for _ in metas), {}
    types = ["tensordesc<bf16[64,128]>"] * 3 + ["*bf16", "*fp32", "i32", "i32", "i32", "fp32"]
    types += ["constexpr"] * len(plan.tail)
    module = compile_module_from_src(src=nv.make_launcher({}, dict(enumerate(types)), metas),
                                     name="__triton_launcher", library_dirs=[workdir], include_dirs=nv.include_dirs,
                                     libraries=nv.libraries)
    direct.launcher = module.launch
    ctypes.c_int.in_dll(stub, "stub_nparams").value = 3 * 5 + 6 + 2
    out = flashdecode.flash_attn(q, k, v)
    got = list((ctypes.c_uint64 * 256).in_dll(stub, "stub_params"))
    call, = [c for c in attention_plans._DENSE_CALLS.values() if c.gluon is plan]
    assert [got[0], got[5], got[10]] == [q.data_ptr(), k.data_ptr(), v.data_ptr()], "CUtensorMap addresses"
    assert [x & 0xFFFFFFFF for x in got[1:3]] == [2 * 16, 16 * 128] and got[3:5] == [16 * 128, 1], got[1:5]
    assert got[15:17] == [out.data_ptr(), plan.lse_discard()], "out, lse"
    assert [x & 0xFFFFFFFF for x in got[17:20]] == list(plan.shapes), "num_tiles, seqlen_q, seqlen_k"
    grid = tuple((ctypes.c_uint64 * 3).in_dll(stub, "stub_grid"))
    assert grid == plan.grid and direct.fills == 3 and call.gluon is plan
    print(f"Gluon: the C launcher got the three CUtensorMaps (q, k, v addresses), out, the discarded lse, the "
          f"shapes and the grid {grid}")
    return q


def _triton_check(stub, workdir: str):
    """The Triton forward's direct launch (PlainLauncher) through the real C launcher. Returns what the timings
    need: the C launcher module, the launch's arguments (launch fields, kernel parameters), their types, q."""
    import flashdecode
    from flashdecode.ops import attention_plans, direct_launch

    q, k, v = (torch.randn(2, 16, 16, 96, dtype=torch.bfloat16) for _ in range(3))  # head dim 96: Triton's
    flashdecode.flash_attn(q, k, v)
    call, = attention_plans._DENSE_CALLS.values()
    kernel = call.kernel
    seen = []
    kernel.direct.launch = lambda *args: seen.append(args)
    flashdecode.flash_attn(q, k, v)
    full = seen[-1][13:]
    nargs = next(i for i, p in enumerate(kernel.fn.params) if p.is_constexpr)
    types = [_type_of(x, i < 5) for i, x in enumerate(full[:nargs])] + ["constexpr"] * (len(full) - nargs)
    module = _launcher(types, workdir, workdir)
    kernel.direct.launch = module.launch
    runtime = [t for t in _flat(types) if t != "constexpr"]
    ctypes.c_int.in_dll(stub, "stub_nparams").value = len(runtime) + 2  # and the two scratch pointers
    out = flashdecode.flash_attn(q, k, v)
    got = (ctypes.c_uint64 * 256).in_dll(stub, "stub_params")
    expected = [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), call._lse_discard()]
    assert list(got[:5]) == expected, (list(got[:5]), expected)
    scratch = got[len(runtime)]
    buffer, = direct_launch.SCRATCH.buffers.values()
    assert buffer.data_ptr() <= scratch < buffer.data_ptr() + buffer.numel() and scratch % 128 == 0
    grid = tuple((ctypes.c_uint64 * 3).in_dll(stub, "stub_grid"))
    assert grid == call.bound[0], (grid, call.bound[0])
    i32 = [x & 0xFFFFFFFF for x in got[5:len(runtime)]]
    print(f"Triton: the C launcher got q, k, v, out, the discarded lse, the grid {grid} and the scratch; "
          f"{len(runtime)} runtime parameters (first i32/fp32 words: {i32[:8]})")
    return module, seen[-1][:13], full, types, q


def _timings(workdir: str, gluon_us: float, module, launch: tuple, full: tuple, types: list, q):
    import flashdecode

    def us(f, n=100000):
        return min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6
    out_t, lse_t = torch.empty_like(q), torch.empty(2, 16, 16)  # the Triton entry's q (head dim 96)
    with_tensors = launch + (q, q, q, out_t, lse_t) + full[5:]
    no_constexprs = [t for t in types if t != "constexpr"]
    bare = _launcher(no_constexprs, workdir, workdir)
    bare_args = launch + tuple(x for x, t in zip(full, types) if t != "constexpr")
    triton_us = us(lambda: flashdecode.flash_attn(q, q, q), 20000)
    return [
        ("flash_attn, Gluon path, C launcher on the stub driver", gluon_us),
        ("flash_attn, Triton path, C launcher on the stub driver", triton_us),
        ("C launcher alone, pointers as ints", us(lambda: module.launch(*launch, *full))),
        ("C launcher alone, pointers as tensors", us(lambda: module.launch(*with_tensors))),
        (f"C launcher alone, without the {len(types) - len(no_constexprs)} top-level constexprs",
         us(lambda: bare.launch(*bare_args))),
    ]


def main(check_only: bool):
    workdir = tempfile.mkdtemp(prefix="c_launcher_cpu_")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(workdir, "cache"))
    stub = _stub_driver(workdir)
    import host_overhead as ho  # the faked Hopper of scripts/host_overhead.py --cpu

    import flashdecode

    ho._fake_device()
    timing = _triton_check(stub, workdir)
    gluon_q = _gluon_check(stub, workdir)
    print("intact")
    if check_only:
        return
    gluon_us = min(timeit.repeat(lambda: flashdecode.flash_attn(gluon_q, gluon_q, gluon_q), number=20000,
                                 repeat=5)) / 20000 * 1e6
    rows = _timings(workdir, gluon_us, *timing)
    print(f"torch {torch.__version__}; host us per call, CPU, stub driver")
    print("| what | us |")
    print("|---|---|")
    for name, t in rows:
        print(f"| {name} | {t:.2f} |")


if __name__ == "__main__":
    main(check_only="--check" in sys.argv[1:])
