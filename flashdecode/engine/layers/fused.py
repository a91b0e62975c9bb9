"""Fused elementwise kernels for the decode step: a CUDA-graphed token still launches every kernel, and at batch 1
each launch costs ~2 us of GPU time, so the ~40 small PyTorch ops per layer (RMSNorm in float32, rotary, silu*mul,
K/V writes) cost as much as reading a third of the weights. These Triton kernels do each group in one launch.

Each kernel reproduces the PyTorch (HF) op order and its roundings to the activation dtype, so results match the
unfused path (``fused=False``, the CPU default) to the last bit up to reduction order.

``pdl=True`` (the engine's setting, flashdecode.engine.layers.pdl; Hopper only, never under the interpreter): the
kernel is a programmatic dependent launch that waits for the previous kernel before its first memory access (all
their inputs are produced by the step) and then lets the next one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdecode.engine.layers.pdl import launch_options, wait_for_previous_kernel
from flashdecode.kernels.kv_quant import quantize_rows, row_scales
from flashdecode.ops.kv_quant import QMAX

# The engine's 8-bit pages written by rope_and_store (one launch per layer and step) instead of the unfused rotary
# + kv_quant.write_quantized (~18 small launches: ~1 ms of a Llama-3-8B b1 step at ~2 us each, the gap the fp8
# engine showed to the kernel timings, docs/decisions.md). Same codes and scales, bit for bit, on the CPU
# interpreter and the H100 (tests/test_engine_fused.py); Llama-3-8B b1 fp8 pages 114.0 -> 130.3 tok/s at 64k,
# 96.5 -> 108.0 at 128k (benchmarks/probes/engine_quant_store.py).
QUANT_ROPE_STORE = True


@triton.jit
def _add_rms_norm_kernel(X, RES, W, OUT, stride_x, stride_r, stride_o, HIDDEN, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
                         ROUND_NORMED: tl.constexpr = True):
    """One row: (residual += x; x = residual) then out = w * (x * rsqrt(mean(x^2) + eps)) in HF's roundings
    (ROUND_NORMED: Llama's cast of the normalised x before the weight; off: Gemma's float32 product)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < HIDDEN
    wait_for_previous_kernel(USE_PDL)
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(RES + row * stride_r + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(RES + row * stride_r + offs, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / HIDDEN
    normed = xf * tl.math.rsqrt(var + eps)
    if ROUND_NORMED:
        normed = normed.to(X.dtype.element_ty)
    w = tl.load(W + offs, mask=ok, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + row * stride_o + offs, out, mask=ok)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 pdl: bool = False, round_normed: bool = True):
    """x (tokens, hidden). With ``residual`` (same shape, contiguous, updated IN PLACE to residual + x) the norm
    is of the sum. Returns the normalised (tokens, hidden) tensor in x's dtype. pdl: see the module doc.
    round_normed False: Gemma's form (weight (hidden,) float32 = 1 + w, no cast before it multiplies)."""
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    _add_rms_norm_kernel[(tokens,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, eps,
                                    HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(hidden),
                                    USE_PDL=pdl, ROUND_NORMED=round_normed, **launch_options(pdl))
    return out


@triton.jit
def _qk_rms_norm_kernel(QKV, OUT, QW, KW, stride_t, stride_o, NHEADS, NHEADS_KV, eps, q_scale,
                        D: tl.constexpr, ROUND_NORMED: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Program (token, head) over the NHEADS q heads, the NHEADS_KV k heads and the v heads: RMSNorm of a q or k
    head's D values with q's or k's weight (q also times q_scale), in the order and roundings of the unfused
    norm (RMSNorm._norm); a v head is copied."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, D)
    wait_for_previous_kernel(USE_PDL)
    x = tl.load(QKV + t * stride_t + h * D + offs)
    xf = x.to(tl.float32)
    normed = xf * tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    is_q = h < NHEADS
    is_k = (h >= NHEADS) & (h < NHEADS + NHEADS_KV)
    w = (tl.load(QW + offs, mask=(offs < D) & is_q, other=0.0).to(tl.float32)
         + tl.load(KW + offs, mask=(offs < D) & is_k, other=0.0).to(tl.float32))
    scale = tl.where(is_q, q_scale, 1.0)
    if ROUND_NORMED:  # Llama form: cast, weight, cast, then the scale
        out = (w * normed.to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32) * scale
    else:  # Gemma form: float32 throughout
        out = normed * w * scale
    out = tl.where(is_q | is_k, out, xf)
    tl.store(OUT + t * stride_o + h * D + offs, out.to(OUT.dtype.element_ty))


def qk_rms_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, nheads: int, nheads_kv: int,
                head_dim: int, eps: float, q_scale: float = 1.0, round_normed: bool = True,
                pdl: bool = False) -> torch.Tensor:
    """qkv (tokens, (nheads + 2 nheads_kv) * head_dim) -> a new tensor like it whose q heads are
    RMSNorm(q_weight) * q_scale, k heads RMSNorm(k_weight), v heads copied, in one launch (Qwen3 / Gemma 3 q/k
    norms; weights (head_dim,) in the norms' dtypes; round_normed as in add_rms_norm). head_dim a power of two."""
    tokens = qkv.shape[0]
    if head_dim & (head_dim - 1) or qkv.stride(-1) != 1:
        raise ValueError(f"qk_rms_norm needs a power-of-two head_dim and unit-stride rows, got head_dim={head_dim}, "
                         f"strides {qkv.stride()}")
    out = torch.empty_like(qkv)
    if tokens:
        _qk_rms_norm_kernel[(tokens, nheads + 2 * nheads_kv)](
            qkv, out, q_weight, k_weight, qkv.stride(0), out.stride(0), nheads, nheads_kv, eps, q_scale, D=head_dim,
            ROUND_NORMED=round_normed, USE_PDL=pdl, **launch_options(pdl))
    return out


@triton.jit
def _rope_heads(X, OUT, row, stride_x, stride_o, c, s, NHEADS: tl.constexpr, HALF: tl.constexpr,
                BLOCK_H: tl.constexpr):
    """Rotate-half rotary of NHEADS heads of one token: out = x * cos + rotate_half(x) * sin (HF roundings)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, HALF)[None, :]
    ok = h < NHEADS
    base = X + row * stride_x + h * (2 * HALF) + j
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=ok, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    o1 = ((x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    obase = OUT + row * stride_o + h * (2 * HALF) + j
    tl.store(obase, o1, mask=ok)
    tl.store(obase + HALF, o2, mask=ok)
    return o1, o2


@triton.jit
def _rope_store_kernel(QKV, POS, COS, SIN, SLOTS, Q_OUT, K_OUT, V_OUT, K_CACHE, V_CACHE,
                       stride_qkv, stride_q, stride_k, stride_v, stride_tab, stride_page_slot,
                       NHEADS: tl.constexpr, NHEADS_KV: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_HK: tl.constexpr, USE_PDL: tl.constexpr = False,
                       K_SCALE=None, V_SCALE=None, QUANT: tl.constexpr = False, QMAX: tl.constexpr = 1.0):
    """One token: rotate q and k from the fused qkv row, write q/k/v out contiguously and k/v into its page slot.
    QUANT (8-bit pages): k/v are quantised as append_kv's per-token path does (kernels/kv_quant.py) and each kv
    head's float32 scales absmax / QMAX written at K_SCALE / V_SCALE + slot * NHEADS_KV + head."""
    row = tl.program_id(0).to(tl.int64)
    wait_for_previous_kernel(USE_PDL)
    pos = tl.load(POS + row)
    j = tl.arange(0, HALF)[None, :]
    dt = Q_OUT.dtype.element_ty
    c = tl.load(COS + pos * stride_tab + j).to(dt).to(tl.float32)  # table halves are equal (cat(freqs, freqs))
    s = tl.load(SIN + pos * stride_tab + j).to(dt).to(tl.float32)
    _rope_heads(QKV, Q_OUT, row, stride_qkv, stride_q, c, s, NHEADS, HALF, BLOCK_H)
    k1, k2 = _rope_heads(QKV + NHEADS * 2 * HALF, K_OUT, row, stride_qkv, stride_k, c, s, NHEADS_KV, HALF,
                         BLOCK_HK)
    h = tl.arange(0, BLOCK_HK)[:, None]
    ok = h < NHEADS_KV
    vb = QKV + row * stride_qkv + (NHEADS + NHEADS_KV) * 2 * HALF + h * (2 * HALF) + j
    v1 = tl.load(vb, mask=ok, other=0.0)
    v2 = tl.load(vb + HALF, mask=ok, other=0.0)
    ob = V_OUT + row * stride_v + h * (2 * HALF) + j
    tl.store(ob, v1, mask=ok)
    tl.store(ob + HALF, v2, mask=ok)
    slot = tl.load(SLOTS + row)  # int64: slot * row_size can exceed 2**31 on big pools
    cb = slot * stride_page_slot + h * (2 * HALF) + j
    if QUANT:
        k1, k2 = _quantize_halves(k1, k2, K_SCALE + slot * NHEADS_KV + h, ok, QMAX, K_CACHE.dtype.element_ty)
        v1, v2 = _quantize_halves(v1, v2, V_SCALE + slot * NHEADS_KV + h, ok, QMAX, V_CACHE.dtype.element_ty)
    tl.store(K_CACHE + cb, k1, mask=ok)
    tl.store(K_CACHE + cb + HALF, k2, mask=ok)
    tl.store(V_CACHE + cb, v1, mask=ok)
    tl.store(V_CACHE + cb + HALF, v2, mask=ok)


@triton.jit
def _quantize_halves(x1, x2, SCALE_PTRS, ok, QMAX: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The two halves (BLOCK_HK, HALF) of each kv head's row -> 8-bit OUT_DTYPE with one scale per head: absmax /
    QMAX over the whole row (NaN where it holds a NaN), stored at SCALE_PTRS (BLOCK_HK, 1) for the ``ok`` heads -
    the same codes and scales as append_kv's per-token path (kv_quant.row_scales / quantize_rows)."""
    x1 = tl.where(ok, x1.to(tl.float32), 0.0)
    x2 = tl.where(ok, x2.to(tl.float32), 0.0)
    # one (BLOCK_HK, 2 HALF) row per head for the scale (the column order does not matter to it)
    scale = row_scales(tl.reshape(tl.join(x1, x2), (x1.shape[0], 2 * x1.shape[1])), QMAX)
    tl.store(SCALE_PTRS, scale[:, None], mask=ok)
    return quantize_rows(x1, scale, QMAX, OUT_DTYPE), quantize_rows(x2, scale, QMAX, OUT_DTYPE)


def rope_supported(head_dim: int) -> bool:
    """The rope kernel tiles half a head with tl.arange, which needs a power of two (head dims 16 .. 256)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 1 and (half & (half - 1)) == 0


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                   slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, nheads: int,
                   nheads_kv: int, head_dim: int, pdl: bool = False, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None):
    """qkv (tokens, (nheads + 2 nheads_kv) head_dim) -> q (tokens, nheads, d), k, v (tokens, nheads_kv, d), all
    contiguous, q/k rotated; k/v also written to the paged cache (num_pages, page_size, nheads_kv, d) at the flat
    int64 ``slot_mapping``. cos/sin_table float32 (max_positions, d); positions int64 (tokens,). pdl: see the
    module doc. 8-bit caches (float8_e4m3fn / int8, engine/kv_quant.py QuantPages): k_scale / v_scale float32
    (num_pages, page_size, nheads_kv) contiguous receive each written token's per-head scales, and the codes are
    append_kv's (the unfused path: rotary, then kv_quant.write_quantized)."""
    tokens = qkv.shape[0]
    q = torch.empty((tokens, nheads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((tokens, nheads_kv, head_dim), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    if qkv.stride(1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("rope_and_store needs a row-major qkv and contiguous caches")
    quant = k_cache.dtype in QMAX
    if quant != (k_scale is not None and v_scale is not None):
        raise ValueError(f"k_scale / v_scale: needed exactly for an 8-bit cache (k_cache dtype {k_cache.dtype})")
    scales = {}
    if quant:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc.dtype != torch.float32 or tuple(sc.shape) != tuple(k_cache.shape[:-1]) or not sc.is_contiguous():
                raise ValueError(f"{name} must be float32 {tuple(k_cache.shape[:-1])} contiguous, got {sc.dtype} "
                                 f"{tuple(sc.shape)}")
        scales = dict(K_SCALE=k_scale, V_SCALE=v_scale, QUANT=True, QMAX=QMAX[k_cache.dtype])
    _rope_store_kernel[(tokens,)](
        qkv, positions, cos_table, sin_table, slot_mapping, q, k, v, k_cache, v_cache,
        qkv.stride(0), q.stride(0), k.stride(0), v.stride(0), cos_table.stride(0), nheads_kv * head_dim,
        NHEADS=nheads, NHEADS_KV=nheads_kv, HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(nheads),
        BLOCK_HK=triton.next_power_of_2(nheads_kv), USE_PDL=pdl, **scales, **launch_options(pdl),
        # no FMA contraction: with float32 activations x * cos + rotate_half(x) * sin would become one fused
        # multiply-add, one rounding fewer than PyTorch's rotary (so the two paths' pages would differ)
        enable_fp_fusion=False)
    return q, k, v


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_o, INTER, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < INTER
    wait_for_previous_kernel(USE_PDL)
    g = tl.load(GU + row * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + INTER + offs, mask=ok, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(OUT + row * stride_o + offs, (act * u).to(dt), mask=ok)


def silu_and_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """gate_up (tokens, 2 * inter) = [gate | up] -> silu(gate) * up, (tokens, inter). pdl: see the module doc."""
    tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(tokens, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                          BLOCK=block, USE_PDL=pdl, **launch_options(pdl))
    return out

