"""Prefill / training attention benchmark: TFLOP/s of flash_attn forward and forward+backward vs SDPA FA2, cuDNN,
compiled FlexAttention and FlashAttention-3 (FlashInfer's "fa3" backend), all in one run.

Method: triton.testing.do_bench median on fresh random inputs; FLOPs = 4 * b * h * sq * sk * d, halved
for causal; forward+backward counts 3.5x the forward (backward = 2.5x). Every problem holds ``--tokens`` tokens
(batch = tokens // seqlen). Writes prefill_<device>_<date>.json (rows + "summary" strings) and PNGs to --out and
prints a markdown table.

Variants of our kernel timed as extra peers (``--variants``): ``nd`` = flash_attn(deterministic=False) (dQ by atomics
in the dK/dV pass; fwd+bwd only), ``bwdtma`` / ``bwdptr`` = flash_attn with an AttentionConfig whose bwd_tma is
forced on / off (tensor descriptors or pointer loads; fwd+bwd only; "ours" picks by sequence length,
heuristics.use_bwd_tma); ``fp8`` = flash_attn on float8_e4m3fn q, k, v quantised per (batch, head)
(flashdecode.quantize_fp8; forward only, bf16 output), timed beside our bf16 forward and the peers on the same
(quantised-from-the-same) inputs: the row gains ``fp8/ours`` (speed-up over our bf16 forward) and ``fp8/cuDNN``. The
quantisation itself is outside the timed call (a model would keep its K/V in fp8). With ``--fa3`` it also times
``FA3fp8``, FlashAttention-3's FP8 forward through FlashInfer where its wheel plans it.
``--long`` adds the engine's prefill shape: one 64k causal sequence, 32 q / 8 kv heads, hd128, forward, through
flash_attn_varlen and the dense flash_attn (SDPA peers get K/V repeated to 32 heads: same FLOPs).
``--paged`` adds the paged-KV prefill rows (bench/paged_prefill.py: chunks of new tokens over cached pages, ours on
the Triton and the Gluon kernel vs the same problem on a contiguous cache vs FlashInfer's paged prefill), written to
a record of their own
(paged_prefill_<device>_<date>.json); ``--no-grid`` skips the dense grid.

    python -m flashdecode bench prefill --quick --out DIR
    python -m flashdecode bench prefill --paged --no-grid --out DIR
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional

import torch

PEERS = ("ours", "FA2", "cuDNN", "flex", "FA3")
VARIANTS = ("nd", "bwdtma", "bwdptr", "fp8")
LONG = dict(seqlen=65536, nheads=32, nheads_kv=8, headdim=128)
QUICK = dict(dtypes=["bf16"], headdims=[128, 64], seqlens=[16384, 1024], nheads=[16], causal=[False, True],
             modes=["fwd", "fwd+bwd"])
FULL = dict(dtypes=["bf16", "fp16"], headdims=[64, 128, 256], seqlens=[512, 1024, 2048, 4096, 8192, 16384],
            nheads=[16, 32], causal=[False, True], modes=["fwd", "fwd+bwd"])
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BWD_FACTOR = 3.5  # forward (1) + backward (2.5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="bf16, hd128/64, seqlen 16k/1k, 16 heads, peers FA2 + cuDNN (<= 3 min on an H100)")
    parser.add_argument("--out", default=None, help="result folder (default $OUT or benchmarks/results)")
    parser.add_argument("--host", action="store_true",
                        help="also the host table: CPU and wall time per eager call of each public prefill op "
                             "beside SDPA's (flashdecode/bench/host.py)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per problem (batch = tokens // seqlen)")
    parser.add_argument("--dtypes", default=None, help="comma list of bf16,fp16")
    parser.add_argument("--headdims", default=None, help="comma list, e.g. 64,128,256")
    parser.add_argument("--seqlens", default=None, help="comma list, e.g. 512,16384")
    parser.add_argument("--nheads", default=None, help="comma list, e.g. 16,32")
    parser.add_argument("--modes", default=None, help="comma list of fwd,fwd+bwd")
    parser.add_argument("--flex", action=argparse.BooleanOptionalAction, default=None,
                        help="compiled FlexAttention peer (default: on, off in --quick)")
    parser.add_argument("--fa3", action=argparse.BooleanOptionalAction, default=None,
                        help="FlashAttention-3 via FlashInfer when importable (default: on, off in --quick: its "
                             "first call JIT-compiles ~1 minute)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench measurement window per point")
    parser.add_argument("--variants", default=None,
                        help="comma list of our extra variants timed as peers: nd (deterministic=False), bwdtma / "
                             "bwdptr (backward through TMA / pointers), fp8 (FP8 forward); default nd; with --ragged: "
                             "vtail (the ragged Gluon forward with and without its V-tail zeroing, an A/B), vbound "
                             "(vtail's pair and the forward with bounded V descriptors, GluonFwdConfig.v_bound)")
    parser.add_argument("--ragged", action="store_true",
                        help="the ragged (varlen) rows instead: random lengths, 16 x 1k, 64 x 256, 2 x 8k vs FA3 "
                             "and FlashInfer's FA2 (flashdecode/bench/prefill_ragged.py); --modes fwd,fwd+bwd")
    parser.add_argument("--long", action=argparse.BooleanOptionalAction, default=False,
                        help="also time the engine's 64k causal prefill (32/8 heads, hd128): varlen vs dense vs peers")
    parser.add_argument("--paged", action=argparse.BooleanOptionalAction, default=False,
                        help="also time prefill over a paged KV cache (pages of 16 / 128, chunks of 512 / 2048 over "
                             "0 / 8k / 32k cached tokens) vs a contiguous cache and FlashInfer (own record)")
    parser.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True,
                        help="the dense grid of --dtypes x --headdims x --seqlens ... (--no-grid: only --long / "
                             "--paged)")


def _list(value: Optional[str], default, cast=str):
    return default if value is None else [cast(x) for x in value.split(",") if x]


def tflops(batch, nheads, seqlen, headdim, causal, mode, ms) -> Optional[float]:
    if ms is None:
        return None
    flops = 4.0 * batch * nheads * seqlen * seqlen * headdim * (0.5 if causal else 1.0)
    if mode == "fwd+bwd":
        flops *= BWD_FACTOR
    return flops / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------------------------------------------
# Peers: each builds a closure running one forward (or forward+backward) on the same data
# ----------------------------------------------------------------------------------------------------------------

def _with_backward(forward: Callable, inputs, dout):
    def step():
        out = forward(*inputs)
        torch.autograd.grad(out, inputs, dout)
    return step


def _ours(q, k, v, causal):
    import flashdecode

    return lambda a, b, c: flashdecode.flash_attn(a, b, c, causal=causal), (q, k, v)


def _ours_nd(q, k, v, causal):
    import flashdecode

    return lambda a, b, c: flashdecode.flash_attn(a, b, c, causal=causal, deterministic=False), (q, k, v)


def _ours_with(**changes):
    """Our flash_attn with the resolved AttentionConfig changed by ``changes`` (forward and backward)."""
    def build(q, k, v, causal):
        import dataclasses

        import flashdecode
        from flashdecode.ops.attention import resolve_config

        config = dataclasses.replace(resolve_config(q, k, v), backend="triton", **changes)
        return (lambda a, b, c: flashdecode.flash_attn(a, b, c, causal=causal, config=config)), (q, k, v)
    return build


def _ours_fp8(q, k, v, causal):
    """Our FP8 forward: q, k, v quantised to e4m3 with per-(batch, head) descales (q per query head, k and v per kv
    head, FA3's layout), outside the timed call."""
    import flashdecode
    from flashdecode.ops.quant import quantize_fp8

    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(x.detach()) for x in (q, k, v))
    return (lambda a, b, c: flashdecode.flash_attn(a, b, c, causal=causal, q_descale=qd, k_descale=kd,
                                                   v_descale=vd)), (q8, k8, v8)


