"""Probe (CPU): two facts for an e4m3 decode whose dots would take the 8-bit cache as it is, with no conversion of K
or V to 16 bits - the conversion is 46% of the resolved 8-bit KV loop's instructions (docs/decisions.md, "8-bit
cache tiles"; Nsight Compute, `fp8_decode_profile_nvidia-h200_2026-11-28T1400_console.md`).

1. ``mma``: Gluon's ``mma_v2`` on e4m3 operands (the 16-row tile decode needs; wgmma wants 64 rows) emits PTX
   ``mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32`` for sm_90 as for sm_89, but only sm_89's ptxas makes it
   a tensor-core e4m3 MMA (QMMA.16832.F32.E4M3.E4M3, 16 for a 16 x 128 x 128 product); sm_90's lowers it to
   F2FP.F16.E4M3.UNPACK_B conversions and HMMA.16816.F32 (96 and 32) - the conversion-unit instructions the
   resolved kernel's bit operations replaced. On Hopper an 8-bit MMA without conversions is wgmma only: decode would
   have to put the keys on its 64-row M side (S^T = K q^T, q^T the N = 8 / 16 side, both operands e4m3).
2. ``numerics``: with QK^T = sum over parts (q_part . K) and PV = sum over parts ((P * v_scale)_part . V), q and
   P * v_scale each split into e4m3 parts under fixed power-of-two scales (part i + 1 2**4 finer than part i), fp32
   accumulation: the max error against the float64 decode on the dequantised cache, as a multiple of a bf16 PyTorch
   decode's (the FlashAttention rule allows 3x for decode). One part each is 6-11x; two parts of q with one of P
   0.7-7x; two and two 0.01-0.23x - what any all-e4m3 product (wgmma included) would need.

    PYTHONPATH=. python3 benchmarks/probes/fp8_mma_design.py [mma] [numerics]
"""

from __future__ import annotations

import os
import re
import sys

import torch

F8 = torch.float8_e4m3fn


def mma_ops(arch: int = 90, k_width: int = 16) -> dict:
    """PTX mma forms and the SASS MMA / conversion opcodes (counts) of a 16 x 128 x 128 e4m3 Gluon mma_v2 (4 warps,
    k_width bytes a thread) compiled for sm_``arch`` with Triton's ptxas (no GPU)."""
    import collections
    import subprocess
    import tempfile

    import triton
    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = _gluon_mma_kernel()
    sig = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*fp32", M="constexpr", N="constexpr", K="constexpr",
               KW="constexpr")
    compiled = triton.compile(GluonASTSource(kernel, sig, constexprs=dict(M=16, N=128, K=128, KW=k_width)),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
                              for t in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass))
    return dict(ptx=sorted(set(re.findall(r"mma\.sync\.aligned\.[\w.]+", compiled.asm["ptx"]))),
                sass={op: n for op, n in sorted(ops.items()) if "MMA" in op or op.startswith(("F2FP", "F2F."))})


def _gluon_mma_kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    @gluon.jit
    def e4m3_mma(a_ptr, b_ptr, c_ptr, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr, KW: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
        blk: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, M, layout=gl.SliceLayout(1, blk))
        ks = gl.arange(0, K, layout=gl.SliceLayout(0, blk))
        a = gl.load(a_ptr + rows[:, None] * K + ks[None, :])
        kr = gl.arange(0, K, layout=gl.SliceLayout(1, blk))
        cols = gl.arange(0, N, layout=gl.SliceLayout(0, blk))
        b = gl.load(b_ptr + kr[:, None] * N + cols[None, :])
        acc = mma_v2(gl.convert_layout(a, gl.DotOperandLayout(0, mma, KW)),
                     gl.convert_layout(b, gl.DotOperandLayout(1, mma, KW)), gl.zeros([M, N], gl.float32, layout=mma))
        out_rows = gl.arange(0, M, layout=gl.SliceLayout(1, mma))
        out_cols = gl.arange(0, N, layout=gl.SliceLayout(0, mma))
        gl.store(c_ptr + out_rows[:, None] * N + out_cols[None, :], acc)
    return e4m3_mma


