"""Test set-up: Triton kernels run on the GPU when there is one, else through the CPU interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here, before the tests
import flashdecode.kernels.
"""

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# Hypothesis (tests/test_fuzz.py): "ci", the default, draws CI_EXAMPLES fresh cases per property each run (the
# properties with cheap cases draw more: test_fuzz.ci_examples), as many as the CPU suite's time allows;
# `pytest --hypothesis-profile=long` (the GPU machine's gpu-check) runs many more, at larger sizes on a GPU. No
# deadline: interpreter and first-compile times vary. Every run draws from one seed, printed in the pytest header
# and after a failure; `--hypothesis-seed=N` or FLASHDECODE_HYPOTHESIS_SEED=N repeats a run's cases.
CI_EXAMPLES = 10
HYPOTHESIS_SEED_ENV = "FLASHDECODE_HYPOTHESIS_SEED"
settings.register_profile("ci", max_examples=CI_EXAMPLES, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("long", max_examples=100, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")  # `--hypothesis-profile` (applied after this file loads) overrides it


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """One Hypothesis seed for the whole run (pytest-xdist workers too): --hypothesis-seed if given, else
    $FLASHDECODE_HYPOTHESIS_SEED, else a fresh one, put in the environment before the workers start so they inherit
    it. Runs before Hypothesis' own plugin configures, which then forces that seed on every property."""
    seed = config.getoption("hypothesis_seed", None) or os.environ.get(HYPOTHESIS_SEED_ENV)
    if seed is None:
        seed = str(random.SystemRandom().randrange(2**32))
    os.environ[HYPOTHESIS_SEED_ENV] = str(seed)
    config.option.hypothesis_seed = str(seed)


def _seed_line() -> str:
    seed = os.environ[HYPOTHESIS_SEED_ENV]
    return (f"hypothesis seed {seed}, profile {settings.get_current_profile_name()!r} (repeat this run's cases: "
            f"--hypothesis-seed={seed} or {HYPOTHESIS_SEED_ENV}={seed})")


# CPython (3.11+) keeps frames on a stack of 16 KiB chunks and frees a chunk (an munmap) as soon as its first frame
# returns: where a test's hot loop (the Triton interpreter's calls per op) crosses a chunk boundary, every call there
# pays an mmap and an munmap (perf: a quarter of the CPU time in the kernel, the test up to 2x slower). Each test's
# call runs under one frame with enough locals to start its own 128 KiB chunk, which the stack above it then fills.
_BIG_FRAME_LOCALS = 8500
_BIG_FRAME_SOURCE = ("def under_a_big_frame(call):\n    " + " = ".join(f"_{i}" for i in range(_BIG_FRAME_LOCALS))
                     + " = None\n    return call()\n")
_big_frame: dict = {}
exec(compile(_BIG_FRAME_SOURCE, "<conftest: under_a_big_frame>", "exec"), _big_frame)


def pytest_itemcollected(item):
    runtest = item.runtest
    item.runtest = lambda: _big_frame["under_a_big_frame"](runtest)


def pytest_report_header(config):
    return _seed_line()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The seed again after a failed run (-q hides the header)."""
    if exitstatus != 0:
        terminalreporter.write_line(_seed_line())


def pytest_addoption(parser):
    parser.addoption("--compact", action="store_true",
                     help="print nothing for passed or skipped tests while the suite runs (make test): failures and "
                          "errors still print F / E and their tracebacks, and the last line counts every outcome")


def pytest_report_teststatus(report, config):
    """--compact: no progress character for a passed or skipped test (the CPU suite's 2,500 would fill the screen);
    expected failures keep theirs."""
    if not config.getoption("compact", False) or hasattr(report, "wasxfail"):
        return None
    if report.passed and report.when == "call" or report.skipped:
        return report.outcome, "", report.outcome.upper()
    return None


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by `make gpu-check` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


GPU_PEAK_PROPERTY = "gpu_peak_gib"  # junit-xml property: a test's peak of reserved GPU memory (scripts/gpu_check.py)


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory(request):
    """GPU suites run several pytest-xdist workers on one GPU: give each test's cached blocks back to the driver so
    one worker's peak (a 16k float64 reference, a 2**31-element cache) does not starve the others, and record the
    test's peak of reserved memory (GiB) as a junit-xml property, which gpu_check lists to group the heavy tests."""
    if HAS_CUDA:
        torch.cuda.reset_peak_memory_stats()
    yield
    if HAS_CUDA:
        request.node.user_properties.append((GPU_PEAK_PROPERTY, round(torch.cuda.max_memory_reserved() / 2**30, 2)))
        torch.cuda.empty_cache()


# Several pytest-xdist workers share the GPU machine's one GPU: a test can meet the driver out of memory only because
# other workers' tests hold their peaks (a float64 reference of a 16k sequence) at that moment. Such a test runs
# again once, after the free memory recovers (a warning names it); an out-of-memory error in a lone process, or on
# the second try, fails the test as usual.
OOM_RETRY_WAIT_S = 120
OOM_RETRY_FREE_FRACTION = 0.5


def _wait_for_free_gpu_memory() -> None:
    """Release this worker's cached blocks, then wait (at most OOM_RETRY_WAIT_S) until half the GPU is free."""
    import gc
    import time

    gc.collect()
    torch.cuda.empty_cache()
    deadline = time.monotonic() + OOM_RETRY_WAIT_S
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free >= OOM_RETRY_FREE_FRACTION * total:
            return
        time.sleep(2.0)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run the test function; under pytest-xdist on a GPU, once more after a CUDA out-of-memory error."""
    if not (HAS_CUDA and os.environ.get("PYTEST_XDIST_WORKER")):
        return None  # pytest's own call
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    try:
        pyfuncitem.obj(**args)
    except torch.OutOfMemoryError as error:
        import warnings

        warnings.warn(f"{pyfuncitem.nodeid} ran out of GPU memory beside the other workers' tests and runs again "
                      f"once ({str(error).splitlines()[0]})")
        _wait_for_free_gpu_memory()
        pyfuncitem.obj(**args)
    return True


@pytest.fixture(autouse=True)
def _fresh_host_caches():
    """Each test resolves its decode calls anew: a test that patches the launch policy (a heuristics constant, the
    capture check) must not meet a config or launch that another test's call left in the per-key caches."""
    yield
    import sys

    for name in ("flashdecode.ops.decode_host", "flashdecode.ops.launch_cache"):
        module = sys.modules.get(name)
        if module is not None:
            module.clear()


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def gen():
    """A fresh, seeded CPU generator per test: inputs are random (never zeros) and reproducible."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def device_resident(monkeypatch):
    """Treat every metadata tensor (lengths, block tables, cu_seqlens) as device-resident, as CUDA tensors are:
    the ops' host-side value checks stand aside (validate=True still copies and checks), so CPU tests exercise
    the kernels' own masking of bad values."""
    from flashdecode.ops import checks

    monkeypatch.setattr(checks, "host_resident", lambda x: False)


@pytest.fixture
def host_resident(monkeypatch):
    """Treat every metadata tensor as host-resident, as CPU tensors are: the ops validate its values on the host and
    raise, also where the tests' tensors live on a GPU."""
    from flashdecode.ops import checks

    monkeypatch.setattr(checks, "host_resident", lambda x: True)