def _ours_varlen(q, k, v, causal):
    """One packed sequence per batch row through flash_attn_varlen (the engine's prefill call)."""
    import flashdecode

    batch, seqlen = q.shape[:2]
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=q.device)
    flat = tuple(x.detach().reshape(batch * seqlen, *x.shape[2:]) for x in (q, k, v))
    return (lambda a, b, c: flashdecode.flash_attn_varlen(a, b, c, cu, cu, seqlen, seqlen, causal=causal)), flat


def _sdpa(backend_name):
    def build(q, k, v, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        if k.shape[2] != q.shape[2]:  # GQA: repeat K/V to every q head (same FLOPs; the peers' GQA support varies)
            k, v = (x.detach().repeat_interleave(q.shape[2] // k.shape[2], dim=2) for x in (k, v))
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in (q, k, v))

        def fwd(a, b, c):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal)
        return fwd, (qt, kt, vt)
    return build


_FLEX_CACHE: dict = {}


def _flex(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX_CACHE:
        _FLEX_CACHE["fn"] = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in (q, k, v))
    block_mask = None
    if causal:
        seqlen = q.shape[1]
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seqlen, seqlen, device=q.device)
    fn = _FLEX_CACHE["fn"]
    return (lambda a, b, c: fn(a, b, c, block_mask=block_mask)), (qt, kt, vt)


