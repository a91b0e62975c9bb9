"""A read-only stream: what reading bytes costs with no other work (the read-stream bandwidth of flashdecode.timing,
the denominator of bench e2e's read-stream roofline)."""

import triton
import triton.language as tl


@triton.jit
def read_sum_kernel(X, OUT, BLOCK: tl.constexpr):
    """Program p sums elements [p * BLOCK, (p + 1) * BLOCK) of the flat X (unmasked: the launcher passes whole
    blocks) into OUT[p] (float32), so the loads cannot be optimised away; a flat sweep by as many small programs as
    a copy kernel launches."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + tl.program_id(0), tl.sum(tl.load(X + offs).to(tl.float32), 0))
