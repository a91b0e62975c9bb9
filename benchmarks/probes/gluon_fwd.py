"""Probe: the warp-specialised Gluon attention forward on Hopper - correctness, then speed beside its peers.

    PYTHONPATH=. python benchmarks/probes/gluon_fwd.py [--variants all|name,name] [--quick]
    PYTHONPATH=. python benchmarks/probes/gluon_fwd.py --fp8 [--fp8-variants all|name,name] [--quick]

1. Correctness: every supported feature (causal or not, GQA, odd lengths, hd 64/128, fp16/bf16) against the float64
   reference with the FlashAttention rule (error <= 2x a same-dtype PyTorch implementation's).
2. Speed (triton.testing.do_bench median, bf16): 16k tokens (batch 1, 16 heads) and 16 x 1k, hd 128 and 64, causal
   and not (--shapes / --headdims choose others, e.g. --shapes 1x65536x32/8: the Llama-3-8B prefill, GQA); the
   Gluon kernel (resolved config; --variants adds the VARIANTS ablations) beside flash_attn (the dispatch: the
   Gluon kernel where it applies on sm_90, our Triton kernel elsewhere) and torch SDPA's cuDNN and FLASH
   (FlashAttention-2) backends. TFLOP/s = 4 b h sq sk d, halved for causal.
Writes gluon_fwd.json to $OUT (or the current directory) and prints a table last.

--fp8 (instead of the above): the e4m3 kernel. Correctness of each FP8_VARIANTS config against the Triton FP8
forward (same rounding of P; both vs the float64 reference on the dequantised inputs), then speed at 16k tokens
(batch 1, 16 heads), hd 128 / 64 / 256, causal and not: flash_attn's FP8 forward end to end (V transpose + e4m3
Gluon kernel, resolved config), the e4m3 path per variant (V transpose + kernel, outputs preallocated), the V
transpose alone (ms, GB/s), the Triton FP8 kernel (flash_attn with an explicit config) and bf16 on the Gluon kernel
and through flash_attn; ratios to bf16 Gluon in the same run.
Writes gluon_fwd_fp8.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch
import triton

from flashdecode.ops.attention import flash_attn
from flashdecode.ops.gluon_attention import GluonFwdConfig, gluon_attention_forward, resolve_gluon_config
from flashdecode.reference import attention_ref


def _inputs(b, sq, sk, h, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda s, n: torch.randn(b, s, n, d, generator=gen).to("cuda", dtype)  # noqa: E731
    return make(sq, h), make(sk, hkv), make(sk, hkv)


VARIANTS = {  # name -> overrides of the resolved config (ablations and candidates)
    "resolved": {},
    "persistent": dict(persistent=True),
    "persist+qbuf2": dict(persistent=True, q_buffers=2),
    "one-cta-per-tile": dict(persistent=False),
    "bn64": dict(block_n=64, num_stages=3),
    "1wg": dict(num_consumers=1),
    # three consumer warpgroups: 192-row tiles (FA3's hd64 tile), consumer registers 160 to fit the SM's 65536
    "3wg": dict(num_consumers=3, consumer_regs=160),
    "3wg+s4": dict(num_consumers=3, consumer_regs=160, num_stages=4),
    # with FA3's intra-warpgroup overlap (the softmax under the PV wgmma; no spills at hd64, unlike hd128)
    "overlap": dict(overlap=True),
    # persistent CTAs (two Q buffer sets) taking a head's heavy and light causal tiles together, or host-made lists
    "pairs": dict(q_buffers=2, persistent=False, tile_order="pairs"),
    "pairs+persist": dict(q_buffers=2, persistent=True, tile_order="pairs"),
    "lpt": dict(q_buffers=2, persistent=True, tile_order="lpt"),
    # K and V slots released apart (K once its scores are in registers), alone and with the overlap:
    # with one release after PV the overlapped loop held K_{j-1}'s slot until PV_{j-1} retired, so with two stages
    # K_{j+1}'s load waited on it
    "split": dict(split_release=True),
    "no-overlap": dict(overlap=False, split_release=False),  # hd128's loop before the overlap was resolved
    "overlap+split": dict(overlap=True, split_release=True),
    # the overlapped loop where launches up to 8k keys resolve to persistent CTAs: host tile lists, or one CTA a tile
    "lpt+overlap": dict(persistent=True, q_buffers=2, tile_order="lpt", overlap=True, split_release=True),
    "cta+overlap": dict(persistent=False, q_buffers=1, tile_order="round_robin", overlap=True, split_release=True),
    # hd64 from 16k keys: two consumer warpgroups with the overlapped loop instead of three plain ones (sm_90
    # compile: no spills, where three with the overlap spill 80 bytes non-causal, 496 causal)
    "2wg+overlap": dict(num_consumers=2, consumer_regs=240, overlap=True, split_release=True),
    # 256-key blocks, two stages (the 64 x 256 scores fit the registers at hd64 only)
    "bn256": dict(block_n=256, num_stages=2),
}
# variants that apply at some head dims only (hd128: three consumers spill at 160 registers and their two-Q-buffer
# persistent launches overflow shared memory; 64 x 256 scores and a 64 x 128 accumulator exceed the registers)
VARIANT_HEAD_DIMS = {"3wg": (64, ), "3wg+s4": (64, ), "bn256": (64, )}


def config_for(name: str, d: int, causal: bool = False, seqlen_k: int = 0) -> GluonFwdConfig | None:
    """The variant's config at head dim d (None where it does not apply: VARIANT_HEAD_DIMS)."""
    if d not in VARIANT_HEAD_DIMS.get(name, (d, )):
        return None
    return dataclasses.replace(resolve_gluon_config(d, causal, seqlen_k), **VARIANTS[name])


