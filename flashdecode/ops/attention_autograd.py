"""flash_attn's autograd and torch.compile glue: the forward and backward as torch.library custom ops
(flashdecode::attn_fwd / attn_bwd, with fake implementations, so torch.compile traces them without a graph break),
the autograd Functions that tie them together (one with the sinks step, ops/sinks.py), and ``attention``, which
takes a checked call through autograd only where a gradient can flow.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from flashdecode.ops.attention_config import RESOLVE_CONFIG
from flashdecode.ops.attention_launch import FP8_OUT_DTYPE, _bwd_impl, _fwd_impl
from flashdecode.ops.checks import FP8_DTYPE
from flashdecode.ops.sinks import apply_sinks, sinks_grad

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
        ctx.params = (q.shape[1], k.shape[1], scale, -1, right, 0.0, deterministic, RESOLVE_CONFIG)
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


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, score, deterministic, config_id,
              descales=None, alibi_slopes=None):
    """(out, lse): through autograd only when a gradient can flow (its Function costs host time per call).
    score: the call's ScoreTransform (ops/score_transform.py; the ops below take its fields as scalars, the
    custom ops' schema). descales: FP8 inputs' (q_descale, k_descale, v_descale) (forward only, checked before),
    else None."""
    scale, left, right, softcap = score.scale, score.window_left, score.window_right, score.softcap
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


class _SinkAttentionFunction(torch.autograd.Function):
    """_FlashAttnFunction followed by the sinks step: the kernels' (o, lse), then ops/sinks.apply_sinks; backward =
    the FlashAttention backward on (out, lse') (exact, see ops/sinks.py) plus the sinks' gradient. Dense
    (cu_seqlens_q None) or varlen; no ALiBi, FP8 or config= (flash_attn refuses them with sinks)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right,
                softcap, deterministic):
        layout = "dense" if cu_seqlens_q is None else "varlen"
        o, lse = _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
                      RESOLVE_CONFIG, None, None, None)
        out, lse_new = apply_sinks(o, lse, sinks, layout)
        ctx.save_for_backward(q, k, v, out, lse_new, sinks, cu_seqlens_q, cu_seqlens_k)
        ctx.params = (max_seqlen_q, max_seqlen_k, scale, left, right, softcap, deterministic, RESOLVE_CONFIG)
        ctx.layout = layout
        ctx.mark_non_differentiable(lse_new)
        return out, lse_new

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse_new, sinks, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        dq, dk, dv = _bwd(dout, q, k, v, out, lse_new, cu_seqlens_q, cu_seqlens_k, *ctx.params, None)
        dsinks = sinks_grad(dout, out, lse_new, sinks, ctx.layout) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None, None, None


def attention_with_sinks(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, score,
                         deterministic):
    """(out, lse') of a checked call with sinks (checked, (nheads,); score: its ScoreTransform, without ALiBi):
    differentiable in q, k, v and sinks."""
    return _SinkAttentionFunction.apply(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        score.scale, score.window_left, score.window_right, score.softcap,
                                        deterministic)
