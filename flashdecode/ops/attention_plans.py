"""The Triton prefill's launch plans: everything a flash_attn / flash_attn_varlen launch depends on besides the data,
kept per launch key in ops/launch_cache.py PlanCaches. A forward plan (_FwdPlan) and a backward plan (_BwdPlan)
hold the configuration and the TunedKernels of one key; a dense call (_DenseCall) holds a plain dense forward
ready to launch: on Hopper the Gluon plan where the dispatch sends the call there (ops/gluon_attention.py), else
the Triton kernel with its grid and the arguments its key fixes.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdecode import heuristics
from flashdecode.kernels import bwd as bwd_kernels
from flashdecode.kernels import fwd as fwd_kernels
from flashdecode.ops import direct_launch, gluon_attention
from flashdecode.ops.attention_config import config_for, gluon_allowed, head_dim_pad
from flashdecode.ops.checks import FP8_DTYPE
from flashdecode.ops.launch_cache import PlanCache, TunedKernel
from flashdecode.ops.score_transform import logit_scales_of
from flashdecode.ops.util import aligned_bits, autotune_enabled, cdiv, interpreting_now, tma_layout_ok

# the tile constexprs of each kernel, in the order of a tile tuple (warps and stages follow them)
_FWD_TILE = ("BLOCK_M", "BLOCK_N")
_DKDV_TILE = ("BLOCK_N", "BLOCK_M")
_DQ_TILE = ("BLOCK_M", "BLOCK_N")
_FUSED_TILE = ("BLOCK_N", "BLOCK_M", "BLOCK_M2", "BLOCK_N2", "SPLIT_DKDV")


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


def _launch_key(q, k, v, strides, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right, softcap,
                config_id, alibi_slopes=None, alibi_stride=0, v_descale=None):
    """What the configuration, the kernel choice and Triton's specialisation of a call depend on: shapes, strides
    (of q, k, v), dtype, device, pointer alignment, mask flags, the configuration and the autotune switch; for
    varlen tensors, whose packed lengths stay out of it, the shape buckets and length class of max_seqlen_q/k
    (dense shapes imply them). ALiBi adds its flag and batch stride; FP8 the v_descale's alignment (the product
    q_descale * k_descale is a fresh tensor)."""
    extra = () if alibi_slopes is None and v_descale is None else (
        alibi_slopes is not None, alibi_stride, aligned_bits(alibi_slopes, v_descale))
    if cu_seqlens_q is None:
        return (q.shape, k.shape, strides, q.dtype, q.device, aligned_bits(q, k, v), left >= 0, right >= 0,
                softcap > 0.0, config_id, autotune_enabled()) + extra
    return (q.shape[1:], k.shape[1:], strides, q.dtype, q.device, aligned_bits(q, k, v, cu_seqlens_q, cu_seqlens_k),
            left >= 0, right >= 0, softcap > 0.0, config_id, autotune_enabled(),
            heuristics.seqlen_bucket(max_seqlen_q), heuristics.seqlen_bucket(max_seqlen_k),
            heuristics.prefill_length_class(max_seqlen_k)) + extra


def _buckets(max_seqlen_q: int, max_seqlen_k: int) -> tuple[int, int]:
    """The autotune-key arguments bucket_q, bucket_k (a plan stores them: its key implies them)."""
    return heuristics.seqlen_bucket(max_seqlen_q), heuristics.seqlen_bucket(max_seqlen_k)


def _common_constexprs(headdim, varlen, left, right, softcap, dtype, has_alibi=False):
    constexprs = dict(HEAD_DIM=headdim, HEAD_DIM_PAD=head_dim_pad(headdim, dtype), IS_VARLEN=varlen,
                      HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=softcap > 0.0,
                      DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
    if has_alibi:  # only when on: the kernels' defaults are off, so other launches keep their exact constexprs
        constexprs["HAS_ALIBI"] = True
    return constexprs


def _shape_info(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
    varlen = cu_seqlens_q is not None
    if varlen:
        return varlen, cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1]
    return varlen, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2]


class _FwdPlan:
    """The forward of one launch key: its configuration and kernel."""

    __slots__ = ("config", "kernel", "buckets")

    def __init__(self, q, k, v, out, cu_seqlens_q, max_seqlen_q, max_seqlen_k, left, right, softcap, config_id,
                 has_alibi=False, v_layout=None):
        """v_layout: the tensor whose layout the V loads see (FP8: the transposed copy), default v."""
        varlen = cu_seqlens_q is not None
        self.buckets = _buckets(max_seqlen_q, max_seqlen_k)
        self.config = config_for(config_id, q, k, v, max_seqlen_k, True)
        use_tma = self.config.fwd_tma and tma_layout_ok(q, k, v if v_layout is None else v_layout, out)
        constexprs = _common_constexprs(q.shape[-1], varlen, left, right, softcap, q.dtype, has_alibi)
        constexprs["USE_TMA"] = use_tma
        if q.dtype == FP8_DTYPE:
            constexprs["IS_FP8"] = True
            if interpreting_now():  # the interpreter's fp32 -> e4m3 cast mis-rounds (see fwd.round_to_e4m3)
                constexprs["FP8_SOFT_ROUND"] = True
        self.kernel = TunedKernel("fwd", fwd_kernels.attn_fwd_kernel, self.config.fwd_tiles, _FWD_TILE,
                              self.config.fwd_autotune, constexprs)


class _BwdPlan:
    """The backward of one launch key (with dout's layout and the determinism flag): its configuration and
    kernels (the atomic dK/dV kernel, the one-launch kernel, or the dK/dV and dQ kernels)."""

    __slots__ = ("config", "mode", "delta", "dkdv", "dq", "buckets")

    def __init__(self, q, k, v, dout, cu_seqlens_q, max_seqlen_q, max_seqlen_k, left, right, softcap, deterministic,
                 config_id, has_alibi=False):
        varlen = cu_seqlens_q is not None
        self.buckets = _buckets(max_seqlen_q, max_seqlen_k)
        config = self.config = config_for(config_id, q, k, v, max_seqlen_k, deterministic)
        # the interpreter has descriptor loads but no descriptor reduction (the atomic dQ path)
        use_tma = (config.bwd_tma and tma_layout_ok(q, k, v, dout)
                   and (deterministic or not interpreting_now()))
        constexprs = _common_constexprs(q.shape[-1], varlen, left, right, softcap, q.dtype, has_alibi)
        constexprs["USE_TMA"] = use_tma
        fn = bwd_kernels.attn_bwd_dkdv_kernel
        # the preprocess: (BLOCK_M, warps, stages) as a plain launch would take them
        self.delta = TunedKernel("bwd_delta", bwd_kernels.attn_bwd_delta_kernel,
                             ((64 if q.shape[-1] <= 128 else 32, 4, 3),), ("BLOCK_M",), False,
                             dict(HEAD_DIM=q.shape[-1], HEAD_DIM_PAD=head_dim_pad(q.shape[-1]), IS_VARLEN=varlen))
        self.dq = None
        if not deterministic:
            self.mode = "atomic"
            self.dkdv = TunedKernel("bwd_atomic", fn, config.bwd_atomic_tiles, _DKDV_TILE, config.bwd_autotune,
                                dict(constexprs, ATOMIC_DQ=True), reset_dq=True)
        elif config.bwd_fused:
            self.mode = "fused"
            self.dkdv = TunedKernel("bwd_fused", fn, config.bwd_fused_tiles, _FUSED_TILE, config.bwd_autotune,
                                dict(constexprs, FUSED_DQ=True))
        else:
            self.mode = "two_pass"
            self.dkdv = TunedKernel("bwd_dkdv", fn, config.bwd_dkdv_tiles, _DKDV_TILE, config.bwd_autotune, constexprs)
            self.dq = TunedKernel("bwd_dq", bwd_kernels.attn_bwd_dq_kernel, config.bwd_dq_tiles, _DQ_TILE,
                              config.bwd_autotune, constexprs)


_FWD_PLANS = PlanCache()
_BWD_PLANS = PlanCache()


def _fwd_plan(q, k, v, v_kernel, out, strides, cu_seqlens_q, cu_seqlens_k, sq, sk, left, right, softcap, config_id,
              alibi_slopes=None, alibi_stride=0, v_descale=None, v_layout=None) -> _FwdPlan:
    """The Triton forward plan of this launch key (built on its first call)."""
    key = _launch_key(q, k, v_kernel, strides, cu_seqlens_q, cu_seqlens_k, sq, sk, left, right, softcap, config_id,
                      alibi_slopes, alibi_stride, v_descale)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        plan = _FWD_PLANS.put(key, _FwdPlan(q, k, v, out, cu_seqlens_q, sq, sk, left, right, softcap,
                                                      config_id, alibi_slopes is not None, v_layout))
    return plan


def _bwd_plan(q, k, v, dout, strides, do_strides, cu_seqlens_q, cu_seqlens_k, sq, sk, left, right, softcap,
              deterministic, config_id, alibi_slopes=None, alibi_stride=0) -> _BwdPlan:
    """The Triton backward plan of this launch key (with dout's layout and the determinism flag)."""
    key = (_launch_key(q, k, v, strides, cu_seqlens_q, cu_seqlens_k, sq, sk, left, right, softcap, config_id,
                       alibi_slopes, alibi_stride),
           do_strides, aligned_bits(dout), deterministic)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        plan = _BWD_PLANS.put(key, _BwdPlan(q, k, v, dout, cu_seqlens_q, sq, sk, left, right, softcap,
                                            deterministic, config_id, alibi_slopes is not None))
    return plan


# ----------------------------------------------------------------------------------------------------------------
# Dense forwards (no FP8, no ALiBi): one cache from a call's signature to its ready forward, shared by flash_attn's
# eager path and the forward op
# ----------------------------------------------------------------------------------------------------------------

_DENSE_CALLS = PlanCache()


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
            softcap > 0.0, config_id, interpreting_now(), autotune_enabled())


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
        if gluon_allowed(config_id) and not self.empty:
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
            qk_scale, softcap_log2 = logit_scales_of(scale, softcap)
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
        qk_scale, softcap_log2 = logit_scales_of(scale, softcap)
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
        """As GluonPlan.lse_discard: the address the kernel may write an unwanted lse to, or None."""
        if self.discard_lse is None:
            nbytes = self.lse_shape[0] * self.lse_shape[1] * self.lse_shape[2] * 4
            self.discard_lse = direct_launch.discard_address(self.device, nbytes)
        return self.discard_lse or None


def _dense_call(q, k, v, left: int, right: int, softcap: float, config_id: int) -> _DenseCall:
    """The ready forward of this dense call's key (built on its first call; inputs already checked)."""
    key = _dense_key(q, k, v, left, right, softcap, config_id)
    call = _DENSE_CALLS.get(key)
    if call is None:
        call = _DENSE_CALLS.put(key, _DenseCall(q, k, v, left, right, softcap, config_id))
    return call
