"""Attention sinks (GPT-OSS, StreamingLLM): a learnable per-head logit that joins every row's softmax denominator.

With S_ij the scaled (soft-capped, masked) logits of query row i and s_h the sink logit of the row's head h:
    P_ij = exp(S_ij) / (exp(s_h) + sum_k exp(S_ik)),    out_i = sum_j P_ij V_j      (the sink carries no value)
This composes exactly outside the kernels, from a plain attention's (o, lse):
    lse'_i = logaddexp(lse_i, s_h),    out_i = o_i * exp(lse_i - lse'_i)   (= o_i * sigmoid(lse_i - s_h))
A row with no visible key (o = 0, lse = -inf) gives out = 0 and lse' = s_h: no NaN.

Backward: the FlashAttention backward run on (out, lse') instead of (o, lse) is exact, because it recomputes
P = exp(S - lse'), which already has the sink in its denominator, and the sink column, which has a probability but
no value (dP_sink = 0), enters only through D_i = rowsum(dO_i * out_i): dS = P (dP - D). The sink's own gradient is
    d s_h = -sum_{rows i of head h} exp(s_h - lse'_i) * D_i.

Public functions (sinks: (nheads,) float tensor, fp32 recommended, on q's device):
  apply_sinks(out, lse, sinks, layout)      -> (out', lse') for results already computed (no gradient)
  flash_attn_with_sinks(q, k, v, sinks, ...)           flash_attn + sinks, differentiable in q, k, v and sinks
  flash_attn_varlen_with_sinks(q, k, v, cu_q, cu_k, max_q, max_k, sinks, ...)   the same for packed batches
  flash_decode_with_sinks(q, k_cache, v_cache, cache_seqlens, sinks, ...)       decode (forward only)
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdecode.ops import attention as attention_ops
from flashdecode.ops import checks
from flashdecode.ops.attention import flash_attn, flash_attn_varlen
from flashdecode.ops.decode import flash_decode

__all__ = ["apply_sinks", "flash_attn_with_sinks", "flash_attn_varlen_with_sinks", "flash_decode_with_sinks"]

# Where the head axis of lse sits relative to out, per producer:
#   "dense":  out (batch, seqlen_q, nheads, headdim),   lse (batch, nheads, seqlen_q)   (flash_attn)
#   "varlen": out (total_q, nheads, headdim),            lse (nheads, total_q)          (flash_attn_varlen)
#   "decode": out (batch, [seqlen_q,] nheads, headdim),  lse (batch, [seqlen_q,] nheads) (flash_decode)
LAYOUTS = ("dense", "varlen", "decode")


def check_sinks(sinks, nheads: int, device) -> torch.Tensor:
    """sinks must be a floating (nheads,) tensor on q's device; returns it."""
    checks.check_tensor("sinks", sinks, (1,), checks.FLOAT_DTYPES + (torch.float64,))
    if sinks.shape[0] != nheads:
        raise ValueError(f"sinks must have shape (nheads,) = ({nheads},), got {tuple(sinks.shape)}")
    checks.check_device("sinks", sinks, device)
    return sinks


def _check_sinks_early(sinks, q, q_dims: int):
    """Check sinks against q before any kernel runs (a malformed q is left to the attention op's own checks)."""
    if isinstance(q, torch.Tensor) and q.dim() == q_dims:
        check_sinks(sinks, q.shape[-2], q.device)


def _rows_view(lse: torch.Tensor, layout: str) -> torch.Tensor:
    """lse as (..., nheads) aligned with out's leading dims (a view)."""
    if layout == "dense":
        return lse.transpose(1, 2)
    if layout == "varlen":
        return lse.t()
    return lse


