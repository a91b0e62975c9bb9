"""flash_attn / flash_attn_varlen: input checks, defaults, kernel choice, autograd and torch.library registration.

Public API (flash-attn compatible shapes and names, DESIGN.md):
  flash_attn(q, k, v, *, causal, softmax_scale, window_size, softcap, return_lse)
      q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_kv, headdim) -> out like q
      [, lse (batch, nheads, seqlen_q) float32, natural log].
  flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, same options)
      q (total_q, nheads, headdim), k/v (total_k, nheads_kv, headdim), int32 cu_seqlens (batch + 1,)
      -> out like q [, lse (nheads, total_q)].

Both are differentiable in q, k, v (lse is returned as a non-differentiable output, like flash-attn). The forward
and backward are torch.library custom ops (flashdecode::attn_fwd / attn_bwd) with fake implementations, so
torch.compile traces them without a graph break; _FlashAttnFunction ties them together for autograd.

Inputs may have any strides (e.g. q, k, v as views of one packed qkv tensor): strides go to the kernels, nothing is
copied. Off the GPU the kernels run only in Triton's CPU interpreter (TRITON_INTERPRET=1); plain CPU tensors
otherwise raise (use flashdecode.reference for a pure-PyTorch CPU path).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from typing import Optional

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensor

from flashdecode import heuristics
from flashdecode.ops import checks
from flashdecode.kernels import bwd as bwd_kernels
from flashdecode.kernels import fwd as fwd_kernels

__all__ = ["flash_attn", "flash_attn_varlen"]

SUPPORTED_DTYPES = checks.FLOAT_DTYPES
MAX_HEAD_DIM = checks.MAX_HEAD_DIM
LOG2E = checks.LOG2E

# Set FLASHDECODE_AUTOTUNE=0 to use the first candidate that fits shared memory instead of timing a handful
# (tests do this to keep compile counts down).
AUTOTUNE = os.environ.get("FLASHDECODE_AUTOTUNE", "1") != "0"
# Hopper forward path through tensor descriptors (TMA): "auto" = on sm90+ when the layout allows it, "0" = never,
# "1" = whenever the layout allows it (also in the CPU interpreter, which emulates descriptors: tests use this).
TMA_MODE = os.environ.get("FLASHDECODE_TMA", "auto")
# Triton's warp specialisation of the unmasked forward loop (needs the TMA path); off unless measured faster.
WARP_SPECIALIZE = os.environ.get("FLASHDECODE_WARP_SPECIALIZE", "0") == "1"
# Forward row max on the raw dot products, scale fused into the exponent's FMA (fwd.attn_fwd_inner); "0" = the
# plain scale-then-max loop (kept for A/B timing).
FWD_RAW_MAX = os.environ.get("FLASHDECODE_FWD_RAW_MAX", "0") == "1"
# Forward with the unmasked loop software-pipelined by one QK^T (fwd.attn_fwd_inner_pipelined, its own tiles):
# "1" = wherever it applies, "0" = never, unset = heuristics.use_fwd_pipeline.
FWD_PIPELINE_QK = {"1": True, "0": False}.get(os.environ.get("FLASHDECODE_FWD_PIPELINE_QK", "auto"))
# Backward through tensor descriptors (TMA loads; bulk TMA reduction of dQ when deterministic=False) wherever the
# forward would use them: "1" = always, "0" = never, unset = auto (heuristics.use_bwd_tma: the deterministic
# backward of long sequences on Hopper, where the H100 measured it faster; short ones lost).
BWD_TMA = {"1": True, "0": False}.get(os.environ.get("FLASHDECODE_BWD_TMA", "auto"))
# Deterministic backward in one launch (bwd.attn_bwd_dkdv_kernel with FUSED_DQ: program j does dK/dV of KV block j,
# then dQ of Q block j) instead of a dK/dV launch and a dQ launch: "1" = always, "0" = never, unset = heuristics.use_bwd_fused.
BWD_FUSED = {"1": True, "0": False}.get(os.environ.get("FLASHDECODE_BWD_FUSED", "auto"))
# The backward preprocess also writes lse in log2 units (+inf on rows with no key) for the backward kernels, so the
# dK/dV loop loads each Q block's lse without converting it (with unmasked loads in unmasked blocks: H100, bf16, 32
# heads, 16k, backward only, same run vs the previous kernels: hd128 13.9 vs 16.5 ms causal, 25.7 vs 27.9
# non-causal); "0" = convert in the loop (kept for A/B timing).
BWD_LSE_LOG2 = os.environ.get("FLASHDECODE_BWD_LSE_LOG2", "1") == "1"


def _interpreting() -> bool:
    return checks.interpreting()


# ----------------------------------------------------------------------------------------------------------------
# Input validation (ValueError / TypeError naming the argument; never asserts)
# ----------------------------------------------------------------------------------------------------------------

def _check_tensor_args(q, k, v, ndim: int, layout: str):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if q.device.type == "cpu" and not _interpreting():
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


def _check_options(causal, softmax_scale, window_size, softcap, deterministic=True):
    checks.check_bool("causal", causal)
    checks.check_bool("deterministic", deterministic)
    checks.check_softmax_scale(softmax_scale)
    checks.check_window(window_size)
    checks.check_softcap(softcap)


def _check_cu_seqlens_layout(name: str, cu: torch.Tensor, batch: Optional[int], max_seqlen, max_name: str,
                             device) -> int:
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
    if not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise TypeError(f"{max_name} must be an int >= 0, got {max_seqlen!r}")
    return cu.numel() - 1


def _check_cu_seqlens_values(checks):
    """checks: [(name, cu, total, max_seqlen, max_name)]. Starts at 0, non-decreasing, within the packed tokens,
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
        if last > total:
            raise ValueError(f"{name}[-1] = {last} exceeds the {total} packed tokens")
        if max_len > max_seqlen:
            raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest sequence ({max_len}) "
                             f"in {name}")


