"""docs/benchmarks.md and the figures in benchmarks/results/latest/, from the JSON records there.

    python scripts/write_benchmarks_md.py                        # redraw latest/*.png, rewrite docs/benchmarks.md
    python scripts/write_benchmarks_md.py --add $OUT/decode_*.json [--commit HASH]

latest/ holds one record per benchmark (decode at contiguous + 16-token pages, decode at other page sizes, prefill,
e2e), each written by `flashdecode bench ...` (flashdecode/bench/report.py: env, git commit, command, rows). The
README's headline numbers (the block between SPEED_BEGIN and SPEED_END) are written from the same records. --add
copies new records in, replacing the older record of the same benchmark (git history keeps it); --commit sets the
git commit the runs are of (the GPU machine's copy of .git can be older than the tree it ran), else a record
without one gets this checkout's HEAD.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdecode.bench import report  # noqa: E402

INTRO = """# Benchmarks

Measured on one H100 80GB HBM3 (SXM), or an H200 where a section or line says so, with every peer in the same
run. Decode: CUDA-graph replays of 32+ calls with the K/V sets rotated beyond L2, median of 20 replays; the floor is
the K/V bytes over the copy bandwidth measured in the same run. Prefill: `triton.testing.do_bench` median, or the
kernels' own time from the CUDA trace where a section says so, TFLOP/s = 4 b h s^2 d (halved when causal, x3.5 for
forward + backward). E2E: the engine's CUDA-graphed decode step, tokens/s against the roofline: the bytes a step must
read (every weight matrix once, the lm_head, one embedding row per token, the K/V and 8-bit scales;
flashdecode/bench/roofline.py) over the copy bandwidth, and beside it over the read-stream bandwidth, both measured in
the same run. Each section names its record in `benchmarks/results/latest/` or
`benchmarks/results/` (JSON with every row, and for `flashdecode bench` the git commit and the command);
`python scripts/write_benchmarks_md.py` regenerates this page and the figures.
"""
# The targets of the open work, one line each with the measured value and its record: written by hand (the numbers
# come from several records and probes), placed after the introduction.
TARGETS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "targets.md"
# The Gluon Hopper prefill kernels against their peers by kernel time: the kernel_time records in latest/
# (benchmarks/probes/kernel_time.py; one per mode set, fwd and fwd+bwd), drawn as one table before the sections.
KERNEL_TIME = "kernel_time"
# README.md's "Speed" list: every line drawn from a record of latest/ (speed_block), never typed by hand.
README = Path(__file__).resolve().parents[1] / "README.md"
SPEED_BEGIN = "<!-- speed: written by scripts/write_benchmarks_md.py from benchmarks/results/latest/ -->"
SPEED_END = "<!-- /speed -->"


def _fmt_tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _num(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def benchmark_key(record: dict) -> str:
    """Which benchmark a record belongs to: its kind, and for decode the cache layouts it swept."""
    if record.get("kind") == "decode":
        rows = [r for r in record["rows"] if r.get("sweep") == "ctx"] or record["rows"]
        layouts = sorted({r["layout"] for r in rows}, key=lambda x: (x != "contig", len(x), x))
        return "decode:" + ",".join(layouts)
    if record.get("kind") == KERNEL_TIME:
        return f"{KERNEL_TIME}:" + ",".join(sorted({r["mode"] for r in record["rows"]}))
    if record.get("kind") == "hf_generate":  # eager and compiled rows may come from separate runs
        return "hf_generate:" + ",".join(sorted({r["cache"] for r in record["rows"]}))
    if record.get("kind") == "serve" and record["rows"][0].get("workload"):  # a serving workload, features on / off
        r = record["rows"][0]
        return (f"serve:{r['workload']}:prefix-caching-{'on' if r.get('prefix_caching') else 'off'}"
                f":chunked-{'on' if r.get('chunked_prefill') else 'off'}")
    return str(record.get("kind"))


def normalise(record: dict, commit: str | None) -> dict:
    """A record as latest/ keeps it: a git commit, and a command a user can paste (older runs stored the path of
    flashdecode/__main__.py on the GPU machine and their --out folder)."""
    if commit:  # the runs' commit as the caller knows it (the GPU machine's copy of .git may be stale)
        record["git_commit"] = commit
    elif not record.get("git_commit"):
        record["git_commit"] = report.git_commit()
    command = record.get("command", "")
    if "__main__.py" in command or "--out" in command:
        record["command"] = report.user_command(shlex.split(command))
    return record


def _decode_section(record: dict) -> list[str]:
    peers = report.external_peers(record)
    lines = ["| sweep | batch | context | cache | ours (us) | best peer | peer (us) | speedup | % of floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        name, value = report.best_peer(r, peers, lower_is_better=True)
        speed = value / r["ours"] if value and r.get("ours") else None
        lines.append(f"| {r['sweep']} | {r['batch']} | {_fmt_tokens(r['context'])} | {r['layout']} | "
                     f"{_num(r.get('ours'))} | {name or '-'} | {_num(value)} | {_num(speed, '.2f')}x | "
                     f"{_num(r.get('ours_%floor'), '.0f')} |")
    paragraph = []
    for layout in dict.fromkeys(r["layout"] for r in record["rows"]):
        ctx = [r for r in record["rows"] if r["sweep"] == "ctx" and r["layout"] == layout and r.get("ours")]
        big = [r for r in record["rows"] if r["sweep"] == "batch" and r["layout"] == layout and r["batch"] >= 16]
        speeds = [report.best_peer(r, peers, True)[1] / r["ours"] for r in ctx if report.best_peer(r, peers, True)[1]]
        if ctx and speeds:
            paragraph.append(
                f"{report.layout_title(layout).capitalize()}: {ctx[0]['ours']:.1f} us at "
                f"{_fmt_tokens(ctx[0]['context'])}, {ctx[-1]['ours']:.1f} us at {_fmt_tokens(ctx[-1]['context'])} "
                f"({ctx[-1]['ours_%floor']:.0f}% of the floor), {min(speeds):.2f}-{max(speeds):.2f}x the best peer"
                + (f"; batch 16-64 at {min(r['ours_%floor'] for r in big):.0f}-"
                   f"{max(r['ours_%floor'] for r in big):.0f}% of the floor." if big else "."))
    rows = record["rows"]
    head = (f"Batch 1 sweeps use {rows[0]['nheads']} q / {rows[0]['nheads_kv']} kv heads (head dim "
            f"{rows[0]['headdim']}, bf16); the batch sweep Llama-3-8B's 32 / 8 heads at 8k tokens, where from batch 16 "
            f"every kernel streams at the bandwidth floor and the peers are level.")
    return [" ".join([head] + paragraph), ""] + lines


def _prefill_section(record: dict) -> list[str]:
    peers = [p for p in report.external_peers(record) if any(r.get(p) for r in record["rows"])]
    lines = ["| mode | head dim | batch x seqlen | causal | ours | " + " | ".join(peers) + " | ours / best | % of matmul |",
             "|" + "---|" * (7 + len(peers))]
    speeds = {}
    for r in record["rows"]:
        _, value = report.best_peer(r, peers, lower_is_better=False)
        speed = r["ours"] / value if value and r.get("ours") else None
        speeds[(r["mode"], r["seqlen"], r["causal"], r["headdim"])] = speed
        lines.append(f"| {r['mode']} | {r['headdim']} | {r['batch']}x{_fmt_tokens(r['seqlen'])} | "
                     f"{'yes' if r['causal'] else 'no'} | {_num(r.get('ours'), '.0f')} | "
                     + " | ".join(_num(r.get(p), ".0f") for p in peers)
                     + f" | {_num(speed, '.2f')} | {_num(r.get('ours_%peak'), '.0f')} |")
    long = [r for r in record["rows"] if r["seqlen"] >= 8192 and r.get("ours/FA2")]
    short = [r for r in record["rows"] if r["seqlen"] < 8192 and r.get("ours/FA2")]
    text = (f"TFLOP/s ({record['rows'][0]['dtype']}, {record['rows'][0]['nheads']} heads). This record predates the "
            f"Gluon Hopper kernels (see the kernel-time section above for those). At long sequences ours is "
            f"{min(r['ours/FA2'] for r in long):.2f}-{max(r['ours/FA2'] for r in long):.2f}x FlashAttention-2 "
            f"(forward and forward + backward); cuDNN stays ahead on every row. Short sequences (16 x 1k) are "
            f"host-bound and noisy ({min(r['ours/FA2'] for r in short):.2f}-{max(r['ours/FA2'] for r in short):.2f}x "
            f"FA2; docs/performance_notes.md).") if long and short else ""
    return [text, ""] + lines


def _paged_prefill_section(record: dict) -> list[str]:
    from flashdecode.bench import paged_prefill

    r0 = record["rows"][0]
    text = (f"TFLOP/s of a causal chunk of new tokens per sequence over cached pages ({r0['dtype']}, {r0['batch']} "
            f"sequences, {r0['nheads']} / {r0['nheads_kv']} heads, hd{r0['headdim']}, randomly permuted pages): ours "
            f"(`flash_attn_varlen(block_table=, seqused_k=)`) against the same problem on a contiguous cache and "
            f"FlashInfer's paged prefill (`FI_backend`).")
    return [text, "", report.markdown_table(record["rows"], paged_prefill.TABLE_COLUMNS,
                                            paged_prefill.TABLE_FORMATS)]


def _prefill_ragged_section(record: dict) -> list[str]:
    r0 = record["rows"][0]
    text = (f"TFLOP/s per call (do_bench median) of ragged (varlen) batches packed along the tokens, bf16, "
            f"{r0['nheads']} / {r0['nheads_kv']} heads: ours (`flash_attn_varlen` as called; the Gluon kernel on "
            f"sm_90), triton (the same call pinned to the Triton kernel, `config=` with backend \"triton\"), FA3 and "
            f"fa2 (FlashInfer's `BatchPrefillWithRaggedKVCacheWrapper`, planned outside the timed call). FLOPs per "
            f"sequence, halved for causal.")
    notes = [record["note"]] if record.get("note") else []
    return [text, ""] + notes + ([""] if notes else []) + [record["table"]]


def _kernel_time_cells(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """TFLOP/s per implementation, keyed by (mode, head dim, batch, seqlen, causal), in the rows' order."""
    cells = {}
    for r in rows:
        cells.setdefault((r["mode"], r["d"], r["b"], r["s"], r["causal"]), {})[r["impl"]] = r["tflops"]
    return cells


