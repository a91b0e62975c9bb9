"""`make gpu-check`: the GPU test suite and the quick benchmarks in one command, a short table printed last.

Runs on the GPU machine from the source tree (PYTHONPATH=.), never reinstalling torch. Results (JSON/PNG, the test
log) go to $OUT when set (the device tool brings back at most 8 files), else benchmarks/results/.

    python3 scripts/gpu_check.py [--only tests,decode,prefill,e2e] [--full] [--pytest-args "-k decode"]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["tests", "decode", "prefill", "e2e"]


def run_tests(out: Path, args: str, timeout_s: int) -> dict:
    """The whole suite on the GPU (unmarked tests run there too, with DEVICE=cuda), pytest-xdist workers."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"] + args.split()
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        log += f"\n[gpu-check] pytest stopped after {timeout_s} s"
        rc = 124
    (out / "gpu_tests.log").write_text(log)
    tail = [l for l in log.strip().splitlines() if l.strip()][-1:] or ["(no output)"]
    print("\n".join(log.strip().splitlines()[-25:]))
    return {"part": "tests", "status": "ok" if rc == 0 else f"rc={rc}",
            "summary": tail[0], "seconds": round(time.time() - t0)}


def run_bench(name: str, out: Path, full: bool, timeout_s: int) -> dict:
    cmd = [sys.executable, "-m", "flashdecode", "bench", name, "--out", str(out)] + ([] if full else ["--quick"])
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=timeout_s)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr, rc = f"[gpu-check] bench {name} stopped after {timeout_s} s", 124
    (out / f"bench_{name}.log").write_text(stdout + stderr)
    print(stdout[-6000:])
    if rc != 0:
        print(stderr[-4000:])
    summary = ""
    files = sorted(out.glob(f"{name}_*.json"), key=lambda p: p.stat().st_mtime)
    if files:
        rec = json.loads(files[-1].read_text())
        summary = "; ".join(rec.get("summary", []))
    return {"part": f"bench {name}", "status": "ok" if rc == 0 else f"rc={rc}",
            "summary": summary, "seconds": round(time.time() - t0)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(PARTS))
    ap.add_argument("--full", action="store_true", help="full benchmark sweeps instead of --quick")
    ap.add_argument("--pytest-args", default="-n 6 --dist loadgroup tests", help="what pytest runs (default: the whole suite)")
    ap.add_argument("--tests-timeout", type=int, default=330)
    ap.add_argument("--bench-timeout", type=int, default=240, help="seconds per benchmark")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from flashdecode.bench.timing import env_info

    env = env_info()
    print("env:", json.dumps(env))
    results = []
    for part in args.only.split(","):
        part = part.strip()
        if part == "tests":
            results.append(run_tests(out, args.pytest_args, args.tests_timeout))
        elif part in PARTS:
            results.append(run_bench(part, out, args.full, args.bench_timeout))
        else:
            raise SystemExit(f"--only: unknown part {part!r}; expected some of {PARTS}")
    print("\n== gpu-check summary:", env.get("device"), "torch", env.get("torch"), "triton", env.get("triton"))
    for r in results:
        print(f"{r['part']:<14} {r['status']:<6} {r['seconds']:>4}s  {r['summary']}")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
