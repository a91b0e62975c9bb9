"""scripts/gpu_check.py's bookkeeping, on the CPU: a test part's tests that ran out of GPU memory beside other xdist
workers are found in pytest's junit report (and run again alone), other failures are not mistaken for them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_decode" name="test_long[bf16-131072]" time="1.0">
  <failure message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB">trace</failure>
</testcase>
<testcase classname="tests.probes.test_fp8_rmse" name="test_rows" time="1.0">
  <error message="setup">torch.OutOfMemoryError: CUDA out of memory.</error>
</testcase>
<testcase classname="tests.test_attention.TestCase" name="test_wrong" time="1.0">
  <failure message="AssertionError: error 3e-2 &gt; 2 x 1e-3">trace</failure>
</testcase>
<testcase classname="tests.test_attention" name="test_ok" time="1.0"/>
<testcase classname="tests.test_attention" name="test_skipped" time="0.0"><skipped message="needs a GPU"/></testcase>
</testsuite></testsuites>"""


def test_out_of_memory_failures_are_told_apart(tmp_path):
    gc = _gpu_check()
    report = tmp_path / "r.xml"
    report.write_text(REPORT)
    failed, oom = gc.junit_failures(report)
    assert failed == ["tests/test_decode.py::test_long[bf16-131072]", "tests/probes/test_fp8_rmse.py::test_rows",
                      "tests/test_attention.py::TestCase::test_wrong"]
    assert oom == failed[:2]
    assert gc.junit_failures(tmp_path / "absent.xml") == ([], [])


OOM_ONLY = REPORT.split("<testcase classname=\"tests.test_attention.TestCase\"")[0] + "</testsuite></testsuites>"


def test_out_of_memory_reruns_share_the_parts_limit(tmp_path, monkeypatch):
    """The tests that ran out of memory beside other workers run again alone within what is left of the part's
    limit (a part must fit one 10-minute command); with under MIN_RERUN_S left they are named, not run."""
    gc = _gpu_check()
    for elapsed, reruns in ((100, True), (gc.PHASE_TIMEOUT_S["tests-kernels"] - 30, False)):
        calls, clock = [], iter([0.0, float(elapsed), float(elapsed)])

        def fake_pytest(args, timeout_s):
            calls.append((args, timeout_s))
            if "--junitxml=" in args:
                Path(args.split("--junitxml=")[1]).write_text(OOM_ONLY)
                return 1, "2 failed in 1.0s"
            return 0, "2 passed in 1.0s"
        monkeypatch.setattr(gc, "run_pytest", fake_pytest)
        monkeypatch.setattr(gc.time, "time", lambda: next(clock))
        result = gc.run_tests("tests-kernels", tmp_path, "-n 2", gc.PHASE_TIMEOUT_S["tests-kernels"])
        monkeypatch.undo()
        if reruns:
            assert calls[1] == ("-n 0 'tests/test_decode.py::test_long[bf16-131072]' "
                                "tests/probes/test_fp8_rmse.py::test_rows", gc.PHASE_TIMEOUT_S["tests-kernels"] - 100)
            assert result["status"] == "ok"
        else:
            assert len(calls) == 1 and result["status"] == "rc=1" and "too few" in result["summary"]


def test_gpu_memory_peaks_are_listed_largest_first(tmp_path):
    """The gpu_peak_gib property tests/conftest.py records per test on a GPU comes back from the junit report,
    largest first; tests without it are left out."""
    gc = _gpu_check()
    report = tmp_path / "r.xml"
    report.write_text("""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_decode" name="test_a" time="1.0"><properties>
  <property name="gpu_peak_gib" value="2.5"/></properties></testcase>
<testcase classname="tests.test_attention" name="test_b" time="1.0"><properties>
  <property name="gpu_peak_gib" value="15.25"/></properties></testcase>
<testcase classname="tests.test_attention" name="test_c" time="1.0"/>
</testsuite></testsuites>""")
    assert gc.gpu_peaks(report) == [("tests.test_attention::test_b", 15.25), ("tests.test_decode::test_a", 2.5)]
    assert gc.gpu_peaks(tmp_path / "absent.xml") == []
