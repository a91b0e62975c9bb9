"""Argument checks shared by every public op (flash_attn*, flash_decode, DecodePlan, append_kv, merge_states*).

Every check raises ValueError (a bad value or shape) or TypeError (a bad type or dtype) whose message names the
argument; none asserts (asserts vanish under ``python -O``) and none reads a device tensor (no host sync): checks
that need values read them only from host tensors.
"""

from __future__ import annotations

import math
import os
from typing import Iterable, Optional, Sequence

import torch

__all__ = [
    "LOG2E", "FLOAT_DTYPES", "MAX_HEAD_DIM", "interpreting", "full_device", "check_tensor", "check_device",
    "check_kernel_device", "check_bool", "check_int", "check_softmax_scale", "check_softcap", "check_window",
    "resolve_scale", "host_resident",
]

LOG2E = 1.4426950408889634  # log2(e): kernels use exp2 with the scale folded in; natural-log lse * LOG2E = log2 lse
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def interpreting(device: Optional[torch.device] = None) -> bool:
    """Whether Triton kernels run in the CPU interpreter: TRITON_INTERPRET=1, or (with a device) a non-CUDA one."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True
    return device is not None and torch.device(device).type != "cuda"


def host_resident(x: torch.Tensor) -> bool:
    """Whether metadata (lengths, block tables, cu_seqlens) can be read without a device sync, so that the ops
    validate it on the host and raise; device-resident metadata is not read (the kernels mask bad values instead).
    Tests stub this to exercise the kernels' device-side masking with CPU (interpreter) tensors."""
    return x.device.type == "cpu"


def full_device(device) -> torch.device:
    """torch.device with its index filled in ("cuda" -> "cuda:<current>"), so it compares equal to tensor.device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_tensor(name: str, x, dims: Iterable[int], dtypes: Optional[Sequence[torch.dtype]] = None):
    """x is a tensor with one of ``dims`` dimensions and (if given) one of ``dtypes``."""
    if isinstance(dims, range) and len(dims) > 4:  # "at least n" (a rank range up to torch's limit)
        wanted = f"at least {dims.start}"
    else:
        wanted = " or ".join(map(str, dims))
    dims = tuple(dims)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in dims:
        raise ValueError(f"{name} must have {wanted} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {x.dtype}")


def check_device(name: str, x: torch.Tensor, device: torch.device, ref: str = "q"):
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {ref} is on {device}")


def check_kernel_device(name: str, x: torch.Tensor):
    """The Triton kernels need a CUDA tensor, or the CPU interpreter (TRITON_INTERPRET=1) for CPU tensors."""
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} is on {x.device}: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 "
                         "for the CPU interpreter); flashdecode.reference is the pure-PyTorch CPU path")


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_int(name: str, value, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """A Python int (bool excluded; numpy/torch integer scalars accepted) within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) or not hasattr(value, "__index__"):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        value = int(value.__index__())
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def check_softmax_scale(softmax_scale) -> Optional[float]:
    """None (headdim**-0.5) or a finite real number."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be None or a finite float, got {softmax_scale!r}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return float(softmax_scale)


def resolve_scale(softmax_scale, headdim: int) -> float:
    scale = check_softmax_scale(softmax_scale)
    return headdim ** -0.5 if scale is None else scale


def check_softcap(softcap) -> float:
    """A finite real number >= 0 (0 = off)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    if not (math.isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    return float(softcap)


def check_window(window_size) -> tuple[int, int]:
    """(left, right) ints >= -1 (-1 = unbounded)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) tuple of ints, got {window_size!r}")
    out = []
    for w in window_size:
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"window_size must be a (left, right) tuple of ints, got {window_size!r}")
        if w < -1:
            raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
        out.append(int(w))
    return out[0], out[1]
