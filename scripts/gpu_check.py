"""`make gpu-check`: the GPU test suite, fuzzing, memcheck and the quick benchmarks, a short table printed last.

Runs on the GPU machine from the source tree (PYTHONPATH=.), never reinstalling torch. Results (JSON/PNG records,
the test and benchmark logs) go to $OUT when set, else benchmarks/results/gpu-check/; to publish a record, copy it
into benchmarks/results/latest/ with `python scripts/write_benchmarks_md.py --add FILE` (which redraws its figure
and docs/benchmarks.md).

    python3 scripts/gpu_check.py [--only PART,PART...] [--shard K/N] [--full] [--pytest-args "-k decode"]
                                 [--tests-timeout S]

Parts (default: all, in this order): tests-kernels, tests-bigmem, tests-engine (``tests`` names all three), fuzz,
sanitize, decode, prefill, e2e. Each part has its own time limit (--tests-timeout, --bench-timeout), so one part per
invocation fits a command limit of 10 minutes (the re-run of out-of-memory tests included): spread a session's
check over several commands, one part each: ``--only tests-kernels``, ``--only tests-bigmem``, ``--only
tests-engine``, ``--only fuzz``, ``--only sanitize``; a part that still runs past its limit splits further with
``--shard 1/2`` and ``--shard 2/2`` (its test files).

- tests-kernels: every test file that touches CUDA, less the engine's and test_fuzz.py, on one pytest-xdist worker per
  core (at most 16);
  the tests of the ``gpu_bigmem`` xdist group are left to tests-bigmem.
- tests-bigmem: the ``gpu_bigmem`` group (long caches, > 2**31-element caches, float64 references of 6-15 GB) on 4
  workers of its own: 16 kernel workers running several such tests at once ran the card (80 GB) out of memory.
- tests-engine: the engine tests that touch CUDA (models of the Llama-3-8B shape, KV pools sized from free memory)
  on 2 workers, plus the CUDA tests of files that are otherwise CPU-only (CPU_ONLY_TEST_FILES).
- fuzz: tests/test_fuzz.py with ``--hypothesis-profile=long`` (tests/conftest.py: many more, larger cases).
- sanitize: ``compute-sanitizer --tool memcheck python3 scripts/sanitize_kernels.py`` (page ids outside the pool in
  device-resident block tables), reporting memcheck's error count; absent tool -> the part says so.
Test files that never touch CUDA (CPU_ONLY_TEST_FILES) are left out of the GPU phases: CI runs them.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_PHASES = ["tests-kernels", "tests-bigmem", "tests-engine"]
BENCHES = ["decode", "prefill", "e2e"]
PARTS = TEST_PHASES + ["fuzz", "sanitize"] + BENCHES

# Test files whose tests never touch CUDA, even on a GPU machine: they pin device="cpu" (engine, scheduler, server,
# sampling), run the Triton interpreter in gloo child processes (distributed), compile for sm_90 without a GPU or
# stub the launch (gluon compile / launch cache), or test pure Python (policy, reference, report, layering). CI runs
# them. The value names the tests in the file that DO use CUDA when there is one: they run in tests-engine.
CPU_ONLY_TEST_FILES: dict[str, tuple[str, ...]] = {
    "tests/test_cli.py": (
        "test_prompt_ids_without_tokenizer_and_text_prompt",  # `flashdecode generate` picks CUDA by itself
        "test_serve_subprocess_answers_on_loopback",  # `flashdecode serve` picks CUDA by itself
    ),
    "tests/test_checks_before_write.py": (),  # the engine on device="cpu"
    "tests/test_distributed_cp.py": ("test_plan_captures_in_a_cuda_graph",),  # one NCCL rank
    "tests/test_distributed_engine.py": (),
    "tests/test_distributed_units.py": (),
    "tests/test_engine.py": (),
    "tests/test_engine_bench.py": (),
    "tests/test_engine_config.py": (),  # EngineConfig checks; the engines it builds pin device="cpu"
    "tests/test_engine_flashinfer.py": (),  # a stand-in flashinfer on device="cpu" (the GPU one: *_gpu.py)
    "tests/test_engine_prefill_last.py": ("test_gpu_last_rows_prefill_matches_full_forward",),
    "tests/test_gluon_bwd_compile.py": (),  # sm_90 compiles; the preprocess kernel in the interpreter
    "tests/test_gluon_compile.py": (),
    "tests/test_gluon_launch_cache.py": (),
    "tests/test_gluon_paged.py": (),  # the paged Gluon dispatch on a faked Hopper (numerics: *_gpu.py)
    "tests/test_gluon_varlen_bwd.py": (),  # host glue with the Gluon kernel emulated (numerics: *_gpu.py)
    "tests/test_gpu_check.py": (),
    "tests/test_heuristics.py": (),
    "tests/test_kv_cache.py": (),
    "tests/test_layers.py": (),
    "tests/test_packaging.py": (),
    "tests/test_reference.py": (),
    "tests/test_report.py": (),
    "tests/test_sampling.py": (),
    "tests/test_scheduler.py": (),
    "tests/test_server.py": (),
    "tests/probes/test_fp8_rmse.py": ("test_probe_kernel_rows_match_the_emulation",),
}
FUZZ_FILE = "tests/test_fuzz.py"
BIGMEM = "xdist_group"  # marker expression of the gpu_bigmem group (the suite's only xdist group)
# per-part limits: with STOP_GRACE_S and the start-up, one part fits a 10-minute command
PHASE_TIMEOUT_S = {"tests-kernels": 510, "tests-bigmem": 510, "tests-engine": 420, "fuzz": 510, "sanitize": 510}
STOP_GRACE_S = 30
MIN_RERUN_S = 60  # the least time left in a part worth re-running its out-of-memory tests alone
# Most of a kernel test's time is Triton's compile on the host: one pytest worker per core (at most 16; each holds
# a CUDA context of ~0.5 GB, far from the card's memory).
KERNEL_WORKERS = max(2, min(16, os.cpu_count() or 8))


def _defined_tests(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")}


def _cuda_tests_of_cpu_only_files() -> list[str]:
    """Node ids of the CUDA tests listed in CPU_ONLY_TEST_FILES; a listed file or test that no longer exists stops
    the check (a renamed test must not drop out of the GPU run silently)."""
    ids = []
    for rel, names in CPU_ONLY_TEST_FILES.items():
        path = ROOT / rel
        if not path.exists():
            raise SystemExit(f"gpu_check: CPU_ONLY_TEST_FILES lists {rel}, which does not exist")
        missing = set(names) - _defined_tests(path)
        if missing:
            raise SystemExit(f"gpu_check: CPU_ONLY_TEST_FILES names tests {sorted(missing)} absent from {rel}")
        ids += [f"{rel}::{name}" for name in names]
    return ids


def test_files_touching_cuda() -> tuple[list[str], list[str]]:
    """(kernel files, engine files): every test file under tests/ except the CPU-only ones and the fuzz file."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    files = [f for f in files if f not in CPU_ONLY_TEST_FILES and f != FUZZ_FILE]
    engine = [f for f in files if Path(f).name.startswith("test_engine")]
    return [f for f in files if f not in engine], engine