def check_correctness(names) -> list[dict]:
    """Each case on each config that applies at its head dim (the resolved one on all cases, the others on the bf16
    ones); one row per pair."""
    cases = [(2, 128, 128, 4, 4, 128, torch.bfloat16, False), (2, 128, 128, 4, 4, 128, torch.bfloat16, True),
             (1, 333, 517, 4, 2, 128, torch.float16, False), (1, 333, 517, 4, 2, 128, torch.float16, True),
             (2, 517, 333, 8, 2, 64, torch.bfloat16, True), (3, 77, 1000, 4, 1, 64, torch.bfloat16, False),
             (1, 1000, 999, 2, 2, 128, torch.bfloat16, True), (2, 1, 300, 4, 4, 128, torch.float16, True),
             (1, 4096, 4096, 2, 1, 128, torch.bfloat16, True), (2, 1700, 1100, 8, 4, 64, torch.float16, False)]
    rows = []
    for b, sq, sk, h, hkv, d, dtype, causal in cases:
        q, k, v = _inputs(b, sq, sk, h, hkv, d, dtype, seed=sq + sk)
        ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=causal)
        same, _ = attention_ref(q, k, v, causal=causal)
        base = (same.double() - ref).abs().max().item()
        for name in names:
            cfg = config_for(name, d, causal, sk)
            # fp16 cases: the resolved config only (the variants do not change the arithmetic)
            if cfg is None or (dtype != torch.bfloat16 and name != "resolved"):
                continue
            try:
                out, lse = gluon_attention_forward(q, k, v, causal=causal, config=cfg)
                torch.cuda.synchronize()
            except Exception as e:  # a variant that fails to build or launch is reported BAD, the others still run
                print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                out, lse = torch.full_like(ref, float("nan")), torch.full_like(ref_lse, float("nan"))
            err = (out.double() - ref).abs().max().item()
            fin = torch.isfinite(ref_lse)
            lse_err = (lse.double() - ref_lse)[fin].abs().max().item() if fin.any() else 0.0
            ok = (not torch.isnan(out).any().item() and err <= 2 * base + 1e-5 and lse_err < 1e-3
                  and torch.equal(torch.isinf(lse), ~fin))
            rows.append(dict(case=f"b{b} sq{sq} sk{sk} h{h}/{hkv} d{d} {str(dtype)[6:]} causal={causal}", config=name,
                             err=err, base=base, lse_err=lse_err, ok=bool(ok)))
    return rows


