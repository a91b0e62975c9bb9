"""FP8 attention accuracy with outliers: RMSE of the attention output against float64, per quantisation scheme.

FlashAttention-3's experiment (its paper reports 2.6x lower RMSE for FP8 with incoherent processing than without):
q, k, v are N(0, 1) with, on 0.1% of the entries, an N(0, 100) outlier (standard deviation 10) added. Schemes:

  bf16                 the inputs rounded to bfloat16, attention in the 16-bit path (for scale)
  per_tensor           one e4m3 descale per tensor
  per_head             one descale per (batch, head): FA3's layout, what flash_attn's q/k/v_descale take
  per_head+hadamard    q and k rotated along the head dim by the same random-sign Hadamard matrix before per-head
                       quantisation (QK^T is unchanged in exact arithmetic; v is not rotated)
  per_block(+hadamard) one descale per (batch, head, 128 tokens): emulated only (the kernel takes per-head descales)

Each scheme runs through our FP8 kernel (flash_attn, GPU) where it can ("kernel") and through
reference.attention_fp8_ref, the kernel's rounding rule in PyTorch ("emulated"). RMSE = sqrt(mean((out - ref)^2))
against reference.attention_ref in float64 on the original, unquantised inputs. Prints a table, then the JSON record
(also written to --out/fp8_rmse.json when --out is given).

    PYTHONPATH=. python3 -m benchmarks.probes.fp8_rmse [--seqlen 4096] [--nheads 16] [--causal] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from flashdecode import reference as ref
from flashdecode.ops.quant import dequantize_fp8, quantize_fp8

OUTLIER_FRACTION = 1e-3
OUTLIER_STD = 10.0  # N(0, 100)
BLOCK = 128
FA3_CLAIM = 2.6  # FA3 paper: RMSE without / with incoherent processing


def outlier_inputs(batch, seqlen, nheads, nheads_kv, headdim, seed):
    """q (batch, seqlen, nheads, headdim), k, v (batch, seqlen, nheads_kv, headdim) float32 on the CPU."""
    gen = torch.Generator().manual_seed(seed)

    def draw(h):
        x = torch.randn(batch, seqlen, h, headdim, generator=gen)
        hit = torch.rand(x.shape, generator=gen) < OUTLIER_FRACTION
        return x + hit * torch.randn(x.shape, generator=gen) * OUTLIER_STD
    return draw(nheads), draw(nheads_kv), draw(nheads_kv)


def quantised(x, scheme: str, seed: int, rotate: bool):
    """(x_fp8, descale, dequantised float32 in the rotated space if rotated) for one scheme."""
    granularity = {"per_tensor": "per_tensor", "per_head": "per_head", "per_block": "per_block"}[scheme]
    x8, descale = quantize_fp8(x, hadamard=rotate, seed=seed, granularity=granularity, block_size=BLOCK)
    return x8, descale, dequantize_fp8(x8, descale, block_size=BLOCK)


def run_scheme(q, k, v, name: str, causal: bool, device, seed: int):
    """{emulated: rmse, kernel: rmse or None} of one scheme; q, k, v float32 CPU originals."""
    out64, _ = ref.attention_ref(q.double(), k.double(), v.double(), causal=causal)

    def rmse(out):
        return ((out.double().cpu() - out64) ** 2).mean().sqrt().item()
    if name == "bf16":
        emulated = rmse(ref.attention_ref(*(x.bfloat16().float() for x in (q, k, v)), causal=causal)[0].bfloat16())
        kernel = None
        if device.type == "cuda":
            import flashdecode

            kernel = rmse(flashdecode.flash_attn(*(x.to(device, torch.bfloat16) for x in (q, k, v)), causal=causal))
        return dict(emulated=emulated, kernel=kernel)
    scheme, _, extra = name.partition("+")
    rotate = extra == "hadamard"
    (q8, qd, qf), (k8, kd, kf) = (quantised(x, scheme, seed, rotate) for x in (q, k))
    v8, vd, vf = quantised(v, scheme, seed, False)
    emulated = rmse(ref.attention_fp8_ref(qf, kf, vf, causal=causal)[0])
    kernel = None
    if device.type == "cuda" and scheme != "per_block":
        import flashdecode

        def per_head(d, x):  # a per-tensor descale as the (batch, heads) tensor the kernel takes
            return d.expand(x.shape[0], x.shape[2]).contiguous() if d.dim() == 0 else d
        out = flashdecode.flash_attn(q8.to(device), k8.to(device), v8.to(device), causal=causal,
                                     q_descale=per_head(qd, q8).to(device), k_descale=per_head(kd, k8).to(device),
                                     v_descale=per_head(vd, v8).to(device))
        kernel = rmse(out)
    return dict(emulated=emulated, kernel=kernel)


SCHEMES = ("bf16", "per_tensor", "per_head", "per_head+hadamard", "per_block", "per_block+hadamard")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--nheads", type=int, default=8)
    parser.add_argument("--nheads-kv", type=int, default=None)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: also run our FP8 kernel; cpu: the emulation only")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    q, k, v = outlier_inputs(args.batch, args.seqlen, args.nheads, args.nheads_kv or args.nheads, args.headdim,
                             args.seed)
    rows = []
    for name in SCHEMES:
        rows.append(dict(scheme=name, **run_scheme(q, k, v, name, args.causal, device, args.seed)))
    by_name = {r["scheme"]: r for r in rows}
    ratios = {f"{base} / {base}+hadamard": by_name[base]["emulated"] / by_name[f"{base}+hadamard"]["emulated"]
              for base in ("per_head", "per_block")}
    if by_name["per_head+hadamard"]["kernel"]:
        ratios["per_head / per_head+hadamard (kernel)"] = (by_name["per_head"]["kernel"]
                                                           / by_name["per_head+hadamard"]["kernel"])
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (emulation)"
    print(f"# FP8 attention RMSE vs float64, outliers N(0,100) on {OUTLIER_FRACTION:.1%} of entries; "
          f"b{args.batch} s{args.seqlen} h{args.nheads} hd{args.headdim} {'causal' if args.causal else 'full'}; "
          f"{device_name}")
    print("| scheme | RMSE emulated | RMSE kernel |")
    print("|---|---|---|")
    for r in rows:
        kernel = f"{r['kernel']:.3e}" if r["kernel"] is not None else "-"
        print(f"| {r['scheme']} | {r['emulated']:.3e} | {kernel} |")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x (FA3 paper: {FA3_CLAIM}x)")
    extra = dict(args=vars(args), ratios=ratios, fa3_claim=FA3_CLAIM)
    if args.out:  # the record every benchmark writes (kind fp8_rmse: docs/benchmarks.md renders it from latest/)
        from flashdecode.bench.report import result_stem, results_dir, write_json
        from flashdecode.timing import env_info

        env = dict(env_info(), device=device_name)
        path = write_json(results_dir(args.out) / f"{result_stem('fp8_rmse', env)}.json", "fp8_rmse", env, rows,
                          extra)
        print(f"wrote {path}")
    else:
        print(json.dumps(dict(rows=rows, **extra), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