def _kernel_time_section(records: dict[str, dict]) -> str:
    """One table of the kernel_time records (file name -> record, in latest/): TFLOP/s of ours and each peer per
    (mode, head dim, shape, mask), ours against the best peer of its row and, where the record has it, against the
    run's bf16 matmul rate."""
    rows, devices, names, timing = [], set(), [], set()
    for name, record in records.items():
        devices.add(f"{record['device']}, torch {record['torch']}")
        timing.add(f"median of {record['rounds']} rotated rounds of {record['calls']} calls")
        names.append(name)
        rows += record["rows"]  # (records from before the matmul rate was measured have no pct_matmul)
    if not rows:
        return ""
    impls = list(dict.fromkeys(r["impl"] for r in rows if r["impl"] != "ours"))
    cells = _kernel_time_cells(rows)
    shares = {(r["mode"], r["d"], r["b"], r["s"], r["causal"]): r.get("pct_matmul")
              for r in rows if r["impl"] == "ours"}
    lines = ["| mode | head dim | batch x seqlen | causal | ours | " + " | ".join(impls)
             + " | ours / best | ours % of matmul |", "|" + "---|" * (7 + len(impls))]
    for key, v in cells.items():
        mode, d, b, seqlen, causal = key
        _, best = report.best_peer(v, impls, lower_is_better=False)
        ratio = v["ours"] / best if best and v.get("ours") else None
        lines.append(f"| {mode} | {d} | {b}x{_fmt_tokens(seqlen)} | {'yes' if causal else 'no'} | "
                     f"{_num(v.get('ours'), '.1f')} | " + " | ".join(_num(v.get(i), ".1f") for i in impls)
                     + f" | {_num(ratio, '.2f')} | {_num(shares.get(key), '.0f')} |")
    links = ", ".join(f"[`{n}`](../benchmarks/results/latest/{n})" for n in names)
    commands = "; ".join(f"`{r['command']}`" for r in records.values() if r.get("command"))
    method = (f"TFLOP/s (bf16, 16 heads) from the CUDA trace: each kernel's own time, {'; '.join(sorted(timing))}, "
              "peers (cuDNN through SDPA, FA3 through FlashInfer's fa3 backend) in the same run; the backward "
              "deterministic. % of matmul: ours against the bf16 matmul (cuBLAS, 8192^3) timed the same way in the "
              "same run, where the record has it.")
    return "\n".join(["## Prefill kernel time (Gluon Hopper kernels)", "",
                      f"{commands or '`python -m benchmarks.probes.kernel_time`'} - {'; '.join(sorted(devices))}; "
                      f"records {links}.",
                      "", method, ""] + lines) + "\n"


