"""Argument checks shared by every public op (flash_attn*, flash_decode, DecodePlan, append_kv, merge_states*).

Every check raises ValueError (a bad value or shape) or TypeError (a bad type or dtype) whose message names the
argument; none asserts (asserts vanish under ``python -O``) and none reads a device tensor (no host sync): checks
that need values read them only from host tensors. The one exception is check_cu_seqlens_values (flash_attn_varlen's
cu_seqlens, one sync the first time a tensor is seen, see there).
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Iterable, Optional, Sequence

import torch

__all__ = [
    "LOG2E", "FLOAT_DTYPES", "MAX_HEAD_DIM", "env_value", "interpreting", "full_device", "check_tensor", "check_device",
    "check_kernel_device", "check_bool", "check_int", "check_softmax_scale", "check_softcap", "check_window",
    "resolve_scale", "host_resident", "MAX_NUM_SPLITS", "check_optional_int", "check_num_splits", "check_dtype",
    "check_device_arg", "check_host_lengths", "check_host_cu_seqlens", "first_bad_page", "check_host_block_table",
    "to_host_once", "check_cache_metadata", "FP8_DTYPE", "NO_WINDOW", "DENSE_LAYOUT", "check_attention_tensors",
    "check_attention_tensors_once", "check_attention_options", "checked_descales", "check_cu_seqlens_layout",
    "check_cu_seqlens_values", "check_batch", "is_default_window",
    "check_alibi_slopes",
]

LOG2E = 1.4426950408889634  # log2(e): kernels use exp2 with the scale folded in; natural-log lse * LOG2E = log2 lse
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# The most KV splits a caller may force: far beyond any useful count (the split policy stops at 64), low enough that
# the fp32 partial buffer (rows x splits x headdim) cannot ask for terabytes.
MAX_NUM_SPLITS = 1024


# CPython's mapping behind os.environ (kept in step with every os.environ write; bytes keys on POSIX): a lookup
# there skips os.environ.get's key encoding and its KeyError for an unset variable (~0.7 us, read on every launch).
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_ENVIRON_BYTES = os.name == "posix" and isinstance(_ENVIRON_DATA, dict)


def env_value(name: str, default: str) -> str:
    """os.environ.get(name, default), cheaply: the launch paths read their switches per call."""
    if _ENVIRON_BYTES:
        value = _ENVIRON_DATA.get(name.encode())
        return default if value is None else os.fsdecode(value)
    return os.environ.get(name, default)


def interpreting(device: Optional[torch.device] = None) -> bool:
    """Whether Triton kernels run in the CPU interpreter: TRITON_INTERPRET=1, or (with a device) a non-CUDA one."""
    if env_value("TRITON_INTERPRET", "0") == "1":
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


def kernels_run_on(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device``: CUDA, or the CPU under the interpreter (TRITON_INTERPRET=1)."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def check_kernel_device(name: str, x: torch.Tensor):
    """The Triton kernels need a CUDA tensor, or the CPU interpreter (TRITON_INTERPRET=1) for CPU tensors."""
    if not kernels_run_on(x.device):
        raise ValueError(f"{name} is on {x.device}: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 "
                         "for the CPU interpreter); flashdecode.reference is the pure-PyTorch CPU path")


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_int(name: str, value, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """A Python int (bool excluded; numpy/torch integer scalars accepted) within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__index__"):
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


def check_optional_int(name: str, value, minimum: Optional[int] = None, maximum: Optional[int] = None):
    """None, or check_int's int within [minimum, maximum]."""
    return None if value is None else check_int(name, value, minimum, maximum)


def check_num_splits(value, optional: bool = True) -> Optional[int]:
    """A forced KV split count: an int in [1, MAX_NUM_SPLITS] (None = the split policy's, where optional)."""
    if value is None and optional:
        return None
    return check_int("num_splits", value, 1, MAX_NUM_SPLITS)


def check_dtype(name: str, value, allowed: Sequence[torch.dtype]) -> torch.dtype:
    if not isinstance(value, torch.dtype) or value not in allowed:
        raise TypeError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")
    return value


