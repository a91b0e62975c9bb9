"""Benchmark output: a JSON record (env, git commit, a command to paste, rows), a markdown table and matplotlib PNGs.

Every benchmark writes through ``write_json`` so each record names the code (``git_commit``) and the command that
produced it, and gets its figure: ``plot_record`` draws it from the record's rows alone, so the PNGs in
benchmarks/results/latest/ can be redrawn from the JSON beside them (scripts/write_benchmarks_md.py does).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

LATEST = Path("benchmarks/results/latest")
REPO_ROOT = Path(__file__).resolve().parents[2]
# columns of our own kernels, never "the best peer": "ours", its ablations "ours-*" and prefill's --variants
OUR_PREFIX = "ours"
OUR_VARIANTS = frozenset({"varlen", "nd", "rawmax", "bwdtma", "bwdptr", "plainmax"})


def results_dir(explicit: str | None = None) -> Path:
    """Where results go: --out if given, else $OUT (the GPU machine's return folder), else benchmarks/results/latest."""
    path = Path(explicit or os.environ.get("OUT") or LATEST)
    path.mkdir(parents=True, exist_ok=True)
    return path


def result_stem(kind: str, env: dict) -> str:
    """``{kind}_{device}_{date}T{hhmm}``: unique per run, so several runs into one folder never overwrite each other."""
    device = re.sub(r"[^A-Za-z0-9]+", "-", str(env.get("device", "cpu"))).strip("-").lower()
    date = env.get("date", "")
    stamp = date[:10] + ("T" + date[11:16].replace(":", "") if len(date) >= 16 else "")
    return f"{kind}_{device}_{stamp}"


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """Short hash of the checkout the package runs from, ``+dirty`` when tracked files differ from it; None outside
    a git checkout (e.g. a copied tree on the GPU machine: scripts/write_benchmarks_md.py --add fills it in)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def user_command(argv: list[str]) -> str:
    """The command line as a user would paste it from the repository root: ``python -m flashdecode ...`` for the
    CLI (whatever path launched it), ``python -m benchmarks.probes.x`` for a probe, without ``--out DIR`` (where the
    run wrote its files is the runner's business)."""
    prog, args = (argv[0] if argv else ""), []
    rest = list(argv[1:])
    while rest:
        arg = rest.pop(0)
        if arg == "--out":
            rest = rest[1:]
        elif not arg.startswith("--out="):
            args.append(arg)
    path = Path(prog)
    if path.name in ("__main__.py", "flashdecode") and (path.name != "__main__.py" or path.parent.name == "flashdecode"):
        head = ["python", "-m", "flashdecode"]
    elif path.suffix == ".py":
        try:
            rel = path.resolve().relative_to(REPO_ROOT)
        except ValueError:
            rel = Path(path.name)
        head = (["python", "-m", ".".join(rel.with_suffix("").parts)] if rel.parts[0] == "benchmarks"
                else ["python", str(rel)])
    else:
        head = [prog]
    return shlex.join(head + args)


def markdown_table(rows: list[dict], columns: list[str], fmt: dict | None = None) -> str:
    """rows: list of dicts; columns: keys in order; fmt: key -> format spec (e.g. '.1f')."""
    fmt = fmt or {}

    def cell(row, col):
        v = row.get(col, "")
        if v is None or v == "":
            return "-"
        return format(v, fmt[col]) if col in fmt and isinstance(v, (int, float)) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def free_path(path: Path) -> Path:
    """path, or path with -2, -3, ... before its suffix where a file is there already (records are named by the
    minute: two runs in one minute must not overwrite each other)."""
    n, free = 2, path
    while free.exists():
        free, n = path.with_name(f"{path.stem}-{n}{path.suffix}"), n + 1
    return free


def write_json(path: Path, kind: str, env: dict, rows: list[dict], extra: dict | None = None,
               overwrite: bool = False) -> Path:
    """The record every benchmark writes: kind, env, git_commit, command (pasteable), rows, then ``extra``; and,
    for the kinds ``plot_record`` draws, its figure beside it (same stem, .png; listed under "plots"). A record
    already at path is kept (free_path) unless ``overwrite`` (a record rewritten as its rows complete)."""
    record = {"kind": kind, "env": env, "git_commit": git_commit(), "command": user_command(sys.argv), "rows": rows}
    record.update(extra or {})
    path = path if overwrite else free_path(path)
    path.write_text(json.dumps(record, indent=1))  # the numbers first: a figure that fails must not lose them
    try:
        png = plot_record(record, path.with_suffix(".png"))
    except (KeyError, TypeError, ValueError) as err:
        print(f"figure for {path.name} not drawn: {type(err).__name__}: {err}")
        png = None
    if png:
        record["plots"] = [png.name]
        path.write_text(json.dumps(record, indent=1))
    return path


# ---------------------------------------------------------------------------------------------------------- plots

_COLOURS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
            "#7f7f7f")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")
_REFERENCE = {"floor", "roofline"}  # ceilings drawn as grey dashes, not as competitors


def series_styles(names: list[str], ours: str = OUR_PREFIX) -> dict[str, dict]:
    """name -> matplotlib line kwargs: every series its own colour and marker (names starting with ``ours`` first,
    the first of them red), ceilings grey and dashed."""
    styles, i = {}, 0
    for name in sorted(names, key=lambda n: (not n.startswith(ours), names.index(n))):
        if name in _REFERENCE:
            styles[name] = dict(color="0.45", linestyle="--", marker=None, linewidth=1.2)
        else:
            styles[name] = dict(color=_COLOURS[i % len(_COLOURS)], marker=_MARKERS[i % len(_MARKERS)],
                                linestyle="-", linewidth=1.6, markersize=5)
            i += 1
    return styles


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _fmt_tokens(n: float) -> str:
    return f"{int(n) // 1024}k" if n >= 1024 and int(n) % 1024 == 0 else str(int(n))


def _legend_below(fig, handles, labels, ncol=None):
    fig.legend(handles, labels, loc="lower center", ncol=ncol or min(len(labels), 6), frameon=False, fontsize=9)


def line_plot(path: Path, series: dict[str, list[tuple[float, float]]], *, title: str, xlabel: str, ylabel: str,
              logx: bool = True, logy: bool = True) -> Path | None:
    """series: label -> [(x, y), ...]; one colour and marker per series, the legend right of the axes. Returns the
    PNG path, or None when matplotlib is missing or no series has a point."""
    plt = _pyplot()
    if plt is None:
        return None
    series = {label: [p for p in pts if p[1] is not None] for label, pts in series.items()}
    series = {label: pts for label, pts in series.items() if pts}
    if not series:  # nothing measured: no figure
        return None
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    styles = series_styles(list(series))
    for label, pts in series.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, label=label, **styles[label])
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def external_peers(record: dict) -> list[str]:
    """The record's peers that are not our own kernels (``ours``, ``ours-pdl``, ... and prefill variants)."""
    return [p for p in record.get("peers", []) if not p.startswith(OUR_PREFIX) and p not in OUR_VARIANTS]


