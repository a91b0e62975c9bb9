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
torch.compile traces them without a graph break; _FlashAttnFunction ties them together for autograd
(ops/attention_autograd.py).

Every launch decision lives in one flashdecode.AttentionConfig, resolved by heuristics.resolve_attention_config
from the problem and the device (or given with ``config=``). The host path is cached per launch key (shapes,
strides, dtype, alignment, mask flags, configuration): a repeated call checks its options, allocates its outputs
and launches the compiled kernel it used last time directly (launch_cache.TunedKernel), skipping the autotuner's
and the JIT's per-call argument binding. Dense forwards go through one cache from the call's key to its ready
forward (the Gluon plan or the Triton kernel with its fixed arguments, _DenseCall): a repeated eager flash_attn call
with plain options builds that key, allocates out (and lse only where it is wanted: return_lse or autograd;
otherwise the kernel writes it to a per-device buffer nobody reads, ops/direct_launch.py) and calls the compiled
kernel's C launcher with the pointers as ints (docs/decisions.md, "Dense call cache"). FLASHDECODE_AUTOTUNE=0
(read when a configuration is resolved) turns autotuning off: the first candidate tile that fits shared memory runs.

This module holds the API and its argument checks' order; the rest of the path lives beside it: the checks in
ops/checks.py, the configuration in ops/attention_config.py, the plans in ops/attention_plans.py (launched through
ops/launch_cache.py), the launches in ops/attention_launch.py, autograd in ops/attention_autograd.py, the Gluon
dispatch in ops/gluon_attention.py, sinks as a step after the kernels in ops/sinks.py.