def _normalise_options(headdim, causal, softmax_scale, window_size, softcap):
    scale = float(headdim ** -0.5 if softmax_scale is None else softmax_scale)
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    return scale, left, right, float(softcap)


# ----------------------------------------------------------------------------------------------------------------
# Kernel choice (autotuned on the GPU, one fixed small config in the interpreter)
# ----------------------------------------------------------------------------------------------------------------

def _head_dim_pad(headdim: int) -> int:
    return max(16, triton.next_power_of_2(headdim))


@functools.lru_cache(maxsize=None)
def _device_facts(device: torch.device) -> tuple[int, int]:
    """(shared memory per block in bytes, compute capability major) of a CUDA device, cached: no per-call
    driver queries on the launch path."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 227 * 1024)), props.major


def _smem_limit(device) -> int:
    # A config that still overflows (Triton's own scratch) fails to compile and the autotuner drops it.
    return _device_facts(device)[0] if device.type == "cuda" else 227 * 1024


@functools.lru_cache(maxsize=None)
def _tuned(kernel_name: str, head_dim_pad: int, elem_bytes: int, smem_limit: int, autotune: bool):
    """(kernel, fixed constexpr kwargs) for one kernel, head-dim bucket and element size.

    Candidates that cannot fit shared memory are pruned here, once. With autotune the survivors are timed per
    key (shape buckets + mask flags); without it the first survivor is used.
    """
    kernel, candidates, held, streamed, names, key = _KERNELS[kernel_name]
    candidates = heuristics.prefill_candidates(kernel_name, candidates, head_dim_pad, elem_bytes)
    if kernel_name == "bwd_fused":  # two tile shapes: heuristics.PREFILL_BWD_FUSED_CANDIDATES
        fits = heuristics.prefill_bwd_fused_configs_that_fit(candidates, head_dim_pad, elem_bytes, smem_limit)
    else:
        fits = heuristics.prefill_configs_that_fit(candidates, head_dim_pad, elem_bytes, smem_limit,
                                                    streamed_tensors=streamed, held_tensors=held)
    configs = [triton.Config(dict(zip(names, c)), num_warps=c[len(names)], num_stages=c[len(names) + 1])
               for c in fits]
    if not autotune:
        configs = configs[:1]
    # the atomic dQ buffer accumulates across launches: zero it before every timed candidate (and after tuning)
    reset = ["DQ"] if kernel_name in _ACCUMULATING_KERNELS else None
    return triton.autotune(configs=configs, key=key, reset_to_zero=reset)(kernel)


def _launch(kernel_name: str, grid_fn, args: tuple, constexprs: dict, q: torch.Tensor, head_dim_pad: int):
    if _interpreting():
        names = _KERNELS[kernel_name][4]
        blocks = heuristics.PREFILL_INTERPRET_BLOCKS
        meta = {name: blocks[i % 2] for i, name in enumerate(names)}
        if "SPLIT_DKDV" in meta:
            meta["SPLIT_DKDV"] = heuristics.PREFILL_INTERPRET_SPLIT_DKDV
        _KERNELS[kernel_name][0][grid_fn(meta)](*args, **constexprs, **meta)
        return
    tuned = _tuned(kernel_name, head_dim_pad, q.element_size(), _smem_limit(q.device),
                   AUTOTUNE and kernel_name not in _UNTUNED_KERNELS)
    if q.device.index == torch.cuda.current_device():
        tuned[grid_fn](*args, **constexprs)
    else:
        with torch.cuda.device(q.device):
            tuned[grid_fn](*args, **constexprs)


_ACCUMULATING_KERNELS = {"bwd_dkdv_atomic"}
_UNTUNED_KERNELS = {"fwd_long"}  # the first candidate that fits shared memory, never timed
_FLAG_KEYS = ["bucket_q", "bucket_k", "HEAD_DIM", "IS_VARLEN", "HAS_LEFT", "HAS_RIGHT", "SOFTCAP", "DOT_PRECISION",
              "USE_TMA", "WARP_SPECIALIZE", "RAW_MAX", "ATOMIC_DQ", "FUSED_DQ"]
# name -> (jit kernel, candidates, held tiles, streamed tiles, (held-rows constexpr, streamed-rows constexpr), key)
_KERNELS = {
    "fwd": (fwd_kernels.attn_fwd_kernel, heuristics.PREFILL_FWD_CANDIDATES, 1, 2, ("BLOCK_M", "BLOCK_N"), _FLAG_KEYS),
    # PIPELINE_QK forward (own autotune cache): two score tiles live and one K tile more in flight; 2 held tiles
    # make the shared-memory estimate match its sm_90 compiles (hd128 (128, 128, 8, 2): 192 KiB)
    "fwd_pipelined": (fwd_kernels.attn_fwd_kernel, heuristics.PREFILL_FWD_PIPELINED_CANDIDATES, 2, 2,
                      ("BLOCK_M", "BLOCK_N"), _FLAG_KEYS),
    # long sequences (heuristics.use_fwd_long_config): a fixed tile, untimed (_UNTUNED_KERNELS)
    "fwd_long": (fwd_kernels.attn_fwd_kernel, heuristics.PREFILL_FWD_LONG_CANDIDATES, 1, 2, ("BLOCK_M", "BLOCK_N"),
                 _FLAG_KEYS),
    "bwd_dkdv": (bwd_kernels.attn_bwd_dkdv_kernel, heuristics.PREFILL_BWD_KV_CANDIDATES, 2, 2,
                 ("BLOCK_N", "BLOCK_M"), _FLAG_KEYS),
    # deterministic=False: dK/dV program that also adds dQ with atomics (its own candidates: bigger KV blocks
    # halve the atomic traffic). 4 held tiles: K, V plus the staging of dS^T and of the dQ tile (sm_90 compiles at
    # hd256: (64, 64, 4, 2) needs 263-271 KB, (64, 32, 4, 2) 168-180 KB)
    "bwd_dkdv_atomic": (bwd_kernels.attn_bwd_dkdv_kernel, heuristics.PREFILL_BWD_ATOMIC_CANDIDATES, 4, 2,
                        ("BLOCK_N", "BLOCK_M"), _FLAG_KEYS),
    "bwd_dq": (bwd_kernels.attn_bwd_dq_kernel, heuristics.PREFILL_BWD_Q_CANDIDATES, 2, 2, ("BLOCK_M", "BLOCK_N"),
               _FLAG_KEYS),
    # deterministic backward in one launch (FUSED_DQ): the dK/dV tile shape, then the dQ tile shape (the tile counts
    # of the held/streamed columns are unused: heuristics.prefill_bwd_fused_configs_that_fit sizes both phases)
    "bwd_fused": (bwd_kernels.attn_bwd_dkdv_kernel, heuristics.PREFILL_BWD_FUSED_CANDIDATES, 2, 2,
                  ("BLOCK_N", "BLOCK_M", "BLOCK_M2", "BLOCK_N2", "SPLIT_DKDV"), _FLAG_KEYS),
}


def _tma_layout_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need a unit head-dim stride, 16-byte aligned base and row strides, and >= 16-byte rows."""
    for t in tensors:
        elem = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or t.shape[-1] * elem < 16:
            return False
        if any((st * elem) % 16 for st in t.stride()[:-1]):
            return False
    return True


