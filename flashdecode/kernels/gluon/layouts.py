"""Register layouts and small compile-time helpers shared by the Gluon attention kernels (forward and backward).

Also ``aggregate`` (Triton's ``@aggregate`` class decorator, bound once here), ``RUNTIME``, the annotation of an
aggregate field that holds a runtime value - a tensor, or a constexpr where Triton specialised the argument (an
integer 1, a None pointer) -, and ``runtime``, which stores such a value from an aggregate's constructor (a
constexpr_function: it receives constexprs unwrapped); ``OPTIONAL`` / ``optional`` likewise for a field that holds
another aggregate or None."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate  # noqa: F401 (re-exported: the kernels' @aggregate)
from triton.language.core import base_value

RUNTIME = (gl.tensor, gl.constexpr)
OPTIONAL = (base_value, gl.constexpr)  # an aggregate field holding another aggregate, or a constexpr None (optional)


@gluon.constexpr_function
def runtime(value):
    """``value`` as a RUNTIME field: a tensor as it is, a plain Python value (an unwrapped constexpr) rewrapped."""
    return value if isinstance(value, gl.tensor) else gl.constexpr(value)


@gluon.constexpr_function
def optional(value):
    """``value`` (an aggregate) as an OPTIONAL field, None as a constexpr None."""
    return gl.constexpr(None) if value is None else value


@gluon.constexpr_function
def mma_layout(n, dtype=None):
    """Accumulator layout of a 64 x n wgmma over one warpgroup with operands of ``dtype`` (instruction n = the
    whole tile width; instruction k = 32 bytes: 16 for fp16/bf16 - also dtype None, as the backward passes it -,
    32 for e4m3)."""
    k = 16 if dtype is None else 256 // dtype.primitive_bitwidth
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, k])


@gluon.constexpr_function
def p_layout(o_layout, dtype):
    """Register layout of P as the A operand of O += P V: k_width = the elements of ``dtype`` per 32-bit register
    (2 for fp16/bf16, 4 for e4m3: see fwd_softmax.p_operand for how P gets there without moving data)."""
    return gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=32 // dtype.primitive_bitwidth)


@gluon.constexpr_function
def p_log2_scale(dtype):
    """log2 of the factor P (in [0, 1]) carries into an e4m3 PV wgmma: P * 2**8 <= 256 stays below e4m3's 448 and
    keeps probabilities down to 2**-17 (e4m3's smallest subnormal is 2**-9) instead of flushing them to 0; the
    factor cancels in O / l and comes out of the lse. 0 (no factor) for fp16/bf16."""
    return 8.0 if dtype.primitive_bitwidth == 8 else 0.0


@gluon.constexpr_function
def store_layout(head_dim):
    """Row-major blocked layout for the output store: 8 contiguous elements (16 bytes) per thread."""
    cols = head_dim // 8
    cols = 32 if cols > 32 else cols
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // cols, cols], warps_per_cta=[4, 1],
                            order=[1, 0])
