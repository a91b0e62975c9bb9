"""Delete the result files in benchmarks/results/ that nothing in the repository cites (git history keeps them).

    python scripts/prune_results.py            # list what would go
    python scripts/prune_results.py --delete   # delete it

benchmarks/results/latest/ is never touched; a run that was copied into it goes from benchmarks/results/. A file
elsewhere in benchmarks/results/ stays only when the docs, README, the package, scripts, probes or tests name it in
full (docs/decisions.md names each rule's evidence so); folders are left alone.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CITING = ["README.md", "docs/*.md", "flashdecode/**/*.py", "scripts/*.py", "benchmarks/**/*.py", "tests/**/*.py",
          "benchmarks/results/targets.md"]


def read(patterns: list[str]) -> str:
    return "\n".join(p.read_text(errors="replace") for pattern in patterns for p in ROOT.glob(pattern)
                     if p.is_file() and (RESULTS not in p.parents or p.name == "targets.md"))


def cited(path: Path, text: str) -> bool:
    """Named outright: its stem, not a longer name that begins with it."""
    return re.search(re.escape(path.stem) + r"(?![\w-])", text) is not None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delete", action="store_true")
    args = ap.parse_args()
    text = read(CITING)
    files = sorted(p for p in RESULTS.iterdir() if p.is_file())
    in_latest = {p.stem for p in (RESULTS / "latest").glob("*")}  # runs moved into latest/ are cited from there
    drop = [p for p in files if any(p.stem.startswith(stem) for stem in in_latest) or not cited(p, text)]
    for p in drop:
        print(("deleted " if args.delete else "would delete ") + str(p.relative_to(ROOT)))
        if args.delete:
            p.unlink()
    print(f"{len(files) - len(drop)} cited files kept, {len(drop)} {'deleted' if args.delete else 'uncited'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