def check_device_arg(name: str, value) -> torch.device:
    """A torch.device or device string the Triton kernels can run on (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if not isinstance(value, (torch.device, str)):
        raise TypeError(f"{name} must be a torch.device or a device string, got {type(value).__name__}")
    try:
        device = torch.device(value)
    except RuntimeError as err:
        raise ValueError(f"{name} is not a device: {value!r} ({err})") from None
    if not (device.type == "cuda" or (device.type == "cpu" and interpreting())):
        raise ValueError(f"{name} is {device}: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for "
                         "the CPU interpreter)")
    return full_device(device)


# ----------------------------------------------------------------------------------------------------------------
# Metadata values (lengths, cu_seqlens, block tables). Host-resident metadata is always checked (no sync);
# device-resident metadata only on request (``validate=True``: one copy to the host), since the kernels mask
# out-of-range values themselves and must never touch memory outside the tensors.
# ----------------------------------------------------------------------------------------------------------------

def to_host_once(*tensors):
    """CPU copies of int metadata tensors (None passes through) with ONE device->host copy (one sync)."""
    live = [t for t in tensors if t is not None]
    if not live or all(t.device.type == "cpu" for t in live):
        return tuple(None if t is None else t.cpu() for t in tensors)
    flat = torch.cat([t.reshape(-1).long() for t in live]).cpu()
    out, at = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        out.append(flat[at: at + t.numel()].view(t.shape))
        at += t.numel()
    return tuple(out)


def check_host_lengths(name: str, lengths: torch.Tensor, capacity: int, added=0):
    """Host int (batch,) lengths: each >= 0 and, with ``added`` ((batch,) tensor or int) new tokens, <= capacity.
    The message gives the first bad sequence."""
    lengths = lengths.long()
    bad = (lengths < 0).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"{name}[{b}] = {int(lengths[b])} must be >= 0")
    ends = lengths + added
    bad = (ends > capacity).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"{name}[{b}] asks for {int(ends[b])} keys but the cache holds {capacity} per sequence")


def check_host_cu_seqlens(name: str, cu: torch.Tensor, total: int, total_name: str):
    """Host int (batch + 1,) cumulative lengths: start at 0, non-decreasing, end <= total (rows of total_name)."""
    cu = cu.long()
    if cu.numel() == 0:
        raise ValueError(f"{name} must have batch + 1 >= 1 entries, got none")
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] = {int(cu[0])} must be 0")
    bad = (cu[1:] < cu[:-1]).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"{name} must be non-decreasing: {name}[{b + 1}] = {int(cu[b + 1])} < {name}[{b}] = "
                         f"{int(cu[b])}")
    if int(cu[-1]) > total:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} runs past the {total} rows of {total_name}")


def first_bad_page(block_table: torch.Tensor, start: torch.Tensor, end: torch.Tensor, page_size: int,
                   num_pages: int):
    """The first (sequence, table column, page id) of a host block table whose id is outside [0, num_pages) among
    the pages that hold positions [start[b], end[b]) of each sequence (entries past them are never read), or None.
    block_table (batch, pages_per_seq) int; start, end (batch,) int with end <= pages_per_seq * page_size."""
    table = block_table.long()
    cols = torch.arange(table.shape[1])[None, :]
    first = (start.long() // page_size)[:, None]
    last = ((end.long() + page_size - 1) // page_size)[:, None]
    bad = (cols >= first) & (cols < last) & ((table < 0) | (table >= num_pages))
    hit = bad.nonzero()
    if not hit.numel():
        return None
    b, j = int(hit[0, 0]), int(hit[0, 1])
    return b, j, int(table[b, j])


def check_host_block_table(block_table, start, end, page_size: int, num_pages: int):
    """ValueError naming the first out-of-range page id among the pages of positions [start, end) (host tensors)."""
    found = first_bad_page(block_table, start, end, page_size, num_pages)
    if found is not None:
        b, j, page = found
        raise ValueError(f"block_table[{b}, {j}] = {page} is not a page of the cache (ids 0..{num_pages - 1}); "
                         f"sequence {b} uses it for positions {j * page_size}..{(j + 1) * page_size - 1}")


def check_cache_metadata(cache_seqlens, block_table, *, capacity: int, page_size: int, num_pages: int, validate,
                         appending: bool = False, added=0, cu_seqlens_new=None, new_rows: int = 0,
                         max_new: Optional[int] = None):
    """Values of a decode / append call's metadata. Host-resident metadata is always checked (no sync);
    device-resident metadata only with ``validate=True``, by one copy to the host (one sync; not during CUDA-graph
    capture), since the kernels mask bad values themselves instead. Checks cu_seqlens_new (start 0,
    non-decreasing, within the new_rows of k_new), the lengths (>= 0; + the new tokens within capacity) and the
    block-table ids of the positions the call reads ([0, len): decode) or writes ([len, len + new): appending);
    max_new (with cu_seqlens_new): the bound on its lengths that sizes the grid. ValueError names the first bad
    sequence and position."""
    if not (check_bool("validate", validate) or host_resident(cache_seqlens)):
        return
    lens, table, cu = to_host_once(cache_seqlens, block_table, cu_seqlens_new)
    if cu is not None:
        check_host_cu_seqlens("cu_seqlens_new", cu, new_rows, "k_new")
        added = (cu[1:] - cu[:-1]).long()
        if max_new is not None and added.numel() and int(added.max()) > max_new:
            b = int(added.argmax())
            raise ValueError(f"max_seqlen_new = {max_new} is less than sequence {b}'s {int(added[b])} new tokens in "
                             "cu_seqlens_new")
    check_host_lengths("cache_seqlens", lens, capacity, added)
    if table is not None:
        lens = lens.long()
        start, end = (lens, lens + added) if appending else (torch.zeros_like(lens), lens)
        check_host_block_table(table, start, end, page_size, num_pages)


# ----------------------------------------------------------------------------------------------------------------
# flash_attn / flash_attn_varlen (prefill and training)
# ----------------------------------------------------------------------------------------------------------------

FP8_DTYPE = torch.float8_e4m3fn  # prefill forward only, with q/k/v descales (FA3's FP8 API); output bfloat16
NO_WINDOW = (-1, -1)  # the default window_size: the options' fast checks pass it by identity
DENSE_LAYOUT = "(batch, seqlen, nheads, headdim)"
_CHECKED_MAX = 4096  # tensor signatures kept as checked (a set cleared when full: a check is cheap to redo)


def check_attention_tensors(q, k, v, ndim: int, layout: str):
    """q, k, v of flash_attn (ndim 4) or flash_attn_varlen (ndim 3, ``layout`` names the shape for messages): one
    dtype (fp16 / bf16 / fp32 / e4m3) and device, head dims equal and <= MAX_HEAD_DIM, k and v alike, GQA heads."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES and t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float8_e4m3fn (with descales), "
                            f"got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: q, k, v must share one dtype "
                            f"(FP8 attention takes all three in float8_e4m3fn)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if q.device.type == "cpu" and not interpreting():
        raise ValueError("q, k, v are CPU tensors: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1); "
                         "flashdecode.reference.attention_ref is the pure-PyTorch CPU path")
    headdim = q.shape[-1]
    if k.shape[-1] != headdim or v.shape[-1] != headdim:
        raise ValueError(f"k and v head dim must equal q's ({headdim}), got k {k.shape[-1]}, v {v.shape[-1]}")
    if not 1 <= headdim <= MAX_HEAD_DIM:
        raise ValueError(f"q head dim must be in 1..{MAX_HEAD_DIM}, got {headdim}")
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    if v.shape[-2] != nheads_kv:
        raise ValueError(f"v must have nheads_kv = {nheads_kv} heads like k, got {v.shape[-2]}")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads_kv of k/v ({nheads_kv})")
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"k and v must have the same leading shape, got k {tuple(k.shape)}, v {tuple(v.shape)}")