def _corrected_e2e_table(record: dict) -> list[dict]:
    """The table of an e2e record made before the roofline counted the bytes a step reads (it counted every
    parameter, the input-embedding table included), its roofline and flashdecode share recomputed from the record's
    own tokens/s and copy bandwidth with flashdecode.bench.roofline (random-weight named shapes only)."""
    from flashdecode.bench.roofline import roofline_tokens_per_s
    from flashdecode.engine.config import named_config

    name, _, rest = str(record.get("model", "")).partition(":")
    layers = int(rest.split(" layers")[0]) if " layers" in rest else None
    cfg, bandwidth = named_config(name.strip(), layers), record["copy_bandwidth_bytes_per_s"]
    table = []
    for t in record.get("table", []):
        roof = roofline_tokens_per_s(cfg, t["context"], t["batch"], bandwidth)
        ours = t.get("flashdecode tok/s")
        table.append(dict(t, **{"roofline tok/s": roof, "flashdecode % roofline": ours and 100 * ours / roof}))
    return table


def _e2e_section(record: dict) -> list[str]:
    recomputed = record.get("read_bandwidth_bytes_per_s") is None
    table = _corrected_e2e_table(record) if recomputed else record.get("table", [])
    backends = [k[: -len(" tok/s")] for k in (table[0] if table else {})
                if k.endswith(" tok/s") and "roofline" not in k]
    read = not recomputed and any(t.get("flashdecode % read roofline") for t in table)
    lines = ["| batch | context | roofline tok/s | " + " | ".join(f"{b} tok/s" for b in backends)
             + " | flashdecode % of roofline |" + (" % of read-stream roofline |" if read else ""),
             "|" + "---|" * (4 + len(backends) + read)]
    for t in table:
        lines.append(f"| {t['batch']} | {_fmt_tokens(t['context'])} | {t['roofline tok/s']:.0f} | "
                     + " | ".join(_num(t.get(f"{b} tok/s"), ".0f") for b in backends)
                     + f" | {_num(t.get('flashdecode % roofline'), '.0f')} |"
                     + (f" {_num(t.get('flashdecode % read roofline'), '.0f')} |" if read else ""))
    prefill = [r for r in record["rows"] if r.get("kind") == "prefill"]
    if prefill:
        lines += ["", "| prefill | tokens | seconds |", "|---|---|---|"]
        lines += [f"| {r['backend']} | {_fmt_tokens(r['context'])} | {r['seconds']:.2f} |" for r in prefill]
    pct = [t["flashdecode % roofline"] for t in table if t.get("flashdecode % roofline")]
    text = (f"{record.get('model', '')}. Decode reaches {min(pct):.0f}-{max(pct):.0f}% of the bandwidth roofline"
            + (" (recomputed here with the roofline that counts the bytes a step reads from the record's tokens/s "
               "and copy bandwidth: the record counted every parameter, the input-embedding table included)"
               if recomputed else "")
            + "; `sdpa` is the same engine with PyTorch's attention over a dense copy of the pages gathered every "
              "step (a reference, not a peer), `hf-sdpa` transformers' own model on the same weights. Decode KV "
              "caches are filled with random values (decode speed does not depend on them).")
    return [text, ""] + lines


