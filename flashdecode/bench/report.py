"""Benchmark output: a JSON record (env + rows + command), a markdown table and a matplotlib PNG."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path


def results_dir(explicit: str | None = None) -> Path:
    """Where results go: --out if given, else $OUT (the GPU machine's return folder), else benchmarks/results."""
    path = Path(explicit or os.environ.get("OUT") or "benchmarks/results")
    path.mkdir(parents=True, exist_ok=True)
    return path


def result_stem(kind: str, env: dict) -> str:
    device = re.sub(r"[^A-Za-z0-9]+", "-", str(env.get("device", "cpu"))).strip("-").lower()
    # date and UTC time (e.g. 2026-11-22T0654): several runs a day must not overwrite each other's files
    date = env.get("date", "")
    stamp = date[:10] + ("T" + date[11:16].replace(":", "") if len(date) >= 16 else "")
    return f"{kind}_{device}_{stamp}"


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


def write_json(path: Path, kind: str, env: dict, rows: list[dict], extra: dict | None = None) -> Path:
    record = {"kind": kind, "env": env, "command": " ".join(sys.argv), "rows": rows}
    record.update(extra or {})
    path.write_text(json.dumps(record, indent=1))
    return path


def line_plot(path: Path, series: dict[str, list[tuple[float, float]]], *, title: str, xlabel: str, ylabel: str,
              logx: bool = True, logy: bool = True) -> Path | None:
    """series: label -> [(x, y), ...]. Returns the PNG path, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for label, pts in series.items():
        pts = [p for p in pts if p[1] is not None]
        if pts:
            xs, ys = zip(*pts)
            # the colour cycle has 10 colours: later series repeat them, so they get another line and marker
            repeat = drawn >= len(plt.rcParams["axes.prop_cycle"].by_key()["color"])
            ax.plot(xs, ys, marker="s" if repeat else "o", linestyle="--" if repeat else "-", label=label)
            drawn += 1
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
