"""Decode attention benchmark: flash_decode vs SDPA FA2, SDPA cuDNN, compiled FlexAttention and FlashInfer.

Method: CUDA-graph replay of many calls, K/V buffers rotated until the working set is >= 4x L2,
medians, fresh random bf16 inputs; floor = K/V bytes / measured copy bandwidth (read + write, as the anchors).
Two sweeps: latency vs context at batch 1, 16 q / 2 kv heads, head dim 128 (the seeds' microbenchmark) and a
batch sweep at the Llama-3-8B shape (32 / 8 heads, 8k context); contiguous and paged caches (random page
permutation). Ours runs through a DecodePlan (the capturable path the engine uses); "ours-nosplit" is the
num_splits=1 ablation, "ours-pdl" the same plan with the merge as a programmatic dependent launch, "ours-bi" the
plan with batch_invariant=True (its cost vs "ours" in the summary), "fai-kvcache" flash-attn 2.x's
flash_attn_with_kvcache through flashdecode.flash_attn_interface (vs "FA2", SDPA's FLASH_ATTENTION backend, the
flash-attn 2 semantics peer, on contiguous rows). Writes
decode_<device>_<date>.json (rows + "summary" strings) and a PNG to --out and prints a markdown table.

    python -m flashdecode bench decode --quick --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Callable, Optional

import torch

from flashdecode.bench.host import MIXED_LENS

CTX_SHAPE = dict(nheads=16, nheads_kv=2, headdim=128)
LLAMA_SHAPE = dict(nheads=32, nheads_kv=8, headdim=128)
QUICK = dict(contexts=[512, 4096, 32768, 65536, 131072], ctx_layouts=[0, 16], batches=[16, 64],
             batch_layouts=[0, 16], batch_context=8192, mixed=True)
FULL = dict(contexts=[512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072], ctx_layouts=[0, 1, 16, 64],
            batches=[1, 2, 4, 8, 16, 32, 64], batch_layouts=[0, 1, 16, 64], batch_context=8192, mixed=True)
CONTIG_PEERS = ("ours", "ours-nosplit", "ours-pdl", "ours-bi", "fai-kvcache", "FA2", "cuDNN", "flex", "FlashInfer")
PAGED_PEERS = ("ours", "ours-nosplit", "ours-pdl", "ours-bi", "fai-kvcache", "FlashInfer")
# ablations and other entry points of our kernels, never "the best peer"
OURS = ("ours", "ours-nosplit", "ours-pdl", "ours-bi", "fai-kvcache")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="contexts 512..128k at b1 (contiguous + page 16), batch 16/64 at 32/8 (<= 3 min)")
    parser.add_argument("--out", default=None, help="result folder (default $OUT or benchmarks/results)")
    parser.add_argument("--host", action="store_true",
                        help="also the host table: CPU and wall time per eager call of each public decode op "
                             "beside SDPA's (flashdecode/bench/host.py)")
    parser.add_argument("--contexts", default=None, help="comma list for the batch-1 sweep, e.g. 4096,65536")
    parser.add_argument("--batches", default=None, help="comma list for the Llama-shape batch sweep")
    parser.add_argument("--layouts", default=None, help="comma list of page sizes, 0 = contiguous (both sweeps)")
    parser.add_argument("--flex", action=argparse.BooleanOptionalAction, default=None,
                        help="compiled FlexAttention peer (default: on, off in --quick: compiles per shape)")
    parser.add_argument("--reps", type=int, default=20, help="graph replays per point (median reported)")
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                        help="time the batch_invariant=True plan (ours-bi) beside the default (default: on)")
    parser.add_argument("--bi-split-keys", default=None,
                        help="comma list of other batch-invariant split sizes in keys to time beside ours-bi "
                             "(columns ours-bi@S), e.g. 512,1024,4096")
    parser.add_argument("--kvcache", action=argparse.BooleanOptionalAction, default=True,
                        help="time flash_attn_with_kvcache through flashdecode.flash_attn_interface (fai-kvcache)"
                             " (default: on)")


def _list(value: Optional[str], default, cast=int):
    return default if value is None else [cast(x) for x in value.split(",") if x]


# ----------------------------------------------------------------------------------------------------------------
# Inputs: one set per rotation slot; each peer gets closures over the same sets
# ----------------------------------------------------------------------------------------------------------------

def _make_set(batch, context_lens, nheads, nheads_kv, headdim, page_size, dtype, gen):
    """q (batch, nheads, headdim); a contiguous (batch, max_len, hk, d) or paged (pages, page_size, hk, d) cache
    with a random page permutation; lens int32 on the GPU."""
    dev = "cuda"
    max_len = max(context_lens)
    q = torch.randn(batch, nheads, headdim, device=dev, dtype=dtype, generator=gen)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=dev)
    if page_size == 0:
        shape = (batch, max_len, nheads_kv, headdim)
        table = None
    else:
        pages_per_seq = -(-max_len // page_size)
        shape = (batch * pages_per_seq, page_size, nheads_kv, headdim)
        perm = torch.randperm(batch * pages_per_seq, device=dev, generator=gen)
        table = perm.view(batch, pages_per_seq).to(torch.int32)
    k = torch.randn(shape, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(shape, device=dev, dtype=dtype, generator=gen)
    return dict(q=q, k=k, v=v, lens=lens, table=table, page_size=page_size, context_lens=context_lens)


def _ours(sets, num_splits=None, use_pdl=None, tweak=None, batch_invariant=False):
    """Our DecodePlan over the sets; ``tweak``: a function of the DecodeConfig it resolves, for probes (config=)."""
    import flashdecode

    s0 = sets[0]
    batch, nheads, headdim = s0["q"].shape
    kw = dict(max_seqlen_k=max(s0["context_lens"]), dtype=s0["q"].dtype, device=s0["q"].device,
              num_splits=num_splits, use_pdl=use_pdl, batch_invariant=batch_invariant)
    plan = flashdecode.DecodePlan(batch, nheads, s0["k"].shape[2], headdim, **kw)
    if tweak is not None:
        config = tweak(plan.config_for(s0["q"], s0["k"], s0["v"], s0["lens"], block_table=s0["table"]))
        plan = flashdecode.DecodePlan(batch, nheads, s0["k"].shape[2], headdim,
                                      **dict(kw, num_splits=None, batch_invariant=False), config=config)

    def call(s):
        return lambda: plan.run(s["q"], s["k"], s["v"], s["lens"], block_table=s["table"])
    return [call(s) for s in sets], {"num_splits": plan.num_splits}


def _fai_kvcache(sets):
    """flash-attn's flash_attn_with_kvcache through flashdecode.flash_attn_interface: q (batch, 1, nheads, d),
    cache_seqlens a device tensor, num_splits=0 (the heuristic; under the timing's graph capture it sizes the
    splits from the cache capacity, which equals the lengths here)."""
    from flashdecode.flash_attn_interface import flash_attn_with_kvcache

    def call(s):
        q = s["q"][:, None]
        return lambda: flash_attn_with_kvcache(q, s["k"], s["v"], cache_seqlens=s["lens"], block_table=s["table"],
                                               causal=True)
    return [call(s) for s in sets], {}


def _sdpa(backend_name):
    def build(sets):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)

        def call(s):
            q = s["q"][:, :, None, :]  # (b, h, 1, d)
            k, v = s["k"].transpose(1, 2), s["v"].transpose(1, 2)  # (b, hk, s, d) views of the same cache

            def fn():
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            return fn
        return [call(s) for s in sets], {}
    return build


_FLEX: dict = {}


def _flex(sets):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    s0 = sets[0]
    seqlen = s0["k"].shape[1]
    # A block mask is what makes compiled FlexAttention decode fast (measured on the H100: 2 ms without, ~45 us with).
    mask = create_block_mask(lambda b, h, qi, ki: ki >= 0, None, None, 1, seqlen, device="cuda")
    fn = _FLEX["fn"]

    def call(s):
        q, k, v = s["q"][:, :, None, :], s["k"].transpose(1, 2), s["v"].transpose(1, 2)
        return lambda: fn(q, k, v, block_mask=mask, enable_gqa=True)
    return [call(s) for s in sets], {}


def _flashinfer(sets):
    import flashinfer

    s0 = sets[0]
    batch, nheads, headdim = s0["q"].shape
    hk = s0["k"].shape[2]
    if s0["page_size"] == 0 and batch == 1:
        def single(s):
            q, k, v = s["q"][0], s["k"][0], s["v"][0]
            return lambda: flashinfer.single_decode_with_kv_cache(q, k, v, kv_layout="NHD", use_tensor_cores=True)
        return [single(s) for s in sets], {"flashinfer": "single_decode"}
    if s0["page_size"] == 0:
        raise RuntimeError("contiguous batch > 1: FlashInfer is timed on the paged rows")
    page_size = s0["page_size"]
    calls = []
    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")  # scratch, shared: calls are serial
    for s in sets:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        lens = torch.tensor(s["context_lens"], dtype=torch.int32)
        pages = (lens + page_size - 1) // page_size
        indptr = torch.zeros(batch + 1, dtype=torch.int32)
        indptr[1:] = pages.cumsum(0)
        table = s["table"].cpu()
        indices = torch.cat([table[b, : int(pages[b])] for b in range(batch)]).to("cuda")
        last = (lens - (pages - 1) * page_size).to(torch.int32)
        wrapper.plan(indptr.cuda(), indices, last.cuda(), nheads, hk, headdim, page_size,
                     q_data_type=s["q"].dtype, kv_data_type=s["k"].dtype)
        out = torch.empty_like(s["q"])
        calls.append((lambda w, q, k, v, o: (lambda: w.run(q, (k, v), out=o)))(wrapper, s["q"], s["k"], s["v"], out))
    return calls, {"flashinfer": "paged_decode"}


BUILDERS: dict[str, Callable] = {
    "ours": _ours, "ours-nosplit": lambda sets: _ours(sets, num_splits=1),
    "ours-pdl": lambda sets: _ours(sets, use_pdl=True), "ours-bi": lambda sets: _ours(sets, batch_invariant=True),
    "fai-kvcache": _fai_kvcache, "FA2": _sdpa("FLASH_ATTENTION"),
    "cuDNN": _sdpa("CUDNN_ATTENTION"), "flex": _flex, "FlashInfer": _flashinfer,
}


def _builder(name: str) -> Callable:
    """BUILDERS[name]; "ours-bi@S": the batch-invariant plan with splits of S keys instead of
    DECODE_BATCH_INVARIANT_SPLIT_KEYS (a FIXED_SPLIT config=, batch-invariant too), to choose that constant."""
    if name.startswith("ours-bi@"):
        keys = int(name.split("@", 1)[1])
        return lambda sets: _ours(sets, batch_invariant=True,
                                  tweak=lambda config: dataclasses.replace(config, split_keys=keys))
    return BUILDERS[name]


def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


def _kv_bytes(context_lens, nheads_kv, headdim, elem):
    return 2 * sum(context_lens) * nheads_kv * headdim * elem


def bench_point(sweep, batch, context_lens, shape, page_size, peers, reps, bandwidth, gen) -> dict:
    from flashdecode.timing import cuda_graph_time_us, rotation_count

    dtype = torch.bfloat16
    kv_bytes = _kv_bytes(context_lens, shape["nheads_kv"], shape["headdim"], 2)
    n_sets = rotation_count(kv_bytes)
    sets = [_make_set(batch, context_lens, shape["nheads"], shape["nheads_kv"], shape["headdim"], page_size, dtype,
                      gen) for _ in range(n_sets)]
    floor_us = kv_bytes / bandwidth * 1e6
    row = dict(sweep=sweep, batch=batch, context=max(context_lens), total_tokens=sum(context_lens),
               layout="contig" if page_size == 0 else f"page{page_size}", nheads=shape["nheads"],
               nheads_kv=shape["nheads_kv"], headdim=shape["headdim"], floor_us=floor_us, rotated_sets=n_sets)
    for name in peers:
        try:
            fns, info = _builder(name)(sets)
            row[name] = cuda_graph_time_us(fns, reps=reps)
            row.update({f"{name}_{k}": v for k, v in info.items()})
        except Exception as e:  # a peer that cannot run this shape is reported, not fatal
            row[name] = None
            row[f"{name}_skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
            torch.cuda.synchronize()
    if row.get("ours"):
        row["ours_%floor"] = 100.0 * floor_us / row["ours"]
        row["ours_GB/s"] = kv_bytes / (row["ours"] * 1e-6) / 1e9
        best = _best_peer(row, peers)
        if best:
            row["best_peer"], row["ours_vs_best"] = best[0], best[1] / row["ours"]
    del sets
    torch.cuda.empty_cache()
    return row


def _best_peer(row, peers):
    times = [(p, row[p]) for p in peers if p not in OURS and not p.startswith("ours-bi@") and row.get(p)]
    return min(times, key=lambda t: t[1]) if times else None


def _fmt_len(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def summary_line(row) -> str:
    """e.g. 'b1 64k contig: ours 24.1us vs best peer cuDNN 30.4us (1.26x), 92% of floor'."""
    head = f"{row['sweep']} b{row['batch']} {_fmt_len(row['context'])} {row['layout']}"
    if row.get("ours") is None:
        return f"{head}: ours failed ({row.get('ours_skipped', '?')})"
    s = f"{head}: ours {row['ours']:.1f}us"
    if row.get("best_peer"):
        s += f" vs best peer {row['best_peer']} {row[row['best_peer']]:.1f}us ({row['ours_vs_best']:.2f}x)"
    s += f", {row['ours_%floor']:.0f}% of floor"
    s += f" (with PDL {row['ours-pdl']:.1f}us)" if row.get("ours-pdl") else ""
    if row.get("ours-bi"):
        s += f"; batch-invariant {row['ours-bi']:.1f}us ({row['ours-bi'] / row['ours']:.2f}x)"
    for name in sorted((p for p in row if p.startswith("ours-bi@") and row.get(p)), key=lambda p: int(p[8:])):
        s += f", {name[5:]} keys {row[name]:.1f}us"
    if row.get("fai-kvcache"):
        s += f"; flash_attn_with_kvcache {row['fai-kvcache']:.1f}us"
        s += f" vs FA2 {row['FA2']:.1f}us ({row['FA2'] / row['fai-kvcache']:.2f}x)" if row.get("FA2") else ""
    return s


def _paged_vs_contig(rows) -> list[str]:
    """'b1 64k page16 vs contig: +3.1%' for every paged row with a contiguous twin."""
    contig = {(r["sweep"], r["batch"], r["context"]): r.get("ours") for r in rows if r["layout"] == "contig"}
    lines = []
    for r in rows:
        base = contig.get((r["sweep"], r["batch"], r["context"]))
        if r["layout"] != "contig" and base and r.get("ours"):
            lines.append(f"{r['sweep']} b{r['batch']} {_fmt_len(r['context'])} {r['layout']} vs contig: "
                         f"{100.0 * (r['ours'] / base - 1):+.1f}%")
    return lines


def _plot(out_dir, stem, rows, peers):
    from flashdecode.bench.report import line_plot

    series = {}
    for r in rows:
        if r["sweep"] != "ctx":
            continue
        for p in peers + ["floor_us"]:
            if p == "floor_us" and r["layout"] != "contig":
                continue
            label = "floor" if p == "floor_us" else f"{p} {r['layout']}"
            series.setdefault(label, []).append((r["context"], r.get(p)))
    if not series:
        return None
    return line_plot(out_dir / f"{stem}.png", series, title="decode latency, b1, 16 q / 2 kv heads, hd128, bf16",
                     xlabel="context", ylabel="us (CUDA-graph replay)")


def _points(args, base):
    contexts = _list(args.contexts, base["contexts"])
    batches = _list(args.batches, base["batches"])
    ctx_layouts = _list(args.layouts, base["ctx_layouts"])
    batch_layouts = _list(args.layouts, base["batch_layouts"])
    for layout in ctx_layouts:
        for ctx in contexts:
            yield "ctx", 1, [ctx], CTX_SHAPE, layout
    for layout in batch_layouts:
        for batch in batches:
            yield "batch", batch, [base["batch_context"]] * batch, LLAMA_SHAPE, layout
    if base["mixed"] and args.contexts is None and args.batches is None:
        yield "mixed", 16, MIXED_LENS, LLAMA_SHAPE, 16



def run(args) -> int:
    from flashdecode.bench.report import markdown_table, result_stem, results_dir, write_json
    from flashdecode.timing import copy_bandwidth_bytes_per_s, env_info

    if not torch.cuda.is_available():
        print("bench decode needs a CUDA GPU")
        return 1
    if args.host:
        from flashdecode.bench.host import host_rows

        print("# host time per eager call (loop of 200 after 10 warm-ups)")
        host_rows("decode")
    base = QUICK if args.quick else FULL
    use_flex = (not args.quick) if args.flex is None else args.flex
    fi = _flashinfer_available()
    env = env_info()
    bandwidth = copy_bandwidth_bytes_per_s()
    env["copy_bandwidth_TBps"] = round(bandwidth / 1e12, 3)
    print(f"# decode attention on {env['device']} (torch {env['torch']}, triton {env['triton']}, {env['date']}); "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; FlashInfer {'present' if fi else 'absent (skipped)'}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    all_peers: list[str] = []
    for sweep, batch, lens, shape, layout in _points(args, base):
        peers = list(CONTIG_PEERS if layout == 0 else PAGED_PEERS)
        peers = [p for p in peers if (p != "flex" or use_flex) and (p != "FlashInfer" or fi)
                 and (p != "ours-bi" or args.batch_invariant) and (p != "fai-kvcache" or args.kvcache)]
        if args.batch_invariant:
            peers += [f"ours-bi@{keys}" for keys in _list(args.bi_split_keys, [])]
        if sweep == "batch" and layout == 0:
            peers = [p for p in peers if p != "FlashInfer"]  # FlashInfer's batch decode is paged: see paged rows
        all_peers += [p for p in peers if p not in all_peers]
        row = bench_point(sweep, batch, lens, shape, layout, peers, args.reps, bandwidth, gen)
        rows.append(row)
        print("  " + summary_line(row), flush=True)

    out_dir = results_dir(args.out)
    stem = result_stem("decode", env)
    summary = [summary_line(r) for r in rows] + _paged_vs_contig(rows)
    columns = ["sweep", "batch", "context", "layout", "floor_us"] + all_peers + ["ours_%floor", "ours_vs_best",
                                                                                  "best_peer", "ours_num_splits"]
    table = markdown_table(rows, columns, {c: ".1f" for c in ["floor_us"] + all_peers}
                           | {"ours_%floor": ".0f", "ours_vs_best": ".2f"})
    png = _plot(out_dir, stem, rows, all_peers)
    path = write_json(out_dir / f"{stem}.json", "decode", env, rows,
                      {"summary": summary, "peers": all_peers, "table": table, "plots": [str(png)] if png else [],
                       "floor": "K/V bytes / copy bandwidth (read+write)", "dtype": "bf16"})
    print()
    print(table)
    print()
    print("\n".join(_paged_vs_contig(rows)))
    print(f"\nwrote {path}" + (f", {png}" if png else ""))
    failed = [r for r in rows if r.get("ours") is None]
    for r in failed:
        print("ours failed:", r.get("ours_skipped"))
    return 1 if failed or any(math.isnan(r["ours"]) for r in rows if r.get("ours")) else 0
