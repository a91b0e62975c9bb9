"""flash_attn / flash_attn_varlen: input checks, the launch configuration, autograd and torch.library registration.

Public API (flash-attn compatible shapes and names):
  flash_attn(q, k, v, *, causal, softmax_scale, window_size, softcap, return_lse, deterministic, config,
             q_descale, k_descale, v_descale, alibi_slopes)
      q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_kv, headdim) -> out like q
      [, lse (batch, nheads, seqlen_q) float32, natural log].
  flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, same options)
      q (total_q, nheads, headdim), k/v (total_k, nheads_kv, headdim), int32 cu_seqlens (batch + 1,)
      -> out like q [, lse (nheads, total_q)].

Both are differentiable in q, k, v (lse is returned as a non-differentiable output, like flash-attn), except with
FP8 (float8_e4m3fn) inputs, which are forward only (FA3's FP8 API: q/k/v_descale (batch, nheads_kv) float32, out
bfloat16). alibi_slopes adds flash-attn's ALiBi bias in the forward and the backward. The forward
and backward are torch.library custom ops (flashdecode::attn_fwd / attn_bwd) with fake implementations, so
torch.compile traces them without a graph break; _FlashAttnFunction ties them together for autograd.

Every launch decision lives in one flashdecode.AttentionConfig, resolved by heuristics.resolve_attention_config
from the problem and the device (or given with ``config=``). The host path is cached per launch key (shapes,
strides, dtype, alignment, mask flags, configuration): a repeated call checks its options, allocates its outputs
and launches the compiled kernel it used last time directly (_Kernel), skipping the autotuner's and the JIT's
per-call argument binding. Dense forwards go through one cache from the call's key to its ready forward (the
Gluon plan or the Triton kernel with its fixed arguments, _DenseCall): a repeated eager flash_attn call with plain
options builds that key, allocates out (and lse only where it is wanted: return_lse or autograd; otherwise the
kernel writes it to a per-device buffer nobody reads, ops/direct_launch.py) and calls the compiled kernel's C
launcher with the pointers as ints (docs/decisions.md, "Dense call cache"). FLASHDECODE_AUTOTUNE=0 (read when a
configuration is resolved) turns autotuning off: the first candidate tile that fits shared memory runs.

Inputs may have any strides (e.g. q, k, v as views of one packed qkv tensor): strides go to the kernels, nothing is
copied. Off the GPU the kernels run only in Triton's CPU interpreter (TRITON_INTERPRET=1); plain CPU tensors
otherwise raise (use flashdecode.reference for a pure-PyTorch CPU path).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Callable, Optional

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensor

from flashdecode import heuristics
from flashdecode.config import AttentionConfig, AttentionProblem
from flashdecode.ops import checks, direct_launch, gluon_attention
from flashdecode.ops.fp8_v_transpose import fp8_v_transposed
from flashdecode.kernels import bwd as bwd_kernels
from flashdecode.kernels import fwd as fwd_kernels

__all__ = ["flash_attn", "flash_attn_varlen", "AUTOTUNE_ENV"]

SUPPORTED_DTYPES = checks.FLOAT_DTYPES
FP8_DTYPE = torch.float8_e4m3fn  # forward only, with q/k/v descales (FA3's FP8 API); output bfloat16
FP8_OUT_DTYPE = torch.bfloat16
MAX_HEAD_DIM = checks.MAX_HEAD_DIM
LOG2E = checks.LOG2E
# The one environment variable of this module: "0" = no autotuning (the first candidate that fits runs).
AUTOTUNE_ENV = "FLASHDECODE_AUTOTUNE"
cdiv = heuristics.cdiv  # pure Python: triton.cdiv is a constexpr function, ~10x slower on the host
_INT32_MAX = 2 ** 31 - 1  # window bounds are clamped to it: a huge window means "unbounded", and stays an i32
_LAUNCH_CACHE_SIZE = 4096  # launch keys kept per direction (a dict cleared when full: keys are cheap to rebuild)
_NO_WINDOW = (-1, -1)  # the default window_size: the options' fast checks pass it by identity


# os.environ's own bytes dict on POSIX: the switches below are read per call (the dense call cache's key holds
# them), so one dict lookup each instead of checks.env_value's decoding (the same answers: "1" and "0" are ASCII)
_ENVIRON_GET = checks._ENVIRON_DATA.get if checks._ENVIRON_BYTES else None
_INTERPRET_NAME, _AUTOTUNE_NAME = b"TRITON_INTERPRET", AUTOTUNE_ENV.encode()


def _interpreting() -> bool:
    if _ENVIRON_GET is not None:
        return _ENVIRON_GET(_INTERPRET_NAME) == b"1"
    return checks.interpreting()


def _autotune_enabled() -> bool:
    if _ENVIRON_GET is not None:
        return _ENVIRON_GET(_AUTOTUNE_NAME) != b"0"
    return checks.env_value(AUTOTUNE_ENV, "1") != "0"


# ----------------------------------------------------------------------------------------------------------------
# Input validation (ValueError / TypeError naming the argument; never asserts)
# ----------------------------------------------------------------------------------------------------------------

def _check_tensor_args(q, k, v, ndim: int, layout: str):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES and t.dtype != FP8_DTYPE:
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
    if q.device.type == "cpu" and not checks.interpreting():
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


# (shapes, dtypes, devices, interpreter flag) of q, k, v that passed _check_tensor_args: a repeated call skips it
_CHECKED_TENSORS: set = set()


def _check_tensors_once(q, k, v, ndim: int, layout: str):
    """_check_tensor_args, skipped for a (layout, shape, dtype, device) signature that already passed (the checks
    read nothing else; the layout keeps a varlen call's 3-D shapes from passing for flash_attn)."""
    try:
        key = (ndim, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               type(q), type(k), type(v), q.device.type == "cpu" and checks.interpreting())
    except AttributeError:  # not tensors: the full check names the argument
        key = None
    if key is None or key not in _CHECKED_TENSORS:
        _check_tensor_args(q, k, v, ndim, layout)
        if key is not None:
            if len(_CHECKED_TENSORS) >= _LAUNCH_CACHE_SIZE:
                _CHECKED_TENSORS.clear()
            _CHECKED_TENSORS.add(key)


def _check_options(causal, softmax_scale, window_size, softcap, deterministic=True):
    """The shared checks, in this order; the common values (bools, no scale, the default window, softcap 0.0) pass
    without a call."""
    if causal is not True and causal is not False:
        checks.check_bool("causal", causal)
    if deterministic is not True and deterministic is not False:
        checks.check_bool("deterministic", deterministic)
    if softmax_scale is not None:
        checks.check_softmax_scale(softmax_scale)
    if window_size is not _NO_WINDOW:
        checks.check_window(window_size)
    if type(softcap) is not float or softcap != 0.0:
        checks.check_softcap(softcap)


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
        checks.check_device(name, d, q.device)
    if torch.is_grad_enabled():
        for name, d in given:
            if d.requires_grad:
                raise ValueError(f"{name} requires grad, but FP8 attention is forward only (no gradients)")


def _checked_descales(q, k, v, q_descale, k_descale, v_descale, batch: int):
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


def _check_alibi(alibi_slopes, batch: int, nheads: int, device):
    """alibi_slopes None, float32 (nheads,) or (batch, nheads) on q's device. Returns the slopes with a unit head
    stride, detached (the bias is a constant: no gradient flows to the slopes, as in flash-attn)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a float32 torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = ({batch}, "
                         f"{nheads}), got {tuple(alibi_slopes.shape)}")
    checks.check_device("alibi_slopes", alibi_slopes, device)
    slopes = alibi_slopes.detach()
    return slopes if slopes.stride(-1) == 1 else slopes.contiguous()


def _check_cu_seqlens_layout(name: str, cu, batch: Optional[int], max_seqlen, max_name: str, device) -> int:
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


def _check_cu_seqlens_values(checks):
    """checks: [(name, cu, total, max_seqlen, max_name)]. Starts at 0, non-decreasing, ends at the packed tokens,
    longest sequence <= max_seqlen. One host sync for all of them (skipped while torch.compile traces)."""
    if torch.compiler.is_compiling() or checks[0][1].numel() < 2:
        return
    stats = []
    for _, cu, _, _, _ in checks:
        lens = cu[1:] - cu[:-1]
        stats.append(torch.stack([cu[0], cu[-1], lens.min(), lens.max()]))
    for (name, cu, total, max_seqlen, max_name), (first, last, min_len, max_len) in zip(
            checks, torch.stack(stats).tolist()):
        if first != 0 or min_len < 0:
            raise ValueError(f"{name} must start at 0 and be non-decreasing, got {cu.tolist()}")
        if last != total:  # fewer: rows outside every sequence would be left unwritten
            raise ValueError(f"{name}[-1] = {last} must equal the {total} packed tokens")
        if max_len > max_seqlen:
            raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest sequence ({max_len}) "
                             f"in {name}")


def _normalise_options(headdim, causal, softmax_scale, window_size, softcap):
    scale = headdim ** -0.5 if softmax_scale is None else float(softmax_scale)
    if window_size is _NO_WINDOW:
        left, right = -1, -1
    else:
        left, right = min(int(window_size[0]), _INT32_MAX), min(int(window_size[1]), _INT32_MAX)
    return scale, left, 0 if causal else right, float(softcap)


# ----------------------------------------------------------------------------------------------------------------
# The configuration: resolved once per problem, or given (config=); interned so custom ops can carry it as an int
# ----------------------------------------------------------------------------------------------------------------

_GIVEN_CONFIGS: list[AttentionConfig] = []
_GIVEN_CONFIG_IDS: dict[AttentionConfig, int] = {}
_RESOLVE_CONFIG = -1  # config id meaning "resolve from the problem"


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionConfig))


def _config_id(config) -> int:
    """An int that stands for ``config`` across the torch.library op boundary (-1: None, resolve it). Under
    torch.compile the config reaches the interning as a tuple of its field values: an assume_constant_result
    function runs while tracing (its result is a constant of the graph, so the config is interned before the graph
    runs), and torch 2.11's Dynamo can hand it only constants such as tuples, not a dataclass instance."""
    if config is None:
        return _RESOLVE_CONFIG
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be a flashdecode.AttentionConfig or None, got {type(config).__name__}")
    if torch.compiler.is_compiling():
        return _config_id_of_fields(tuple([getattr(config, name) for name in _CONFIG_FIELDS]))
    return _intern_config(config)


def _config_id_of_fields(fields: tuple) -> int:
    return _intern_config(AttentionConfig(*fields))


# torch._dynamo.assume_constant_result's whole effect (torch 2.4-2.13), without importing torch._dynamo: `import
# flashdecode` must not pay for Dynamo (about a second) where nothing is compiled
_config_id_of_fields._dynamo_marked_constant = True


def _intern_config(config: AttentionConfig) -> int:
    found = _GIVEN_CONFIG_IDS.get(config)
    if found is None:
        config.check()
        found = _GIVEN_CONFIG_IDS[config] = len(_GIVEN_CONFIGS)
        _GIVEN_CONFIGS.append(config)
    return found


def _head_dim_pad(headdim: int, dtype: Optional[torch.dtype] = None) -> int:
    """Head dim padded to a power of two >= the smallest GPU dot depth (16 for 16/32-bit operands, 32 for fp8)."""
    return max(32 if dtype == FP8_DTYPE else 16, heuristics.next_power_of_2(headdim))


@functools.lru_cache(maxsize=None)
def _device_facts(device: torch.device) -> tuple[int, int]:
    """(shared memory per block in bytes, compute capability major) of a CUDA device, cached: no per-call
    driver queries on the launch path."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 227 * 1024)), props.major


_resolve_cached = functools.lru_cache(maxsize=1024)(heuristics.resolve_attention_config)


def attention_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_k: int,
                      deterministic: bool = True) -> AttentionProblem:
    """The AttentionProblem of a call with these q, k, v (any layout flash_attn or flash_attn_varlen takes)."""
    interpret = _interpreting()
    smem, major = _device_facts(q.device) if q.is_cuda and not interpret else (227 * 1024, 0)
    return AttentionProblem(head_dim_pad=_head_dim_pad(q.shape[-1], q.dtype), elem_bytes=q.element_size(),
                            max_seqlen_k=max_seqlen_k, deterministic=deterministic,
                            tma_layout=_tma_layout_ok(q, k, v), capability_major=major, smem_limit=smem,
                            interpret=interpret, autotune=_autotune_enabled())


def resolve_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_k: Optional[int] = None,
                   deterministic: bool = True) -> AttentionConfig:
    """The AttentionConfig flash_attn (max_seqlen_k None: k.shape[1]) or flash_attn_varlen would use for these
    inputs: the starting point of a ``dataclasses.replace`` override."""
    if max_seqlen_k is None:
        if k.dim() != 4:
            raise ValueError("max_seqlen_k is required for varlen (3-D) k")
        max_seqlen_k = k.shape[1]
    return _resolve_cached(attention_problem(q, k, v, max_seqlen_k, deterministic))


def _config_for(config_id: int, q, k, v, max_seqlen_k: int, deterministic: bool) -> AttentionConfig:
    if config_id >= 0:
        return _GIVEN_CONFIGS[config_id]
    return resolve_config(q, k, v, max_seqlen_k, deterministic)


def _tma_layout_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need a unit head-dim stride, 16-byte aligned base and row strides, and >= 16-byte rows."""
    for t in tensors:
        elem = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or t.shape[-1] * elem < 16:
            return False
        if any((st * elem) % 16 for st in t.stride()[:-1]):
            return False
    return True


# ----------------------------------------------------------------------------------------------------------------
# Kernel launches: autotuned on the GPU (one autotuner per tile list, shared by the launch keys that use it), one
# fixed tile in the interpreter; after its first GPU launch a launch key calls the compiled kernel directly
# ----------------------------------------------------------------------------------------------------------------

_AUTOTUNE_KEY = ["bucket_q", "bucket_k", "HEAD_DIM", "IS_VARLEN", "HAS_LEFT", "HAS_RIGHT", "SOFTCAP", "DOT_PRECISION",
                 "USE_TMA", "ATOMIC_DQ", "FUSED_DQ", "HAS_ALIBI", "PAGE_SIZE"]
# the tile constexprs of each kernel, in the order of a tile tuple (warps and stages follow them)
_FWD_TILE = ("BLOCK_M", "BLOCK_N")
_DKDV_TILE = ("BLOCK_N", "BLOCK_M")
_DQ_TILE = ("BLOCK_M", "BLOCK_N")
_FUSED_TILE = ("BLOCK_N", "BLOCK_M", "BLOCK_M2", "BLOCK_N2", "SPLIT_DKDV")


@functools.lru_cache(maxsize=None)
def _tuned(fn, tiles: tuple, names: tuple, autotune: bool, reset_dq: bool):
    """fn autotuned over ``tiles`` (only the first without autotune), keyed by shape buckets and mask flags.
    reset_dq: the atomic dQ buffer accumulates across launches, so it is zeroed before every timed candidate."""
    configs = [triton.Config(dict(zip(names, t)), num_warps=t[len(names)], num_stages=t[len(names) + 1])
               for t in tiles]
    if not autotune:
        configs = configs[:1]
    return triton.autotune(configs=configs, key=_AUTOTUNE_KEY, reset_to_zero=["DQ"] if reset_dq else None)(fn)


class _Kernel:
    """One kernel with its constexprs under one launch key (everything its compilation depends on is in the key).

    The first GPU launch goes through the autotuner and Triton's JIT and records the compiled kernel, the tile it
    ran and the constexpr tail of its argument list; later launches call the compiled kernel's launcher with the
    same arguments, skipping the per-call binding (tens of microseconds of host time). Launch arguments: the
    kernel's runtime parameters in order, as a tuple.
    """

    __slots__ = ("name", "fn", "tiles", "names", "autotune", "reset_dq", "constexprs", "use_tma", "meta", "tail",
                 "run", "function", "packed", "compiled", "direct")

    def __init__(self, name: str, fn, tiles: tuple, names: tuple, autotune: bool, constexprs: dict,
                 reset_dq: bool = False):
        self.name = name  # fwd, bwd_atomic, bwd_fused, bwd_dkdv or bwd_dq
        self.fn, self.tiles, self.names, self.autotune, self.reset_dq = fn, tiles, names, autotune, reset_dq
        self.constexprs = constexprs
        self.use_tma = bool(constexprs.get("USE_TMA"))  # descriptors need the allocator of the calling thread
        self.compiled = self.direct = None

    def __call__(self, grid_fn: Callable[[dict], tuple], args: tuple, device: torch.device):
        if self.compiled is not None:
            self.launch(grid_fn(self.meta), args + self.tail, device)
            return
        if self.use_tma:
            _ensure_triton_allocator()
        if _interpreting():
            meta = dict(zip(self.names, self.tiles[0]))
            self.fn[grid_fn(meta)](*args, **self.constexprs, **meta)
            return
        tuned = _tuned(self.fn, self.tiles, self.names, self.autotune, self.reset_dq)
        if device.index == _current_device():
            compiled = tuned[grid_fn](*args, **self.constexprs)
        else:
            with torch.cuda.device(device):
                compiled = tuned[grid_fn](*args, **self.constexprs)
        self._record(tuned, compiled, len(args))

    def launch(self, grid: tuple, full: tuple, device: torch.device):
        """A launch of the compiled kernel (after the first) on ``grid`` (3 entries) with every kernel parameter
        (``full``: the runtime arguments, pointers as tensors or data_ptr() ints, then self.tail)."""
        if device.index == _current_device():
            self._launch_compiled(grid, full, device)
        else:
            with torch.cuda.device(device):
                self._launch_compiled(grid, full, device)

    def _launch_compiled(self, grid: tuple, full: tuple, device: torch.device):
        stream = _current_stream(device.index)
        enter, exit_ = direct_launch.launch_hooks()
        if enter is None and self.direct is not None:
            self.direct(grid, stream, device, full)
            return
        if self.use_tma:
            _ensure_triton_allocator()
        meta = None if enter is None else self.compiled.launch_metadata(grid, stream, *full)
        self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed, meta, enter, exit_, *full)

    def _record(self, tuned, compiled, nargs: int):
        """Keep what a direct launch needs; anything unexpected leaves the key on the autotuner's path."""
        if hasattr(compiled, "result"):  # asynchronous compilation
            compiled = compiled.result()
        best = getattr(tuned, "best_config", None)
        if best is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata",
                                                                   "launch_metadata")):
            return
        values = {**self.constexprs, **best.kwargs}
        tail = []
        for param in self.fn.params[nargs:]:
            if param.name in values:
                tail.append(values[param.name])
            elif param.has_default:
                tail.append(param.default)
            else:
                return
        self.meta, self.tail = dict(best.kwargs), tuple(tail)
        self.run, self.function, self.packed = compiled.run, compiled.function, compiled.packed_metadata
        self.direct = direct_launch.PlainLauncher.of(compiled)  # None: Triton's launcher (self.run)
        self.compiled = compiled