def _use_tma(q, k, v, out) -> bool:
    if TMA_MODE == "0" or not _tma_layout_ok(q, k, v, out):
        return False
    if TMA_MODE == "1":
        return True
    return q.is_cuda and _device_facts(q.device)[1] >= 9


_ALLOCATOR_SET = threading.local()


def _scratch_allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8,
                       device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")


def _ensure_triton_allocator():
    """Device-side tensor descriptors live in a small global scratch that Triton asks an allocator for.

    Triton keeps the allocator in a ContextVar, i.e. per thread: autograd runs the backward of CUDA tensors on its
    own worker thread, which never saw the forward's set_allocator, so the flag is per thread too."""
    if not getattr(_ALLOCATOR_SET, "done", False):
        triton.set_allocator(_scratch_allocator)
        _ALLOCATOR_SET.done = True


def _strides(x: torch.Tensor, varlen: bool):
    """(batch, seq, head, dim) strides; a packed varlen tensor has batch stride 0 (sequences start at cu_seqlens)."""
    if varlen:
        return (0,) + tuple(x.stride())
    return tuple(x.stride())


def _lse_strides(lse: torch.Tensor, varlen: bool):
    """(batch, head) strides of lse: dense (batch, nheads, seqlen_q), varlen (nheads, total_q)."""
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _common_constexprs(headdim, varlen, left, right, softcap, dtype):
    return dict(HEAD_DIM=headdim, HEAD_DIM_PAD=_head_dim_pad(headdim), IS_VARLEN=varlen, HAS_LEFT=left >= 0,
                HAS_RIGHT=right >= 0, SOFTCAP=softcap > 0.0,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")


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


def _use_fwd_pipeline(use_tma: bool, q: torch.Tensor, softcap: float, max_seqlen_k: int) -> bool:
    """PIPELINE_QK forward: descriptor path, 16-bit, head dim <= 128, no softcap; FLASHDECODE_FWD_PIPELINE_QK
    forces it on or off, otherwise heuristics.use_fwd_pipeline decides."""
    if not use_tma or softcap > 0.0 or q.element_size() != 2 or _head_dim_pad(q.shape[-1]) > 128:
        return False
    return FWD_PIPELINE_QK if FWD_PIPELINE_QK is not None else heuristics.use_fwd_pipeline(max_seqlen_k)


def _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap):
    varlen, batch, sq, sk, nheads, nheads_kv = _shape_info(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    out = torch.empty_like(q)
    lse_shape = (nheads, q.shape[0]) if varlen else (batch, nheads, sq)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or batch == 0 or sq == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    headdim = q.shape[-1]
    qk_scale, softcap_log2 = _scale_args(scale, softcap)
    args = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
            *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(out, varlen),
            *_lse_strides(lse, varlen),
            nheads, nheads // nheads_kv, sq, sk, qk_scale, softcap_log2, max(left, 0), max(right, 0),
            heuristics.seqlen_bucket(sq), heuristics.seqlen_bucket(sk))
    constexprs = _common_constexprs(headdim, varlen, left, right, softcap, q.dtype)
    use_tma = _use_tma(q, k, v, out)
    if use_tma:
        _ensure_triton_allocator()
    pipeline = _use_fwd_pipeline(use_tma, q, softcap, sk)
    # a zero scale would make the masked -inf logits 0 * -inf = NaN on the raw-max path
    constexprs.update(USE_TMA=use_tma, WARP_SPECIALIZE=use_tma and WARP_SPECIALIZE and not pipeline,
                      RAW_MAX=FWD_RAW_MAX and softcap == 0.0 and scale != 0.0 and not pipeline,
                      PIPELINE_QK=pipeline)
    grid = lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), nheads, batch)  # noqa: E731
    if pipeline:
        name = "fwd_pipelined"
    elif heuristics.use_fwd_long_config(sk, constexprs["HEAD_DIM_PAD"], q.element_size(), use_tma):
        name = "fwd_long"
    else:
        name = "fwd"
    _launch(name, grid, args, constexprs, q, constexprs["HEAD_DIM_PAD"])
    return out, lse