# (shapes, dtypes, devices, interpreter flag) of q, k, v that passed check_attention_tensors: a repeated call skips it
_CHECKED_TENSORS: set = set()


def check_attention_tensors_once(q, k, v, ndim: int, layout: str):
    """check_attention_tensors, skipped for a (layout, shape, dtype, device) signature that already passed (the checks
    read nothing else; the layout keeps a varlen call's 3-D shapes from passing for flash_attn)."""
    try:
        key = (ndim, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               type(q), type(k), type(v), q.device.type == "cpu" and interpreting())
    except AttributeError:  # not tensors: the full check names the argument
        key = None
    if key is None or key not in _CHECKED_TENSORS:
        check_attention_tensors(q, k, v, ndim, layout)
        if key is not None:
            if len(_CHECKED_TENSORS) >= _CHECKED_MAX:
                _CHECKED_TENSORS.clear()
            _CHECKED_TENSORS.add(key)


def check_attention_options(causal, softmax_scale, window_size, softcap, deterministic=True):
    """The shared checks, in this order; the common values (bools, no scale, the default window, softcap 0.0) pass
    without a call."""
    if causal is not True and causal is not False:
        check_bool("causal", causal)
    if deterministic is not True and deterministic is not False:
        check_bool("deterministic", deterministic)
    if softmax_scale is not None:
        check_softmax_scale(softmax_scale)
    if window_size is not NO_WINDOW:
        check_window(window_size)
    if type(softcap) is not float or softcap != 0.0:
        check_softcap(softcap)