def default_pytest_args(phase: str, shard: tuple[int, int] = (1, 1)) -> str:
    """pytest arguments of a test part; shard (k, n): the k-th of n round-robin slices of its test files."""
    kernels, engine = test_files_touching_cuda()
    k, n = shard
    if phase == "tests-kernels":
        return f"-n {KERNEL_WORKERS} --dist loadgroup -m 'not {BIGMEM}' " + " ".join(kernels[k - 1::n])
    if phase == "tests-bigmem":
        return f"-n 4 --dist load -m '{BIGMEM}' " + " ".join(kernels[k - 1::n])
    if phase == "tests-engine":
        return "-n 2 --dist loadgroup " + " ".join((engine + _cuda_tests_of_cpu_only_files())[k - 1::n])
    if phase == "fuzz":
        return f"-n {KERNEL_WORKERS} --hypothesis-profile=long {FUZZ_FILE}"
    raise ValueError(phase)


def _shard(text: str) -> tuple[int, int]:
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise argparse.ArgumentTypeError(f"expected K/N with 1 <= K <= N, got {text!r}")
    return int(k), int(n)


def run_tests(part: str, out: Path, args: str, timeout_s: int) -> dict:
    """One test part. Its xdist workers share the card: a test that runs out of GPU memory beside them runs again
    once in its worker after the memory frees (tests/conftest.py); one that fails so again is run alone after the
    part (one worker, the card to itself), and the part passes if every failure was such a test and it passes
    alone; a test that runs out of memory alone fails. The log ends with the tests' largest memory peaks."""
    t0 = time.time()
    report = out / f"gpu_{part.replace('-', '_')}.xml"
    rc, log = run_pytest(f"{args} --junitxml={report}", timeout_s)
    failed, oom = junit_failures(report)
    if rc == 1 and failed and failed == oom:
        left = timeout_s - round(time.time() - t0)  # the re-run shares the part's limit (a command's 10 minutes)
        if left < MIN_RERUN_S:
            log += (f"\n[gpu-check] {len(oom)} tests out of GPU memory beside other workers; {left} s left of the "
                    f"part's {timeout_s} s, too few to run them again alone: " + " ".join(oom))
        else:
            rc, again = run_pytest("-n 0 " + " ".join(shlex.quote(t) for t in oom), left)
            log += f"\n[gpu-check] {len(oom)} tests out of GPU memory beside other workers, run again alone: " + \
                ("passed" if rc == 0 else f"rc={rc}") + "\n" + again
    heavy = gpu_peaks(report)[:HEAVY_LISTED]
    if heavy:
        log += "\n[gpu-check] largest GPU memory peaks (GiB, reserved): " + ", ".join(f"{t} {g:.1f}" for t, g in heavy)
    print("\n".join(log.strip().splitlines()[-15:]))
    (out / f"gpu_{part.replace('-', '_')}.log").write_text(f"$ pytest {args}\n{log}")
    tails = [l.strip("= ") for l in log.splitlines()
             if re.search(r"(\d+ (passed|failed|errors?|skipped|deselected)|no tests ran).* in [\d.]+s", l)][-1:]
    tails += [l for l in log.splitlines() if l.startswith("[gpu-check]")]
    return {"part": part, "status": "ok" if rc == 0 else f"rc={rc}", "summary": " | ".join(tails),
            "seconds": round(time.time() - t0)}