def _e2e_step_section(record: dict) -> list[str]:
    rows = record["rows"]
    families = list(dict.fromkeys(f for r in rows for f in r["families_us"]))
    lines = ["| batch | context | KV pages | engine step ms | graph replay ms | host ms | gaps in the graph us | "
             + " | ".join(f"{f} %" for f in families) + " | floor ms (read stream) |",
             "|" + "---|" * (8 + len(families))]
    for r in rows:
        floor = r["floors"].get("read", r["floors"].get("copy"))["step_us"] / 1e3
        lines.append(f"| {r['batch']} | {_fmt_tokens(r['context'])} | {r['kv_cache_dtype']} | "
                     f"{r['engine_step_ms']:.3f} | {r['replay_ms']:.3f} | {r['host_ms']:.3f} | {r['gap_us']:.0f} | "
                     + " | ".join(_num(100 * r["family_share"].get(f, 0.0), ".1f") for f in families)
                     + f" | {floor:.3f} |")
    text = ("One CUDA-graphed decode step replayed under torch.profiler (CUPTI kernel times; the median step by "
            "span): each kernel family's share of the summed kernel time, the device's idle time between kernels "
            "inside the graph, and the host's share (engine step wall time - graph replay). The floor: the bytes "
            "the step must read over the read-stream bandwidth measured in the run.")
    return [text, ""] + lines


# fp8_decode columns: (heading, row key, format)
FP8_DECODE_COLUMNS = [("shape", "shape", "s"), ("batch", "batch", "d"), ("context", "context", "tokens"),
                      ("bf16 contig", "ours bf16 contig", ".1f"), ("fp8 contig", "ours fp8-token contig", ".1f"),
                      ("fp8 vs bf16", "speedup fp8-token vs bf16 contig", ".2f"),
                      ("% of 8-bit floor", "ours fp8-token contig %floor", ".0f"),
                      ("bf16 page16", "ours bf16 page16", ".1f"), ("fp8 page16", "ours fp8-token page16", ".1f"),
                      ("FlashInfer fp8 page16", "FlashInfer fp8 page16", ".1f"),
                      ("vs FlashInfer fp8", "ours fp8 vs FlashInfer fp8 (page16)", ".2f")]