def _sdpa(backend, **kwargs):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
    return run


def _gluon_call(q, k, v, causal, cfg):
    return lambda: gluon_attention_forward(q, k, v, causal=causal, config=cfg)


def _graphed(fn):
    """fn captured in a CUDA graph: its replay times the kernels alone, without the host's launch work (at 1k
    tokens the kernels run for ~0.1 ms, comparable to a Python launcher's overhead)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


DEFAULT_SHAPES = "1x16384x16,16x1024x16"


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """"BxSxH[/HKV],..." -> [(batch, seqlen, nheads, nheads_kv)], e.g. "1x65536x32/8" (the Llama-3-8B prefill)."""
    shapes = []
    for item in text.split(","):
        bsh, _, hkv = item.partition("/")
        b, s, h = (int(x) for x in bsh.split("x"))
        shapes.append((b, s, h, int(hkv) if hkv else h))
    return shapes


def _graphed_or_none(name, fn):
    try:
        return _graphed(fn)
    except Exception as e:  # a peer that cannot be captured is reported, not fatal
        print(f"{name} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return None


def _time_ms(name, fn, quick: bool) -> float:
    """do_bench median of fn in ms, nan where fn is None or fails (a peer missing on this build is reported)."""
    if fn is None:
        return float("nan")
    try:
        return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100)
    except Exception as e:
        print(f"{name} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return float("nan")


def time_all(names, quick: bool, graph: bool = False, shapes=None, headdims=(128, 64), rounds: int = 1) -> list[dict]:
    from torch.nn.attention import SDPBackend

    shapes = shapes or parse_shapes(DEFAULT_SHAPES)
    rows = []
    for d in headdims:
        for b, s, h, hkv in shapes:
            for causal in (False, True):
                q, k, v = _inputs(b, s, s, h, hkv, d, torch.bfloat16, seed=1)
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                fns = {f"gluon:{n}": _gluon_call(q, k, v, causal, config_for(n, d, causal, s)) for n in names
                       if config_for(n, d, causal, s) is not None}
                fns["flash_attn"] = lambda: flash_attn(q, k, v, causal=causal)  # the dispatch (Gluon on sm_90)
                gqa = dict(enable_gqa=True) if hkv != h else {}
                fns["cudnn"] = lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, **gqa)(qt, kt, vt, causal)
                fns["fa2"] = lambda: _sdpa(SDPBackend.FLASH_ATTENTION, **gqa)(qt, kt, vt, causal)
                if graph:
                    fns = {name: _graphed_or_none(name, fn) for name, fn in fns.items()}
                times = {name: [] for name in fns}
                # rounds > 1: every implementation once per round, the order rotated each round, so no column
                # always runs first (cooler, higher clocks) or last; the median over rounds is reported
                for r in range(rounds):
                    names_r = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
                    for name in names_r:
                        times[name].append(_time_ms(name, fns[name], quick))
                for name, ms_all in times.items():
                    ms = statistics.median(ms_all)
                    rows.append(dict(d=d, b=b, s=s, h=h, hkv=hkv, causal=causal, impl=name, ms=ms,
                                     tflops=flops / ms / 1e9, graph=graph, ms_rounds=ms_all))
    return rows


FP8_VARIANTS = {  # name -> overrides of resolve_gluon_fp8_config
    "resolved": {},
    "stages2": dict(num_stages=2),
    "stages4": dict(num_stages=4),
    "persistent": dict(persistent=True),
    "1wg": dict(num_consumers=1),
    "bn256": dict(block_n=256, num_stages=2),  # hd 64 / 128 only (at hd256 the 64 x 256 scores do not fit)
    "bn256s3": dict(block_n=256, num_stages=3),  # hd128: 3 x 64 KiB K / V^T slots + the Q tile fit 227 KiB
    "bn256p": dict(block_n=256, num_stages=2, persistent=True, q_buffers=2),  # next tile's loads under this one's end
}


def _fp8_config(name: str, d: int, causal: bool, seqlen_k: int):
    """The FP8 variant's config at head dim d, or None where it does not apply."""
    from flashdecode.ops.gluon_attention import resolve_gluon_fp8_config

    if name.startswith("bn256") and d > 128:
        return None
    return dataclasses.replace(resolve_gluon_fp8_config(d, causal, seqlen_k), **FP8_VARIANTS[name])


