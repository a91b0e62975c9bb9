"""Programmatic dependent launch (PDL) for the engine's decode-step kernels: the setting and its kernel-side helpers.

A CUDA-graphed decode step is ~300 kernels; between two of them the GPU idles ~1.5 us (the next grid is launched only
once the previous one has finished and flushed). With PDL (Hopper, sm_90+) a kernel launched with
``launch_pdl=True`` may start while the kernel before it in the stream still runs:

- ``gdc_wait()`` (griddepcontrol.wait) blocks until the previous grid has COMPLETED and its memory is visible. A PDL
  kernel must not read anything an earlier kernel wrote, nor write anything (its output may reuse memory an earlier
  kernel still reads: the graph's allocator recycles freed activations), before that line. Since every program waits
  before it exits, a kernel's completion implies its predecessor's, so the chain is ordered however many kernels
  are PDL launches, and whoever launched the kernel before (cuBLAS, a torch op) does not matter.
- ``gdc_launch_dependents()`` lets the next PDL kernel launch once every program of this grid has called it (or
  exited). The kernels here call it right after their wait: the next kernel's programs then become resident while
  this one runs (never before all of this grid's programs are resident, so they cannot starve it), and the chain
  stays one kernel deep (a trigger before the wait would let the whole step's kernels pile up behind the first).

What a kernel may do before its wait: index math, and touching memory that no kernel of the step writes - the
weights. The GEMV / flat GEMM issue L2 prefetch hints (``prefetch.global.L2``: no register, no data, not a read in
the memory model) for the first columns of their weight rows there, so the DRAM latency of their first tiles
overlaps the previous kernel instead of following it; their pipelined K loop is unchanged (Triton's pipeliner
issues its loads after the wait) and then finds those lines in L2. Loading the first tiles into registers would need
the loop peeled by hand and fight the pipeliner.

The decision is the engine's (``LLM(pdl=...)``, resolved once by ``resolve_pdl``) and lives on the modules that
launch the kernels (``install``); the launch functions (fused.add_rms_norm, ..., gemv.gemv, flat_gemm.flat_gemm)
take ``pdl=`` and trust it. Decode attention has its own, older PDL policy (DecodePlan's ``use_pdl``: on for
Hopper), which this setting does not change. The interpreter cannot run the inline PTX, so PDL is off on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashdecode.kernels.decode_gather import prefetch_l2
from flashdecode.ops.checks import interpreting

# What pdl="auto" gives on a GPU that can do PDL: off. Measured end to end on the H100 (bench e2e --pdl both, Llama-3-8B
# shape, 4k): b1 1.012x, b16 0.982x, b64 1.006x - no step gained beyond noise (docs/decisions.md); pdl=True opts in.
AUTO_ON = False

# Weight bytes one PDL GEMV / flat-GEMM launch prefetches into L2 before its wait, over all its rows: about what HBM
# delivers while a short kernel before it runs (~2.5 us at 3.35 TB/s), far below the 50 MB L2, so the lines stay
# there until the K loop reads them.
PREFETCH_BYTES = 8 << 20
PREFETCH_MAX_COLUMNS = 1024  # per weight row: bounds the prefetch instructions of one program
LINE_BYTES = 128


def pdl_supported(device) -> bool:
    """Whether the kernels can be launched with PDL on ``device``: a CUDA GPU of compute capability >= 9.0, not the
    interpreter (which cannot run griddepcontrol's inline PTX)."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting(device):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def resolve_pdl(pdl, device) -> bool:
    """The engine's ``pdl`` argument as a decision: "auto" = AUTO_ON where pdl_supported, True = on (ValueError where
    the device cannot do it), False = off."""
    if isinstance(pdl, str):
        if pdl != "auto":
            raise ValueError(f"pdl must be 'auto' or a bool, got {pdl!r}")
        return AUTO_ON and pdl_supported(device)
    if not isinstance(pdl, bool):
        raise TypeError(f"pdl must be 'auto' or a bool, got {type(pdl).__name__}")
    if pdl and not pdl_supported(device):
        raise ValueError(f"pdl=True needs a CUDA GPU of compute capability >= 9.0 outside the Triton interpreter; "
                         f"{torch.device(device)} is not one (use pdl='auto' or False)")
    return pdl


def install(model: torch.nn.Module, enabled: bool) -> None:
    """Let every module of ``model`` that launches decode-step kernels (those with a ``use_pdl`` attribute) launch
    them with PDL or not. Set by each engine at its start (engines that share a model each set it again)."""
    for mod in model.modules():
        if hasattr(mod, "use_pdl"):
            mod.use_pdl = bool(enabled)


def launch_options(pdl: bool) -> dict:
    """Keyword arguments of a Triton launch: launch_pdl=True with PDL, nothing without (the variant stays as it was)."""
    return {"launch_pdl": True} if pdl else {}


def prefetch_columns(rows: int, k: int, element_size: int) -> int:
    """PREFETCH_K of a PDL launch whose programs read ``rows`` weight rows of ``k`` elements in all: the first
    columns of each row to prefetch into L2 before the wait, a power of two of whole 128-byte lines, PREFETCH_BYTES
    over all rows at most (0: not even one line per row fits)."""
    line = LINE_BYTES // element_size
    cols = min(PREFETCH_BYTES // max(rows * element_size, 1), PREFETCH_MAX_COLUMNS, triton.next_power_of_2(k))
    if cols < line:
        return 0
    return 1 << (cols.bit_length() - 1)


def linear_launch_args(pdl: bool, rows: int, k: int, weight: torch.Tensor) -> dict:
    """The PDL constexprs (USE_PDL, PREFETCH_K, LINE_ELEMS) and launch option of a GEMV / flat-GEMM launch whose
    programs read ``rows`` rows of ``weight`` (N, K) in all; nothing without PDL (the kernel variant stays the one
    compiled before)."""
    if not pdl:
        return {}
    size = weight.element_size()
    return dict(USE_PDL=True, PREFETCH_K=prefetch_columns(rows, k, size), LINE_ELEMS=LINE_BYTES // size,
                **launch_options(True))


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """PDL: block until the previous kernel in the stream has completed and its writes are visible, then let the
    next PDL kernel launch (see the module doc). Nothing without USE_PDL."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_weight_rows(W, rows, n_rows, stride_row, K, PREFETCH_K: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """L2 prefetch hints for the first PREFETCH_K columns (a power of two, a multiple of LINE_ELEMS, the elements of
    a 128-byte line) of weight rows ``rows`` (BLOCK,) of W (n_rows, K), row stride ``stride_row``. Row and column
    indices are clamped into the weight, so every hinted address lies inside it. Not a memory read: may precede
    the PDL wait (weights are never written during a step)."""
    r = tl.minimum(rows, n_rows - 1).to(tl.int64)
    cols = tl.minimum(tl.arange(0, PREFETCH_K // LINE_ELEMS) * LINE_ELEMS, K - 1)
    prefetch_l2(W + r[:, None] * stride_row + cols[None, :])