def _bwd_delta(dout, out, lse, cu_seqlens_q, varlen, batch, sq, nheads, headdim, lse_log2: bool):
    """FA-2's D = rowsum(dO * O): fp32, laid out like lse ((batch, nheads, seqlen_q) or (nheads, total_q)).
    Returns (delta, lse for the backward kernels): lse_log2 = lse * log2(e) with +inf for -inf (a new buffer like
    delta), else lse itself."""
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(delta) if lse_log2 else delta
    block_m = 64 if headdim <= 128 else 32
    grid = (triton.cdiv(sq, block_m), nheads, batch)
    bwd_kernels.attn_bwd_delta_kernel[grid](
        out, dout, delta, cu_seqlens_q, lse, lse2, *_strides(out, varlen), *_strides(dout, varlen),
        *_lse_strides(delta, varlen), *_lse_strides(lse, varlen), nheads, sq, HEAD_DIM=headdim,
        HEAD_DIM_PAD=_head_dim_pad(headdim), IS_VARLEN=varlen, BLOCK_M=block_m, WRITE_LSE2=lse_log2)
    return delta, (lse2 if lse_log2 else lse)


def _bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right,
              softcap, deterministic=True):
    """dq, dk, dv like q, k, v. deterministic: dK/dV and dQ computed by different programs, no atomics (bitwise
    reproducible), either in one launch (BWD_FUSED / heuristics.use_bwd_fused) or two; otherwise one dK/dV pass that
    adds dQ into an fp32 buffer with atomics, then scales and casts it."""
    varlen, batch, sq, sk, nheads, nheads_kv = _shape_info(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if batch == 0 or q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    # atomic mode: fp32 accumulator (contiguous, shape of q), zeroed; deterministic mode: the output itself
    dq = torch.empty_like(q) if deterministic else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    headdim = q.shape[-1]
    delta, lse = _bwd_delta(dout, out, lse, cu_seqlens_q, varlen, batch, sq, nheads, headdim, BWD_LSE_LOG2)
    qk_scale, softcap_log2 = _scale_args(scale, softcap)
    constexprs = _common_constexprs(headdim, varlen, left, right, softcap, q.dtype)
    if BWD_LSE_LOG2:
        constexprs["LSE_LOG2"] = True
    # the interpreter has descriptor loads but no descriptor reduction (the atomic dQ path)
    want_tma = BWD_TMA if BWD_TMA is not None else heuristics.use_bwd_tma(sk, deterministic)
    use_tma = want_tma and _use_tma(q, k, v, dout) and (deterministic or not _interpreting())
    if use_tma:
        _ensure_triton_allocator()
    constexprs["USE_TMA"] = use_tma
    common_tail = (*_lse_strides(lse, varlen), *_lse_strides(delta, varlen),
                   nheads, nheads // nheads_kv, sq, sk, qk_scale, softcap_log2, scale, max(left, 0), max(right, 0),
                   heuristics.seqlen_bucket(sq), heuristics.seqlen_bucket(sk))
    dkdv_args = (q, k, v, dout, lse, delta, dk, dv, dq, cu_seqlens_q, cu_seqlens_k,
                 *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(dout, varlen),
                 *_strides(dk, varlen), *_strides(dv, varlen), *_strides(dq, varlen), *common_tail)
    grid_kv = lambda meta: (triton.cdiv(sk, meta["BLOCK_N"]), nheads_kv, batch)  # noqa: E731
    if not deterministic:
        _launch("bwd_dkdv_atomic", grid_kv, dkdv_args, dict(constexprs, ATOMIC_DQ=True), q,
                constexprs["HEAD_DIM_PAD"])
        return dq.mul_(scale).to(q.dtype), dk, dv
    fused = (BWD_FUSED if BWD_FUSED is not None
             else heuristics.use_bwd_fused(sk, constexprs["HEAD_DIM_PAD"], q.element_size()))
    if fused:
        def grid_pair(meta):  # one program per (KV block j, Q block j) pair: the longer of the two block counts
            kv_programs = triton.cdiv(sk, meta["BLOCK_N"]) * (2 if meta["SPLIT_DKDV"] else 1)
            return max(kv_programs, triton.cdiv(sq, meta["BLOCK_M2"])), nheads_kv, batch
        _launch("bwd_fused", grid_pair, dkdv_args, dict(constexprs, FUSED_DQ=True), q, constexprs["HEAD_DIM_PAD"])
        return dq, dk, dv
    _launch("bwd_dkdv", grid_kv, dkdv_args, constexprs, q, constexprs["HEAD_DIM_PAD"])
    dq_args = (q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k,
               *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(dout, varlen),
               *_strides(dq, varlen), *common_tail)
    grid_q = lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), nheads, batch)  # noqa: E731
    _launch("bwd_dq", grid_q, dq_args, constexprs, q, constexprs["HEAD_DIM_PAD"])
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------------
# torch.library custom ops (+ fake implementations for torch.compile) and autograd
# ----------------------------------------------------------------------------------------------------------------