HEAVY_LISTED = 10  # tests named in a part's log with their GPU memory peaks (candidates for the gpu_bigmem group)


def gpu_peaks(report: Path) -> list[tuple[str, float]]:
    """(test name, peak reserved GPU memory in GiB) of each test of a --junitxml report that recorded one
    (tests/conftest.py's gpu_peak_gib property), largest first."""
    import xml.etree.ElementTree as ET

    if not report.exists():
        return []
    peaks = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name") == "gpu_peak_gib":
                peaks.append((f"{case.get('classname', '')}::{case.get('name', '')}", float(prop.get("value"))))
    return sorted(peaks, key=lambda tp: -tp[1])


def junit_failures(report: Path) -> tuple[list[str], list[str]]:
    """(node ids of the failed or errored tests, those of them that failed on CUDA running out of memory) from a
    pytest --junitxml report (absent: none)."""
    import xml.etree.ElementTree as ET

    if not report.exists():
        return [], []
    failed, oom = [], []
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = [e for e in case if e.tag in ("failure", "error")]
        if not bad:
            continue
        module, _, cls = case.get("classname", "").partition(".test_")
        path = module.replace(".", "/") + "/test_" + cls.split(".")[0] + ".py" if cls else module
        node = "::".join([path] + cls.split(".")[1:] + [case.get("name", "")])
        failed.append(node)
        text = " ".join((e.get("message") or "") + (e.text or "") for e in bad)
        if "OutOfMemoryError" in text or "CUDA out of memory" in text:
            oom.append(node)
    return failed, oom


def run_pytest(args: str, timeout_s: int) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark"] + shlex.split(args)
    return _run(cmd, timeout_s, "pytest")