_current_stream = direct_launch.current_stream
_current_device = direct_launch.current_device

_ALLOCATOR_SET = threading.local()


@functools.lru_cache(maxsize=None)
def _scratch_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"  # "cuda": the current device (Triton's convention)


def _scratch_allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device=_scratch_device())


def _ensure_triton_allocator():
    """Device-side tensor descriptors live in a small global scratch that Triton asks an allocator for.

    Triton keeps the allocator in a ContextVar, i.e. per thread: autograd runs the backward of CUDA tensors on its
    own worker thread, which never saw the forward's set_allocator, so the flag is per thread too."""
    if not getattr(_ALLOCATOR_SET, "done", False):
        triton.set_allocator(_scratch_allocator)
        _ALLOCATOR_SET.done = True


# ----------------------------------------------------------------------------------------------------------------
# Launch plans: everything a call's launches depend on besides the data, cached per launch key
# ----------------------------------------------------------------------------------------------------------------

def _strides(x: torch.Tensor, varlen: bool) -> tuple:
    """(batch, seq, head, dim) strides; a packed varlen tensor has batch stride 0 (sequences start at cu_seqlens)."""
    if varlen:
        return (0,) + x.stride()
    return x.stride()


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple:
    """(batch, head) strides of a contiguous lse-like tensor (unit row stride): dense (batch, nheads, seqlen_q),
    varlen (nheads, total_q)."""
    if varlen:
        return 0, lse.shape[1]
    return lse.shape[1] * lse.shape[2], lse.shape[2]


