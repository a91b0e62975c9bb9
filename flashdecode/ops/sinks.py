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

A step the ops apply after their kernels (flash_attn / flash_attn_varlen / paged prefill / flash_decode take
``sinks=``; ops/attention_autograd.py adds the backward): this module calls no op (it imports only ops/checks.py).
  apply_sinks(out, lse, sinks, layout)      -> (out', lse') for results already computed (no gradient)
  sinks_grad(dout, out, lse', sinks, layout) -> d sinks, for the ops' backward
  check_decode_sinks / decode_sinks_step     -> flash_decode's and DecodePlan.run's check and step
"""

from __future__ import annotations

import torch

from flashdecode.ops import checks

__all__ = ["apply_sinks", "check_sinks", "sinks_grad", "check_decode_sinks", "decode_sinks_step", "LAYOUTS"]

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


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse_new: torch.Tensor, sinks: torch.Tensor,
               layout: str) -> torch.Tensor:
    """The sinks' gradient, (nheads,) like sinks: d s_h = -sum over the rows i of head h of exp(s_h - lse'_i) * D_i,
    D_i = rowsum(dO_i * out_i). dout, out: the step's output layout; lse_new: lse' in the producer's layout."""
    delta = (dout.float() * out.float()).sum(-1)  # D_i, (..., nheads) aligned with out
    p_sink = torch.exp(sinks.float() - _rows_view(lse_new, layout))
    return -(p_sink * delta).reshape(-1, sinks.shape[0]).sum(0).to(sinks.dtype)


def check_decode_sinks(sinks, q):
    """A decode call's sinks, before its kernels: (nheads,) float on q's device (a malformed q is left to the decode
    checks)."""
    if isinstance(q, torch.Tensor) and q.dim() in (3, 4):
        check_sinks(sinks, q.shape[-2], q.device)


def decode_sinks_step(o, lse, sinks, out, return_lse: bool):
    """The sinks step after a decode call's kernels: (out', lse') from their (o, lse) in the "decode" layout; out' is
    a new tensor, or ``out`` (the caller's, written in place) where one was given."""
    result, lse = apply_sinks(o, lse, sinks, "decode")
    if out is not None:
        result = out.copy_(result)
    return (result, lse) if return_lse else result