def split_e4m3(x: torch.Tensor, parts: int, bound: float) -> list[tuple[torch.Tensor, float]]:
    """x (fp32, |x| <= bound) as ``parts`` e4m3 tensors (returned as their fp32 values) with fixed power-of-two
    scales: x ~ sum(part / scale). Part 1 puts ``bound`` in [256, 512) (e4m3 saturates at 448: clamped), each further
    part takes the residual 2**4 finer."""
    out, rest = [], x.clone()
    exponent = float(torch.floor(torch.log2(torch.tensor(256.0 / max(bound, 1e-30)))))
    for i in range(parts):
        scale = 2.0 ** (exponent + 4 * i)
        part = (rest * scale).clamp(-448, 448).to(F8).float()
        out.append((part, scale))
        rest = rest - part / scale
    return out


def decode_e4m3_dots(q, k8, ks, v8, vs, q_parts: int, p_parts: int) -> torch.Tensor:
    """One (kv head, split) of decode with both dots on e4m3 operands: q (rows, d) fp32 values of a bf16 q, k8 / v8
    (keys, d) e4m3 codes, ks / vs (keys,) fp32 per-token scales; fp32 accumulation; returns o (rows, d)."""
    s = sum((p @ k8.float().T) / scale for p, scale in split_e4m3(q, q_parts, q.abs().max().item()))
    s = s * ks[None, :] * q.shape[1] ** -0.5
    p = torch.exp(s - s.amax(1, keepdim=True))
    pv = p * vs[None, :]  # <= max(vs): the split's bound
    o = sum((part @ v8.float()) / scale for part, scale in split_e4m3(pv, p_parts, vs.max().item()))
    return o / p.sum(1, keepdim=True)


def decode_reference(q, k8, ks, v8, vs, dtype=torch.float64) -> torch.Tensor:
    """The decode on the dequantised cache in ``dtype`` (float64: the reference; bfloat16: a same-dtype PyTorch
    implementation, softmax in fp32)."""
    k = (k8.double() * ks.double()[:, None]).to(dtype)
    v = (v8.double() * vs.double()[:, None]).to(dtype)
    s = (q.to(dtype) @ k.T).double() * q.shape[1] ** -0.5
    return (torch.softmax(s, 1).to(dtype) @ v).double()


def quantized_cache(keys: int, d: int, gen: torch.Generator, outliers: float = 0.01):
    """e4m3 K / V codes with per-token absmax scales from N(0, 1) values (K: ``outliers`` of the tokens x5)."""
    kf = torch.randn(keys, d, generator=gen) * (1 + 4 * (torch.rand(keys, 1, generator=gen) < outliers))
    vf = torch.randn(keys, d, generator=gen)
    ks, vs = kf.abs().amax(1) / 448, vf.abs().amax(1) / 448
    return (kf / ks[:, None]).clamp(-448, 448).to(F8), ks, (vf / vs[:, None]).clamp(-448, 448).to(F8), vs


def error_ratios(keys: int, seed: int, q_scale: float = 1.0, splits=((1, 1), (2, 1), (2, 2), (3, 3))) -> dict:
    """Max error of decode_e4m3_dots against float64, per (q parts, P parts), over the bf16 implementation's."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(8, 128, generator=gen) * q_scale).bfloat16().float()
    k8, ks, v8, vs = quantized_cache(keys, 128, gen)
    ref = decode_reference(q, k8, ks, v8, vs)
    bf16 = (decode_reference(q, k8, ks, v8, vs, torch.bfloat16) - ref).abs().max().item()
    return {(qp, pp): (decode_e4m3_dots(q, k8, ks, v8, vs, qp, pp).double() - ref).abs().max().item() / bf16
            for qp, pp in splits}


def main() -> int:
    what = sys.argv[1:] or ["mma", "numerics"]
    if "mma" in what:
        os.environ.pop("TRITON_INTERPRET", None)
        for arch in (89, 90):
            print(f"sm_{arch}, an e4m3 Gluon mma_v2:", mma_ops(arch))
    if "numerics" in what:
        for keys in (512, 8192):
            for seed, q_scale in ((0, 1.0), (1, 1.0), (2, 3.0)):
                ratios = error_ratios(keys, seed, q_scale)
                print(f"{keys} keys, seed {seed}, |q| x{q_scale}: max error / bf16 implementation's: "
                      + ", ".join(f"q{qp} P{pp} {r:.2f}" for (qp, pp), r in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
