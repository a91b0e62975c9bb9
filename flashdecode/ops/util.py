"""The small host helpers every op shares: integer arithmetic, the call's device facts (SM count, compute
capability, shared memory), the interpreter / autotune switches read per call, CUDA-graph capture and
call-scoped buffers (call_scoped_buffers), the layout
predicates of tensor descriptors (TMA) and the ALiBi slopes as the kernels read them (the score transform itself is
ops/score_transform.py).

Device facts are those of the CALL's device (a tensor's), never of the current device: a call on cuda:1 while
cuda:0 is current must see cuda:1's SM count and architecture. Each is cached per device (no driver query per call).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from flashdecode import heuristics
from flashdecode.ops import checks

__all__ = ["cdiv", "next_power_of_2", "interpreting_now", "autotune_enabled", "AUTOTUNE_ENV", "capturing",
           "call_scoped_buffers", "call_scoped", "keeps_nothing", "num_sms", "device_facts", "capability_major",
           "is_hopper", "hopper_or_newer", "tma_layout_ok", "rows_layout_ok", "cache_rows_tma_ok", "pages_tma_ok",
           "aligned16", "aligned_bits", "constant_slopes"]

cdiv = heuristics.cdiv  # pure Python: triton.cdiv is a constexpr function, ~10x slower on the host
next_power_of_2 = heuristics.next_power_of_2
num_sms = heuristics.num_sms  # the call's device; heuristics.DEFAULT_NUM_SMS off the GPU

# The one environment variable of the prefill launch policy: "0" = no autotuning (the first candidate that fits).
AUTOTUNE_ENV = "FLASHDECODE_AUTOTUNE"

# os.environ's own bytes dict on POSIX: these switches are read per call (the launch keys hold them), so one dict
# lookup each instead of checks.env_value's decoding (the same answers: "1" and "0" are ASCII)
_ENVIRON_GET = checks._ENVIRON_DATA.get if checks._ENVIRON_BYTES else None
_INTERPRET_NAME, _AUTOTUNE_NAME = b"TRITON_INTERPRET", AUTOTUNE_ENV.encode()


def interpreting_now() -> bool:
    """TRITON_INTERPRET=1 (checks.interpreting without a device, at a dict lookup's cost)."""
    if _ENVIRON_GET is not None:
        return _ENVIRON_GET(_INTERPRET_NAME) == b"1"
    return checks.interpreting()


def autotune_enabled() -> bool:
    """FLASHDECODE_AUTOTUNE is not "0" (the default: time the candidate tiles on the GPU)."""
    if _ENVIRON_GET is not None:
        return _ENVIRON_GET(_AUTOTUNE_NAME) != b"0"
    return checks.env_value(AUTOTUNE_ENV, "1") != "0"


_CUDA_BUILD = torch.version.cuda is not None  # CPU-only builds of torch lack (or stub) the C function below
_cuda_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) if _CUDA_BUILD else None


def capturing(device: torch.device | None = None) -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph (torch.cuda.is_current_stream_capturing, without
    its Python wrapper); with a device, False unless it is a CUDA device (no host sync is allowed while True)."""
    if device is not None and device.type != "cuda":
        return False
    return _cuda_capturing is not None and _cuda_capturing()


class _CallScoped(threading.local):
    """.on: inside call_scoped_buffers on this thread (False by default: a class attribute, so a thread that never
    set it reads it without the AttributeError a getattr default would raise and catch on every call)."""

    on = False


_CALL_SCOPED = _CallScoped()


@contextlib.contextmanager
def call_scoped_buffers():
    """Within it (on this thread) the ops keep no tensor they make beyond the call that made it: decode workspace,
    launch scratch, discard buffers, tensor templates, cached lengths are each call's own (allocated per call,
    freed when it returns) and no pool or cache grows. For callers whose allocations must not outlive the call: an
    op that torch.compile runs (a cudagraph tree's warmup allocates from the graph's memory pool and raises on any
    block still held afterwards that the graph did not return; a capture's pool is reused by the tree's other
    graphs). Host-side records (checks, configs, launch records) are kept as usual."""
    before = _CALL_SCOPED.on
    _CALL_SCOPED.on = True
    try:
        yield
    finally:
        _CALL_SCOPED.on = before


def call_scoped() -> bool:
    """Whether this thread is inside call_scoped_buffers (then keep no tensor made in the call)."""
    return _CALL_SCOPED.on


def keeps_nothing(device: torch.device | None = None) -> bool:
    """Whether a tensor made now must not be kept in a cache or pool past the call: inside call_scoped_buffers, or
    while the current CUDA stream captures a graph (capturing(device))."""
    return call_scoped() or capturing(device)


@functools.lru_cache(maxsize=None)
def device_facts(device: torch.device) -> tuple[int, int]:
    """(shared memory per block in bytes, compute capability major) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 227 * 1024)), props.major