def _fa3(q, k, v, causal, fp8=False):
    """FlashAttention-3 through FlashInfer's "fa3" backend. fp8: on float8_e4m3fn q, k, v with unit scales (the
    time does not depend on them) and bf16 output, where the installed FlashInfer plans it (else the row says
    why)."""
    import inspect

    import flashinfer

    batch, seqlen, nheads, headdim = q.shape
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
    indptr = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=q.device)
    dtypes = dict(q_data_type=q.dtype)
    if fp8:
        dtypes = dict(q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn)
        if "o_data_type" in inspect.signature(wrapper.plan).parameters:
            dtypes["o_data_type"] = torch.bfloat16
    wrapper.plan(indptr, indptr, nheads, k.shape[2], headdim, causal=causal, **dtypes)
    flat = [x.detach().reshape(batch * seqlen, x.shape[2], headdim) for x in (q, k, v)]
    if fp8:
        flat = [x.to(torch.float8_e4m3fn) for x in flat]
    return (lambda a, b, c: wrapper.run(a, b, c)), tuple(flat)


BUILDERS = {"ours": _ours, "FA2": _sdpa("FLASH_ATTENTION"), "cuDNN": _sdpa("CUDNN_ATTENTION"), "flex": _flex,
            "FA3": _fa3, "nd": _ours_nd, "bwdtma": _ours_with(bwd_tma=True),
            "bwdptr": _ours_with(bwd_tma=False), "varlen": _ours_varlen, "fp8": _ours_fp8,
            "FA3fp8": lambda q, k, v, causal: _fa3(q, k, v, causal, fp8=True)}
FORWARD_ONLY = {"FA3", "varlen", "fp8", "FA3fp8"}
BACKWARD_ONLY = {"nd", "bwdtma", "bwdptr"}  # variants that change only the backward


def _time_peer(name, q, k, v, causal, mode, rep_ms):
    """Median ms of one peer, or (None, reason)."""
    from flashdecode.timing import do_bench_ms

    if mode == "fwd+bwd" and name in FORWARD_ONLY:
        return None, "forward only"
    if mode == "fwd" and name in BACKWARD_ONLY:
        return None, "same forward as ours"
    try:
        fwd, inputs = BUILDERS[name](q, k, v, causal)
        if mode == "fwd+bwd":
            dout = torch.randn(fwd(*inputs).shape, dtype=q.dtype, device=q.device)
            step = _with_backward(fwd, inputs, dout)
        else:
            step = lambda: fwd(*inputs)  # noqa: E731
        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            step()  # compile / autotune outside the timed window
            torch.cuda.synchronize()
            return do_bench_ms(step, warmup_ms=25, rep_ms=rep_ms), None
    except Exception as e:  # a peer that cannot run this shape is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def _peer_available(name: str) -> bool:
    if name != "FA3":
        return True
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return torch.cuda.get_device_capability()[0] == 9  # FA3 is Hopper-only