def _from_rows(lse_rows: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of _rows_view, materialised contiguous in the producer's layout (the backward kernels read it)."""
    if layout == "dense":
        return lse_rows.transpose(1, 2).contiguous()
    if layout == "varlen":
        return lse_rows.t().contiguous()
    return lse_rows.contiguous()


def _sink_weights(lse_rows: torch.Tensor, sinks: torch.Tensor):
    """(lse' rows, weight exp(lse - lse')) in fp32 for lse rows (..., nheads) and sinks (nheads,).

    A sink of -inf is "no sink" (lse' = lse); where both are -inf the weight is 0, not exp(-inf + inf) = NaN."""
    sinks = sinks.float()
    lse_new = torch.logaddexp(lse_rows, sinks)
    weight = torch.exp(lse_rows - lse_new)
    weight = torch.where(torch.isneginf(lse_new), torch.zeros_like(weight), weight)
    return lse_new, weight


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, layout: str = "dense"):
    """Add the sink logits to the softmax of an attention result that was computed without them.

    Args:
        out: attention output (see LAYOUTS for the shape per layout), any float dtype.
        lse: its float32 natural-log log-sum-exp in the producer's layout (-inf on rows with no key).
        sinks: (nheads,) per-head sink logits (computed in float32).
        layout: "dense" (flash_attn), "varlen" (flash_attn_varlen) or "decode" (flash_decode / DecodePlan).
    Returns:
        (out', lse'): out' like out (a new tensor), lse' float32 in lse's layout, lse' = logaddexp(lse, sink).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    check_sinks(sinks, out.shape[-2], out.device)
    lse_rows = _rows_view(lse, layout)
    if lse_rows.shape != out.shape[:-1]:
        raise ValueError(f"lse of shape {tuple(lse.shape)} does not match out {tuple(out.shape)} in the "
                         f"{layout!r} layout")
    lse_new, weight = _sink_weights(lse_rows, sinks)
    out_new = (out.float() * weight.unsqueeze(-1)).to(out.dtype)
    return out_new, _from_rows(lse_new, layout)


class _SinkAttention(torch.autograd.Function):
    """flash_attn / flash_attn_varlen followed by apply_sinks; backward = the FlashAttention backward on
    (out, lse') (exact, see the module docstring) plus the sinks' gradient."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                window_size, softcap, deterministic, check_seqlens=True):
        kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                  return_lse=True, deterministic=deterministic)
        if cu_seqlens_q is None:
            layout = "dense"
            o, lse = flash_attn(q, k, v, **kw)
        else:
            layout = "varlen"
            o, lse = flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       check_seqlens=check_seqlens, **kw)
        out, lse_new = apply_sinks(o, lse, sinks, layout)
        scale, left, right, cap = attention_ops._normalise_options(q.shape[-1], causal, softmax_scale, window_size,
                                                                   softcap)
        ctx.save_for_backward(q, k, v, out, lse_new, sinks, cu_seqlens_q, cu_seqlens_k)
        ctx.params = (max_seqlen_q, max_seqlen_k, scale, left, right, cap, deterministic)
        ctx.layout = layout
        ctx.mark_non_differentiable(lse_new)
        return out, lse_new

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse_new, sinks, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        max_q, max_k, scale, left, right, cap, deterministic = ctx.params
        dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        dq, dk, dv = attention_ops._bwd(dout, q, k, v, out, lse_new, cu_seqlens_q, cu_seqlens_k, max_q, max_k,
                                        scale, left, right, cap, deterministic)
        dsinks = None
        if ctx.needs_input_grad[3]:
            delta = (dout.float() * out.float()).sum(-1)  # D_i, (..., nheads) aligned with out
            p_sink = torch.exp(sinks.float() - _rows_view(lse_new, ctx.layout))
            dsinks = -(p_sink * delta).reshape(-1, sinks.shape[0]).sum(0).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None, None, None, None


def flash_attn_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, *,
                          causal: bool = False, softmax_scale: Optional[float] = None, window_size=(-1, -1),
                          softcap: float = 0.0, return_lse: bool = False, deterministic: bool = True):
    """flash_attn with attention sinks; differentiable in q, k, v and sinks.

    Args:
        q, k, v and the options: as flashdecode.flash_attn (q (batch, seqlen_q, nheads, headdim), k/v
            (batch, seqlen_k, nheads_kv, headdim)).
        sinks: (nheads,) sink logits (fp32 recommended), in the same units as the scaled logits.
    Returns:
        out like q [, lse' (batch, nheads, seqlen_q) float32 = logaddexp(lse, sink)].
    """
    _check_sinks_early(sinks, q, 4)
    out, lse = _SinkAttention.apply(q, k, v, sinks, None, None, 0, 0, causal, softmax_scale, window_size, softcap,
                                    deterministic)
    return (out, lse) if return_lse else out


def flash_attn_varlen_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                 sinks: torch.Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
                                 window_size=(-1, -1), softcap: float = 0.0, return_lse: bool = False,
                                 deterministic: bool = True, check_seqlens: bool = True):
    """flash_attn_varlen with attention sinks; differentiable in q, k, v and sinks.

    Args: as flashdecode.flash_attn_varlen (q (total_q, nheads, headdim), ...), plus sinks (nheads,).
    Returns: out like q [, lse' (nheads, total_q) float32].
    """
    _check_sinks_early(sinks, q, 3)
    out, lse = _SinkAttention.apply(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    softmax_scale, window_size, softcap, deterministic, check_seqlens)
    return (out, lse) if return_lse else out


def flash_decode_with_sinks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor, sinks: torch.Tensor, *, return_lse: bool = False, **kwargs):
    """flash_decode (or, with plan=, DecodePlan.run) followed by apply_sinks (forward only, no gradient).

    Args: as flashdecode.flash_decode (q (batch, [seqlen_q,] nheads, headdim), ...), plus sinks (nheads,);
        ``out=`` receives the final result (written in place, and returned).
    Returns: out like q [, lse' (batch, [seqlen_q,] nheads) float32].
    """
    if isinstance(q, torch.Tensor) and q.dim() in (3, 4):
        check_sinks(sinks, q.shape[-2], q.device)
    o, lse = flash_decode(q, k_cache, v_cache, cache_seqlens, return_lse=True, **kwargs)
    result, lse = apply_sinks(o, lse, sinks, "decode")
    if kwargs.get("out") is not None:
        result = kwargs["out"].copy_(result)
    return (result, lse) if return_lse else result
