"""``dot``: tl.dot as the kernels call it, exact in Triton's CPU interpreter too.

The interpreter keeps bfloat16 tensors as their raw 16-bit patterns (numpy has no bfloat16) and its tl.dot multiplies
those patterns as integers: a bf16 dot is wrong by orders of magnitude there, silently. ``dot`` upcasts bf16
operands to float32 (exactly) when the kernels are interpreted; compiled for a GPU it is tl.dot, unchanged
(INTERPRETED is a constexpr, so the branch does not exist in the compiled kernel).
"""

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _decorated():
    pass


# Triton decides at decoration whether a @triton.jit function is compiled or interpreted (TRITON_INTERPRET=1 when
# the module is imported); every kernel of this package is decorated under the same setting as this probe.
INTERPRETED = tl.constexpr(isinstance(_decorated, InterpretedFunction))


@triton.jit
def dot(a, b, acc=None, input_precision: tl.constexpr = None):
    """tl.dot(a, b, acc, input_precision=...): a (M, K) @ b (K, N) [+ acc (M, N) fp32], fp32 result."""
    if INTERPRETED:
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=input_precision)