Inputs may have any strides (e.g. q, k, v as views of one packed qkv tensor): strides go to the kernels, nothing is
copied. Off the GPU the kernels run only in Triton's CPU interpreter (TRITON_INTERPRET=1); plain CPU tensors
otherwise raise (use flashdecode.reference for a pure-PyTorch CPU path).
"""


from __future__ import annotations

import math
from typing import Optional

import torch

from flashdecode.config import AttentionConfig
from flashdecode.kernels import fwd as fwd_kernels  # noqa: F401  (tests swap the forward kernel here)
from flashdecode.ops import checks, score_transform
from flashdecode.ops.attention_autograd import _dense_autograd, attention, attention_with_sinks
from flashdecode.ops.attention_config import (RESOLVE_CONFIG, attention_problem, config_id_of,  # noqa: F401
                                             resolve_config)
from flashdecode.ops.attention_plans import _DENSE_CALLS, _DenseCall, _dense_key
from flashdecode.ops.checks import DENSE_LAYOUT, FP8_DTYPE, NO_WINDOW
from flashdecode.ops.paged_prefill import paged_prefill
from flashdecode.ops.sinks import check_sinks
from flashdecode.ops.util import AUTOTUNE_ENV, constant_slopes

__all__ = ["flash_attn", "flash_attn_varlen", "flash_attn_with_sinks", "flash_attn_varlen_with_sinks",
           "resolve_config", "AUTOTUNE_ENV"]


def _check_sinks_alone(config, q, q_descale, alibi_slopes):
    """Sinks are composed outside the kernels with the default launch (ops/sinks.py): refuse what that path lacks."""
    if config is not None or q.dtype == FP8_DTYPE or q_descale is not None or alibi_slopes is not None:
        raise ValueError("sinks cannot be combined with config=, FP8 inputs (q_descale ...) or alibi_slopes")


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
            or type(v) is not torch.Tensor
            or (window_size is not NO_WINDOW and not checks.is_default_window(window_size))
            or type(softcap) is not float
            or softcap != 0.0 or (causal is not True and causal is not False)
            or (return_lse is not True and return_lse is not False)
            or (deterministic is not True and deterministic is not False)):
        return None
    right = 0 if causal else -1
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    key = _dense_key(q, k, v, -1, right, 0.0, RESOLVE_CONFIG, ptrs)
    call = _DENSE_CALLS.get(key)
    if call is None:
        checks.check_attention_tensors_once(q, k, v, 4, DENSE_LAYOUT)
        checks.check_batch(q, k)
        if q.dtype == FP8_DTYPE:  # descales required: the general path says so
            return None
        call = _DENSE_CALLS.put(key, _DenseCall(q, k, v, -1, right, 0.0, RESOLVE_CONFIG))
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
               softmax_scale: Optional[float] = None, window_size=NO_WINDOW, softcap: float = 0.0,
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
    checks.check_attention_tensors_once(q, k, v, 4, DENSE_LAYOUT)
    checks.check_batch(q, k)
    checks.check_attention_options(causal, softmax_scale, window_size, softcap, deterministic)
    checks.check_bool("return_lse", return_lse)
    if sinks is not None:  # the kernels' (out, lse), then the sinks step (ops/sinks.py)
        _check_sinks_alone(config, q, q_descale, alibi_slopes)
        check_sinks(sinks, q.shape[2], q.device)
        score = score_transform.build(q.shape[-1], causal, softmax_scale, window_size, softcap, sinks=True)
        out, lse = attention_with_sinks(q, k, v, sinks, None, None, q.shape[1], k.shape[1], score, deterministic)
        return (out, lse) if return_lse else out
    descales = None
    if q.dtype == FP8_DTYPE or q_descale is not None or k_descale is not None or v_descale is not None:
        descales = checks.checked_descales(q, k, v, q_descale, k_descale, v_descale, q.shape[0])
    if alibi_slopes is not None:
        alibi_slopes = constant_slopes(checks.check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device))
    config_id = config_id_of(config)
    score = score_transform.build(q.shape[-1], causal, softmax_scale, window_size, softcap,
                                  alibi=alibi_slopes is not None)
    out, lse = attention(q, k, v, None, None, q.shape[1], k.shape[1], score, deterministic, config_id, descales,
                         alibi_slopes)
    return (out, lse) if return_lse else out


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, *,
                      causal: bool = False, softmax_scale: Optional[float] = None, window_size=NO_WINDOW,
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
            owns rows cu_seqlens[b]:cu_seqlens[b + 1]. Causal/window masks are bottom-right aligned per sequence. The
            same tensor may be passed as both (self-attention; also under torch.compile).
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
        The cu_seqlens values are checked with one host sync (skipped under torch.compile), once per tensor: a
            cu_seqlens tensor that passed with the same total and max_seqlen and has had no in-place torch write
            since (its version counter) is not read again, so a model's layers sharing one cost one sync a step.
            validate=True checks again (a write from outside torch, e.g. a kernel, bumps no version counter).
        check_seqlens: False skips that value check (and its sync) for callers that build cu_seqlens themselves,
            e.g. a serving engine's prefill step or a CUDA graph. Wrong values then give wrong results, never
            memory accesses outside q, k, v, out or lse: the kernels clamp every sequence into the packed rows
            (entries < 0 read as 0, entries past total as total, a decreasing pair as an empty sequence). Rows
            no sequence covers, query rows past max_seqlen_q within a sequence and (backward) keys past
            max_seqlen_k are left unwritten: out, lse, dq, dk, dv hold whatever the allocator gave there.
        deterministic, config: as flash_attn; with block_table, config may also be a GluonFwdConfig, which runs
            the Gluon paged kernel with that launch (ops/paged_prefill.py).
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
    checks.check_attention_tensors_once(q, k, v, 3, "(total, nheads, headdim)")
    checks.check_attention_options(causal, softmax_scale, window_size, softcap, deterministic)
    batch = checks.check_cu_seqlens_layout("cu_seqlens_q", cu_seqlens_q, None, max_seqlen_q, "max_seqlen_q", q.device)
    checks.check_cu_seqlens_layout("cu_seqlens_k", cu_seqlens_k, batch, max_seqlen_k, "max_seqlen_k", q.device)
    if not isinstance(check_seqlens, bool):
        raise TypeError(f"check_seqlens must be a bool, got {check_seqlens!r}")
    checks.check_bool("return_lse", return_lse)
    if sinks is not None:
        _check_sinks_alone(config, q, q_descale, alibi_slopes)
        check_sinks(sinks, q.shape[1], q.device)
    descales = None
    if q.dtype == FP8_DTYPE or q_descale is not None or k_descale is not None or v_descale is not None:
        descales = checks.checked_descales(q, k, v, q_descale, k_descale, v_descale, batch)
    if alibi_slopes is not None:
        alibi_slopes = constant_slopes(checks.check_alibi_slopes(alibi_slopes, batch, q.shape[1], q.device))
    config_id = config_id_of(config)
    if check_seqlens or validate:
        checks.check_cu_seqlens_values([("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q"),
                                        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")],
                                       recheck=validate)
    score = score_transform.build(q.shape[-1], causal, softmax_scale, window_size, softcap,
                                  alibi=alibi_slopes is not None, sinks=sinks is not None)
    if score.sinks:
        out, lse = attention_with_sinks(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, score,
                                        deterministic)
    else:
        out, lse = attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, score, deterministic,
                             config_id, descales, alibi_slopes)
    return (out, lse) if return_lse else out


def _paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                  seqused_k, *, descales, **options):
    """flash_attn_varlen's paged form (block_table given): ops/paged_prefill.py, with seqused_k from cu_seqlens_k's
    differences where only those are given (a device op, no sync)."""
    if any(d is not None for d in descales):
        raise ValueError("q_descale / k_descale / v_descale are not supported with block_table (paged K/V)")
    if seqused_k is None:
        if cu_seqlens_k is None:
            raise ValueError("block_table needs seqused_k (int32 (batch,): the keys of each sequence in the cache) "
                             "or cu_seqlens_k")
        checks.check_cu_seqlens_layout("cu_seqlens_k", cu_seqlens_k, cu_seqlens_k.numel() - 1, max_seqlen_k,
                                 "max_seqlen_k", q.device if isinstance(q, torch.Tensor) else cu_seqlens_k.device)
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    return paged_prefill(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                         **options)


def flash_attn_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, *,
                          causal: bool = False, softmax_scale: Optional[float] = None, window_size=(-1, -1),
                          softcap: float = 0.0, return_lse: bool = False, deterministic: bool = True):
    """flash_attn(..., sinks=sinks): attention sinks, differentiable in q, k, v and sinks.

    Args:
        q, k, v and the options: as flash_attn (q (batch, seqlen_q, nheads, headdim), k/v
            (batch, seqlen_k, nheads_kv, headdim)).
        sinks: (nheads,) sink logits (fp32 recommended), in the same units as the scaled logits.
    Returns:
        out like q [, lse' (batch, nheads, seqlen_q) float32 = logaddexp(lse, sink)].
    """
    return flash_attn(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                      return_lse=return_lse, deterministic=deterministic, sinks=sinks)


def flash_attn_varlen_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                 sinks: torch.Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
                                 window_size=(-1, -1), softcap: float = 0.0, return_lse: bool = False,
                                 deterministic: bool = True, check_seqlens: bool = True):
    """flash_attn_varlen(..., sinks=sinks): attention sinks over a packed batch, differentiable in q, k, v and sinks.

    Args: as flash_attn_varlen (q (total_q, nheads, headdim), ...), plus sinks (nheads,).
    Returns: out like q [, lse' (nheads, total_q) float32].
    """
    return flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                             softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                             return_lse=return_lse, deterministic=deterministic, check_seqlens=check_seqlens,
                             sinks=sinks)