def _aligned(*tensors) -> int:
    """Bit i set: tensor i's data pointer is 16-byte aligned (Triton specialises pointer arguments on it); None
    tensors count as aligned (their argument is a constexpr None either way)."""
    bits = 0
    for i, t in enumerate(tensors):
        if t is None or t.data_ptr() % 16 == 0:
            bits |= 1 << i
    return bits


def _launch_key(q, k, v, strides, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right, softcap,
                config_id, alibi_slopes=None, alibi_stride=0, v_descale=None):
    """What the configuration, the kernel choice and Triton's specialisation of a call depend on: shapes, strides
    (of q, k, v), dtype, device, pointer alignment, mask flags, the configuration and the autotune switch; for
    varlen tensors, whose packed lengths stay out of it, the shape buckets and length class of max_seqlen_q/k
    (dense shapes imply them). ALiBi adds its flag and batch stride; FP8 the v_descale's alignment (the product
    q_descale * k_descale is a fresh tensor)."""
    extra = () if alibi_slopes is None and v_descale is None else (
        alibi_slopes is not None, alibi_stride, _aligned(alibi_slopes, v_descale))
    if cu_seqlens_q is None:
        return (q.shape, k.shape, strides, q.dtype, q.device, _aligned(q, k, v), left >= 0, right >= 0,
                softcap > 0.0, config_id, _autotune_enabled()) + extra
    return (q.shape[1:], k.shape[1:], strides, q.dtype, q.device, _aligned(q, k, v, cu_seqlens_q, cu_seqlens_k),
            left >= 0, right >= 0, softcap > 0.0, config_id, _autotune_enabled(),
            heuristics.seqlen_bucket(max_seqlen_q), heuristics.seqlen_bucket(max_seqlen_k),
            heuristics.prefill_length_class(max_seqlen_k)) + extra


def _buckets(max_seqlen_q: int, max_seqlen_k: int) -> tuple[int, int]:
    """The autotune-key arguments bucket_q, bucket_k (a plan stores them: its key implies them)."""
    return heuristics.seqlen_bucket(max_seqlen_q), heuristics.seqlen_bucket(max_seqlen_k)


def _common_constexprs(headdim, varlen, left, right, softcap, dtype, has_alibi=False):
    constexprs = dict(HEAD_DIM=headdim, HEAD_DIM_PAD=_head_dim_pad(headdim, dtype), IS_VARLEN=varlen,
                      HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=softcap > 0.0,
                      DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
    if has_alibi:  # only when on: the kernels' defaults are off, so other launches keep their exact constexprs
        constexprs["HAS_ALIBI"] = True
    return constexprs


def _scale_args(scale: float, softcap: float):
    """(qk_scale, softcap_log2) as fwd.logits_log2 expects them."""
    if softcap > 0.0:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


def _shape_info(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
    varlen = cu_seqlens_q is not None
    if varlen:
        return varlen, cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1]
    return varlen, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2]


def _gluon_allowed(config_id: int) -> bool:
    """Whether the dispatch may take the Gluon kernels: without config=, or with a config whose backend is
    "gluon" (the resolved one on sm_90); backend "triton" pins the Triton kernels."""
    return config_id == _RESOLVE_CONFIG or _GIVEN_CONFIGS[config_id].backend == "gluon"