def _run(cmd: list[str], timeout_s: int, name: str, env: dict | None = None) -> tuple[int, str]:
    """(exit status, stdout + stderr) of cmd. Past timeout_s it gets SIGINT, so that pytest still prints the
    failures it has seen (their tracebacks come at the end of a run), then after STOP_GRACE_S its whole process
    group is killed (xdist workers, the sanitizer's target: nothing keeps GPU memory from the next part); the
    status is then 124."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out + err
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # workers left behind by an interrupted run
        return 124, f"{out}{err}\n[gpu-check] {name} stopped after {timeout_s} s"


def run_sanitize(out: Path, timeout_s: int) -> dict:
    """memcheck over scripts/sanitize_kernels.py. PyTorch's caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING)
    so that every tensor is an allocation of its own and a read past one is an error, not a read of a neighbour."""
    t0 = time.time()
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        print("compute-sanitizer is not on PATH: the sanitize part did not run")
        return {"part": "sanitize", "status": "absent", "summary": "compute-sanitizer not on PATH", "seconds": 0}
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "scripts/sanitize_kernels.py"]
    rc, log = _run(cmd, timeout_s, "compute-sanitizer", env)
    (out / "gpu_sanitize.log").write_text(f"$ {' '.join(cmd)}\n{log}")
    print("\n".join(log.strip().splitlines()[-15:]))
    found = re.findall(r"ERROR SUMMARY: (\d+) error", log)
    errors = found[-1] if found else "?"
    return {"part": "sanitize", "status": "ok" if rc == 0 and errors == "0" else f"rc={rc}",
            "summary": f"memcheck errors: {errors}", "seconds": round(time.time() - t0)}


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
    ap.add_argument("--only", default=",".join(PARTS),
                    help=f"comma-separated parts among {PARTS}; 'tests' names {TEST_PHASES}")
    ap.add_argument("--full", action="store_true", help="full benchmark sweeps instead of --quick")
    ap.add_argument("--pytest-args", default=None,
                    help="pytest arguments replacing the default ones of every test part run (tests-*, fuzz)")
    ap.add_argument("--shard", type=_shard, default=(1, 1), metavar="K/N",
                    help="tests-* parts: only the K-th of N round-robin slices of their test files (1/2, then 2/2)")
    ap.add_argument("--tests-timeout", type=int, default=None,
                    help=f"seconds per test / fuzz / sanitize part (default per part: {PHASE_TIMEOUT_S})")
    ap.add_argument("--bench-timeout", type=int, default=240, help="seconds per benchmark")
    ap.add_argument("--bench-args", action="append", default=[], metavar="NAME=ARGS",
                    help="extra arguments for one benchmark, e.g. 'e2e=--contexts 512,131072 --hf sdpa,eager'")
    args = ap.parse_args()
    extra = {}
    for item in args.bench_args:
        name, sep, rest = item.partition("=")
        if not sep or name not in BENCHES:
            raise SystemExit(f"--bench-args: expected NAME=ARGS with NAME in {BENCHES}, got {item!r}")
        extra[name] = rest.split()
    parts = []
    for part in (p.strip() for p in args.only.split(",")):
        if part not in PARTS + ["tests"]:
            raise SystemExit(f"--only: unknown part {part!r}; expected some of {PARTS} (or 'tests')")
        parts += TEST_PHASES if part == "tests" else [part]
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from flashdecode.timing import env_info

    env = env_info()
    print("env:", json.dumps(env))
    print(install_carried_wheels())
    results = []
    for part in parts:
        timeout_s = args.tests_timeout or PHASE_TIMEOUT_S.get(part)
        if part in TEST_PHASES or part == "fuzz":
            results.append(run_tests(part, out, args.pytest_args or default_pytest_args(part, args.shard), timeout_s))
        elif part == "sanitize":
            results.append(run_sanitize(out, timeout_s))
        else:
            results.append(run_bench(part, out, args.full, args.bench_timeout, extra.get(part)))
    print("\n== gpu-check summary:", env.get("device"), "torch", env.get("torch"), "triton", env.get("triton"))
    for r in results:
        print(f"{r['part']:<14} {r['status']:<6} {r['seconds']:>4}s  {r['summary']}")
    return 0 if all(r["status"] in ("ok", "absent") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
