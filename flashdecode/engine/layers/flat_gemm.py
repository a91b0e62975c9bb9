"""Flat GEMM for batched-decode linear layers (FlashDecoding++'s small-M GEMM) and the per-shape choice table.

A decode step at batch M = 2..64 multiplies a flat (M, K) activation by an (N, K) weight: the weight read dominates
(the problem is bandwidth-bound like the batch-1 GEMV) but M rows allow tensor cores. cuBLAS pads M up to a tile of
64 or 128 rows and may launch too few programs for the N dimension. This kernel pads M only to BLOCK_M = 16 (the
smallest tensor-core tile Triton's dot takes), splits N finely (BLOCK_N 32..128) so every SM streams weight rows,
and lets Triton double-buffer the K loop (num_stages >= 2). The input goes through the same optional prologues as
the batch-1 GEMV (flashdecode.engine.layers.gemv), applied per row with the same roundings:

    PLAIN      Y = X W^T
    SILU_MUL   Y = (silu(G) * U) W^T,       X = [G | U] (M, 2K)
    RMSNORM    Y = norm(X) W^T
    ADD_NORM   S = R + X; Y = norm(S) W^T   S stored to RES_OUT by the programs of the first N block

The output goes through an optional epilogue (``epilogue=``), with the roundings of the kernel it replaces:

    EPILOGUE_NONE      OUT = Y (M, N)
    EPILOGUE_SILU_MUL  OUT = silu(G) * U (M, N/2),  Y = [G | U]: W (N, K) holds the gate rows [0, N/2) and the up rows
                       [N/2, N) (the MLP's gate_up_proj); each program accumulates its BLOCK_N gate columns and the
                       same BLOCK_N up columns in one K loop, so silu*mul costs no launch (and [G | U] no round trip)

``pdl=True`` (the engine's setting, flashdecode.engine.layers.pdl): a programmatic dependent launch. Before waiting
for the previous kernel, the programs of the first M block hint the first PREFETCH_K columns of their weight rows
into L2 (weights are never written during a step); every read of X / RES and every store comes after the wait.

Whether the flat GEMM or cuBLAS (torch.matmul) runs is a per-(M, N, K) decision measured on the device: the
``ChoiceTable`` times both for the shapes a model has and keeps the flat GEMM only where it wins by a margin.
benchmarks/probes/flat_gemm.py prints the same comparison as a table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from flashdecode.engine.layers.pdl import (linear_launch_args, prefetch_weight_rows,
                                          wait_for_previous_kernel)
from flashdecode.engine.layers.gemv import ADD_NORM, PLAIN, RMSNORM, SILU_MUL
from flashdecode.kernels.dot import dot

logger = logging.getLogger(__name__)

# the epilogues (module docstring)
EPILOGUE_NONE, EPILOGUE_SILU_MUL = 0, 1

MAX_M = 64
# Whether an engine start measures the silu*mul epilogue for its [gate | up] layers (ChoiceTable.silu_mul): on the
# H100 it was 3-9% faster than cuBLAS + silu_and_mul at M = 2..16 and bitwise equal (docs/decisions.md).
SILU_MUL_EPILOGUE = True
WIN_MARGIN = 0.97  # the flat GEMM must be at least 3% faster than cuBLAS to be chosen (timing noise)


@triton.jit
def _row_inv_rms(X, RES, offs_m, m_ok, stride_x, stride_r, K, eps, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
                 NORM_BLOCK: tl.constexpr):
    """1 / rms of each row of the (residual-added) input, float32 (BLOCK_M,)."""
    sq = tl.zeros((BLOCK_M, NORM_BLOCK), dtype=tl.float32)
    for k0 in range(0, K, NORM_BLOCK):
        offs = k0 + tl.arange(0, NORM_BLOCK)
        mask = m_ok[:, None] & (offs < K)[None, :]
        x = tl.load(X + offs_m[:, None] * stride_x + offs[None, :], mask=mask, other=0.0)
        if PROLOGUE == 3:
            r = tl.load(RES + offs_m[:, None] * stride_r + offs[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        xf = x.to(tl.float32)
        sq += xf * xf
    return tl.math.rsqrt(tl.sum(sq, axis=1) / K + eps)


@triton.jit
def _flat_gemm_kernel(X, RES, NORM_W, W, BIAS, OUT, RES_OUT, M, N, K, strides_x, strides_r, stride_w, stride_out,
                      eps, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_RES: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NORM_BLOCK: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
                      PREFETCH_K: tl.constexpr = 0, LINE_ELEMS: tl.constexpr = 64, EPILOGUE: tl.constexpr = 0):
    """OUT (M, N) = epilogue(prologue(X) (M, K) @ W^T); see the module docstring for PROLOGUE and EPILOGUE. N counts
    output columns: W is (N, K), or (2N, K) = [gate | up] rows for EPILOGUE_SILU_MUL (BIAS (N,) / (2N,) alike).
    strides_x / strides_r: row strides of X and of RES / RES_OUT (the column stride is 1). USE_PDL, PREFETCH_K (0: no
    prefetch) and LINE_ELEMS (elements of a 128-byte line): the module docstring's PDL."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    dt = X.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * strides_x
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_w
    if EPILOGUE == 1:  # the up row of output column n is weight row N + n
        up_rows = W + (N + offs_n).to(tl.int64)[:, None] * stride_w
    if USE_PDL and PREFETCH_K > 0:
        if pid_m == 0:  # the other M blocks read the same rows
            prefetch_weight_rows(W, offs_n, N, stride_w, K, PREFETCH_K, LINE_ELEMS)
            if EPILOGUE == 1:
                prefetch_weight_rows(W, N + offs_n, 2 * N, stride_w, K, PREFETCH_K, LINE_ELEMS)
    wait_for_previous_kernel(USE_PDL)
    inv_rms = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    if PROLOGUE >= 2:
        inv_rms = _row_inv_rms(X, RES, offs_m.to(tl.int64), m_ok, strides_x, strides_r, K, eps, PROLOGUE,
                               BLOCK_M, NORM_BLOCK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EPILOGUE == 1:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x_mask = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0)
        if PROLOGUE == 1:  # SILU_MUL: the up half of each row sits K further
            u = tl.load(x_rows + K + offs_k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            g = x.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            x = (act * u).to(dt)
        if PROLOGUE == 3:  # ADD_NORM: the residual sum first (stored once, by the first N block)
            r_off = offs_m.to(tl.int64)[:, None] * strides_r + offs_k[None, :]
            r = tl.load(RES + r_off, mask=x_mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
            if STORE_RES:
                if pid_n == 0:
                    tl.store(RES_OUT + r_off, x, mask=x_mask)
        if PROLOGUE >= 2:
            normed = (x.to(tl.float32) * inv_rms[:, None]).to(dt)
            nw = tl.load(NORM_W + offs_k, mask=k_ok, other=0.0)
            x = (nw.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dt)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if EPILOGUE == 1:  # both halves' tiles in flight before the dots; x is loaded (and prologued) once
            wu = tl.load(up_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += dot(x.to(w.dtype), tl.trans(w), input_precision=PRECISION)
        if EPILOGUE == 1:
            acc_up += dot(x.to(wu.dtype), tl.trans(wu), input_precision=PRECISION)
    if HAS_BIAS:  # HF rounds the product before adding the bias
        acc = acc.to(OUT.dtype.element_ty).to(tl.float32) + \
            tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE == 1:  # what fused.silu_and_mul computes from the [gate | up] the unfused GEMM would have stored
        if HAS_BIAS:
            acc_up = acc_up.to(dt).to(tl.float32) + \
                tl.load(BIAS + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        g = acc.to(dt).to(tl.float32)
        u = acc_up.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        acc = act * u
    out = OUT + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclasses.dataclass(frozen=True)
class FlatGemmConfig:
    """Tile sizes and launch settings of one flat GEMM launch."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int, n: int, k: int) -> FlatGemmConfig:
    """A starting point before measurement: narrow N tiles when N is small so every SM gets weight rows."""
    return FlatGemmConfig(block_n=32 if n <= 4096 else 64, block_k=128, num_warps=4, num_stages=3)


def flat_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, prologue: int = PLAIN,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
              config: FlatGemmConfig | None = None, pdl: bool = False, epilogue: int = EPILOGUE_NONE):
    """M tokens through a linear layer (M <= 64).

    x: (M, K) activations (SILU_MUL: (M, 2K) = [gate | up]), unit stride along K. weight (N, K) row-major, bias
    (N,), in x's dtype. residual (M, K) for ADD_NORM (unit stride along K), norm_weight (K,) for RMSNORM/ADD_NORM.
    Returns Y (M, N) in x's dtype - EPILOGUE_SILU_MUL: silu(Y[:, :N/2]) * Y[:, N/2:] (M, N/2), bit for bit
    fused.silu_and_mul of the EPILOGUE_NONE output (N even; config.block_n tiles the N/2 output columns, each program
    reads 2 block_n weight rows) - and for ADD_NORM also the new residual stream (M, K) = residual + x (a new tensor;
    ``residual`` is not modified). pdl: launch as a programmatic dependent (module docstring; only where
    pdl.pdl_supported).
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("x and weight must be tensors")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be a row-major (N, K) tensor, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    width = 2 * k if prologue == SILU_MUL else k
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(f"x must be (M, {width}) with unit stride along its last dim, got {tuple(x.shape)}")
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x must have 1..{MAX_M} rows (the flat GEMM is for decode batches), got {m}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"x, weight and bias must share one dtype, got {x.dtype}, {weight.dtype}"
                        f"{'' if bias is None else f', {bias.dtype}'}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be ({n},), got {tuple(bias.shape)}")
    if prologue not in (PLAIN, SILU_MUL, RMSNORM, ADD_NORM):
        raise ValueError(f"prologue must be PLAIN, SILU_MUL, RMSNORM or ADD_NORM, got {prologue!r}")
    if isinstance(epilogue, bool) or epilogue not in (EPILOGUE_NONE, EPILOGUE_SILU_MUL):
        raise ValueError(f"epilogue must be EPILOGUE_NONE or EPILOGUE_SILU_MUL, got {epilogue!r}")
    if epilogue == EPILOGUE_SILU_MUL and n % 2:
        raise ValueError(f"epilogue=EPILOGUE_SILU_MUL needs a weight of [gate | up] rows (an even N), got N = {n}")
    if prologue in (RMSNORM, ADD_NORM) and (norm_weight is None or norm_weight.shape != (k,)):
        raise ValueError(f"the norm prologues need a ({k},) norm_weight")
    if prologue == ADD_NORM and (residual is None or residual.shape != (m, k) or residual.stride(1) != 1):
        raise ValueError(f"ADD_NORM needs an ({m}, {k}) residual with unit stride along its last dim")
    n_out = n // 2 if epilogue == EPILOGUE_SILU_MUL else n
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if prologue == ADD_NORM else out
    res = residual if prologue == ADD_NORM else x
    cfg = config or default_config(m, n, k)
    grid = (triton.cdiv(n_out, cfg.block_n), triton.cdiv(m, 16))
    _flat_gemm_kernel[grid](
        x, res, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else weight, out,
        res_out, m, n_out, k, x.stride(0), res.stride(0), weight.stride(0), out.stride(0), eps,
        PROLOGUE=prologue, EPILOGUE=epilogue, HAS_BIAS=bias is not None, STORE_RES=prologue == ADD_NORM, BLOCK_M=16,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NORM_BLOCK=min(triton.next_power_of_2(k), 1024),
        # float32 models get float32 products (no TF32 rounding); half types use the tensor cores as they are
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **linear_launch_args(pdl, n, k, weight))
    return (out, res_out) if prologue == ADD_NORM else out


# ------------------------------------------------------------------------------------------------ choice table
CANDIDATE_CONFIGS = tuple(FlatGemmConfig(bn, bk, w, s) for bn in (32, 64, 128) for bk in (64, 128, 256)
                          for w in (4, 8) for s in (2, 3, 4) if not (bn == 128 and bk == 256 and s == 4))
# a handful of configs for measuring at engine start (the full CANDIDATE_CONFIGS sweep is the probe's)
QUICK_CONFIGS = (FlatGemmConfig(32, 128, 4, 3), FlatGemmConfig(64, 128, 4, 3), FlatGemmConfig(64, 256, 8, 3),
                 FlatGemmConfig(128, 128, 8, 3), FlatGemmConfig(32, 256, 4, 4))
M_BUCKETS = (2, 4, 8, 16, 32, 64)


def m_bucket(m: int) -> int:
    """The measured batch size a decode batch of ``m`` rows uses (the next bucket up, as the CUDA graphs pad)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    raise ValueError(f"m must be <= {M_BUCKETS[-1]}, got {m}")


def rotated_graph_timer(fns: list[Callable[[], object]]) -> float:
    """Median microseconds per call, CUDA-graph replays cycling through ``fns`` (one per weight copy, together
    beyond L2, so no call finds its weight in L2 - as in a decode step, where each layer's weight is read once)."""
    from flashdecode.timing import cuda_graph_time_us

    return cuda_graph_time_us(fns)


def fastest_config(timer: Callable[[list[Callable[[], object]]], float], configs: Iterable[FlatGemmConfig],
                   fns_for: Callable[[FlatGemmConfig], list[Callable[[], object]]]
                   ) -> tuple[float, FlatGemmConfig | None]:
    """(us, config) of the fastest of ``configs``, each timed as timer(fns_for(config)) (one closure per weight
    copy); a config whose kernel needs more shared memory than the device has (the silu*mul epilogue stages two
    weight tiles) is skipped - its launch fails in the timer's warm-up; (inf, None) where none fits."""
    timed = []
    for config in configs:
        try:
            timed.append((timer(fns_for(config)), config))
        except OutOfResources:
            continue
    return min(timed, key=lambda t: t[0]) if timed else (float("inf"), None)


@dataclasses.dataclass
class Choice:
    """The measured winner of one (M bucket, N, K): "flat" (with its config) or "cublas", and both times (us).
    For the silu*mul epilogue (ChoiceTable.silu_mul): "flat" is the fused launch (flat_us its time), "cublas" the
    layer's own GEMM (the plain choice) followed by fused.silu_and_mul (cublas_us)."""

    kernel: str
    config: FlatGemmConfig | None
    flat_us: float
    cublas_us: float


class ChoiceTable:
    """Per-(M bucket, N, K) choice between the flat GEMM and cuBLAS, measured on the device.

    ``measure`` times, for each shape, cuBLAS (torch.matmul through F.linear) and every candidate flat-GEMM config
    (``configs``), and keeps the flat GEMM only where its best config beats cuBLAS by WIN_MARGIN. ``timer`` takes
    one closure per weight copy and returns microseconds per call; it is injectable (tests), the default is
    rotated_graph_timer.
    """

    def __init__(self):
        self.choices: dict[tuple[int, int, int], Choice] = {}
        self.silu_mul: dict[tuple[int, int, int], Choice] = {}  # [gate | up] layers: the fused epilogue or not

    def choose(self, m: int, n: int, k: int) -> FlatGemmConfig | None:
        """The flat-GEMM config to use for this shape, or None for cuBLAS (also for unmeasured shapes)."""
        if not 2 <= m <= MAX_M:
            return None
        choice = self.choices.get((m_bucket(m), n, k))
        return choice.config if choice is not None and choice.kernel == "flat" else None

    def choose_silu_mul(self, m: int, n: int, k: int) -> FlatGemmConfig | None:
        """The config of the flat GEMM with the silu*mul epilogue for a [gate | up] (n, k) layer at m rows, or
        None: the layer's GEMM (``choose``) then silu_and_mul (also for unmeasured shapes)."""
        if not 2 <= m <= MAX_M:
            return None
        choice = self.silu_mul.get((m_bucket(m), n, k))
        return choice.config if choice is not None and choice.kernel == "flat" else None

    def measure(self, shapes: Iterable[tuple[int, int]], dtype: torch.dtype, device, *,
                m_values: Iterable[int] = M_BUCKETS, configs: Iterable[FlatGemmConfig] = CANDIDATE_CONFIGS,
                timer: Callable[[list[Callable[[], object]]], float] | None = None,
                copies: int | None = None, silu_mul_shapes: Iterable[tuple[int, int]] = ()) -> "ChoiceTable":
        """Measure every (m, n, k) for ``shapes`` = [(n, k), ...] (the model's linear layers) and m in m_values;
        then, for ``silu_mul_shapes`` (the [gate | up] layers among them), the silu*mul epilogue against the
        plain choice followed by fused.silu_and_mul. ``copies``: weight copies rotated per timing (default: enough
        to exceed L2 four times)."""
        timer = timer or rotated_graph_timer
        configs = tuple(configs)
        silu_mul_shapes = set(silu_mul_shapes)
        gen = torch.Generator(device=device).manual_seed(0)
        for n, k in dict.fromkeys(shapes):
            if copies is None:
                from flashdecode.timing import rotation_count

                sets = rotation_count(n * k * torch.empty((), dtype=dtype).element_size())
            else:
                sets = copies
            ws = [(torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(dtype) for _ in range(sets)]
            for m in m_values:
                x = torch.randn(m, k, generator=gen, device=device).to(dtype)
                cublas = timer([lambda w=w: F.linear(x, w) for w in ws])
                best_us, best = fastest_config(
                    timer, configs, lambda c: [lambda w=w, c=c: flat_gemm(x, w, config=c) for w in ws])
                wins = best_us < WIN_MARGIN * cublas
                self.choices[(m_bucket(m), n, k)] = Choice("flat" if wins else "cublas", best if wins else None,
                                                           best_us, cublas)
                if (n, k) in silu_mul_shapes:
                    self.silu_mul[(m_bucket(m), n, k)] = self._measure_silu_mul(x, ws, configs, timer)
        return self

    def _measure_silu_mul(self, x, ws, configs, timer) -> Choice:
        """The silu*mul epilogue's best config at x's rows against the plain choice + silu_and_mul (measured
        before it), kept only where it wins by WIN_MARGIN."""
        from flashdecode.engine.layers.fused import silu_and_mul

        plain = self.choose(x.shape[0], *ws[0].shape)
        if plain is None:
            unfused = timer([lambda w=w: silu_and_mul(F.linear(x, w)) for w in ws])
        else:
            unfused = timer([lambda w=w: silu_and_mul(flat_gemm(x, w, config=plain)) for w in ws])
        best_us, best = fastest_config(
            timer, configs, lambda c: [lambda w=w, c=c: flat_gemm(x, w, config=c, epilogue=EPILOGUE_SILU_MUL)
                                       for w in ws])
        wins = best_us < WIN_MARGIN * unfused
        return Choice("flat" if wins else "cublas", best if wins else None, best_us, unfused)

    @classmethod
    def from_json(cls, rows: list[dict]) -> "ChoiceTable":
        """The table whose ``rows()`` (as JSON holds them) these are."""
        table = cls()
        for r in rows:
            config = FlatGemmConfig(**r["config"]) if r["config"] else None
            into = table.silu_mul if r.get("epilogue") == "silu_mul" else table.choices
            into[(r["M"], r["N"], r["K"])] = Choice(r["kernel"], config, r["flat_us"], r["cublas_us"])
        return table

    def rows(self) -> list[dict]:
        """The table as rows (M, N, K, epilogue ("none" / "silu_mul"), kernel, flat us, cuBLAS us, speed-up,
        config)."""
        return [{"M": m, "N": n, "K": k, "epilogue": epilogue, "kernel": c.kernel, "flat_us": c.flat_us,
                 "cublas_us": c.cublas_us, "speedup": c.cublas_us / c.flat_us,
                 "config": dataclasses.asdict(c.config) if c.config else None}
                for epilogue, table in (("none", self.choices), ("silu_mul", self.silu_mul))
                for (m, n, k), c in sorted(table.items())]


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [mod for mod in model.modules() if hasattr(mod, "shard_rows") and hasattr(mod, "choice_table")]


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(N, K) of every distinct weight of the model's linear layers (the shapes a choice table measures)."""
    return list(dict.fromkeys(tuple(mod.weight.shape) for mod in _linears(model)))


def silu_mul_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(N, K) of the model's [gate | up] layers (MLP gate_up_proj: the shapes the silu*mul epilogue can take)."""
    return list(dict.fromkeys(tuple(mod.weight.shape) for mod in _linears(model)
                              if list(mod.shard_rows) == ["gate", "up"]))


def install(model: torch.nn.Module, table: "ChoiceTable | None") -> None:
    """Let every linear layer of ``model`` consult ``table`` (None: cuBLAS everywhere again), and the model itself
    (its lm_head: ``flat_table``)."""
    for mod in _linears(model):
        mod.choice_table = table
    if hasattr(model, "flat_table"):
        model.flat_table = table



def install_for_engine(model: torch.nn.Module, flat_gemm, max_num_seqs: int, dtype: torch.dtype, device) -> None:
    """The engine's ``flat_gemm`` option (checked by EngineConfig) put in place on ``model``: "auto" = on CUDA with
    max_num_seqs >= 2 for a model worth it (worth_measuring), the table measured once per GPU model then read from
    the cache; True = measure now (CUDA only: ValueError elsewhere); False / None = cuBLAS everywhere (a shared
    model may hold another engine's table: cleared); or a ready ChoiceTable."""
    device = torch.device(device)
    if flat_gemm is False or flat_gemm is None:
        install(model, None)
        return
    if flat_gemm == "auto":
        if device.type != "cuda" or max_num_seqs < 2 or not worth_measuring(model):
            return
        t0 = time.perf_counter()
        flat_gemm = cached_table_for_model(model, dtype, device)
        logger.info("flat GEMM table ready in %.1f s (measured once per GPU model, then read from %s; "
                    "flat_gemm=False skips it)", time.perf_counter() - t0, cache_dir())
    elif flat_gemm is True:
        if device.type != "cuda":
            raise ValueError("flat_gemm=True measures kernels on the GPU; it needs a CUDA device")
        t0 = time.perf_counter()
        flat_gemm = measure_for_model(model, max_num_seqs, dtype, device)
        wins = [r for r in flat_gemm.rows() if r["kernel"] == "flat"]
        logger.info("flat GEMM measured in %.1f s: chosen for %d of %d (M, N, K) shapes", time.perf_counter() - t0,
                    len(wins), len(flat_gemm.rows()))
    install(model, flat_gemm)

# The flat GEMM's gain is in streaming a weight from HBM (cuBLAS pads M and may leave SMs idle): for a model whose
# largest linear weight is smaller than this, launch overheads decide and cuBLAS stays (nothing is measured).
MIN_WEIGHT_BYTES = 8 << 20


def worth_measuring(model: torch.nn.Module) -> bool:
    """Whether the engine's flat_gemm="auto" measures a table for ``model`` (see MIN_WEIGHT_BYTES)."""
    sizes = [mod.weight.numel() * mod.weight.element_size() for mod in _linears(model)]
    return bool(sizes) and max(sizes) >= MIN_WEIGHT_BYTES


def cache_dir() -> Path:
    """Where measured tables are kept: $FLASHDECODE_CACHE_DIR, else $XDG_CACHE_HOME/flashdecode, else
    ~/.cache/flashdecode (a subfolder flat_gemm/)."""
    root = os.environ.get("FLASHDECODE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "flashdecode")
    return Path(root) / "flat_gemm"


def _cache_key(model: torch.nn.Module, dtype: torch.dtype, device) -> dict:
    """Everything a measured table depends on: the GPU, the software, the shapes, batches and candidates."""
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "dtype": str(dtype), "shapes": sorted(linear_shapes(model)),
            "m_values": list(M_BUCKETS), "win_margin": WIN_MARGIN,
            "configs": [dataclasses.asdict(c) for c in QUICK_CONFIGS],
            **({"silu_mul_shapes": sorted(silu_mul_shapes(model))} if SILU_MUL_EPILOGUE else {})}


def cached_table_for_model(model: torch.nn.Module, dtype: torch.dtype, device,
                           directory: Path | None = None) -> "ChoiceTable":
    """``measure_for_model`` at every decode bucket (M = 2..64), measured once per GPU model, software and shapes
    and then read from ``directory`` (default ``cache_dir()``): the engine's default on CUDA (a first start on a
    new GPU measures for some seconds, whatever its max_num_seqs, so that one file serves every engine of the model).
    A cache file that cannot be read or written is measured over / skipped with a warning."""
    key = json.loads(json.dumps(_cache_key(model, dtype, device)))  # as the file will hold it
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (directory or cache_dir()) / f"{digest}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return ChoiceTable.from_json(stored["rows"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.warning("flat GEMM table %s unreadable (%s): measuring again", path, err)
    table = measure_for_model(model, MAX_M, dtype, device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "rows": table.rows()}, indent=1))
        tmp.replace(path)
    except OSError as err:
        logger.warning("flat GEMM table not cached at %s: %s", path, err)
    return table


def measure_for_model(model: torch.nn.Module, max_batch: int, dtype: torch.dtype, device) -> "ChoiceTable":
    """The choice table for a model's linears at the decode buckets up to ``max_batch`` (QUICK_CONFIGS)."""
    top = m_bucket(min(max(2, max_batch), MAX_M))
    m_values = [b for b in M_BUCKETS if b <= top]
    return ChoiceTable().measure(linear_shapes(model), dtype, device, m_values=m_values, configs=QUICK_CONFIGS,
                                 silu_mul_shapes=silu_mul_shapes(model) if SILU_MUL_EPILOGUE else ())