def bench_point(dtype_name, headdim, seqlen, nheads, causal, mode, peers, tokens, rep_ms, nheads_kv=None) -> dict:
    dtype = DTYPES[dtype_name]
    batch = max(1, tokens // seqlen)
    nheads_kv = nheads_kv or nheads
    gen = torch.Generator(device="cuda").manual_seed(seqlen * 1000 + headdim)
    need_grad = mode == "fwd+bwd"
    q, k, v = (torch.randn(batch, seqlen, h, headdim, device="cuda", dtype=dtype, generator=gen)
               .requires_grad_(need_grad) for h in (nheads, nheads_kv, nheads_kv))
    row = dict(mode=mode, dtype=dtype_name, headdim=headdim, nheads=nheads, seqlen=seqlen, batch=batch,
               causal=causal)
    if nheads_kv != nheads:
        row["nheads_kv"] = nheads_kv
    for name in peers:
        ms, why = _time_peer(name, q, k, v, causal, mode, rep_ms)
        row[f"{name}_ms"] = ms
        row[name] = tflops(batch, nheads, seqlen, headdim, causal, mode, ms)
        if why:
            row[f"{name}_skipped"] = why
    if row.get("ours") and row.get("FA2"):
        row["ours/FA2"] = row["ours"] / row["FA2"]
    if row.get("fp8"):
        for base in ("ours", "cuDNN"):
            if row.get(base):
                row[f"fp8/{base}"] = row["fp8"] / row[base]
    del q, k, v
    torch.cuda.empty_cache()
    return row


def _fmt_len(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def summary_lines(rows, peers) -> list[str]:
    """Short strings like 'fwd hd128 16k causal: ours 480 vs FA2 328 (1.46x), cuDNN 571' (bf16, 16 heads)."""
    lines = []
    for r in rows:
        if r["nheads"] != 16 and "nheads_kv" not in r:
            continue
        heads = f" {r['nheads']}/{r['nheads_kv']}h" if "nheads_kv" in r else ""
        head = (f"{r['mode']} {r['dtype']} hd{r['headdim']} {_fmt_len(r['seqlen'])}{heads} "
                f"{'causal' if r['causal'] else 'non-causal'}")
        if r.get("ours") is None:
            lines.append(f"{head}: ours failed ({r.get('ours_skipped', '?')})")
            continue
        s = f"{head}: ours {r['ours']:.0f}"
        if r.get("FA2"):
            s += f" vs FA2 {r['FA2']:.0f} ({r['ours'] / r['FA2']:.2f}x)"
        for p in peers:
            if p not in ("ours", "FA2") and r.get(p):
                s += f", {p} {r[p]:.0f}"
        lines.append(s)
    return lines


def _plots(out_dir, stem, rows, peers) -> list[str]:
    from flashdecode.bench.report import line_plot

    paths = []
    for mode in sorted({r["mode"] for r in rows}):
        series = {}
        for r in rows:
            if r["mode"] != mode or r["nheads"] != rows[0]["nheads"] or r["dtype"] != rows[0]["dtype"]:
                continue
            for p in peers:
                label = f"{p} hd{r['headdim']} {'causal' if r['causal'] else 'full'}"
                series.setdefault(label, []).append((r["seqlen"], r.get(p)))
        if len({pt[0] for pts in series.values() for pt in pts}) < 2:
            continue  # one seqlen: a table says it better than a plot
        path = line_plot(out_dir / f"{stem}_{mode.replace('+', '')}.png", series,
                         title=f"prefill {mode} ({rows[0]['dtype']}, {rows[0]['nheads']} heads, "
                               f"{rows[0]['batch'] * rows[0]['seqlen']} tokens)",
                         xlabel="seqlen", ylabel="TFLOP/s", logy=False)
        if path:
            paths.append(str(path))
    return paths


def run(args) -> int:
    from flashdecode.bench.report import markdown_table, result_stem, results_dir, write_json
    from flashdecode.timing import env_info, matmul_flops_per_s

    if not torch.cuda.is_available():
        print("bench prefill needs a CUDA GPU")
        return 1
    if args.ragged:
        from flashdecode.bench.prefill_ragged import run_ragged

        return run_ragged(args)
    if args.host:
        from flashdecode.bench.host import host_rows

        print("# host time per eager call (loop of 200 after 10 warm-ups)")
        host_rows("prefill")
    base = QUICK if args.quick else FULL
    dtypes = _list(args.dtypes, base["dtypes"])
    headdims = _list(args.headdims, base["headdims"], int)
    seqlens = _list(args.seqlens, base["seqlens"], int)
    nheads_list = _list(args.nheads, base["nheads"], int)
    modes = _list(args.modes, base["modes"])
    use_flex = (not args.quick) if args.flex is None else args.flex
    use_fa3 = (not args.quick) if args.fa3 is None else args.fa3
    peers = [p for p in PEERS if (p != "flex" or use_flex) and (p != "FA3" or use_fa3) and _peer_available(p)]
    variants = _list(args.variants, ["nd"])
    unknown = [x for x in variants if x not in VARIANTS]
    if unknown:
        print(f"unknown --variants {unknown}; choose from {list(VARIANTS)}")
        return 2
    peers += variants
    if "fp8" in variants and use_fa3 and _peer_available("FA3"):
        peers.append("FA3fp8")  # FA3's own FP8 forward beside ours

    env = env_info()
    peak = matmul_flops_per_s(8192, torch.bfloat16) / 1e12
    env["bf16_matmul_tflops"] = round(peak, 1)
    print(f"# prefill attention on {env['device']} (torch {env['torch']}, triton {env['triton']}, {env['date']}); "
          f"bf16 matmul {peak:.0f} TFLOP/s; peers: {', '.join(peers)}")
    rows = []
    for mode in modes if args.grid else []:
        for dtype_name in dtypes:
            for nheads in nheads_list:
                for headdim in headdims:
                    for causal in base["causal"]:
                        for seqlen in seqlens:
                            row = bench_point(dtype_name, headdim, seqlen, nheads, causal, mode, peers,
                                              args.tokens, args.rep_ms)
                            if row.get("ours"):
                                row["ours_%peak"] = 100.0 * row["ours"] / peak
                            rows.append(row)
                            print("  " + (summary_lines([row], peers) or [str(row)])[0], flush=True)
    if args.long:  # the engine's 64k prefill: varlen (its call) vs dense vs peers, forward only
        long_peers = ["ours", "varlen"] + [p for p in peers if p in ("FA2", "cuDNN", "FA3")]
        row = bench_point("bf16", LONG["headdim"], LONG["seqlen"], LONG["nheads"], True, "fwd", long_peers,
                          LONG["seqlen"], args.rep_ms, nheads_kv=LONG["nheads_kv"])
        rows.append(row)
        print("  " + summary_lines([row], long_peers)[0], flush=True)
        peers = peers + ["varlen"]

    out_dir = results_dir(args.out)
    failed_paged = _run_paged(args, env, out_dir, use_fa3) if args.paged else False
    if not rows:
        return 1 if failed_paged else 0
    stem = result_stem("prefill", env)
    summary = summary_lines(rows, peers)
    ratios = ["ours/FA2"] + (["fp8/ours", "fp8/cuDNN"] if "fp8" in peers else [])
    columns = ["mode", "dtype", "headdim", "nheads", "seqlen", "batch", "causal"] + peers + ratios + ["ours_%peak"]
    table = markdown_table(rows, columns, {p: ".0f" for p in peers} | {r: ".2f" for r in ratios}
                           | {"ours_%peak": ".0f"})
    pngs = _plots(out_dir, stem, rows, peers)
    path = write_json(out_dir / f"{stem}.json", "prefill", env, rows,
                      {"summary": summary, "peers": peers, "flops": "4*b*h*s*s*d, /2 causal, x3.5 fwd+bwd",
                       "plots": pngs, "table": table})
    print()
    print(table)
    print(f"\nwrote {path}" + "".join(f", {p}" for p in pngs))
    failed = [r for r in rows if r.get("ours") is None]
    return 1 if failed or failed_paged or any(math.isnan(r["ours"]) for r in rows if r.get("ours")) else 0


def _run_paged(args, env: dict, out_dir, with_flashinfer: bool) -> bool:
    """The paged-KV prefill rows into their own record; True if ours failed on any row."""
    from flashdecode.bench import paged_prefill
    from flashdecode.bench.report import markdown_table, result_stem, write_json

    print("# paged-KV prefill (bf16, 32/8 heads, hd128, causal): ours paged (Triton and Gluon kernels) vs contiguous "
          "vs FlashInfer paged")
    rows = paged_prefill.bench_rows(args.rep_ms, with_flashinfer)
    table = markdown_table(rows, paged_prefill.TABLE_COLUMNS, paged_prefill.TABLE_FORMATS)
    path = write_json(out_dir / f"{result_stem('paged_prefill', env)}.json", "paged_prefill", env, rows,
                      {"summary": [paged_prefill.summary_line(r) for r in rows], "table": table,
                       "flops": "4*d*h*(chunk*cached + chunk*(chunk+1)/2) per sequence"})
    print()
    print(table)
    print(f"\nwrote {path}")
    return any(paged_prefill.failed(r) for r in rows)