@torch.library.custom_op("flashdecode::attn_fwd", mutates_args=())
def attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                window_left: int, window_right: int, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward (dense when cu_seqlens_q is None, else varlen); window_right = 0 is causal. Returns (out, lse)."""
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                     window_right, softcap)


@attn_fwd_op.register_fake
def _attn_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                   window_right, softcap):
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return torch.empty_like(q), lse


@torch.library.custom_op("flashdecode::attn_bwd", mutates_args=())
def attn_bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
                max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
                softcap: float, deterministic: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward from the saved lse: (dq, dk, dv); deterministic (no atomics) unless told otherwise."""
    return _bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, window_left, window_right, softcap, deterministic)


@attn_bwd_op.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   window_left, window_right, softcap, deterministic=True):
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
    """Autograd glue: forward saves (q, k, v, out, lse); backward recomputes P from lse (FA v1/v2)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
                deterministic):
        out, lse = _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.params = (max_seqlen_q, max_seqlen_k, scale, left, right, softcap, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dq, dk, dv = _bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.params)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------

def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
               softmax_scale: Optional[float] = None, window_size=(-1, -1), softcap: float = 0.0,
               return_lse: bool = False, deterministic: bool = True):
    """Exact attention softmax(scale * Q K^T) V, FlashAttention-2 style, differentiable in q, k, v.

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
    Returns:
        out (batch, seqlen_q, nheads, headdim) like q [, lse]. Rows with no visible key give out 0, lse -inf.
    """
    _check_tensor_args(q, k, v, 4, "(batch, seqlen, nheads, headdim)")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k/v batch ({k.shape[0]}) must equal q's batch ({q.shape[0]})")
    _check_options(causal, softmax_scale, window_size, softcap, deterministic)
    scale, left, right, cap = _normalise_options(q.shape[-1], causal, softmax_scale, window_size, softcap)
    out, lse = _FlashAttnFunction.apply(q, k, v, None, None, q.shape[1], k.shape[1], scale, left, right, cap,
                                        deterministic)
    return (out, lse) if return_lse else out


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                      softmax_scale: Optional[float] = None, window_size=(-1, -1), softcap: float = 0.0,
                      return_lse: bool = False, deterministic: bool = True, check_seqlens: bool = True):
    """flash_attn over a packed ragged batch (prefill of several prompts in one launch).

    Args:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim); dtypes and rules as flash_attn.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), non-decreasing from 0; sequence b owns rows
            cu_seqlens[b]:cu_seqlens[b + 1]. Causal/window masks are bottom-right aligned per sequence.
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence (they size the grid).
        The cu_seqlens values are checked with one host sync per call (prefill only; skipped under torch.compile).
        check_seqlens: False skips that value check (and its sync) for callers that build cu_seqlens themselves,
            e.g. a serving engine's prefill step or a CUDA graph: wrong values then give wrong results, not errors.
        deterministic: as flash_attn.
    Returns:
        out (total_q, nheads, headdim) [, lse (nheads, total_q) float32 natural log].
    """
    _check_tensor_args(q, k, v, 3, "(total, nheads, headdim)")
    _check_options(causal, softmax_scale, window_size, softcap, deterministic)
    batch = _check_cu_seqlens_layout("cu_seqlens_q", cu_seqlens_q, None, max_seqlen_q, "max_seqlen_q", q.device)
    _check_cu_seqlens_layout("cu_seqlens_k", cu_seqlens_k, batch, max_seqlen_k, "max_seqlen_k", q.device)
    if not isinstance(check_seqlens, bool):
        raise TypeError(f"check_seqlens must be a bool, got {check_seqlens!r}")
    if check_seqlens:
        _check_cu_seqlens_values([("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q"),
                                  ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")])
    scale, left, right, cap = _normalise_options(q.shape[-1], causal, softmax_scale, window_size, softcap)
    out, lse = _FlashAttnFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left,
                                        right, cap, deterministic)
    return (out, lse) if return_lse else out
