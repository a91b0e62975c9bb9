"""`make gpu-check`: the GPU test suite and the quick benchmarks in one command, a short table printed last.

Runs on the GPU machine from the source tree (PYTHONPATH=.), never reinstalling torch. Results (JSON/PNG records,
the test and benchmark logs) go to $OUT when set, else benchmarks/results/gpu-check/; to publish a record, copy it
into benchmarks/results/latest/ with `python scripts/write_benchmarks_md.py --add FILE` (which redraws its figure
and docs/benchmarks.md).

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


def default_test_phases() -> list[str]:
    """The whole suite on the GPU (unmarked tests run there too, with DEVICE=cuda) in two phases: kernel tests on 6
    pytest-xdist workers, then the engine tests (each builds models of the Llama-3-8B shape and sizes a KV pool from
    free memory) on 2, so that the workers sharing the GPU do not run it out of memory."""
    engine = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_engine*.py"))
    engine += ["tests/test_kv_cache.py", "tests/test_scheduler.py"]
    ignores = " ".join(f"--ignore={p}" for p in engine)
    return [f"-n 6 --dist loadgroup tests {ignores}", "-n 2 --dist loadgroup " + " ".join(engine)]


def run_tests(out: Path, phases: list[str], timeout_s: int) -> dict:
    logs, rcs, t0 = [], [], time.time()
    for args in phases:
        rc, log = run_pytest(args, timeout_s)
        rcs.append(rc)
        logs.append(f"$ pytest {args}\n{log}")
        print("\n".join(log.strip().splitlines()[-15:]))
    log = "\n".join(logs)
    (out / "gpu_tests.log").write_text(log)
    tails = [l for l in log.splitlines() if " passed" in l or " failed" in l]
    rc = next((r for r in rcs if r != 0), 0)
    return {"part": "tests", "status": "ok" if rc == 0 else f"rc={rc}", "summary": " | ".join(tails),
            "seconds": round(time.time() - t0)}


def run_pytest(args: str, timeout_s: int) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark"] + args.split()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        log += f"\n[gpu-check] pytest stopped after {timeout_s} s"
        rc = 124
    return rc, log


def run_bench(name: str, out: Path, full: bool, timeout_s: int, extra: list[str] | None = None) -> dict:
    cmd = [sys.executable, "-m", "flashdecode", "bench", name, "--out", str(out)] + ([] if full else ["--quick"])
    cmd += extra or []
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


def install_carried_wheels() -> str:
    """Install the peer wheels carried in .whl/ (``make peer-wheels``; FlashInfer) into this python3 with --no-deps,
    so that torch is never touched. Returns a line for the log."""
    wheels = sorted(str(p) for p in (ROOT / ".whl").glob("*.whl"))
    if not wheels:
        return "no peer wheels in .whl/ (FlashInfer is skipped unless installed)"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *wheels],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return f"installing .whl/ failed (rc={proc.returncode}): {proc.stderr.strip()[-500:]}"
    return f"installed {len(wheels)} peer wheels from .whl/ (--no-deps)"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(PARTS))
    ap.add_argument("--full", action="store_true", help="full benchmark sweeps instead of --quick")
    ap.add_argument("--pytest-args", action="append", default=None,
                    help="one pytest phase (repeatable); default: kernel tests on 6 workers, then engine tests on 2")
    ap.add_argument("--tests-timeout", type=int, default=330)
    ap.add_argument("--bench-timeout", type=int, default=240, help="seconds per benchmark")
    ap.add_argument("--bench-args", action="append", default=[], metavar="NAME=ARGS",
                    help="extra arguments for one benchmark, e.g. 'e2e=--contexts 512,131072 --hf sdpa,eager'")
    args = ap.parse_args()
    extra = {}
    for item in args.bench_args:
        name, sep, rest = item.partition("=")
        if not sep or name not in PARTS[1:]:
            raise SystemExit(f"--bench-args: expected NAME=ARGS with NAME in {PARTS[1:]}, got {item!r}")
        extra[name] = rest.split()
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from flashdecode.timing import env_info

    env = env_info()
    print("env:", json.dumps(env))
    print(install_carried_wheels())
    results = []
    for part in args.only.split(","):
        part = part.strip()
        if part == "tests":
            results.append(run_tests(out, args.pytest_args or default_test_phases(), args.tests_timeout))
        elif part in PARTS:
            results.append(run_bench(part, out, args.full, args.bench_timeout, extra.get(part)))
        else:
            raise SystemExit(f"--only: unknown part {part!r}; expected some of {PARTS}")
    print("\n== gpu-check summary:", env.get("device"), "torch", env.get("torch"), "triton", env.get("triton"))
    for r in results:
        print(f"{r['part']:<14} {r['status']:<6} {r['seconds']:>4}s  {r['summary']}")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
