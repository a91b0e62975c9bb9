"""Regenerate docs/benchmarks.md from the result files in benchmarks/results/ (JSON written by `flashdecode bench`).

    python3 scripts/write_benchmarks_md.py [--results benchmarks/results] [--out docs/benchmarks.md]

Each JSON holds env (device, versions, date), the command, the rows and a short summary; this script only lays
them out, newest run of each kind first, so every figure in the docs names its device, versions and command.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

TITLES = {"decode": "Decode (Flash-Decoding)", "decodetune": "Decode config variants (`bench decode --tune`, same run)",
          "stream_floor": "Streaming floor of a split-KV stage 1 (`python -m flashdecode.bench.stream`)",
          "prefill": "Prefill / training (FlashAttention)", "e2e": "End to end (engine)"}
INTRO = """# Benchmarks

Every figure below was measured on the GPU machine with the peers in the same run, following
BENCHMARKING.md (decode: CUDA-graph replays with K/V rotated beyond L2; prefill: triton.testing.do_bench median).
Files: `benchmarks/results/` (JSON with every row, PNG plots). Regenerate this page with
`python3 scripts/write_benchmarks_md.py` after copying new results there.
"""


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "-" if v is None else str(v)


def table(rows: list[dict]) -> str:
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def section(path: Path) -> str:
    rec = json.loads(path.read_text())
    if isinstance(rec, list):  # an ad-hoc A/B script's rows, without env or command (its .log names them)
        rec = {"rows": rec, "command": "see the .log of the same name" if path.with_suffix(".log").exists() else "?"}
    env = rec.get("env", {})
    command = re.sub(r"\S*flashdecode/__main__\.py", "python -m flashdecode", rec.get("command", "?"))
    parts = [f"### {path.stem}",
             f"Device {env.get('device')} · torch {env.get('torch')} · triton {env.get('triton')} · "
             f"CUDA {env.get('cuda')} · {env.get('date')}  ",
             f"Command: `{command}`", ""]
    if rec.get("summary"):
        parts += ["Summary:", ""] + [f"- {s}" for s in rec["summary"]] + [""]
    notes = rec.get("notes") or []
    for note in [notes] if isinstance(notes, str) else notes:
        parts += [f"> {note}", ""]
    if isinstance(rec.get("table"), str):  # the benchmark's own markdown table
        parts += [rec["table"], ""]
    elif isinstance(rec.get("table"), list):
        parts += [table(rec["table"]), ""]
    elif rec.get("rows"):
        parts += [table(rec["rows"]), ""]
    for png in sorted(path.parent.glob(path.stem + "*.png")):
        parts.append(f"![{png.stem}](../benchmarks/results/{png.name})")
    return "\n".join(parts) + "\n"


def _run_stamp(path: Path) -> str:
    """The run's date and UTC time from the file name (e.g. 2026-11-22T1142; a date alone sorts before that
    day's timed runs), so editing a file's notes does not reorder the page."""
    match = re.search(r"\d{4}-\d\d-\d\d(T\d{4})?", path.stem)
    return match.group() if match else ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="benchmarks/results")
    ap.add_argument("--out", default="docs/benchmarks.md")
    args = ap.parse_args()
    files = sorted(Path(args.results).glob("*.json"), key=_run_stamp, reverse=True)
    out = [INTRO]
    targets = Path(args.results) / "targets.md"  # hand-written comparison with the issues' targets, if present
    if targets.exists():
        out.append(targets.read_text())
    for kind, title in TITLES.items():
        mine = [f for f in files if f.stem.startswith(kind + "_")]
        if mine:
            out.append(f"## {title}\n")
            out += [section(f) for f in mine]
    Path(args.out).write_text("\n".join(out))
    print(f"wrote {args.out} from {len(files)} result files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