def _check_descales(q, q_descale, k_descale, v_descale, batch: int, nheads_kv: int):
    """FP8 inputs need all three descales, float32 (batch, nheads_kv) on q's device (FA3's layout; q_descale may
    also be per query head, (batch, nheads)); other inputs take none. Descales that require grad are refused."""
    given = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    if q.dtype != FP8_DTYPE:
        for name, d in given:
            if d is not None:
                raise ValueError(f"{name} is only for float8_e4m3fn q, k, v; these are {q.dtype}")
        return
    for name, d in given:
        if d is None:
            raise ValueError(f"{name} is required with float8_e4m3fn q, k, v: a float32 ({batch}, {nheads_kv}) "
                             f"tensor (batch, nheads_kv) of dequantisation factors (x = x_fp8 * descale)")
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{name} must be a float32 torch.Tensor, got {type(d).__name__}")
        if d.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {d.dtype}")
        nheads = q.shape[-2]
        if tuple(d.shape) != (batch, nheads_kv) and not (name == "q_descale" and tuple(d.shape) == (batch, nheads)):
            also = f" or (batch, nheads) = ({batch}, {nheads})" if name == "q_descale" else ""
            raise ValueError(f"{name} must have shape (batch, nheads_kv) = ({batch}, {nheads_kv}){also}, "
                             f"got {tuple(d.shape)}")
        check_device(name, d, q.device)
    if torch.is_grad_enabled():
        for name, d in given:
            if d.requires_grad:
                raise ValueError(f"{name} requires grad, but FP8 attention is forward only (no gradients)")


def checked_descales(q, k, v, q_descale, k_descale, v_descale, batch: int):
    """(q_descale, k_descale, v_descale) for FP8 inputs (checked; inputs must not require grad), else None (and
    no descale may be given)."""
    _check_descales(q, q_descale, k_descale, v_descale, batch, k.shape[-2])
    if q.dtype != FP8_DTYPE:
        return None
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.requires_grad:
                raise ValueError(f"{name} requires grad, but FP8 attention (float8_e4m3fn inputs) is forward only")
    return q_descale, k_descale, v_descale