def _cell(row: dict, key: str, spec: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if spec == "tokens":
        return _fmt_tokens(value)
    return str(value) if spec == "s" else format(value, spec)


def _fp8_decode_section(record: dict) -> list[str]:
    lines = ["| " + " | ".join(c[0] for c in FP8_DECODE_COLUMNS) + " |", "|" + "---|" * len(FP8_DECODE_COLUMNS)]
    lines += ["| " + " | ".join(_cell(r, key, spec) for _, key, spec in FP8_DECODE_COLUMNS) + " |"
              for r in record["rows"]]
    text = ("Microseconds per call; e4m3 K/V with one float32 scale per token and kv head (`k_scale` / `v_scale`) "
            "against our bf16 cache and FlashInfer's FP8 paged decode (`kv_data_type=torch.float8_e4m3fn`), same "
            "run. The 8-bit floor is the 8-bit K/V bytes plus their scales over the copy bandwidth measured in the "
            "run.")
    return [text, ""] + lines


def _serve_section(record: dict) -> list[str]:
    r = record["rows"][0]
    t, p = r["ttft_ms"], r["tpot_ms"]
    ratio = r.get("serve_vs_generate")
    lines = ["| requests (ok / failed) | concurrency | prompt / output tokens | output tok/s | LLM.generate tok/s | "
             "server / generate | TTFT ms p50 / p99 | TPOT ms p50 / p99 |", "|---|---|---|---|---|---|---|---|",
             f"| {r['ok']} / {r['failed']} | {r['concurrency']} | {r['prompt_len']} / {r['output_len']} | "
             f"{r['output_tokens_per_s']:.0f} | {_num(r.get('generate_output_tokens_per_s'), '.0f')} | "
             f"{_num(ratio, '.2f')} | {_num(t.get('p50'))} / {_num(t.get('p99'))} | "
             f"{_num(p.get('p50'))} / {_num(p.get('p99'))} |"]
    text = (f"`flashdecode serve` on loopback with {r['model']} ({r.get('layers')} layers, random weights), "
            f"streaming {r['endpoint']} requests")
    if r.get("workload"):
        text += (f"; workload {r['workload']}, prefix caching {'on' if r.get('prefix_caching') else 'off'}, "
                 f"chunked prefill {'on' if r.get('chunked_prefill') else 'off'}")
    if "itl_ms" in r:
        itl, during = r["itl_ms"], r.get("itl_during_long_prefill_ms", {})
        text += (f"; the streams' inter-token latency p50 / p99 {_num(itl.get('p50'))} / {_num(itl.get('p99'))} ms "
                 f"(max {_num(r.get('itl_max_ms'))}), while the long prompt prefilled {_num(during.get('p50'))} / "
                 f"{_num(during.get('p99'))} ms; the long prompt's TTFT "
                 f"{_num(r.get('long_prompt_ttft_s', 0) * 1e3)} ms")
    if ratio is not None:
        text += ", against `LLM.generate` on the same batch in the same process"
    return [text + ".", ""] + lines


def _hf_generate_section(record: dict) -> list[str]:
    rows = record["rows"]
    lines = ["| cache | batch | context | decode tok/s ours | SDPA | ours / SDPA | end to end ours / SDPA | "
             "prefill s ours / SDPA |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['batch']} | {_fmt_tokens(r['context'])} | "
                     f"{_num(r.get('ours_decode_tok_s'))} | {_num(r.get('sdpa_decode_tok_s'))} | "
                     f"{_num(r.get('ours_vs_sdpa'), '.2f')}x | {_num(r.get('ours_vs_sdpa_e2e'), '.2f')}x | "
                     f"{_num(r.get('ours_prefill_s'), '.3f')} / {_num(r.get('sdpa_prefill_s'), '.3f')} |")
    errors = [f"{r['cache']} {r['batch']}x{r['context']} {k[:-6]}: {r[k]}" for r in rows for k in r
              if k.endswith("_error")]
    text = (f"transformers `generate` with `attn_implementation=register()` (flashdecode.integrations.transformers) "
            f"against \"sdpa\" on one Llama-3-8B-shaped model ({rows[0]['layers']} layers, random bf16 weights), "
            f"greedy, {rows[0]['new_tokens']} new tokens; dynamic: eager DynamicCache; static: StaticCache with "
            "generate's compiled decode step (fullgraph, mode=\"reduce-overhead\"). Decode tokens/s = batch x "
            "(new tokens - 1) / (time of generate - time of a 1-token generate); end to end includes the prefill."
            + (" Failed: " + "; ".join(errors) if errors else ""))
    return [text, ""] + lines


def _fp8_rmse_section(record: dict) -> list[str]:
    args = record.get("args", {})
    lines = ["| scheme | RMSE (emulated) | RMSE (kernel) |", "|---|---|---|"]
    lines += [f"| {r['scheme']} | {r['emulated']:.2e} | {_num(r.get('kernel'), '.2e')} |" for r in record["rows"]]
    ratios = record.get("ratios", {})
    text = (f"FlashAttention-3's setup: q, k, v N(0, 1) plus N(0, 100) on 0.1% of the entries; batch "
            f"{args.get('batch')}, {args.get('seqlen')} tokens, {args.get('nheads')} heads, head dim "
            f"{args.get('headdim')}. Incoherent processing (a random-sign Hadamard rotation of q and k before "
            f"per-head e4m3 quantisation, `quantize_fp8(hadamard=True)`) lowers the error "
            + ", ".join(f"{v:.2f}x ({k})" for k, v in ratios.items())
            + f"; the FlashAttention-3 paper reports {record.get('fa3_claim')}x. Per-block descales are emulated "
            "only (the kernel takes per-head descales).")
    return [text, ""] + lines


def _flat_gemm_section(record: dict) -> list[str]:
    cols = ["layer", "M", "N", "K", "cublas_us", "flat_us", "speedup", "kernel", "best_config"]
    fmt = {"cublas_us": ".1f", "flat_us": ".1f", "speedup": ".2f"}
    text = ("Microseconds per call of each Llama-3-8B decode linear at M rows (CUDA-graph replays rotating weight "
            "copies beyond L2, as in a decode step): cuBLAS (`F.linear`) against the best flat-GEMM config "
            "(FlashDecoding++'s small-M GEMM, `flashdecode.engine.layers.flat_gemm`); `kernel` is what the engine's "
            "choice table picks (the flat GEMM only where it wins by 3%; M = 1 is the batch-1 GEMV).")
    return [text, "", report.markdown_table(record["rows"], cols, fmt)]


def _card(record: dict) -> str:
    device = str(record.get("env", {}).get("device") or record.get("device", ""))
    return next((c for c in ("H100", "H200") if c in device), device)


def _ratio_range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x"


def _link(name: str) -> str:
    return f"([record](benchmarks/results/latest/{name}))"


def _decode_headline(name: str, record: dict) -> str:
    peers = report.external_peers(record)

    def ctx(layout):
        return [r for r in record["rows"] if r["sweep"] == "ctx" and r["layout"] == layout and r.get("ours")]

    def vs_best(rows):
        return [report.best_peer(r, peers, True)[1] / r["ours"] for r in rows if report.best_peer(r, peers, True)[1]]

    contig, paged = ctx("contig"), ctx("page16")
    r0 = contig[0]
    times = ", ".join(f"{r['ours']:.1f} us at {_fmt_tokens(r['context'])}" for r in contig
                      if r["context"] in (512, 4096, 32768, 131072))
    batch = [r for r in record["rows"] if r["sweep"] == "batch" and r["batch"] >= 16 and r.get("ours")]
    return (f"- **Decode** ({_card(record)}, bf16, batch 1, {r0['nheads']} q / {r0['nheads_kv']} kv heads, head dim "
            f"{r0['headdim']}): {times}; {_ratio_range(vs_best(contig))} the fastest of {', '.join(peers)}"
            + (f"; 16-token pages {_ratio_range(vs_best(paged))} the best peer" if paged and vs_best(paged) else "")
            + (f"; batch 16-64 (Llama-3-8B heads, 8k tokens) {_ratio_range(vs_best(batch))} the best peer"
               if batch and vs_best(batch) else "")
            + f" {_link(name)}, commit `{record.get('git_commit')}`.")


def _fp8_decode_headline(name: str, record: dict) -> str:
    b1 = [r for r in record["rows"] if r["batch"] == 1 and r.get("ours fp8-token contig")]
    big = [r for r in record["rows"] if r["batch"] > 1]
    vs_fi = "ours fp8 vs FlashInfer fp8 (page16)"
    last = b1[-1]
    text = (f"- **Decode on 8-bit KV caches** ({_card(record)}, e4m3, per-token scales): "
            f"{last['ours fp8-token contig']:.1f} us at {_fmt_tokens(last['context'])} against "
            f"{last['ours bf16 contig']:.1f} for bf16 ({last['speedup fp8-token vs bf16 contig']:.2f}x)")
    if any(r.get(vs_fi) for r in b1):
        text += (f"; {_ratio_range([r[vs_fi] for r in b1 if r.get(vs_fi)])} FlashInfer's FP8 paged decode from "
                 f"{_fmt_tokens(b1[0]['context'])} to {_fmt_tokens(last['context'])} tokens")
    if any(r.get(vs_fi) for r in big):
        text += f", {_ratio_range([r[vs_fi] for r in big if r.get(vs_fi)])} at {big[0]['shape']} batch " \
                f"{big[0]['batch']}-{big[-1]['batch']}"
    return text + f" {_link(name)}."


def _kernel_time_headline(records: dict[str, dict]) -> str:
    cells = _kernel_time_cells([r for record in records.values() for r in record["rows"]])

    def pair(mode, d, peer=None):
        got = [cells.get((mode, d, 1, 16384, causal), {}) for causal in (False, True)]
        if not all(g.get("ours") and (peer is None or g.get(peer)) for g in got):
            return None
        if peer is None:
            return " / ".join(f"{g['ours']:.0f}" for g in got)
        return " / ".join(f"{g['ours'] / g[peer]:.2f}" for g in got) + f"x {peer}"

    parts = []
    if pair("fwd", 128):
        parts.append(f"forward {pair('fwd', 128)} TFLOP/s ("
                     + ", ".join(x for x in (pair("fwd", 128, "cuDNN"), pair("fwd", 128, "FA3")) if x) + ")")
    if pair("fwd+bwd", 128):
        parts.append(f"forward + backward {pair('fwd+bwd', 128)}"
                     + (f" ({pair('fwd+bwd', 128, 'cuDNN')})" if pair("fwd+bwd", 128, "cuDNN") else ""))
    if pair("fwd", 64, "cuDNN"):
        parts.append(f"head dim 64 forward {pair('fwd', 64, 'cuDNN')}")
    if not parts:
        return ""
    links = ", ".join(f"[record](benchmarks/results/latest/{n})" for n in records)
    return (f"- **Prefill** ({_card(next(iter(records.values())))}, kernel time, 16k tokens, head dim 128, "
            f"non-causal / causal): {'; '.join(parts)} ({links}).")


def _ragged_headline(name: str, record: dict) -> str:
    """One clause per head dim of the record (hd128 at 32 / 8 heads, hd64 at 16 / 16, ...): its rows' ratios to our
    Triton kernel and to FA3, non-causal and causal."""
    rows = record["rows"]

    def ratios(group, key, causal=None):
        return _ratio_range([r[key] for r in group if r.get(key) and (causal is None or r["causal"] == causal)])

    clauses = []
    for headdim in sorted({r["headdim"] for r in rows}, reverse=True):
        group = [r for r in rows if r["headdim"] == headdim]
        r0 = group[0]
        clauses.append(f"head dim {headdim} ({r0['nheads']} / {r0['nheads_kv']} heads): "
                       f"{ratios(group, 'ours/triton')} our Triton kernel, {ratios(group, 'ours/FA3', False)} "
                       f"FlashAttention-3 non-causal, {ratios(group, 'ours/FA3', True)} causal")
    return (f"- **Ragged (varlen) prefill** ({_card(record)}, {_fmt_tokens(rows[0]['tokens'])} tokens a call): "
            f"{'; '.join(clauses)} {_link(name)}.")


def _e2e_headline(name: str, record: dict) -> str:
    table = _corrected_e2e_table(record) if record.get("read_bandwidth_bytes_per_s") is None else record["table"]
    rows = [t for t in table if t.get("flashdecode tok/s")]
    tokens = ", ".join(f"{t['flashdecode tok/s']:.0f} tokens/s at batch {t['batch']} and {_fmt_tokens(t['context'])}"
                       for t in rows)
    shares = " / ".join(f"{t['flashdecode % roofline']:.0f}%" for t in rows)
    text = (f"- **Engine** ({_card(record)}, {str(record.get('model', '')).split(':')[0]} shape, random weights): "
            f"{tokens} ({shares} of the roofline of the bytes a step reads)")
    fp8 = [t for t in rows if t.get("flashdecode+fp8 vs model-dtype pages")]
    if fp8:
        text += (f"; fp8 KV pages " + " / ".join(f"{t['flashdecode+fp8 vs model-dtype pages']:.2f}x" for t in fp8)
                 + " bf16 pages there")
    prefill = {r["backend"]: r for r in record["rows"] if r.get("kind") == "prefill"}
    if "flashdecode" in prefill and "sdpa" in prefill:
        ours, sdpa = prefill["flashdecode"], prefill["sdpa"]
        text += (f"; the {_fmt_tokens(ours['context'])}-token prefill {ours['seconds']:.2f} s against "
                 f"{sdpa['seconds']:.2f} s on its SDPA (cuDNN) backend")
    return text + f" {_link(name)}."


def _serve_headline(name: str, record: dict) -> str:
    r = record["rows"][0]
    if r.get("serve_vs_generate") is None:
        return ""  # a serving workload without the LLM.generate comparison (its section and targets row say it)
    return (f"- **Serving** ({_card(record)}, {r['concurrency']} streams of {r['prompt_len']}-token prompts and "
            f"{r['output_len']} new tokens): {r['output_tokens_per_s']:.0f} output tokens/s, "
            f"{r['serve_vs_generate']:.2f}x `LLM.generate` on the same batch, {r['failed']} failed, TTFT p50 "
            f"{r['ttft_ms']['p50']:.0f} ms, TPOT p50 {r['tpot_ms']['p50']:.1f} ms {_link(name)}.")


PREFIX_ON, PREFIX_OFF = ("serve:shared-prefix:prefix-caching-on:chunked-off",
                         "serve:shared-prefix:prefix-caching-off:chunked-off")


def _prefix_caching_headline(by_key: dict) -> str:
    """The shared-prefix workload with prefix caching on against off (two records of one commit), or ""."""
    if PREFIX_ON not in by_key or PREFIX_OFF not in by_key:
        return ""
    (name, on), (off_name, off) = by_key[PREFIX_ON], by_key[PREFIX_OFF]
    a, b = on["rows"][0], off["rows"][0]
    ttft, total = b["ttft_ms"]["p50"] / a["ttft_ms"]["p50"], b["duration_s"] / a["duration_s"]
    return (f"- **Prefix caching** ({_card(on)}, {a['num_requests']} requests sharing a {a['prefix_len']}-token "
            f"prefix, {a['prompt_len']} new prompt and {a['output_len']} output tokens each): TTFT p50 "
            f"{a['ttft_ms']['p50']:.0f} ms against {b['ttft_ms']['p50']:.0f} ms without it ({ttft:.1f}x), total "
            f"{a['duration_s']:.2f} s against {b['duration_s']:.2f} s ({total:.1f}x) {_link(name)}, {_link(off_name)}.")


HEADLINES = {"decode:contig,page16": _decode_headline, "fp8_decode": _fp8_decode_headline,
             "prefill_ragged": _ragged_headline, "e2e": _e2e_headline, "serve": _serve_headline}


def speed_block(records: dict[Path, dict], kernel_time: dict[str, dict]) -> str:
    """README's headline list, one line per benchmark, each from its record in latest/ (and its link)."""
    by_key = {benchmark_key(record): (path.name, record) for path, record in records.items()}
    lines = []
    for key, headline in HEADLINES.items():
        if key in by_key:
            lines.append(headline(*by_key[key]))
        if key == "fp8_decode" and kernel_time:
            lines.append(_kernel_time_headline(kernel_time))
    lines.append(_prefix_caching_headline(by_key))
    return "\n".join([SPEED_BEGIN] + [line for line in lines if line] + [SPEED_END])


def write_speed_block(readme: Path, block: str) -> bool:
    """Replace the README's block between SPEED_BEGIN and SPEED_END; False (nothing written) if it has none."""
    text = readme.read_text()
    begin, end = text.find(SPEED_BEGIN), text.find(SPEED_END)
    if begin < 0 or end < begin:
        return False
    readme.write_text(text[:begin] + block + text[end + len(SPEED_END):])
    return True


def load_latest(latest: Path) -> tuple[dict[Path, dict], dict[str, dict]]:
    """The records of latest/ that have a section, and the kernel_time records (by file name)."""
    records, kernel_time = {}, {}
    for path in sorted(latest.glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("kind") in SECTIONS:
            records[path] = record
        elif record.get("kind") == KERNEL_TIME:
            kernel_time[path.name] = record
    return records, kernel_time


SECTIONS = {"decode": ("Decode (Flash-Decoding)", _decode_section), "prefill": ("Prefill (FlashAttention)",
                                                                             _prefill_section),
            "paged_prefill": ("Prefill over a paged KV cache", _paged_prefill_section),
            "prefill_ragged": ("Ragged (varlen) prefill", _prefill_ragged_section),
            "fp8_decode": ("Decode on 8-bit KV caches", _fp8_decode_section),
            "fp8_rmse": ("FP8 attention accuracy", _fp8_rmse_section),
            "e2e": ("End to end (engine, Llama-3-8B)", _e2e_section),
            "e2e_step": ("Decode-step breakdown (engine, Llama-3-8B)", _e2e_step_section),
            "serve": ("Serving (OpenAI-compatible server)", _serve_section),
            "flat_gemm": ("Flat GEMM vs cuBLAS (batched-decode linears)", _flat_gemm_section),
            "hf_generate": ("transformers generate with our attention backend", _hf_generate_section)}
ORDER = ["decode:contig,page16", "decode", "fp8_decode", "prefill", "prefill_ragged", "paged_prefill", "fp8_rmse", "e2e", "e2e_step",
         "flat_gemm", "hf_generate",
         "serve"]


def section(path: Path, record: dict, png: Path | None) -> str:
    kind = record["kind"]
    title, body = SECTIONS[kind]
    key = benchmark_key(record)
    if kind == "decode":
        title += ": " + " and ".join(report.layout_title(x) for x in key.split(":")[1].split(","))
    if kind == "serve" and key != "serve":
        title += ": the " + key.split(":")[1] + " workload"
    env = record.get("env", {})
    parts = [f"## {title}", "",
             f"`{record['command']}` - {env.get('device')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"CUDA {env.get('cuda')}, {env.get('date')}, commit `{record.get('git_commit')}`; record "
             f"[`{path.name}`](../benchmarks/results/latest/{path.name}).", ""]
    parts += body(record) + [""]
    if png:
        parts += [f"![{title}](../benchmarks/results/latest/{png.name})", ""]
    return "\n".join(parts)


def add(paths: list[Path], latest: Path, commit: str | None) -> None:
    for src in paths:
        record = normalise(json.loads(src.read_text()), commit)
        key = benchmark_key(record)
        for old in latest.glob("*.json"):
            if old.name != src.name and benchmark_key(json.loads(old.read_text())) == key:
                for f in [old, *latest.glob(old.stem + "*.png")]:
                    f.unlink()
        (latest / src.name).write_text(json.dumps(record, indent=1))
        print(f"latest/{src.name} ({key})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latest", default=str(report.LATEST))
    ap.add_argument("--out", default="docs/benchmarks.md")
    ap.add_argument("--add", nargs="*", default=[], help="result JSON files to put into latest/")
    ap.add_argument("--commit", help="git commit the --add runs are of (replaces theirs; default: theirs, else this checkout's HEAD)")
    ap.add_argument("--readme", default=None,
                    help="README whose speed block to rewrite (default: README.md when --out is docs/benchmarks.md)")
    args = ap.parse_args()
    latest = Path(args.latest)
    latest.mkdir(parents=True, exist_ok=True)
    add([Path(p) for p in args.add], latest, args.commit)
    records, kernel_time = load_latest(latest)
    ordered = sorted(records.items(), key=lambda pr: next((i for i, k in enumerate(ORDER)
                                                          if benchmark_key(pr[1]).startswith(k)), len(ORDER)))
    out = [INTRO]
    if TARGETS.exists():
        out.append(TARGETS.read_text().rstrip() + "\n")
    if kernel_time:
        out.append(_kernel_time_section(kernel_time))
    for path, record in ordered:
        png = report.plot_record(record, path.with_suffix(".png"))
        if png is None and path.with_suffix(".png").exists():  # a figure its benchmark drew itself (serve)
            png = path.with_suffix(".png")
        if png and record.get("plots") != [png.name]:
            record["plots"] = [png.name]
            path.write_text(json.dumps(record, indent=1))
        out.append(section(path, record, png))
    Path(args.out).write_text("\n".join(out))
    print(f"wrote {args.out} from {len(records) + len(kernel_time)} records in {latest}")
    readme = Path(args.readme) if args.readme else (README if args.out == ap.get_default("out") else None)
    if readme and write_speed_block(readme, speed_block(records, kernel_time)):
        print(f"wrote the speed block of {readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