def best_peer(row: dict, peers: list[str], lower_is_better: bool) -> tuple[str | None, float | None]:
    """(name, value) of the best peer that produced a number for ``row``."""
    got = [(p, row[p]) for p in peers if isinstance(row.get(p), (int, float)) and not math.isnan(row[p])]
    if not got:
        return None, None
    return (min if lower_is_better else max)(got, key=lambda pv: pv[1])


LAYOUT_TITLES = {"contig": "contiguous cache"}


def layout_title(layout: str) -> str:
    """'contig' -> 'contiguous cache', 'page16' -> '16-token pages'."""
    return LAYOUT_TITLES.get(layout, layout[4:] + "-token pages" if layout.startswith("page") else layout)


def plot_decode(record: dict, path: Path) -> Path | None:
    """Batch-1 context sweep: per cache layout, latency (log-log, with the floor) beside ours / best peer (linear)."""
    plt = _pyplot()
    rows = [r for r in record["rows"] if r.get("sweep") == "ctx"]
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    if plt is None or not rows:
        return None
    peers = external_peers(record)
    names = ["ours"] + [p for p in peers if any(r.get(p) for r in rows)] + ["floor"]
    styles = series_styles(names)
    fig, axes = plt.subplots(len(layouts), 2, figsize=(11, 3.3 * len(layouts) + 0.9), squeeze=False,
                             gridspec_kw={"width_ratios": [1.35, 1]})
    handles = {}
    for (lat, spd), layout in zip(axes, layouts):
        mine = [r for r in rows if r["layout"] == layout]
        xs = [r["context"] for r in mine]
        for name in names:
            key = "floor_us" if name == "floor" else name
            pts = [(x, r.get(key)) for x, r in zip(xs, mine) if isinstance(r.get(key), (int, float))]
            if pts:
                (line,) = lat.plot(*zip(*pts), label=name, **styles[name])
                handles.setdefault(name, line)
        ratio = [(x, best_peer(r, peers, True)[1] / r["ours"]) for x, r in zip(xs, mine)
                 if r.get("ours") and best_peer(r, peers, True)[1]]
        if ratio:
            spd.plot(*zip(*ratio), **styles["ours"])
            for x, y in ratio:
                spd.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
            spd.set_ylim(0, max(2.0, max(y for _, y in ratio) * 1.15))
        spd.axhline(1.0, color="0.3", linewidth=1, linestyle=":")
        for ax in (lat, spd):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [_fmt_tokens(x) for x in xs], fontsize=8)
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
        lat.set_yscale("log")
        lat.set_ylabel("latency (us)")
        lat.set_title(f"{layout_title(layout)}: latency", fontsize=10)
        spd.set_ylabel("speedup (x)")
        spd.set_title(f"{layout_title(layout)}: best peer's time / ours", fontsize=10)
    for ax in axes[-1]:
        ax.set_xlabel("context (tokens)")
    r0 = rows[0]
    fig.suptitle(f"Decode, batch 1, {r0.get('nheads', '?')} q / {r0.get('nheads_kv', '?')} kv heads, "
                 f"head dim {r0.get('headdim', '?')}, {record.get('dtype', 'bf16')} - {record['env'].get('device')}",
                 fontsize=11)
    _legend_below(fig, list(handles.values()), list(handles))
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _grouped_bars(ax, groups: list[str], names: list[str], value, styles, label_fmt=None):
    """One group of bars per entry of ``groups``, one bar per name; value(group_index, name) -> float | None."""
    width = 0.8 / max(1, len(names))
    bars = {}
    for j, name in enumerate(names):
        for i in range(len(groups)):
            v = value(i, name)
            if v is None:
                continue
            bar = ax.bar(i + (j - (len(names) - 1) / 2) * width, v, width, color=styles[name]["color"],
                         edgecolor="white", label=name)
            bars.setdefault(name, bar)
            if label_fmt:  # inside a tall bar (clear of lines above it), above a short one
                inside = v > 0.3 * ax.get_ylim()[1]
                ax.annotate(label_fmt(i, name, v), (i + (j - (len(names) - 1) / 2) * width, v / 2 if inside else v),
                            textcoords="offset points", xytext=(0, 0 if inside else 3), rotation=90, fontsize=7,
                            ha="center", va="center" if inside else "bottom", color="white" if inside else "black")
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    return bars


