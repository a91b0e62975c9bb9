"""Decode attention benchmark: flash_decode vs SDPA FA2, SDPA cuDNN, compiled FlexAttention and FlashInfer.

Method: CUDA-graph replay of many calls, K/V buffers rotated until the working set is >= 4x L2,
medians, fresh random bf16 inputs; floor = K/V bytes / measured copy bandwidth (read + write, as the anchors).
Two sweeps: latency vs context at batch 1, 16 q / 2 kv heads, head dim 128 (the seeds' microbenchmark) and a
batch sweep at the Llama-3-8B shape (32 / 8 heads, 8k context); contiguous and paged caches (random page
permutation). Ours runs through a DecodePlan (the capturable path the engine uses); "ours-nosplit" is the
num_splits=1 ablation, "ours-pdl" the same plan with the merge as a programmatic dependent launch. Writes
decode_<device>_<date>.json (rows + "summary" strings) and a PNG to --out and prints a markdown table.

    python -m flashdecode bench decode --quick --out DIR
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional

import torch

CTX_SHAPE = dict(nheads=16, nheads_kv=2, headdim=128)
LLAMA_SHAPE = dict(nheads=32, nheads_kv=8, headdim=128)
QUICK = dict(contexts=[512, 4096, 32768, 65536, 131072], ctx_layouts=[0, 16], batches=[16, 64],
             batch_layouts=[0, 16], batch_context=8192, mixed=True)
FULL = dict(contexts=[512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072], ctx_layouts=[0, 1, 16, 64],
            batches=[1, 2, 4, 8, 16, 32, 64], batch_layouts=[0, 1, 16, 64], batch_context=8192, mixed=True)
CONTIG_PEERS = ("ours", "ours-nosplit", "ours-pdl", "FA2", "cuDNN", "flex", "FlashInfer")
PAGED_PEERS = ("ours", "ours-nosplit", "ours-pdl", "FlashInfer")
OURS = ("ours", "ours-nosplit", "ours-pdl")  # ablations of our kernel, never "the best peer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="contexts 512..128k at b1 (contiguous + page 16), batch 16/64 at 32/8 (<= 3 min)")
    parser.add_argument("--out", default=None, help="result folder (default $OUT or benchmarks/results)")
    parser.add_argument("--contexts", default=None, help="comma list for the batch-1 sweep, e.g. 4096,65536")
    parser.add_argument("--batches", default=None, help="comma list for the Llama-shape batch sweep")
    parser.add_argument("--layouts", default=None, help="comma list of page sizes, 0 = contiguous (both sweeps)")
    parser.add_argument("--flex", action=argparse.BooleanOptionalAction, default=None,
                        help="compiled FlexAttention peer (default: on, off in --quick: compiles per shape)")
    parser.add_argument("--reps", type=int, default=20, help="graph replays per point (median reported)")


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


def _ours(sets, num_splits=None, use_pdl=None, tweak=None):
    """Our DecodePlan over the sets; ``tweak``: a function of the DecodeConfig it resolves, for probes (config=)."""
    import flashdecode

    s0 = sets[0]
    batch, nheads, headdim = s0["q"].shape
    kw = dict(max_seqlen_k=max(s0["context_lens"]), dtype=s0["q"].dtype, device=s0["q"].device,
              num_splits=num_splits, use_pdl=use_pdl)
    plan = flashdecode.DecodePlan(batch, nheads, s0["k"].shape[2], headdim, **kw)
    if tweak is not None:
        config = tweak(plan.config_for(s0["q"], s0["k"], s0["v"], s0["lens"], block_table=s0["table"]))
        plan = flashdecode.DecodePlan(batch, nheads, s0["k"].shape[2], headdim, **dict(kw, num_splits=None),
                                      config=config)

    def call(s):
        return lambda: plan.run(s["q"], s["k"], s["v"], s["lens"], block_table=s["table"])
    return [call(s) for s in sets], {"num_splits": plan.num_splits}


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
    "ours-pdl": lambda sets: _ours(sets, use_pdl=True), "FA2": _sdpa("FLASH_ATTENTION"),
    "cuDNN": _sdpa("CUDNN_ATTENTION"), "flex": _flex, "FlashInfer": _flashinfer,
}


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
            fns, info = BUILDERS[name](sets)
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
    times = [(p, row[p]) for p in peers if p not in OURS and row.get(p)]
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
    return s + (f" (with PDL {row['ours-pdl']:.1f}us)" if row.get("ours-pdl") else "")


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


# load balance: one 128k sequence among 15 short ones (Llama shape, paged 16 in the peer sweep)
MIXED_LENS = [131072] + [1024] * 15


<<<<<<< HEAD
# The decode path before issue 4's second round (no PDL at all, 512 keys unsplit): the baseline every variant is
# compared with in the same run.
_OLD = {"USE_PDL": False, "PDL_WAIT": False, "FUSED_MERGE": False}
TUNE_VARIANTS = [  # (label, config overrides, heuristics module overrides, forced num_splits or None)
    ("old", _OLD, {"DECODE_NO_SPLIT_MAX_KEYS": 512}, None),
    ("default", {}, {}, None),
    # the defaults of round 2 (T0806: no prefetch, no early trigger, 32 KiB tiles for page 16 at batch)
    ("r2", {"PREFETCH_BLOCKS": 0, "MERGE_EARLY_TRIGGER": False}, {}, None),
    ("r2 bn128", {"PREFETCH_BLOCKS": 0, "MERGE_EARLY_TRIGGER": False, "BLOCK_N": 128}, {}, None),
    ("merge-pdl-only", {"PDL_WAIT": False}, {}, None),
    ("unsplit512", {}, {"DECODE_NO_SPLIT_MAX_KEYS": 512}, None),
    ("no-tma", {"USE_TMA": False}, {}, None),
    ("no-preload", {"PRELOAD_PAGES_MAX": 0}, {}, None),
    # gathered pages read each key's page id from the block table in the loop as well (no preloaded ids)
    ("no-preload-gather", {"PRELOAD_PAGES_MAX": 0, "PRELOAD_GATHER_MAX": 0}, {}, None),
    # page ids of gathered pages by select-and-sum steps instead of one tl.gather (the default from session 4)
    ("select", {"PAGE_GATHER": False}, {}, None),
    ("bn32", {"BLOCK_N": 32}, {}, None),
    # page-sized tiles: pages of 16 keys read one page per tensor-descriptor load (no gathers), deeper pipelines
    ("bn16", {"BLOCK_N": 16}, {}, None),
    ("bn16 s6", {"BLOCK_N": 16, "num_stages": 6}, {}, None),
    ("bn16 s10", {"BLOCK_N": 16, "num_stages": 10}, {}, None),
    ("no-tiny", {}, {"DECODE_TINY_TILE_MAX_SPLIT_KEYS": 0}, None),  # gathered pages keep 16 KiB tiles at b1
    ("tiny128", {}, {"DECODE_TINY_TILE_MAX_SPLIT_KEYS": 128}, None),  # 8 KiB tiles for 128-key splits too
    ("tiny256", {}, {"DECODE_TINY_TILE_MAX_SPLIT_KEYS": 256}, None),
    ("pre256g", {"PRELOAD_GATHER_MAX": 256}, {}, None),  # gathered page ids preloaded up to 256 (session 3)
    ("persistent-gathered", {"PERSISTENT_GATHERED": True}, {}, None),  # page 16 on the persistent path too
    ("persistent-gathered bn64", {"PERSISTENT_GATHERED": True, "BLOCK_N": 64}, {}, None),
    # the persistent kernel's work queue also where pairs <= SMs (default: static shares there), and for gathered pages
    ("dyn", {"PERSISTENT_DYNAMIC": True}, {}, None),
    ("persistent-gathered dyn", {"PERSISTENT_GATHERED": True, "PERSISTENT_DYNAMIC": True}, {}, None),
    ("persistent-gathered dyn bn128", {"PERSISTENT_GATHERED": True, "PERSISTENT_DYNAMIC": True, "BLOCK_N": 128}, {},
     None),
    ("pgd bn128 s1", {"PERSISTENT_GATHERED": True, "PERSISTENT_DYNAMIC": True, "BLOCK_N": 128, "PERSISTENT_SLOTS": 1},
     {}, None),
    ("pgd bn128 s2", {"PERSISTENT_GATHERED": True, "PERSISTENT_DYNAMIC": True, "BLOCK_N": 128, "PERSISTENT_SLOTS": 2},
     {}, None),
    # one split per sequence of a uniform batch on the queue (slots = the programs: share = programs / pairs)
    ("slots1", {"PERSISTENT_SLOTS": 1, "PERSISTENT_QUEUE_SPLITS": 0}, {}, None),
    ("pgd slots1", {"PERSISTENT_GATHERED": True, "PERSISTENT_DYNAMIC": True, "PERSISTENT_SLOTS": 1,
                    "PERSISTENT_QUEUE_SPLITS": 0}, {}, None),
    # the queue's split counts before session 10: 4 slots per program, no split rule for equal lengths
    ("slots4", {"PERSISTENT_SLOTS": 4, "PERSISTENT_QUEUE_SPLITS": 0}, {}, None),
    # pages of 1-7 keys at batch on the split grid (before session 10) instead of the queue
    ("grid key pages", {}, {"DECODE_QUEUE_KEY_PAGES": False}, None),
    ("s4", {"num_stages": 4}, {}, None),
    # pipeline depth where the KV loop reads page ids from the block table (default: 2 stages more than the config's
    # 3, so K/V are double-buffered there); tr0 = before session 9
    ("tr0", {"TABLE_READ_EXTRA_STAGES": 0}, {}, None),
    ("tr1", {"TABLE_READ_EXTRA_STAGES": 1}, {}, None),
    ("tr3", {"TABLE_READ_EXTRA_STAGES": 3}, {}, None),
    # pages of 1-7 keys: the gathered-page rules of 8-63-key pages (tiles, work queue) and up to 2048 preloaded ids
    ("ids1", {"PRELOAD_GATHER_MAX": 2048}, {"DECODE_MIN_PRELOAD_PAGE": 1}, None),
    ("ids1 tr0", {"PRELOAD_GATHER_MAX": 2048, "TABLE_READ_EXTRA_STAGES": 0}, {"DECODE_MIN_PRELOAD_PAGE": 1}, None),
    # pages of 1-7 keys read their ids in the loop (before session 9: no per-split preload below 8-key pages)
    ("no-key-ids", {"PRELOAD_KEY_IDS": False}, {}, None),
    ("no-key-ids tr0", {"PRELOAD_KEY_IDS": False, "TABLE_READ_EXTRA_STAGES": 0}, {}, None),
    ("bn64", {"BLOCK_N": 64}, {}, None),
    # pages of 64 keys at batch: 64-key tiles make them block multiples (TMA, persistent path), on the work queue
    ("bn64 dyn", {"BLOCK_N": 64, "PERSISTENT_DYNAMIC": True}, {}, None),
    # 64-key pages at 97-132 pairs as before session 9: the split grid's 128-key gathers
    ("bn128 grid", {"BLOCK_N": 128, "PERSISTENT_DYNAMIC": False, "PERSISTENT_BOUND_PAGES": False}, {}, None),
    # block-multiple pages on the persistent kernel whose ids do not fit the preload: read per block in the loop
    # (before session 8) instead of bounding the splits
    ("unbounded", {"PERSISTENT_BOUND_PAGES": False}, {}, None),
    ("bounded", {"PERSISTENT_BOUND_PAGES": True}, {}, None),  # session 8's default for 64-key pages at batch
    ("persistent unbounded", {"PERSISTENT": True, "PERSISTENT_BOUND_PAGES": False}, {}, None),
    ("bn128", {"BLOCK_N": 128}, {}, None),
    ("bn64 s4", {"BLOCK_N": 64, "num_stages": 4}, {}, None),
    ("w8", {"num_warps": 8}, {}, None),
    # fewer warps for the 16-row tile: fewer cross-warp reductions and layout conversions per block
    ("w2", {"num_warps": 2}, {}, None),
    ("w1", {"num_warps": 1}, {}, None),
    ("w2 bn128", {"num_warps": 2, "BLOCK_N": 128}, {}, None),
    ("w1 bn128", {"num_warps": 1, "BLOCK_N": 128}, {}, None),
    ("s2", {"num_stages": 2}, {}, None),
    ("splits32", {}, {"DECODE_MAX_SPLITS": 32}, None),
    ("mb2", {}, {"DECODE_MIN_BLOCKS_PER_SPLIT": 2}, None),
    # one launch: the last program of each (batch, kv head) merges after an atomic ticket (issue 4)
    ("fused", {"FUSED_MERGE": True}, {}, None),
    # wave quantisation at 32/8 heads, batch 1: 16 splits = 128 programs (one wave of 132 SMs), 17 = 136 (two)
    ("n16", {}, {}, 16),
    ("n17", {}, {}, 17),
    ("n32", {}, {}, 32),
    ("n1", {}, {}, 1),
    ("n2", {}, {}, 2),
    ("n3", {}, {}, 3),
    ("n4", {}, {}, 4),
    ("n8", {}, {}, 8),
    ("n128", {}, {}, 128),  # b1 16/2: 256 programs, two per SM with 16 KiB tiles
    # no cp.async pipeline (register loads), many programs per SM hiding each other's latency instead: the stream
    # probe's 'sm s256 bn64 st1' streams 32k in 13.7 us vs 14.5 for 64 pipelined splits (stream_floor T1908)
    ("s1", {"num_stages": 1}, {}, None),
    ("n128 s1", {"num_stages": 1}, {}, 128),
    ("n256 s1", {"num_stages": 1}, {}, 256),
    ("n128 s2", {"num_stages": 2}, {}, 128),
    ("n256 s2", {"num_stages": 2}, {}, 256),
    ("bn64 n1", {"BLOCK_N": 64}, {}, 1),
    # L2 prefetch of each split's first blocks before stage 1's PDL wait, and the merge's early trigger that lets
    # the next stage 1 launch (and prefetch) while this one still runs (issue 4, round 3)
    ("et", {"MERGE_EARLY_TRIGGER": True}, {}, None),
    ("pf1", {"PREFETCH_BLOCKS": 1, "MERGE_EARLY_TRIGGER": False}, {}, None),
    ("pf4", {"PREFETCH_BLOCKS": 4}, {}, None),
    ("pf1 et", {"PREFETCH_BLOCKS": 1, "MERGE_EARLY_TRIGGER": True}, {}, None),
    # the next call's stage 1 resident during this call (early trigger) without its pre-wait prefetch: is it the
    # early prefetch or the early residency that loses at long contexts?
    ("pf0 et", {"PREFETCH_BLOCKS": 0, "MERGE_EARLY_TRIGGER": True}, {}, None),
    # the merge before session 13 below 16 pairs: whole rows, as many per program as a tile of 8192 values holds
    ("merge tile", {"MERGE_D_CHUNKS": 1, "MERGE_MAX_ROWS": 0}, {}, None),
    ("pf2 et", {"PREFETCH_BLOCKS": 2, "MERGE_EARLY_TRIGGER": True}, {}, None),
    ("pf4 et", {"PREFETCH_BLOCKS": 4, "MERGE_EARLY_TRIGGER": True}, {}, None),
    ("pf8 et", {"PREFETCH_BLOCKS": 8, "MERGE_EARLY_TRIGGER": True}, {}, None),
    ("bn64 pf4 et", {"BLOCK_N": 64, "PREFETCH_BLOCKS": 4, "MERGE_EARLY_TRIGGER": True}, {}, None),
    # device-side split counts: a fixed grid of programs loops over (sequence, kv head, split) items and merges
    # in-kernel (default with many pairs from session 4; "split-grid" is the two-kernel path it replaced there);
    # x2: two programs per SM (16 KiB tiles fit twice)
    ("split-grid", {"PERSISTENT": False}, {}, None),
    # more pairs than SMs: the persistent kernel's work queue, with 2 / 8 item slots per program instead of 4
    ("dyn-slots2", {"PERSISTENT_SLOTS": 2, "PERSISTENT_QUEUE_SPLITS": 0}, {}, None),
    ("dyn-slots8", {"PERSISTENT_SLOTS": 8, "PERSISTENT_QUEUE_SPLITS": 0}, {}, None),
    ("persistent", {"PERSISTENT": True}, {}, None),
    # paged caches at a third to a half of the SMs' worth of pairs (default: the split grid): the persistent kernel
    # with its work queue, gathered and 1-7-key pages included (32 / 128-key tiles)
    ("persistent dyn", {"PERSISTENT": True, "PERSISTENT_DYNAMIC": True}, {}, None),
    ("pgd all", {"PERSISTENT": True, "PERSISTENT_GATHERED": True, "PERSISTENT_DYNAMIC": True}, {}, None),
    ("pgd all bn128", {"PERSISTENT": True, "PERSISTENT_GATHERED": True, "PERSISTENT_DYNAMIC": True, "BLOCK_N": 128},
     {}, None),
    # the split grid with device-side split counts, one program per work item (1 or 2 items per SM)
    ("dev", {"DEVICE_SPLITS": True}, {}, None),
    ("dev x2", {"DEVICE_SPLITS": True, "DEVICE_SPLIT_SLOTS": 264}, {}, None),
    ("dev md2", {"DEVICE_SPLITS": True, "MERGE_D_CHUNKS": 2}, {}, None),
    # 64-bit gather offsets even where the cache allows 32-bit ones (before session 11)
    ("offs64", {"OFFS_32": False}, {}, None),
    # paged: the split's page ids read after its length (before session 12), not beside it
    ("nospec", {"SPEC_PAGES": False}, {}, None),
    ("dev md4", {"DEVICE_SPLITS": True, "MERGE_D_CHUNKS": 4}, {}, None),
    ("nodev", {"DEVICE_SPLITS": False}, {}, None),
    ("persistent x2", {"PERSISTENT": True, "PERSISTENT_PROGRAMS": 264}, {}, None),
    ("bn64 persistent x2", {"PERSISTENT": True, "PERSISTENT_PROGRAMS": 264, "BLOCK_N": 64}, {}, None),
    # the merge over more, smaller programs (head-dim slices), with the round-3 defaults
    ("md2", {"MERGE_D_CHUNKS": 2}, {}, None),
    ("md4", {"MERGE_D_CHUNKS": 4}, {}, None),
    ("pf1 et mb2", {"PREFETCH_BLOCKS": 1, "MERGE_EARLY_TRIGGER": True}, {"DECODE_MIN_BLOCKS_PER_SPLIT": 2}, None),
    # where the fixed cost goes (results are wrong on purpose: a stage is skipped): time of stage 1 alone, the
    # merge alone (reading stale partials), and an empty kernel per call (the graph's launch floor)
    ("stage1-only", {}, {}, None),
    ("merge-only", {}, {}, None),
    ("empty-kernel", {}, {}, None),
    # stage 1 alone as a plain launch (no PDL, no prefetch): compare with scripts/stream_floor.py's kernels
    ("stage1-only nopdl", {"PDL_WAIT": False, "USE_PDL": False, "PREFETCH_BLOCKS": 0}, {}, None),
    ("nopdl", {"PDL_WAIT": False, "USE_PDL": False, "PREFETCH_BLOCKS": 0, "MERGE_EARLY_TRIGGER": False}, {}, None),
    # bench/stream.py's kernel on the same contiguous caches: the two dots and the softmax, nothing else; with
    # stage 1's epilogue (partial and lse stores); and with the length read on the device
    ("stream", {}, {}, None),
    ("stream-epi", {}, {}, None),
    ("stream-len", {}, {}, None),
]
DIAGNOSTIC_VARIANTS = ("stage1-only", "merge-only", "empty-kernel", "stage1-only nopdl", "stream", "stream-epi",
                       "stream-len")


def _diagnostic_patch(label):
    """Context manager: for the DIAGNOSTIC_VARIANTS, stub out a part of ops.decode (timing only)."""
    import contextlib

    from flashdecode.ops import decode as ops_decode

    @contextlib.contextmanager
    def patched():
        names = {"stage1-only": ["launch_merge_many"], "stage1-only nopdl": ["launch_merge_many"],
                 "merge-only": ["_launch_stage1"],
                 "empty-kernel": ["_run_decode"], "stream": ["_run_decode"], "stream-epi": ["_run_decode"],
                 "stream-len": ["_run_decode"]}.get(label, [])
        saved = {n: getattr(ops_decode, n) for n in names}
        stub = {"empty-kernel": _empty_kernel_launch, "stream": functools.partial(_stream_launch, mode=2),
                "stream-epi": functools.partial(_stream_launch, mode=3),
                "stream-len": functools.partial(_stream_launch, mode=4)}.get(label)
        try:
            for n in names:
                setattr(ops_decode, n, stub if n == "_run_decode" else (lambda *a, **k: None))
            yield
        finally:
            for n, f in saved.items():
                setattr(ops_decode, n, f)
    return patched()


def _empty_kernel_launch(shape, *args, **kwargs):
    """One launch of a kernel that does nothing (grid 1): the per-call floor of a CUDA-graph replay."""
    _empty_kernel()[(1,)](shape.q4)


def _stream_launch(shape, k_cache, v_cache, cache_seqlens, block_table, out4, lse3, partial_o, partial_lse,
                   num_splits, *args, mode=2, **kwargs):
    """bench/stream.py's kernel (``mode``) with stage 1's grid and tile, over the same contiguous batch-1 cache
    (its capacity = the context), writing into the plan's partial buffers."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flashdecode.bench.stream import stream_kernel

    if shape.paged or shape.batch != 1 or num_splits < 2 or shape.nheads < 16:
        raise ValueError("the stream diagnostic times split contiguous batch-1 caches with >= 16 q heads only")
    rows, width = k_cache.shape[1], k_cache.shape[2] * k_cache.shape[3]
    kd, vd = (TensorDescriptor(x, [rows, width], [width, 1], [shape.block_n, shape.headdim])
              for x in (k_cache, v_cache))
    stream_kernel[(shape.nheads_kv * num_splits,)](kd, vd, shape.q4, partial_lse, partial_o, cache_seqlens, rows,
                                                   SPLITS=num_splits, HEADDIM=shape.headdim, BLOCK_N=shape.block_n,
                                                   BLOCK_M=16, MODE=mode, num_warps=4, num_stages=shape.num_stages)


