"""One-token linear layers (GEMV) in Triton, with the elementwise op that feeds them fused into the input load.

A batch-1 decode step is 32 x 4 weight reads of 16-235 MB plus the small ops between them. Each small op is a
kernel launch of a few microseconds on an otherwise idle GPU, and every launch is a pipeline drain between two
bandwidth-bound GEMVs. This kernel reads its input vector through an optional prologue so the op before the GEMV
costs no launch of its own:

    PLAIN      y = W x
    SILU_MUL   y = W (silu(gate) * up),          x = [gate | up] (2K,)    (down_proj after gate_up_proj)
    RMSNORM    y = W norm(x)                                             (first layer's input norm)
    ADD_NORM   s = residual + x; y = W norm(s)   s is also stored to RES_OUT by the first program
                                                 (the residual stream: qkv_proj and gate_up_proj inputs)

Roundings follow the PyTorch (HF) ops they replace, exactly like flashdecode.engine.layers.fused: the residual sum,
the normalised vector, the norm-weight product, silu and silu*up are each rounded to the activation dtype, then the
dot product accumulates in float32 and rounds once (what cuBLAS does). Only the summation order differs.

Each program owns BLOCK_N output rows and walks K in BLOCK_K chunks; the norm prologues first sum the squares of
the (8 KB, L2-resident) input vector. Programs never write what another program reads: RES_OUT is a new tensor.

``pdl=True`` (the engine's setting, flashdecode.engine.layers.pdl): a programmatic dependent launch. Before waiting
for the previous kernel, each program hints the first PREFETCH_K columns of its weight rows into L2 (weights are
never written during a step); every read of X / RES and every store comes after the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdecode.engine.layers.pdl import (linear_launch_args, prefetch_weight_rows,
                                          wait_for_previous_kernel)

PLAIN, SILU_MUL, RMSNORM, ADD_NORM = 0, 1, 2, 3


@triton.jit
def _input_chunk(X, RES, NORM_W, offs, ok, K, inv_rms, PROLOGUE: tl.constexpr, EVEN_K: tl.constexpr):
    """float32 values (in the activation dtype's rounding) of the GEMV input at ``offs``; also the residual sum
    (ADD_NORM) so the caller can store it."""
    dt = X.dtype.element_ty
    if EVEN_K:
        x = tl.load(X + offs)
    else:
        x = tl.load(X + offs, mask=ok, other=0.0)
    s = x
    if PROLOGUE == 1:  # SILU_MUL: x is the gate, the up half sits K further
        if EVEN_K:
            u = tl.load(X + K + offs).to(tl.float32)
        else:
            u = tl.load(X + K + offs, mask=ok, other=0.0).to(tl.float32)
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        x = (act * u).to(dt)
    if PROLOGUE == 3:  # ADD_NORM: the residual sum first
        if EVEN_K:
            r = tl.load(RES + offs)
        else:
            r = tl.load(RES + offs, mask=ok, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        x = s
    if PROLOGUE >= 2:
        normed = (x.to(tl.float32) * inv_rms).to(dt)
        if EVEN_K:
            w = tl.load(NORM_W + offs)
        else:
            w = tl.load(NORM_W + offs, mask=ok, other=0.0)
        x = (w.to(tl.float32) * normed.to(tl.float32)).to(dt)
    return x.to(tl.float32), s


@triton.jit
def _gemv_kernel(X, RES, NORM_W, W, BIAS, OUT, RES_OUT, N, K, stride_w, eps,
                 PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_RES: tl.constexpr, EVEN_N: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
                 USE_PDL: tl.constexpr = False, PREFETCH_K: tl.constexpr = 0, LINE_ELEMS: tl.constexpr = 64):
    """OUT (N,) = W (N, K) @ prologue(X); see the module docstring for PROLOGUE. USE_PDL, PREFETCH_K (0: no
    prefetch) and LINE_ELEMS (elements of a 128-byte line): the module docstring's PDL."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_w
    if USE_PDL and PREFETCH_K > 0:
        prefetch_weight_rows(W, offs_n, N, stride_w, K, PREFETCH_K, LINE_ELEMS)
    wait_for_previous_kernel(USE_PDL)
    inv_rms = 1.0
    if PROLOGUE >= 2:  # sum of squares of the whole (residual-added) input
        sq = tl.zeros((NORM_BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):  # one trip for hidden sizes up to NORM_BLOCK: one L2 round trip
            offs = k0 + tl.arange(0, NORM_BLOCK)
            ok = offs < K
            x = tl.load(X + offs, mask=ok, other=0.0)
            if PROLOGUE == 3:
                r = tl.load(RES + offs, mask=ok, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            xf = x.to(tl.float32)
            sq += xf * xf
        inv_rms = tl.math.rsqrt(tl.sum(sq, axis=0) / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        ok = offs < K
        xk, s = _input_chunk(X, RES, NORM_W, offs, ok, K, inv_rms, PROLOGUE, EVEN_K)
        if STORE_RES:
            if pid == 0:
                tl.store(RES_OUT + offs, s, mask=ok)
        if EVEN_N and EVEN_K:
            w = tl.load(w_rows + offs[None, :])
        else:
            w = tl.load(w_rows + offs[None, :], mask=n_ok[:, None] & ok[None, :], other=0.0)
        acc += w.to(tl.float32) * xk[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:  # HF rounds the product before adding the bias
        y = y.to(OUT.dtype.element_ty).to(tl.float32) + tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(OUT + offs_n, y.to(OUT.dtype.element_ty), mask=n_ok)


def default_config(n: int, k: int, prologue: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). From the H100 sweep in `bench e2e --profile` (Llama-3-8B weights, bf16, us
    per GEMV; cuBLAS in brackets): 4096 rows - o_proj 14.7 (17.5), down_proj 44.9 (46.8) - want (16, 1024, 8);
    more rows - qkv 21.1 (21.1), gate_up 81.3 (83.1), lm_head 349.7 (387.3) - want (8, 512, 4). The norm
    prologues re-read the input vector in every program (L2 traffic), so they keep BLOCK_N >= 16: (16, 512, 4)
    measured 21.3 on qkv, (16, 1024, 8) 81.6 on gate_up."""
    if n <= 4096:
        return 16, 1024, 8
    if prologue in (RMSNORM, ADD_NORM):
        return (16, 512, 4) if n < 16384 else (16, 1024, 8)
    return 8, 512, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         prologue: int = PLAIN, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
         eps: float = 0.0, config: tuple[int, int, int] | None = None, pdl: bool = False):
    """One token through a linear layer.

    x: (1, K) activations (SILU_MUL: (1, 2K) = [gate | up]), contiguous. weight (N, K), row-major. bias (N,).
    residual (1, K) for ADD_NORM, norm_weight (K,) for RMSNORM/ADD_NORM. Returns y (1, N) in x's dtype, and for
    ADD_NORM also the new residual stream (1, K) = residual + x (a new tensor; ``residual`` is not modified).
    pdl: launch as a programmatic dependent (module docstring; only where pdl.pdl_supported).
    """
    n, k = weight.shape
    width = 2 * k if prologue == SILU_MUL else k
    if x.dim() != 2 or x.shape != (1, width) or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous (1, {width}) tensor, got {tuple(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("weight must be row-major (stride 1 along K)")
    if prologue in (RMSNORM, ADD_NORM) and norm_weight is None:
        raise ValueError("the norm prologues need norm_weight")
    if prologue == ADD_NORM and (residual is None or residual.shape != (1, k) or not residual.is_contiguous()):
        raise ValueError(f"ADD_NORM needs a contiguous (1, {k}) residual")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(residual) if prologue == ADD_NORM else out
    block_n, block_k, warps = config or default_config(n, k, prologue)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, out, res_out, n, k, weight.stride(0), eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None, STORE_RES=prologue == ADD_NORM, EVEN_N=n % block_n == 0,
        EVEN_K=k % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k,
        NORM_BLOCK=min(triton.next_power_of_2(k), 16384), num_warps=warps,
        **linear_launch_args(pdl, n, k, weight))
    return (out, res_out) if prologue == ADD_NORM else out