def _fp8_inputs(b, sq, sk, h, hkv, d, seed=0):
    """e4m3 q, k, v of N(0, 1) data with per-(batch, kv head) absmax descales (FA3's layout), float32."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s, n in ((sq, h), (sk, hkv), (sk, hkv)):
        x = torch.randn(b, s, n, d, generator=gen).to("cuda")
        amax = x.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # (b, n)
        descale = (amax / 448.0).float()
        x8 = (x / descale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        if n != hkv:  # q: one descale per kv head (its group's max)
            descale = descale.view(b, hkv, n // hkv).amax(dim=2)
            x8 = (x / descale.repeat_interleave(n // hkv, 1)[:, None, :, None]).clamp(-448, 448).to(
                torch.float8_e4m3fn)
        out += [x8, descale.contiguous()]
    q8, qd, k8, kd, v8, vd = out
    return q8, k8, v8, qd, kd, vd


def _fp8_kernel_call(q8, k8, v8, qd, kd, vd, causal, cfg):
    """The e4m3 Gluon path with its V transpose (the fused descale and the outputs made once, outside the timed
    call)."""
    from flashdecode.ops.gluon_attention import gluon_fp8_forward_into

    group = q8.shape[2] // k8.shape[2]
    qk = (qd * kd).repeat_interleave(group, dim=1).contiguous()
    out = torch.empty(q8.shape, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(q8.shape[0], q8.shape[2], q8.shape[1], dtype=torch.float32, device="cuda")
    scale = q8.shape[-1] ** -0.5

    def run():
        if not gluon_fp8_forward_into(q8, k8, v8, out, lse, qk, vd, scale, -1, 0 if causal else -1, config=cfg):
            raise RuntimeError("the e4m3 Gluon kernel refused the call")
        return out
    return run


def check_fp8(names) -> list[dict]:
    """Each FP8 variant vs the Triton FP8 kernel and both vs float64 on the dequantised inputs (max abs error)."""
    from flashdecode.ops.attention import resolve_config

    rows = []
    for b, sq, sk, h, hkv, d, causal in [(2, 1000, 1100, 8, 2, 128, False), (2, 1000, 1100, 8, 2, 128, True),
                                         (1, 777, 777, 4, 4, 64, True), (1, 300, 100, 4, 2, 256, True),
                                         (1, 4096, 4096, 4, 1, 128, True)]:
        q8, k8, v8, qd, kd, vd = _fp8_inputs(b, sq, sk, h, hkv, d, seed=sq + sk + d)
        group = h // hkv
        deq = lambda x, s: (x.double() * s.double().repeat_interleave(x.shape[2] // s.shape[1], 1)  # noqa: E731
                            [:, None, :, None])
        ref, _ = attention_ref(deq(q8, qd), deq(k8, kd), deq(v8, vd), causal=causal)
        tri = flash_attn(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                         config=dataclasses.replace(resolve_config(q8, k8, v8), backend="triton"))
        tri_err = (tri.double() - ref).abs().max().item()
        for name in names:
            cfg = _fp8_config(name, d, causal, sk)
            if cfg is None:
                continue
            try:
                out = _fp8_kernel_call(q8, k8, v8, qd, kd, vd, causal, cfg)().clone()
                torch.cuda.synchronize()
            except Exception as e:  # a variant that fails to build is reported, the others still run
                print(f"{name} d{d} causal={causal} failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                out = torch.full_like(ref, float("nan"))
            err = (out.double() - ref).abs().max().item()
            ok = not torch.isnan(out).any().item() and err <= 2 * tri_err + 2e-3
            rows.append(dict(case=f"b{b} sq{sq} sk{sk} h{h}/{hkv} d{d} causal={causal}", config=name, err=err,
                             triton_err=tri_err, ok=bool(ok), group=group))
    return rows


def time_fp8(names, quick: bool, headdims=(128, 64, 256)) -> list[dict]:
    from flashdecode.ops.attention import resolve_config
    from flashdecode.ops.fp8_v_transpose import fp8_v_transposed

    rows = []
    b, s, h = 1, 16384, 16
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100)  # noqa
    for d in headdims:
        for causal in (False, True):
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            q8, k8, v8, qd, kd, vd = _fp8_inputs(b, s, s, h, h, d, seed=1)
            q, k, v = _inputs(b, s, s, h, h, d, torch.bfloat16, seed=1)
            fns = {"fp8 flash_attn": lambda: flash_attn(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                                        v_descale=vd)}
            for n in names:
                cfg = _fp8_config(n, d, causal, s)
                if cfg is not None:
                    fns[f"fp8 gluon:{n}"] = _fp8_kernel_call(q8, k8, v8, qd, kd, vd, causal, cfg)
            tri_cfg = dataclasses.replace(resolve_config(q8, k8, v8), backend="triton")
            fns["fp8 triton"] = lambda: flash_attn(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                                   v_descale=vd, config=tri_cfg)
            if d != 256:  # bf16 Gluon takes hd 64 / 128
                fns["bf16 gluon"] = _gluon_call(q, k, v, causal, resolve_gluon_config(d, causal, s))
            fns["bf16 flash_attn"] = lambda: flash_attn(q, k, v, causal=causal)
            for name, fn in fns.items():
                try:
                    ms = bench(fn)
                    tf = flops / ms / 1e9
                except Exception as e:  # reported, not fatal
                    print(f"d{d} causal={causal} {name} failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                    ms, tf = float("nan"), float("nan")
                rows.append(dict(d=d, b=b, s=s, h=h, causal=causal, impl=name, ms=ms, tflops=tf))
            ms = bench(lambda: fp8_v_transposed(v8, key_order="wgmma"))
            rows.append(dict(d=d, b=b, s=s, h=h, causal=causal, impl="v transpose", ms=ms, tflops=float("nan"),
                             gbps=2 * v8.numel() / ms / 1e6))
    return rows


def main_fp8(args):
    names = list(FP8_VARIANTS) if args.fp8_variants == "all" else args.fp8_variants.split(",")
    dev = torch.cuda.get_device_name()
    print(f"device {dev}; torch {torch.__version__}; triton {triton.__version__}")
    result = dict(device=dev, torch=torch.__version__, triton=triton.__version__, fp8_variants=names)
    if not args.no_check:
        result["correctness"] = check_fp8(names)
        for r in result["correctness"]:
            print(f"{'ok ' if r['ok'] else 'BAD'} {r['config']:>12} {r['case']:<40} err {r['err']:.2e} "
                  f"(triton fp8 {r['triton_err']:.2e})")
    result["timing"] = time_fp8(names, args.quick, [int(d) for d in (args.headdims or "128,64,256").split(",")])
    with open(os.path.join(os.environ.get("OUT", "."), "gluon_fwd_fp8.json"), "w") as f:
        json.dump(result, f, indent=1)
    timing = result["timing"]
    impls = list(dict.fromkeys(r["impl"] for r in timing if r["impl"] != "v transpose"))
    print(f"\n{'shape':<22}" + "".join(f"{n[-14:]:>15}" for n in impls)
          + f"{'fp8/bf16':>10}{'best/bf16':>10}{'vT ms':>8}{'vT GB/s':>9}")
    for key in dict.fromkeys((r["d"], r["causal"]) for r in timing):
        cells = {r["impl"]: r for r in timing if (r["d"], r["causal"]) == key}
        bf16 = cells.get("bf16 gluon", {}).get("tflops", float("nan"))
        best = max((c["tflops"] for n, c in cells.items() if n.startswith("fp8 gluon")), default=float("nan"))
        vt = cells["v transpose"]
        label = f"d{key[0]} 1x16384 h16 {'causal' if key[1] else 'full'}"
        print(f"{label:<22}" + "".join(f"{cells[n]['tflops'] if n in cells else float('nan'):>15.1f}" for n in impls)
              + f"{cells['fp8 flash_attn']['tflops'] / bf16:>10.2f}{best / bf16:>10.2f}{vt['ms']:>8.3f}"
              f"{vt['gbps']:>9.0f}")
    print("(TFLOP/s, do_bench median; V transpose included in every fp8 column; fp8/bf16 = flash_attn FP8 over bf16"
          " Gluon, best/bf16 = the best e4m3 variant over bf16 Gluon; vT = the V transpose alone)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="resolved", help="comma-separated names from VARIANTS, or 'all'")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--graph", action="store_true", help="also time CUDA-graph replays (kernels without host work)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every column this many times per shape in rotated order and report the median")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="timed shapes BxSxH[/HKV], e.g. 1x65536x32/8")
    ap.add_argument("--headdims", default=None, help="timed head dims (default 128,64; --fp8: 128,64,256)")
    ap.add_argument("--fp8", action="store_true", help="the e4m3 kernel's checks and timings instead")
    ap.add_argument("--fp8-variants", default="resolved,stages2,stages4,bn256",
                    help="comma-separated names from FP8_VARIANTS, or 'all'")
    args = ap.parse_args()
    if args.fp8:
        return main_fp8(args)
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    dev = torch.cuda.get_device_name()
    print(f"device {dev}; torch {torch.__version__}; triton {triton.__version__}")
    result = dict(device=dev, torch=torch.__version__, triton=triton.__version__,
                  configs={n: {d: dataclasses.asdict(config_for(n, d)) for d in (64, 128) if config_for(n, d)}
                           for n in names})
    if not args.no_check:
        result["correctness"] = check_correctness(names)
        bad = [r for r in result["correctness"] if not r["ok"]]
        for r in result["correctness"]:
            if r["ok"]:
                continue
            print(f"BAD {r['config']:>16} {r['case']:<48} err {r['err']:.2e} "
                  f"(2x base {2 * r['base']:.2e}) lse {r['lse_err']:.1e}")
        print(f"correctness: {len(result['correctness']) - len(bad)} ok, {len(bad)} bad")
    shapes, headdims = parse_shapes(args.shapes), [int(d) for d in (args.headdims or "128,64").split(",")]
    result["timing"] = time_all(names, args.quick, shapes=shapes, headdims=headdims, rounds=args.rounds)
    if args.graph:
        result["timing"] += time_all(names, args.quick, graph=True, shapes=shapes, headdims=headdims,
                                     rounds=args.rounds)
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "gluon_fwd.json"), "w") as f:
        json.dump(result, f, indent=1)
    for graph in (False, True) if args.graph else (False, ):
        timing = [r for r in result["timing"] if r["graph"] == graph]
        impls = list(dict.fromkeys(r["impl"] for r in timing))
        print(f"\n{'CUDA-graph replay' if graph else 'direct calls'}\n{'shape':<28}"
              + "".join(f"{n[-12:]:>13}" for n in impls))
        keys = dict.fromkeys((r["d"], r["b"], r["s"], r["h"], r["hkv"], r["causal"]) for r in timing)
        for key in keys:
            cells = {r["impl"]: r for r in timing if (r["d"], r["b"], r["s"], r["h"], r["hkv"], r["causal"]) == key}
            label = f"d{key[0]} {key[1]}x{key[2]} h{key[3]}/{key[4]} {'causal' if key[5] else 'full'}"
            print(f"{label:<28}" + "".join(f"{cells[n]['tflops']:>13.1f}" if n in cells else f"{'-':>13}"
                                           for n in impls))
    print(f"(TFLOP/s, bf16, do_bench median{f' of {args.rounds} rotated rounds' if args.rounds > 1 else ''}; - = "
          f"the variant does not apply at that head dim)")


if __name__ == "__main__":
    main()