def _bounded_put(cache: dict, key, value):
    if len(cache) >= _LAUNCH_CACHE_SIZE:
        cache.clear()
    cache[key] = value
    return value


class _FwdPlan:
    """The forward of one launch key: its configuration and kernel."""

    __slots__ = ("config", "kernel", "buckets")

    def __init__(self, q, k, v, out, cu_seqlens_q, max_seqlen_q, max_seqlen_k, left, right, softcap, config_id,
                 has_alibi=False, v_layout=None):
        """v_layout: the tensor whose layout the V loads see (FP8: the transposed copy), default v."""
        varlen = cu_seqlens_q is not None
        self.buckets = _buckets(max_seqlen_q, max_seqlen_k)
        self.config = _config_for(config_id, q, k, v, max_seqlen_k, True)
        use_tma = self.config.fwd_tma and _tma_layout_ok(q, k, v if v_layout is None else v_layout, out)
        constexprs = _common_constexprs(q.shape[-1], varlen, left, right, softcap, q.dtype, has_alibi)
        constexprs["USE_TMA"] = use_tma
        if q.dtype == FP8_DTYPE:
            constexprs["IS_FP8"] = True
            if _interpreting():  # the interpreter's fp32 -> e4m3 cast mis-rounds (see fwd.round_to_e4m3)
                constexprs["FP8_SOFT_ROUND"] = True
        self.kernel = _Kernel("fwd", fwd_kernels.attn_fwd_kernel, self.config.fwd_tiles, _FWD_TILE,
                              self.config.fwd_autotune, constexprs)


class _BwdPlan:
    """The backward of one launch key (with dout's layout and the determinism flag): its configuration and
    kernels (the atomic dK/dV kernel, the one-launch kernel, or the dK/dV and dQ kernels)."""

    __slots__ = ("config", "mode", "delta", "dkdv", "dq", "buckets")

    def __init__(self, q, k, v, dout, cu_seqlens_q, max_seqlen_q, max_seqlen_k, left, right, softcap, deterministic,
                 config_id, has_alibi=False):
        varlen = cu_seqlens_q is not None
        self.buckets = _buckets(max_seqlen_q, max_seqlen_k)
        config = self.config = _config_for(config_id, q, k, v, max_seqlen_k, deterministic)
        # the interpreter has descriptor loads but no descriptor reduction (the atomic dQ path)
        use_tma = (config.bwd_tma and _tma_layout_ok(q, k, v, dout)
                   and (deterministic or not _interpreting()))
        constexprs = _common_constexprs(q.shape[-1], varlen, left, right, softcap, q.dtype, has_alibi)
        constexprs["USE_TMA"] = use_tma
        fn = bwd_kernels.attn_bwd_dkdv_kernel
        # the preprocess: (BLOCK_M, warps, stages) as a plain launch would take them
        self.delta = _Kernel("bwd_delta", bwd_kernels.attn_bwd_delta_kernel,
                             ((64 if q.shape[-1] <= 128 else 32, 4, 3),), ("BLOCK_M",), False,
                             dict(HEAD_DIM=q.shape[-1], HEAD_DIM_PAD=_head_dim_pad(q.shape[-1]), IS_VARLEN=varlen))
        self.dq = None
        if not deterministic:
            self.mode = "atomic"
            self.dkdv = _Kernel("bwd_atomic", fn, config.bwd_atomic_tiles, _DKDV_TILE, config.bwd_autotune,
                                dict(constexprs, ATOMIC_DQ=True), reset_dq=True)
        elif config.bwd_fused:
            self.mode = "fused"
            self.dkdv = _Kernel("bwd_fused", fn, config.bwd_fused_tiles, _FUSED_TILE, config.bwd_autotune,
                                dict(constexprs, FUSED_DQ=True))
        else:
            self.mode = "two_pass"
            self.dkdv = _Kernel("bwd_dkdv", fn, config.bwd_dkdv_tiles, _DKDV_TILE, config.bwd_autotune, constexprs)
            self.dq = _Kernel("bwd_dq", bwd_kernels.attn_bwd_dq_kernel, config.bwd_dq_tiles, _DQ_TILE,
                              config.bwd_autotune, constexprs)


_FWD_PLANS: dict = {}
_BWD_PLANS: dict = {}


def _fwd_plan(q, k, v, v_kernel, out, strides, cu_seqlens_q, cu_seqlens_k, sq, sk, left, right, softcap, config_id,
              alibi_slopes=None, alibi_stride=0, v_descale=None, v_layout=None) -> _FwdPlan:
    """The Triton forward plan of this launch key (built on its first call)."""
    key = _launch_key(q, k, v_kernel, strides, cu_seqlens_q, cu_seqlens_k, sq, sk, left, right, softcap, config_id,
                      alibi_slopes, alibi_stride, v_descale)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        plan = _bounded_put(_FWD_PLANS, key, _FwdPlan(q, k, v, out, cu_seqlens_q, sq, sk, left, right, softcap,
                                                      config_id, alibi_slopes is not None, v_layout))
    return plan


# ----------------------------------------------------------------------------------------------------------------
# Dense forwards (no FP8, no ALiBi): one cache from a call's signature to its ready forward, shared by flash_attn's
# eager path and the forward op
# ----------------------------------------------------------------------------------------------------------------

_DENSE_CALLS: dict = {}


def _dense_key(q, k, v, left: int, right: int, softcap: float, config_id: int,
               ptrs: Optional[tuple] = None) -> tuple:
    """What a dense forward's launch depends on besides the data: shapes, strides, dtypes and devices of q, k, v
    (with the tensor checks' inputs among them, so a hit also stands for checks passed), each pointer's 16-byte
    alignment (Triton specialises on it; TMA needs it), the mask flags (right == 0 apart: the Gluon kernel takes
    causal but no other window), the softcap flag, the configuration and the interpreter and autotune switches.
    ptrs: (q, k, v).data_ptr() where the caller has them (it hands them on to the launch)."""
    qp, kp, vp = (q.data_ptr(), k.data_ptr(), v.data_ptr()) if ptrs is None else ptrs
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, qp % 16 == 0, kp % 16 == 0, vp % 16 == 0, left >= 0, right >= 0, right == 0,
            softcap > 0.0, config_id, _interpreting(), _autotune_enabled())