def check_cu_seqlens_layout(name: str, cu, batch: Optional[int], max_seqlen, max_name: str, device) -> int:
    """Type, shape and device of one cu_seqlens tensor (no host sync); returns its batch size."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of length batch + 1, got shape {tuple(cu.shape)}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} must have length batch + 1 = {batch + 1} (like cu_seqlens_q), got {cu.numel()}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}), got {cu.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise TypeError(f"{max_name} must be an int >= 0, got {max_seqlen!r}")
    return cu.numel() - 1


# The cu_seqlens tensors whose values passed check_cu_seqlens_values: id -> (weakref, data_ptr, version counter,
# total, max_seqlen) at that check. A model's layers (and a benchmark's loop) pass one cu_seqlens tensor to every
# call of a step: it is read back once, not once a layer (a host sync and five small kernels each time).
_CHECKED_CU_SEQLENS: dict = {}


def _cu_key(cu: torch.Tensor, total: int, max_seqlen: int) -> Optional[tuple]:
    """What a passed check of cu against (total, max_seqlen) depends on, or None where it cannot be known: an
    inference-mode tensor keeps no version counter, so a write into it would go unseen."""
    if cu.is_inference():
        return None
    return (cu.data_ptr(), cu._version, total, max_seqlen)


def _checked_before(cu: torch.Tensor, total: int, max_seqlen: int) -> bool:
    entry = _CHECKED_CU_SEQLENS.get(id(cu))
    return entry is not None and entry[0]() is cu and entry[1:] == _cu_key(cu, total, max_seqlen)


def _remember_checked(cu: torch.Tensor, total: int, max_seqlen: int) -> None:
    key = _cu_key(cu, total, max_seqlen)
    if key is not None:
        ident = id(cu)
        ref = weakref.ref(cu, lambda _, ident=ident: _CHECKED_CU_SEQLENS.pop(ident, None))
        _CHECKED_CU_SEQLENS[ident] = (ref, *key)


def check_cu_seqlens_values(cu_checks, recheck: bool = False):
    """cu_checks: [(name, cu, total, max_seqlen, max_name)]. Starts at 0, non-decreasing, ends at the packed tokens,
    longest sequence <= max_seqlen. One host sync for all of them (skipped while torch.compile traces), and none
    where each cu already passed against the same total and max_seqlen and has not been written since (its version
    counter: every in-place torch op on it or a view bumps it; writes from outside torch - a kernel given its
    address - do not, so recheck=True checks again). Inference-mode tensors are checked on every call."""
    if torch.compiler.is_compiling() or cu_checks[0][1].numel() < 2:
        return
    if not recheck and all(_checked_before(cu, total, max_seqlen) for _, cu, total, max_seqlen, _ in cu_checks):
        return
    stats = []
    for _, cu, _, _, _ in cu_checks:
        lens = cu[1:] - cu[:-1]
        stats.append(torch.stack([cu[0], cu[-1], lens.min(), lens.max()]))
    for (name, cu, total, max_seqlen, max_name), (first, last, min_len, max_len) in zip(
            cu_checks, torch.stack(stats).tolist()):
        if first != 0 or min_len < 0:
            raise ValueError(f"{name} must start at 0 and be non-decreasing, got {cu.tolist()}")
        if last != total:  # fewer: rows outside every sequence would be left unwritten
            raise ValueError(f"{name}[-1] = {last} must equal the {total} packed tokens")
        if max_len > max_seqlen:
            raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest sequence ({max_len}) "
                             f"in {name}")
    for _, cu, total, max_seqlen, _ in cu_checks:
        _remember_checked(cu, total, max_seqlen)


def check_batch(q, k):
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k/v batch ({k.shape[0]}) must equal q's batch ({q.shape[0]})")


def is_default_window(window_size) -> bool:
    """window_size is the default: the default object, or a tuple of the ints -1, -1 (flash_attn_interface passes
    its own). Types first: comparing other objects could call their __eq__."""
    return window_size is NO_WINDOW or (type(window_size) is tuple and len(window_size) == 2
                                         and type(window_size[0]) is int and type(window_size[1]) is int
                                         and window_size[0] == -1 and window_size[1] == -1)


def check_alibi_slopes(alibi_slopes, batch: int, nheads: int, device):
    """alibi_slopes: None, or a float32 (nheads,) or (batch, nheads) tensor on ``device`` (ValueError / TypeError
    naming it), one slope per QUERY head (the rows of one kv group get their own); returns it as given."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a float32 torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = ({batch}, "
                         f"{nheads}), got {tuple(alibi_slopes.shape)}")
    check_device("alibi_slopes", alibi_slopes, device)
    return alibi_slopes