def capability_major(device: torch.device) -> int:
    """The compute capability major of ``device``; 0 off CUDA."""
    return device_facts(device)[1] if device.type == "cuda" else 0


@functools.lru_cache(maxsize=None)
def is_hopper(device: torch.device) -> bool:
    """sm_90 exactly (the Gluon kernels' wgmma / setmaxnreg code)."""
    return capability_major(device) == 9


@functools.lru_cache(maxsize=None)
def hopper_or_newer(device: torch.device) -> bool:
    """sm_90 or newer (tensor descriptors, programmatic dependent launch)."""
    return capability_major(device) >= 9


def tma_layout_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need a unit last stride, 16-byte aligned base and strides, and rows of >= 16 bytes."""
    for t in tensors:
        elem = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or t.shape[-1] * elem < 16:
            return False
        if any((st * elem) % 16 for st in t.stride()[:-1]):
            return False
    return True


def rows_layout_ok(x: torch.Tensor) -> bool:
    """x (batch, seqlen, heads, headdim) can be read as a 2-D (batch * seqlen, heads * headdim) TMA view: unit dim
    stride, heads packed, batch rows follow seq rows, 16-byte row stride (the base pointer is checked per call)."""
    b, s, h, d = x.shape
    st = x.stride()
    return (st[3] == 1 and st[2] == d and (b == 1 or st[0] == s * st[1])
            and (st[1] * x.element_size()) % 16 == 0)


def cache_rows_tma_ok(k_cache: torch.Tensor) -> bool:
    """The decode TMA path views a cache as 2-D (rows, nheads_kv * headdim): rows of one sequence (or page) must be
    consecutive and 16-byte aligned (heuristics.decode_tma_fits adds the tile conditions)."""
    _, rows, hk, d = k_cache.shape
    dense = k_cache.stride(2) == d and k_cache.stride(1) == hk * d and k_cache.stride(0) == rows * hk * d
    return dense and k_cache.data_ptr() % 16 == 0 and (hk * d * k_cache.element_size()) % 16 == 0


def pages_tma_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether descriptors may read the caches as (num_pages * page_size) rows per kv head: pages back to back
    (page stride = page_size * token stride), 16-byte aligned bases, token and head strides, rows of >= 16 bytes,
    and row indices below 2**31."""
    num_pages, page_size, _, headdim = k_cache.shape
    elem = k_cache.element_size()
    return (k_cache.stride(0) == page_size * k_cache.stride(1) and num_pages * page_size < 2**31
            and headdim * elem >= 16 and all((st * elem) % 16 == 0 for st in k_cache.stride()[1:3])
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)


def aligned16(*tensors: torch.Tensor) -> bool:
    """Every base address 16-byte aligned (TMA reads from such addresses only)."""
    bits = 0
    for t in tensors:
        bits |= t.data_ptr()
    return bits % 16 == 0


def aligned_bits(*tensors) -> int:
    """Bit i set: tensor i's data pointer is 16-byte aligned (Triton specialises pointer arguments on it); None
    tensors count as aligned (their argument is a constexpr None either way)."""
    bits = 0
    for i, t in enumerate(tensors):
        if t is None or t.data_ptr() % 16 == 0:
            bits |= 1 << i
    return bits




def constant_slopes(slopes):
    """ALiBi slopes (checked; None passes) with a unit head stride, detached: the bias is a constant, so no gradient
    flows to the slopes (as in flash-attn)."""
    if slopes is None:
        return None
    slopes = slopes.detach()
    return slopes if slopes.stride(-1) == 1 else slopes.contiguous()