class _DenseCall:
    """The forward of one dense call key with everything but the data resolved: on Hopper the Gluon plan where
    the dispatch sends the call there (ops/gluon_attention.py, docs/decisions.md; an explicit config= keeps the
    Triton kernels), else the Triton kernel with its grid and the kernel arguments the key fixes. A repeated call
    allocates out (and lse where wanted) and launches. q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k,
    nheads_kv, headdim), fp16 / bf16 / fp32, checked."""

    __slots__ = ("gluon", "kernel", "grid", "lse_shape", "empty", "fixed", "buckets", "calls", "device", "bound",
                 "discard_lse", "default_scale", "lse_template")

    def __init__(self, q, k, v, left: int, right: int, softcap: float, config_id: int):
        batch, sq, nheads, _ = q.shape
        sk, nheads_kv = k.shape[1], k.shape[2]
        self.lse_shape = (batch, nheads, sq)
        self.lse_template = direct_launch.empty_template(self.lse_shape, torch.float32, q.device)
        self.empty = q.numel() == 0
        self.device = q.device
        self.default_scale = q.shape[3] ** -0.5  # softmax_scale None
        self.gluon = self.bound = self.discard_lse = None
        if _gluon_allowed(config_id) and not self.empty:
            self.gluon = gluon_attention.dispatch_plan(q, k, v, left, right, softcap)
        self.calls = 0  # forwards run through this entry (the host-path tests read it)
        if self.gluon is not None or self.empty:
            return
        out = torch.empty_like(q)  # the layout of every call's out under this key: its strides are fixed too
        strides = (q.stride(), k.stride(), v.stride())
        plan = _fwd_plan(q, k, v, v, out, strides, None, None, sq, sk, left, right, softcap, config_id)
        self.kernel, self.buckets = plan.kernel, plan.buckets
        self.fixed = (*strides, out.stride(), (nheads * sq, sq), nheads // nheads_kv, sq, sk, batch, k.shape[0])
        self.grid = lambda meta: (cdiv(sq, meta["BLOCK_M"]), nheads, batch)

    def forward(self, q, k, v, scale: float, left: int, right: int, softcap: float, need_lse: bool = True,
                ptrs: Optional[tuple] = None):
        """(out like q, lse (batch, nheads, seqlen_q) float32) of q, k, v under this key; need_lse False: lse is
        None (the kernel writes it where nobody reads it, direct_launch.discard_buffer, where it can). ptrs: (q, k,
        v).data_ptr() where the caller has them."""
        self.calls += 1
        if self.gluon is not None:
            return gluon_attention.run_plan(self.gluon, q, k, v, scale, need_lse, ptrs)
        out = torch.empty_like(q)
        bound = self.bound
        if bound is None:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
            if self.empty:
                return out, lse.fill_(float("-inf"))
            qk_scale, softcap_log2 = _scale_args(scale, softcap)
            args = ((q, k, v, out, lse, None, None, None, None) + self.fixed
                    + ((qk_scale, softcap_log2), max(left, 0), max(right, 0), 0) + self.buckets + (None,))
            self.kernel(self.grid, args, q.device)
            self._bind()
            return out, lse
        lse = None
        lse_ptr = None if need_lse else self._lse_discard()
        if lse_ptr is None:
            lse = direct_launch.empty_from(self.lse_template, self.lse_shape, torch.float32, q.device)
            lse_ptr = lse.data_ptr()
        qk_scale, softcap_log2 = _scale_args(scale, softcap)
        grid, middle, end = bound
        if ptrs is None:
            ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        self.kernel.launch(grid, (*ptrs, out.data_ptr(), lse_ptr, *middle, (qk_scale, softcap_log2), max(left, 0),
                                  max(right, 0), *end), self.device)
        return out, lse

    def _bind(self):
        """After the kernel's first launch: its grid and the parts of its parameter list that the key fixes
        (around the pointers and the per-call scalars), for the direct launches of later calls."""
        kernel = self.kernel
        if kernel.compiled is not None:
            self.bound = (self.grid(kernel.meta), (None,) * 4 + self.fixed, (0, *self.buckets, None, *kernel.tail))

    def _lse_discard(self):
        """As _GluonPlan.lse_discard: the address the kernel may write an unwanted lse to, or None."""
        if self.discard_lse is None:
            nbytes = self.lse_shape[0] * self.lse_shape[1] * self.lse_shape[2] * 4
            buffer = direct_launch.discard_buffer(self.device, nbytes)
            self.discard_lse = False if buffer is None else buffer.data_ptr()
        return self.discard_lse or None


def _dense_call(q, k, v, left: int, right: int, softcap: float, config_id: int) -> _DenseCall:
    """The ready forward of this dense call's key (built on its first call; inputs already checked)."""
    key = _dense_key(q, k, v, left, right, softcap, config_id)
    call = _DENSE_CALLS.get(key)
    if call is None:
        call = _bounded_put(_DENSE_CALLS, key, _DenseCall(q, k, v, left, right, softcap, config_id))
    return call


def _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
              config_id=_RESOLVE_CONFIG, qk_descale=None, v_descale=None, alibi_slopes=None):
    """(out like q (bfloat16 for FP8 inputs), lse fp32) of one forward; see attn_fwd_op."""
    # scale > 0: the dense call cache may hold a Gluon plan, and the Gluon kernel masks scores before it scales
    # them (-inf * 0 is NaN; a negative scale turns the mask into +inf): other scales take the Triton kernel below
    if (cu_seqlens_q is None and alibi_slopes is None and qk_descale is None and q.dtype != FP8_DTYPE
            and scale > 0):
        return _dense_call(q, k, v, left, right, softcap, config_id).forward(q, k, v, scale, left, right, softcap)
    varlen, batch, sq, sk, nheads, nheads_kv = _shape_info(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    fp8 = q.dtype == FP8_DTYPE
    out = torch.empty(q.shape, dtype=FP8_OUT_DTYPE, device=q.device) if fp8 else torch.empty_like(q)
    lse = torch.empty((nheads, q.shape[0]) if varlen else (batch, nheads, sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or batch == 0 or sq == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    if varlen:  # the kernels read cu_seqlens with a unit stride
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
        # scale > 0: the Gluon kernel masks scores before it scales them (see the dense call above)
        if (not fp8 and alibi_slopes is None and _gluon_allowed(config_id) and scale > 0
                and gluon_attention.gluon_varlen_forward_into(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sq,
                                                              scale, left, right, softcap)):
            return out, lse  # the Gluon kernel on Hopper where it applies (ops/gluon_attention.py)
    v_layout, v_kernel, alibi_stride = None, v, 0
    if fp8:
        v_descale = v_descale.contiguous()
        if (not varlen and alibi_slopes is None and _gluon_allowed(config_id)
                and gluon_attention.gluon_fp8_forward_into(q, k, v, out, lse, qk_descale, v_descale, scale, left,
                                                           right, softcap)):
            return out, lse  # the e4m3 Gluon kernel on Hopper where it applies (ops/gluon_attention.py)
        v_layout, v_strides = fp8_v_transposed(v, varlen)  # V^T (docs/decisions.md)
        v_kernel = v_layout
    else:
        v_strides = _strides(v, varlen)
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        alibi_stride = alibi_slopes.stride(0)
    strides = (_strides(q, varlen), _strides(k, varlen), v_strides)
    plan = _fwd_plan(q, k, v, v_kernel, out, strides, cu_seqlens_q, cu_seqlens_k, sq, sk, left, right, softcap,
                     config_id, alibi_slopes, alibi_stride, v_descale, v_layout)
    qk_scale, softcap_log2 = _scale_args(scale, softcap)
    fp8_descales = None if qk_descale is None else (qk_descale, v_descale)
    args = (q, k, v_kernel, out, lse, cu_seqlens_q, cu_seqlens_k, fp8_descales,
            alibi_slopes, *strides, _strides(out, varlen), _lse_strides(lse, varlen),
            nheads // nheads_kv, sq, sk, q.shape[0], k.shape[0],
            (qk_scale, softcap_log2), max(left, 0), max(right, 0), alibi_stride, *plan.buckets, None)
    plan.kernel(lambda meta: (cdiv(sq, meta["BLOCK_M"]), nheads, batch), args, q.device)
    return out, lse


def _bwd_delta(plan, dout, out, lse, cu_seqlens_q, varlen, batch, sq, nheads):
    """FA-2's D = rowsum(dO * O): fp32, laid out like lse ((batch, nheads, seqlen_q) or (nheads, total_q)).
    Returns (delta, lse2): lse2 = lse * log2(e) with +inf for -inf, the backward kernels' lse."""
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    args = (out, dout, delta, cu_seqlens_q, lse, lse2, _strides(out, varlen), _strides(dout, varlen),
            _lse_strides(delta, varlen), _lse_strides(lse, varlen), sq, out.shape[0])
    plan.delta(lambda meta: (cdiv(sq, meta["BLOCK_M"]), nheads, batch), args, out.device)
    return delta, lse2


def _bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right,
              softcap, deterministic=True, config_id=_RESOLVE_CONFIG, alibi_slopes=None):
    """dq, dk, dv like q, k, v. deterministic: dK/dV and dQ computed by different programs, no atomics (bitwise
    reproducible), either in one launch (config.bwd_fused) or two; otherwise one dK/dV pass that adds dQ into an
    fp32 buffer with atomics, then scales and casts it."""
    varlen, batch, sq, sk, nheads, nheads_kv = _shape_info(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if batch == 0 or q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    if not varlen and alibi_slopes is None and _gluon_allowed(config_id):  # sm_90: the Gluon backward
        grads = gluon_attention.gluon_backward_if_supported(dout, q, k, v, out, lse, scale, left, right, softcap,
                                                           deterministic)
        if grads is not None:
            return grads
    if varlen:  # the kernels read cu_seqlens with a unit stride
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    lse = lse.contiguous()  # the kernels take lse's strides as those of a contiguous tensor (a no-op for ours)
    strides = (_strides(q, varlen), _strides(k, varlen), _strides(v, varlen))
    do_strides = _strides(dout, varlen)
    alibi_stride = alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
    key = (_launch_key(q, k, v, strides, cu_seqlens_q, cu_seqlens_k, sq, sk, left, right, softcap, config_id,
                       alibi_slopes, alibi_stride),
           do_strides, _aligned(dout), deterministic)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        plan = _bounded_put(_BWD_PLANS, key, _BwdPlan(q, k, v, dout, cu_seqlens_q, sq, sk, left, right, softcap,
                                                      deterministic, config_id, alibi_slopes is not None))
    # atomic mode: fp32 accumulator (contiguous, shape of q), zeroed; deterministic mode: the output itself
    dq = torch.empty_like(q) if deterministic else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    delta, lse2 = _bwd_delta(plan, dout, out, lse, cu_seqlens_q, varlen, batch, sq, nheads)
    qk_scale, softcap_log2 = _scale_args(scale, softcap)
    row_strides = (_lse_strides(lse2, varlen), _lse_strides(delta, varlen))
    tail = (nheads // nheads_kv, sq, sk, q.shape[0], k.shape[0], (qk_scale, softcap_log2, scale), max(left, 0),
            max(right, 0), alibi_stride, *plan.buckets)
    q_strides, k_strides, v_strides = strides
    dq_strides = _strides(dq, varlen)
    # the dK/dV kernel takes its lengths and strides grouped (kernels/bwd.py attn_bwd_dkdv_kernel)
    dkdv_strides = (q_strides, k_strides, v_strides, do_strides, _strides(dk, varlen), _strides(dv, varlen),
                    dq_strides) + row_strides
    dkdv_args = (q, k, v, dout, lse2, delta, dk, dv, dq, (cu_seqlens_q, cu_seqlens_k), alibi_slopes,
                 dkdv_strides) + tail
    if plan.mode == "atomic":
        plan.dkdv(lambda meta: (cdiv(sk, meta["BLOCK_N"]), nheads_kv, batch), dkdv_args, q.device)
        return dq.mul_(scale).to(q.dtype), dk, dv
    if plan.mode == "fused":
        def grid_pair(meta):  # one program per (KV block j, Q block j) pair: the longer of the two block counts
            kv_programs = cdiv(sk, meta["BLOCK_N"]) * (2 if meta["SPLIT_DKDV"] else 1)
            return max(kv_programs, cdiv(sq, meta["BLOCK_M2"])), nheads_kv, batch
        plan.dkdv(grid_pair, dkdv_args, q.device)
        return dq, dk, dv
    plan.dkdv(lambda meta: (cdiv(sk, meta["BLOCK_N"]), nheads_kv, batch), dkdv_args, q.device)
    dq_args = (q, k, v, dout, lse2, delta, dq, cu_seqlens_q, cu_seqlens_k, alibi_slopes, q_strides, k_strides,
               v_strides, do_strides, dq_strides) + row_strides + tail
    plan.dq(lambda meta: (cdiv(sq, meta["BLOCK_M"]), nheads, batch), dq_args, q.device)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------------
# torch.library custom ops (+ fake implementations for torch.compile) and autograd
# ----------------------------------------------------------------------------------------------------------------

@torch.library.custom_op("flashdecode::attn_fwd", mutates_args=())
def attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                window_left: int, window_right: int, softcap: float,
                config_id: int = -1, qk_descale: Optional[torch.Tensor] = None,
                v_descale: Optional[torch.Tensor] = None,
                alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward (dense when cu_seqlens_q is None, else varlen); window_right = 0 is causal. Returns (out, lse).
    config_id: -1 resolves the AttentionConfig inside the op, else the index of a config given to flash_attn.
    FP8 q/k/v: qk_descale = q_descale * k_descale per query head, float32 (batch, nheads) contiguous, and v_descale
    (batch, nheads_kv); out is bfloat16.
    alibi_slopes: float32 (nheads,) or (batch, nheads) with a unit last stride, or None."""
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                     window_right, softcap, config_id, qk_descale, v_descale, alibi_slopes)


@attn_fwd_op.register_fake
def _attn_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                   window_right, softcap, config_id=-1, qk_descale=None, v_descale=None, alibi_slopes=None):
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return torch.empty_like(q, dtype=FP8_OUT_DTYPE if q.dtype == FP8_DTYPE else q.dtype), lse


@torch.library.custom_op("flashdecode::attn_bwd", mutates_args=())
def attn_bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
                softcap: float, deterministic: bool = True, config_id: int = -1,
                alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward from the saved lse: (dq, dk, dv); deterministic (no atomics) unless told otherwise."""
    return _bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, window_left, window_right, softcap, deterministic, config_id, alibi_slopes)


@attn_bwd_op.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   window_left, window_right, softcap, deterministic=True, config_id=-1, alibi_slopes=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _tracing(x: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or isinstance(x, FakeTensor)


def _fwd(*args):
    """The forward op: through the registered custom op while torch.compile traces (so it sees one opaque node
    with a fake implementation), straight to the implementation in eager mode (the dispatcher layers of a
    torch.library op cost ~100 us per call, which is most of a short prefill)."""
    if _tracing(args[0]):
        return torch.ops.flashdecode.attn_fwd(*args)
    return _fwd_impl(*args)


def _bwd(*args):
    if _tracing(args[0]):
        return torch.ops.flashdecode.attn_bwd(*args)
    return _bwd_impl(*args)


class _FlashAttnFunction(torch.autograd.Function):
    """Autograd glue: forward saves (q, k, v, out, lse); backward recomputes P from lse (FA v1/v2).
    cu_seqlens_k None with cu_seqlens_q given means the same tensor (self-attention): torch.compile cannot trace
    an autograd.Function that gets one tensor twice."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
                deterministic, config_id, alibi_slopes):
        cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        out, lse = _fwd(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
                        config_id, None, None, alibi_slopes)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
        ctx.params = (max_seqlen_q, max_seqlen_k, scale, left, right, softcap, deterministic, config_id)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
        cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        dq, dk, dv = _bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_k, *ctx.params, alibi_slopes)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


class _DenseCallFunction(torch.autograd.Function):
    """_FlashAttnFunction for an eager dense call with plain options and its ready forward (the dense call cache's
    entry): the same forward and backward, five arguments instead of fourteen (autograd's apply walks every one).
    options: (softmax scale, window right: 0 causal / -1, deterministic, (q, k, v).data_ptr() or None)."""

    @staticmethod
    def forward(ctx, q, k, v, dense_call, options):
        scale, right, deterministic, ptrs = options
        out, lse = dense_call.forward(q, k, v, scale, -1, right, 0.0, True, ptrs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = (q.shape[1], k.shape[1], scale, -1, right, 0.0, deterministic, _RESOLVE_CONFIG)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _bwd(dout, q, k, v, out, lse, None, None, *ctx.params, None)
        return dq, dk, dv, None, None


def _c_apply(function):
    """``function``'s autograd apply in C (what torch.autograd.Function.apply calls last), or None where this torch
    lacks what _dense_autograd needs to stand in for Function.apply's Python part."""
    try:
        torch._C._are_functorch_transforms_active, torch._C._functorch.unwrap_if_dead  # noqa: B018
        return super(torch.autograd.Function, function).apply
    except AttributeError:
        return None


_DENSE_C_APPLY = _c_apply(_DenseCallFunction)


def _dense_autograd(q, k, v, call, options):
    """_DenseCallFunction.apply(q, k, v, call, options) without Function.apply's Python part where that part only
    unwraps dead functorch wrappers (no functorch transform active; the Function has no setup_context): the C apply
    it ends in, with q, k, v unwrapped the same way (~2 us less per call on the CPU)."""
    if _DENSE_C_APPLY is None or torch._C._are_functorch_transforms_active():
        return _DenseCallFunction.apply(q, k, v, call, options)
    unwrap = torch._C._functorch.unwrap_if_dead
    return _DENSE_C_APPLY(unwrap(q), unwrap(k), unwrap(v), call, options)


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
               deterministic, config_id, descales=None, alibi_slopes=None):
    """(out, lse): through autograd only when a gradient can flow (its Function costs host time per call).
    descales: FP8 inputs' (q_descale, k_descale, v_descale) (forward only, checked before), else None."""
    if descales is not None:
        q_descale, k_descale, v_descale = descales
        group = q.shape[-2] // k.shape[-2]
        if q_descale.shape[1] != q.shape[-2]:  # per kv head (FA3): the same factor for the group's query heads
            q_descale = q_descale.repeat_interleave(group, dim=1)
        qk_descale = q_descale * k_descale.repeat_interleave(group, dim=1)  # (batch, nheads), contiguous
        return _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
                    config_id, qk_descale, v_descale, alibi_slopes)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        same_cu = cu_seqlens_k is cu_seqlens_q and cu_seqlens_q is not None
        return _FlashAttnFunction.apply(q, k, v, cu_seqlens_q, None if same_cu else cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, scale, left, right, softcap, deterministic, config_id,
                                        alibi_slopes)
    return _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
                config_id, None, None, alibi_slopes)


def _check_sinks_alone(config, q, q_descale, alibi_slopes):
    """Sinks are composed outside the kernels with the default launch (ops/sinks.py): refuse what that path lacks."""
    if config is not None or q.dtype == FP8_DTYPE or q_descale is not None or alibi_slopes is not None:
        raise ValueError("sinks cannot be combined with config=, FP8 inputs (q_descale ...) or alibi_slopes")


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------

def _check_batch(q, k):
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k/v batch ({k.shape[0]}) must equal q's batch ({q.shape[0]})")


_DENSE_LAYOUT = "(batch, seqlen, nheads, headdim)"


def _no_window(window_size) -> bool:
    """window_size is the default: the default object, or a tuple of the ints -1, -1 (flash_attn_interface passes
    its own). Types first: comparing other objects could call their __eq__."""
    return window_size is _NO_WINDOW or (type(window_size) is tuple and len(window_size) == 2
                                         and type(window_size[0]) is int and type(window_size[1]) is int
                                         and window_size[0] == -1 and window_size[1] == -1)


def _plain_dense_call(q, k, v, causal, softmax_scale, window_size, softcap, return_lse, deterministic):
    """flash_attn's result for an eager dense call with plain options (bools, softmax_scale None or a finite
    float, the default window, softcap 0.0; no config, FP8, ALiBi or sinks) through the dense call cache, or None
    where flash_attn's general path runs instead (it checks everything and raises for bad input): other options,
    tensors that are not plain torch.Tensors (subclasses, FakeTensor), torch.compile tracing, FP8 inputs.

    A hit on the call's key stands for the tensor checks (the key holds everything they read); a miss runs them
    (or finds them passed for the same shapes, dtypes and devices), in flash_attn's order, before the entry is
    built. Autograd only where a gradient can flow (its Function costs
    host time per call)."""
    if (torch.compiler.is_compiling() or type(q) is not torch.Tensor or type(k) is not torch.Tensor
            or type(v) is not torch.Tensor or (window_size is not _NO_WINDOW and not _no_window(window_size))
            or type(softcap) is not float
            or softcap != 0.0 or (causal is not True and causal is not False)
            or (return_lse is not True and return_lse is not False)
            or (deterministic is not True and deterministic is not False)):
        return None
    right = 0 if causal else -1
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    key = _dense_key(q, k, v, -1, right, 0.0, _RESOLVE_CONFIG, ptrs)
    call = _DENSE_CALLS.get(key)
    if call is None:
        _check_tensors_once(q, k, v, 4, _DENSE_LAYOUT)
        _check_batch(q, k)
        if q.dtype == FP8_DTYPE:  # descales required: the general path says so
            return None
        call = _bounded_put(_DENSE_CALLS, key, _DenseCall(q, k, v, -1, right, 0.0, _RESOLVE_CONFIG))
    if softmax_scale is None:
        scale = call.default_scale
    elif type(softmax_scale) is float and math.isfinite(softmax_scale):
        scale = softmax_scale
    else:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _dense_autograd(q, k, v, call, (scale, right, deterministic, ptrs))
    else:
        out, lse = call.forward(q, k, v, scale, -1, right, 0.0, return_lse, ptrs)
    return (out, lse) if return_lse else out


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
               softmax_scale: Optional[float] = None, window_size=_NO_WINDOW, softcap: float = 0.0,
               return_lse: bool = False, deterministic: bool = True, config: Optional[AttentionConfig] = None,
               q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
               v_descale: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None,
               sinks: Optional[torch.Tensor] = None):
    """Exact attention softmax(scale * Q K^T + bias) V, FlashAttention-2 style, differentiable in q, k, v.

    Args:
        q: (batch, seqlen_q, nheads, headdim) float16 / bfloat16 / float32 (fp32 uses IEEE-precision dots).
        k, v: (batch, seqlen_k, nheads_kv, headdim), same dtype and device; nheads % nheads_kv == 0 (GQA/MQA:
            query head h reads kv head h // (nheads // nheads_kv)); headdim <= 256.
        causal: mask keys after the query, bottom-right aligned when seqlen_q != seqlen_k.
        softmax_scale: defaults to headdim ** -0.5.
        window_size: (left, right) sliding window, -1 = unbounded (causal forces right = 0).
        softcap: > 0 applies softcap * tanh(S / softcap) to the scaled logits.
        return_lse: also return lse (batch, nheads, seqlen_q) float32, natural log (-inf on rows with no key).
        deterministic: True (default) = bitwise reproducible gradients (separate dK/dV and dQ passes); False =
            dQ accumulated with fp32 atomics inside the dK/dV pass (FlashAttention-2/3's way: fewer matmuls,
            gradients vary in the last bits from run to run).
        config: an AttentionConfig overriding the launch decisions (usually ``dataclasses.replace`` of
            ``flashdecode.ops.attention.resolve_config(q, k, v)``); None resolves it from the problem.
        q_descale, k_descale, v_descale: FP8 attention (FlashAttention-3's API, forward only): with q, k, v all
            torch.float8_e4m3fn, float32 (batch, nheads_kv) tensors, required, such that the attended tensors are
            ``q.float() * q_descale[b, h // group]`` (likewise k, v per kv head); q_descale may also be per query
            head, (batch, nheads) (``q.float() * q_descale[b, h]``). QK^T runs as an fp8 dot with the descales
            folded into the softmax scale; P is rounded to e4m3 (after scaling by 2**8) for the fp8 PV dot; out is
            bfloat16. Inputs that require grad are refused. Must be None for other dtypes.
        alibi_slopes: float32 (nheads,) or (batch, nheads): ALiBi, flash-attn's bias -slope * |i + seqlen_k -
            seqlen_q - j| for query row i and key j, added to the scaled logits after the softcap. Constant:
            gradients flow to q, k, v (exactly), none to the slopes. (With causal=True flash-attn's own kernel
            adds slope * j instead, which leaves out unchanged but shifts its lse by slope * (i + seqlen_k -
            seqlen_q); ours is the lse of the documented bias.)
        sinks: float32 (nheads,) attention-sink logits (GPT-OSS, StreamingLLM): each joins its head's softmax
            denominator with no value; differentiable (ops/sinks.py composes them exactly with the kernels' out and
            lse). Not combined with config=, FP8 inputs or alibi_slopes (ValueError).
    Returns:
        out (batch, seqlen_q, nheads, headdim) like q (bfloat16 for FP8 inputs) [, lse]. Rows with no visible key
        give out 0, lse -inf.
    """
    if (config is None and sinks is None and alibi_slopes is None and q_descale is None and k_descale is None
            and v_descale is None):
        result = _plain_dense_call(q, k, v, causal, softmax_scale, window_size, softcap, return_lse, deterministic)
        if result is not None:
            return result
    _check_tensors_once(q, k, v, 4, _DENSE_LAYOUT)
    _check_batch(q, k)
    _check_options(causal, softmax_scale, window_size, softcap, deterministic)
    checks.check_bool("return_lse", return_lse)
    if sinks is not None:
        _check_sinks_alone(config, q, q_descale, alibi_slopes)
        from flashdecode.ops.sinks import flash_attn_with_sinks
        return flash_attn_with_sinks(q, k, v, sinks, causal=causal, softmax_scale=softmax_scale,
                                     window_size=window_size, softcap=softcap, return_lse=return_lse,
                                     deterministic=deterministic)
    descales = None
    if q.dtype == FP8_DTYPE or q_descale is not None or k_descale is not None or v_descale is not None:
        descales = _checked_descales(q, k, v, q_descale, k_descale, v_descale, q.shape[0])
    if alibi_slopes is not None:
        alibi_slopes = _check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device)
    config_id = _config_id(config)
    scale, left, right, cap = _normalise_options(q.shape[-1], causal, softmax_scale, window_size, softcap)
    out, lse = _attention(q, k, v, None, None, q.shape[1], k.shape[1], scale, left, right, cap, deterministic,
                          config_id, descales, alibi_slopes)
    return (out, lse) if return_lse else out


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, *,
                      causal: bool = False, softmax_scale: Optional[float] = None, window_size=_NO_WINDOW,
                      softcap: float = 0.0, return_lse: bool = False, deterministic: bool = True,
                      check_seqlens: bool = True, config: Optional[AttentionConfig] = None,
                      q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
                      v_descale: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None,
                      sinks: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
                      seqused_k: Optional[torch.Tensor] = None, validate: bool = False,
                      k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None):
    """flash_attn over a packed ragged batch (prefill of several prompts in one launch), or (block_table given)
    over a paged KV cache.

    Args:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim); dtypes and rules as flash_attn.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), non-decreasing from 0 to total_q / total_k; sequence b
            owns rows cu_seqlens[b]:cu_seqlens[b + 1]. Causal/window masks are bottom-right aligned per sequence. The same
            tensor may be passed as both (self-attention; also under torch.compile).
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence (they size the grid).
        block_table, seqused_k: paged KV (FlashAttention-3's form; forward only, ops/paged_prefill.py): k, v are
            caches (num_pages, page_size, nheads_kv, headdim) (any page size, unit head-dim stride, one set of
            strides), block_table int32 (batch, max_pages) their page ids per sequence, seqused_k int32 (batch,)
            each sequence's keys (new tokens included, already written to the cache). cu_seqlens_k may be None
            (with seqused_k given; else seqused_k is taken from its differences). Values are checked where they
            live on the host (unless check_seqlens=False), on the device only with validate=True (one sync).
            Inputs that require grad, q/k/v_descale and deterministic=False's atomics do not apply (ValueError
            for the first two).
        k_scale, v_scale: with block_table, an 8-bit (float8_e4m3fn / int8) cache's float32 scales, as
            flash_decode takes them ((), (nheads_kv,) or (num_pages, page_size, nheads_kv)).
        The cu_seqlens values are checked with one host sync per call (prefill only; skipped under torch.compile).
        check_seqlens: False skips that value check (and its sync) for callers that build cu_seqlens themselves,
            e.g. a serving engine's prefill step or a CUDA graph. Wrong values then give wrong results, never
            memory accesses outside q, k, v, out or lse: the kernels clamp every sequence into the packed rows
            (entries < 0 read as 0, entries past total as total, a decreasing pair as an empty sequence). Rows
            no sequence covers, query rows past max_seqlen_q within a sequence and (backward) keys past
            max_seqlen_k are left unwritten: out, lse, dq, dk, dv hold whatever the allocator gave there.
        deterministic, config: as flash_attn.
        q_descale, k_descale, v_descale: FP8 as flash_attn, shape (batch, nheads_kv) with batch =
            len(cu_seqlens_q) - 1 (one descale per sequence and kv head).
        alibi_slopes: as flash_attn ((nheads,) or (batch, nheads)); positions are per sequence.
        sinks: as flash_attn.
    Returns:
        out (total_q, nheads, headdim) [, lse (nheads, total_q) float32 natural log].
    """
    if block_table is not None:
        return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                             seqused_k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                             softcap=softcap, return_lse=return_lse, check_seqlens=check_seqlens, config=config,
                             alibi_slopes=alibi_slopes, sinks=sinks, validate=validate,
                             descales=(q_descale, k_descale, v_descale), k_scale=k_scale, v_scale=v_scale)
    for name, value in (("seqused_k", seqused_k), ("k_scale", k_scale), ("v_scale", v_scale)):
        if value is not None:
            raise ValueError(f"{name} is only supported with block_table (paged K/V)")
    checks.check_bool("validate", validate)
    _check_tensors_once(q, k, v, 3, "(total, nheads, headdim)")
    _check_options(causal, softmax_scale, window_size, softcap, deterministic)
    batch = _check_cu_seqlens_layout("cu_seqlens_q", cu_seqlens_q, None, max_seqlen_q, "max_seqlen_q", q.device)
    _check_cu_seqlens_layout("cu_seqlens_k", cu_seqlens_k, batch, max_seqlen_k, "max_seqlen_k", q.device)
    if not isinstance(check_seqlens, bool):
        raise TypeError(f"check_seqlens must be a bool, got {check_seqlens!r}")
    checks.check_bool("return_lse", return_lse)
    if sinks is not None:
        _check_sinks_alone(config, q, q_descale, alibi_slopes)
        from flashdecode.ops.sinks import flash_attn_varlen_with_sinks
        return flash_attn_varlen_with_sinks(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks,
                                            causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                            softcap=softcap, return_lse=return_lse, deterministic=deterministic,
                                            check_seqlens=check_seqlens)
    descales = None
    if q.dtype == FP8_DTYPE or q_descale is not None or k_descale is not None or v_descale is not None:
        descales = _checked_descales(q, k, v, q_descale, k_descale, v_descale, batch)
    if alibi_slopes is not None:
        alibi_slopes = _check_alibi(alibi_slopes, batch, q.shape[1], q.device)
    config_id = _config_id(config)
    if check_seqlens or validate:
        _check_cu_seqlens_values([("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q"),
                                  ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")])
    scale, left, right, cap = _normalise_options(q.shape[-1], causal, softmax_scale, window_size, softcap)
    out, lse = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, cap,
                          deterministic, config_id, descales, alibi_slopes)
    return (out, lse) if return_lse else out


def _paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                  seqused_k, *, descales, **options):
    """flash_attn_varlen's paged form (block_table given): ops/paged_prefill.py, with seqused_k from cu_seqlens_k's
    differences where only those are given (a device op, no sync)."""
    from flashdecode.ops.paged_prefill import paged_prefill

    if any(d is not None for d in descales):
        raise ValueError("q_descale / k_descale / v_descale are not supported with block_table (paged K/V)")
    if seqused_k is None:
        if cu_seqlens_k is None:
            raise ValueError("block_table needs seqused_k (int32 (batch,): the keys of each sequence in the cache) "
                             "or cu_seqlens_k")
        _check_cu_seqlens_layout("cu_seqlens_k", cu_seqlens_k, cu_seqlens_k.numel() - 1, max_seqlen_k,
                                 "max_seqlen_k", q.device if isinstance(q, torch.Tensor) else cu_seqlens_k.device)
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    return paged_prefill(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                         **options)
