"""Shared test helpers: random inputs, the FlashAttention tolerance rule and the sm_90 compile-on-CPU checks.

The rule (flash-attn's tests): a kernel's error against the float64 reference must be at most ``factor`` times
the error of a plain PyTorch implementation run in the kernel's own dtype, plus a small atol. factor is 2 for
forward outputs, 3 for gradients and decode.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, HAS_CUDA  # noqa: F401  (re-exported for tests)

# The Triton interpreter computes bf16 tl.dot wrong (KERNEL_NOTES.md): CPU kernel tests use fp16/fp32.
KERNEL_DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float16, torch.float32]


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


def spilled_bytes(kernel) -> int:
    """Stack bytes (register spills) of a kernel compiled for a GPU target, from cuobjdump (bundled with Triton) on
    its cubin: the sm_90 compile-on-CPU checks use it to prove a tile configuration holds its state in registers."""
    import os
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    return int(re.search(r"STACK:(\d+)", usage).group(1))


# the decode kernels' stride tuples and their lengths (compile_for_sm90's signatures)
STRIDE_TUPLES = dict(stride_q=4, stride_k=3, stride_o=5, stride_l=4, stride_f=4, stride_fl=3, stride_alibi=2)


def compile_for_sm90(fn, types: dict, consts: dict, num_stages: int = 3, num_warps: int = 4):
    """``fn`` compiled for sm_90 (Triton's ptxas, no GPU) with argument types ``types`` (default i32; stride tuples
    as tuples of i32) and constexprs ``consts``, pointers and strides specialised divisible by 16 as the launcher
    does. For the scripts of run_sm90_compile_script (a fresh Python without TRITON_INTERPRET)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # the decode kernels' float cache without ALiBi unless a variant asks for an 8-bit cache / ALiBi
    for flag, default in (("KV_QUANT", {"KV_QUANT": 0, "K_SCALE": None, "V_SCALE": None}),
                          ("ALIBI", {"ALIBI": False, "ALIBI_SLOPES": None})):
        if flag in fn.arg_names:
            consts = {**{k: v for k, v in default.items() if k not in types}, **consts}
    sig = {n: "constexpr" if n in consts else types.get(n, ("i32",) * STRIDE_TUPLES.get(n, 0) or "i32")
           for n in fn.arg_names}
    attrs = {}
    for i, n in enumerate(fn.arg_names):
        if n in STRIDE_TUPLES:
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(STRIDE_TUPLES[n])})
        elif n not in consts and (sig[n].startswith("*") or "stride" in n):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def run_sm90_compile_script(script: str) -> None:
    """Run a script that compiles kernels for sm_90 with Triton's bundled ptxas (no GPU needed) in a fresh Python
    without TRITON_INTERPRET, from the repository root; it must print "compiled". Skips only where Triton ships no
    ptxas for this platform (CI's x86-64 wheels do ship it, so there the check always runs)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=root)
    if "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("Triton's ptxas is not available here")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