_EMPTY = {}


def _empty_kernel():
    if "k" not in _EMPTY:
        import triton

        @triton.jit
        def empty(x):
            pass
        _EMPTY["k"] = empty
    return _EMPTY["k"]


def _tune(args, bandwidth, env) -> int:
    """Time our kernel (DecodePlan path) under each TUNE_VARIANTS config; prints a table, writes decodetune_*.json."""
    from flashdecode import heuristics
    from flashdecode.bench.report import markdown_table, result_stem, results_dir, write_json
    from flashdecode.timing import cuda_graph_time_us, rotation_count

    base_cfg = heuristics.decode_block_config
    base_attrs = {name: getattr(heuristics, name) for _, _, attrs, _ in TUNE_VARIANTS for name in attrs}
    gen = torch.Generator(device="cuda").manual_seed(1)
    contexts = _list(args.contexts, [4096, 32768, 131072])
    layouts = _list(args.layouts, [0, 16])
    nheads, nheads_kv = _list(args.heads, [16, 2])
    variants = [v for v in TUNE_VARIANTS if args.variants is None or v[0] in args.variants.split(",")]
    rows = []
    # the load-balance mix: one 128k sequence among short ones, batch 16 (or --tune-batch when larger)
    mixed_batch = args.mixed_batch or max(args.tune_batch, len(MIXED_LENS))
    mixed = [MIXED_LENS[0]] + MIXED_LENS[1:2] * (mixed_batch - 1)
    length_sets = [[ctx] * args.tune_batch for ctx in contexts] + ([mixed] if args.tune_mixed else [])
    try:
        for layout in layouts:
            for lens in length_sets:
                ctx = max(lens)
                kv_bytes = _kv_bytes(lens, nheads_kv, 128, 2)
                sets = [_make_set(len(lens), lens, nheads, nheads_kv, 128, layout, torch.bfloat16, gen)
                        for _ in range(rotation_count(kv_bytes))]
                row = dict(heads=f"{nheads}/{nheads_kv}", batch=len(lens),
                           context=ctx if len(set(lens)) == 1 else "mixed",
                           layout="contig" if layout == 0 else f"page{layout}", floor_us=kv_bytes / bandwidth * 1e6)
                for label, overrides, attrs, forced_splits in variants:
                    heuristics.decode_block_config = (lambda *a, _o=overrides, **k: dict(base_cfg(*a, **k), **_o))
                    for name, value in dict(base_attrs, **attrs).items():
                        setattr(heuristics, name, value)
                    try:
                        with _diagnostic_patch(label):
                            fns, _ = _ours(sets, num_splits=forced_splits)
                            row[label] = cuda_graph_time_us(fns, reps=args.reps)
                    except Exception as e:
                        row[label] = None
                        print(f"  {label} {ctx} {layout}: {type(e).__name__}: {str(e)[:160]}")
                        torch.cuda.synchronize()
                print("  " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in row.items()), flush=True)
                rows.append(row)
                del sets
                torch.cuda.empty_cache()
    finally:
        heuristics.decode_block_config = base_cfg
        for name, value in base_attrs.items():
            setattr(heuristics, name, value)
    labels = [v[0] for v in variants]
    table = markdown_table(rows, ["heads", "batch", "context", "layout", "floor_us"] + labels, {c: ".1f" for c in ["floor_us"] + labels})
    out_dir = results_dir(args.out)
    # heads, batch and layouts in the name: several tune calls in one command (same minute) must not overwrite each
    # other
    stem = (result_stem("decodetune", env) + f"_h{nheads}-{nheads_kv}_b{args.tune_batch}"
            + "_l" + "-".join(str(x) for x in layouts))
    write_json(out_dir / f"{stem}.json", "decodetune", env, rows, {"table": table})
    print(table)
    return 0


=======
>>>>>>> decode-config
def run(args) -> int:
    from flashdecode.bench.report import markdown_table, result_stem, results_dir, write_json
    from flashdecode.timing import copy_bandwidth_bytes_per_s, env_info

    if not torch.cuda.is_available():
        print("bench decode needs a CUDA GPU")
        return 1
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
        peers = [p for p in peers if (p != "flex" or use_flex) and (p != "FlashInfer" or fi)]
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
