"""The Triton prefill's forward and backward launches (flash_attn, flash_attn_varlen): each takes a call's checked
tensors and normalised options, finds its plan (ops/attention_plans.py), allocates the outputs and launches; on
Hopper the Gluon kernels take the calls their dispatch accepts (ops/gluon_attention.py, ops/gluon_backward.py).
"""

from __future__ import annotations

import torch

from flashdecode.ops import gluon_attention, gluon_backward
from flashdecode.ops.attention_config import RESOLVE_CONFIG, gluon_allowed
from flashdecode.ops.attention_plans import (_bwd_plan, _dense_call, _fwd_plan, _lse_strides, _shape_info,
                                             _strides)
from flashdecode.ops.checks import FP8_DTYPE
from flashdecode.ops.fp8_v_transpose import fp8_v_transposed
from flashdecode.ops.score_transform import logit_scales_of
from flashdecode.ops.util import cdiv

FP8_OUT_DTYPE = torch.bfloat16


def _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
              config_id=RESOLVE_CONFIG, qk_descale=None, v_descale=None, alibi_slopes=None):
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
        if (not fp8 and alibi_slopes is None and gluon_allowed(config_id) and scale > 0
                and gluon_attention.gluon_varlen_forward_into(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sq,
                                                              scale, left, right, softcap)):
            return out, lse  # the Gluon kernel on Hopper where it applies (ops/gluon_attention.py)
    v_layout, v_kernel, alibi_stride = None, v, 0
    if fp8:
        v_descale = v_descale.contiguous()
        if (not varlen and alibi_slopes is None and gluon_allowed(config_id)
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
    qk_scale, softcap_log2 = logit_scales_of(scale, softcap)
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
              softcap, deterministic=True, config_id=RESOLVE_CONFIG, alibi_slopes=None):
    """dq, dk, dv like q, k, v. deterministic: dK/dV and dQ computed by different programs, no atomics (bitwise
    reproducible), either in one launch (config.bwd_fused) or two; otherwise one dK/dV pass that adds dQ into an
    fp32 buffer with atomics, then scales and casts it."""
    varlen, batch, sq, sk, nheads, nheads_kv = _shape_info(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if batch == 0 or q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    if not varlen and alibi_slopes is None and gluon_allowed(config_id):  # sm_90: the Gluon backward
        grads = gluon_backward.gluon_backward_if_supported(dout, q, k, v, out, lse, scale, left, right, softcap,
                                                       deterministic)
        if grads is not None:
            return grads
    if varlen:  # the kernels read cu_seqlens with a unit stride
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
        if alibi_slopes is None and gluon_allowed(config_id):  # sm_90, while PREFILL_RAGGED_GLUON_BWD is on
            grads = gluon_backward.gluon_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sq,
                                                         sk, scale, left, right, softcap, deterministic)
            if grads is not None:
                return grads
    lse = lse.contiguous()  # the kernels take lse's strides as those of a contiguous tensor (a no-op for ours)
    strides = (_strides(q, varlen), _strides(k, varlen), _strides(v, varlen))
    do_strides = _strides(dout, varlen)
    alibi_stride = alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
    plan = _bwd_plan(q, k, v, dout, strides, do_strides, cu_seqlens_q, cu_seqlens_k, sq, sk, left, right, softcap,
                     deterministic, config_id, alibi_slopes, alibi_stride)
    # atomic mode: fp32 accumulator (contiguous, shape of q), zeroed; deterministic mode: the output itself
    dq = torch.empty_like(q) if deterministic else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    delta, lse2 = _bwd_delta(plan, dout, out, lse, cu_seqlens_q, varlen, batch, sq, nheads)
    qk_scale, softcap_log2 = logit_scales_of(scale, softcap)
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