def plot_prefill(record: dict, path: Path) -> Path | None:
    """TFLOP/s of ours and each peer, one panel per mode, the bf16 matmul rate dashed: grouped bars per shape for a
    few shapes, else (a sweep over sequence lengths) lines against the sequence length, one panel per mode and head
    dim, causal dashed. A sweep over dtypes / head counts is drawn for its first dtype and head count."""
    plt = _pyplot()
    rows = record["rows"]
    if plt is None or not rows:
        return None
    rows = [r for r in rows if r.get("dtype") == rows[0].get("dtype") and r.get("nheads") == rows[0].get("nheads")]
    names = ["ours"] + [p for p in external_peers(record) if any(r.get(p) for r in rows)]
    styles = series_styles(names)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    sweep = len({r["seqlen"] for r in rows}) >= 3
    headdims = sorted({r["headdim"] for r in rows}) if sweep else [None]
    fig, axes = plt.subplots(len(modes), len(headdims), figsize=(11 if not sweep else 4.2 * len(headdims) + 1,
                                                                    3.4 * len(modes) + 0.9), squeeze=False)
    handles = {}
    for row_axes, mode in zip(axes, modes):
        for ax, hd in zip(row_axes, headdims):
            mine = [r for r in rows if r["mode"] == mode and (hd is None or r["headdim"] == hd)]
            if sweep:
                for name in names:
                    for causal in (False, True):
                        pts = sorted((r["seqlen"], r[name]) for r in mine if r["causal"] == causal and r.get(name))
                        if pts:
                            style = dict(styles[name], linestyle="--" if causal else "-")
                            (line,) = ax.plot(*zip(*pts), **style)
                            handles.setdefault(name, line)
                ax.set_xscale("log", base=2)
                xs = sorted({r["seqlen"] for r in mine})
                ax.set_xticks(xs, [_fmt_tokens(x) for x in xs], fontsize=8)
                ax.minorticks_off()
                ax.set_xlabel("sequence length (tokens)")
                ax.set_title(f"{mode}, head dim {hd} (dashed: causal)", fontsize=10)
            else:
                groups = [f"hd{r['headdim']} {'causal' if r['causal'] else 'full'}\n"
                          f"{r['batch']}x{_fmt_tokens(r['seqlen'])}" for r in mine]
                handles.update(_grouped_bars(ax, groups, names, lambda i, n: mine[i].get(n), styles))
                ax.set_title(mode, fontsize=10)
            peak = record["env"].get("bf16_matmul_tflops")
            if peak:
                handles["bf16 matmul rate"] = ax.axhline(peak, color="0.45", linestyle="--", linewidth=1.2)
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Prefill attention throughput ({rows[0]['dtype']}, {rows[0]['nheads']} heads) - "
                 f"{record['env'].get('device')}", fontsize=11)
    _legend_below(fig, list(handles.values()), list(handles))
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_e2e(record: dict, path: Path) -> Path | None:
    """Engine decode: share of the bandwidth roofline per (batch, context) and backend, tokens/s on each bar."""
    plt = _pyplot()
    rows = [r for r in record["rows"] if r.get("kind") == "decode" and r.get("tokens_per_s")]
    if plt is None or not rows:
        return None
    points = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    names = sorted(dict.fromkeys(r["backend"] for r in rows), key=lambda n: n != "flashdecode")
    styles = series_styles(names, ours="flashdecode")
    by = {(r["batch"], r["context"], r["backend"]): r for r in rows}
    roofline = {(t["batch"], t["context"]): t["roofline tok/s"] for t in record.get("table", [])}
    fig, ax = plt.subplots(figsize=(9, 4.6))

    def pct(i, name):
        r = by.get((*points[i], name))
        roof = r and (r.get("roofline_tokens_per_s") or roofline.get(points[i]))
        return 100.0 * r["tokens_per_s"] / roof if roof else None

    ax.set_ylim(0, 110)
    handles = _grouped_bars(ax, [f"batch {b}\ncontext {_fmt_tokens(c)}" for b, c in points], names, pct, styles,
                            label_fmt=lambda i, n, v: f"{by[(*points[i], n)]['tokens_per_s']:.0f} tok/s")
    handles["roofline"] = ax.axhline(100, color="0.45", linestyle="--", linewidth=1.2)
    ax.set_ylabel("% of bandwidth roofline")
    ax.grid(True, axis="y", alpha=0.3)
    model = str(record.get("model", "")).split(":")[0]
    ax.set_title(f"End-to-end decode, {model} - {record['env'].get('device')}", fontsize=11)
    ax.legend(list(handles.values()), list(handles), loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


FP8_DECODE_SERIES = {"ours bf16 page16": "ours, bf16 cache", "ours fp8-token page16": "ours, e4m3 cache",
                     "FlashInfer bf16 page16": "FlashInfer, bf16 cache",
                     "FlashInfer fp8 page16": "FlashInfer, e4m3 cache", "fp8_floor_us": "8-bit floor"}


def plot_fp8_decode(record: dict, path: Path) -> Path | None:
    """Batch-1 decode latency against the context on 16-token pages: our bf16 and e4m3 caches, FlashInfer's, and
    the 8-bit floor (the batched rows are in the table)."""
    rows = sorted((r for r in record["rows"] if r.get("batch") == 1), key=lambda r: r["context"])
    if not rows:
        return None
    series = {label: [(r["context"], r.get(key)) for r in rows] for key, label in FP8_DECODE_SERIES.items()}
    return line_plot(path, series, title="decode on 8-bit KV caches, batch 1, 16 q / 2 kv heads, 16-token pages",
                     xlabel="context (tokens)", ylabel="microseconds per call")


def plot_fp8_rmse(record: dict, path: Path) -> Path | None:
    """RMSE against float64 per quantisation scheme (log axis): the emulation's bar beside the kernel's."""
    plt = _pyplot()
    rows = record["rows"]
    if plt is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=(8.5, 4.0))
    xs = range(len(rows))
    for offset, key, label in ((-0.2, "emulated", "emulated (PyTorch, the kernel's rounding)"),
                               (0.2, "kernel", "our FP8 kernel")):
        ax.bar([x + offset for x in xs], [r.get(key) or 0.0 for r in rows], width=0.4, label=label)
    ax.set_xticks(list(xs), [r["scheme"] for r in rows], fontsize=8, rotation=15)
    ax.set_yscale("log")
    ax.set_ylabel("RMSE vs float64")
    ax.set_title("FP8 attention error with 0.1% outliers (lower is better)", fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_e2e_step(record: dict, path: Path) -> Path | None:
    """Decode-step breakdown: one stacked bar per (batch, KV dtype), microseconds of each kernel family, the gaps
    between kernels and the host's share, with the step's floor at the read-stream bandwidth marked."""
    plt = _pyplot()
    rows = record.get("rows", [])
    if plt is None or not rows:
        return None
    families = list(dict.fromkeys(f for r in rows for f in r["families_us"]))
    parts = families + ["gaps in the graph", "host"]
    labels = [f"batch {r['batch']}, {_fmt_tokens(r['context'])}\n{r['kv_cache_dtype']} pages" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    bottom = [0.0] * len(rows)
    cmap = plt.get_cmap("tab10")
    for j, part in enumerate(parts):
        vals = [r["families_us"].get(part, 0.0) if part in families else
                (r["gap_us"] if part == "gaps in the graph" else max(0.0, 1e3 * r["host_ms"])) for r in rows]
        ax.bar(range(len(rows)), vals, 0.6, bottom=bottom, label=part,
               color="0.8" if part == "host" else "0.55" if part.startswith("gaps") else cmap(j % 10))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        floor = r["floors"].get("read", r["floors"].get("copy"))["step_us"]
        ax.plot([i - 0.35, i + 0.35], [floor, floor], color="k", linestyle="--", linewidth=1.2,
                label="floor (read stream)" if i == 0 else None)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("us per decode step")
    ax.set_title(f"Decode step breakdown - {record['env'].get('device')}", fontsize=11)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


PLOTTERS = {"decode": plot_decode, "prefill": plot_prefill, "e2e": plot_e2e, "fp8_decode": plot_fp8_decode,
            "fp8_rmse": plot_fp8_rmse, "e2e_step": plot_e2e_step}


def plot_record(record: dict, path: Path) -> Path | None:
    """Draw ``record``'s figure (by its kind) into ``path``; None when the kind has no figure or matplotlib is
    missing."""
    plotter = PLOTTERS.get(record.get("kind"))
    return plotter(record, path) if plotter else None
