"""Delete the result files in benchmarks/results/ that nothing in the repository cites (git history keeps them).

    python scripts/prune_results.py            # list what would go
    python scripts/prune_results.py --delete   # delete it

benchmarks/results/latest/ is never touched; a run that was copied into it goes from benchmarks/results/. A file elsewhere in benchmarks/results/ stays when the docs, README,
the package, scripts, probes or tests name it, or when docs/decisions.md or the package name its run by its UTC
time stamp (``decodetune T1207``, ``..._T1207_*.json``: the evidence behind a heuristic constant): every file of that
stamp stays.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CITING = ["README.md", "docs/*.md", "flashdecode/**/*.py", "scripts/*.py", "benchmarks/**/*.py", "tests/**/*.py"]
CITING_RUNS = ["docs/decisions.md", "flashdecode/**/*.py"]  # where evidence is named by run stamp alone
STAMP = re.compile(r"\d{4}-\d\d-\d\dT(\d{4})")
RUN = re.compile(r"(?<![A-Za-z])T(\d{4})(?!\d)")  # "T1207", "..._T1207.json", "2026-11-22T1207"


def read(patterns: list[str]) -> str:
    return "\n".join(p.read_text(errors="replace") for pattern in patterns for p in ROOT.glob(pattern)
                     if p.is_file() and RESULTS not in p.parents)


def cited(path: Path, text: str, runs: set[str]) -> bool:
    """Named outright, or its run's time stamp named where evidence is cited by run."""
    if re.search(re.escape(path.stem) + r"(?![\w-])", text):  # the stem, not a longer name it begins
        return True
    stamp = STAMP.search(path.name)
    return bool(stamp) and stamp.group(1) in runs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delete", action="store_true")
    args = ap.parse_args()
    text = read(CITING)
    runs = set(RUN.findall(read(CITING_RUNS)))
    files = sorted(p for p in RESULTS.iterdir() if p.is_file())
    in_latest = {p.stem for p in (RESULTS / "latest").glob("*")}  # runs moved into latest/ are cited from there
    drop = [p for p in files if any(p.stem.startswith(stem) for stem in in_latest) or not cited(p, text, runs)]
    for p in drop:
        print(("deleted " if args.delete else "would delete ") + str(p.relative_to(ROOT)))
        if args.delete:
            p.unlink()
    print(f"{len(files) - len(drop)} cited files kept, {len(drop)} {'deleted' if args.delete else 'uncited'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
