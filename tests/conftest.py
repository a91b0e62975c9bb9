"""Test set-up: Triton kernels run on the GPU when there is one, else through the CPU interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here, before the tests
import flashdecode.kernels.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# Hypothesis (tests/test_fuzz.py, tests/test_bad_inputs.py): "ci", the default, is a fixed, derandomized handful
# of cases per test (deterministic, CPU-interpreter fast); `pytest --hypothesis-profile=long` (the GPU machine's
# gpu-check) runs many more, at larger sizes on a GPU. No deadline: interpreter and first-compile times vary.
settings.register_profile("ci", max_examples=10, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("long", max_examples=100, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")  # `--hypothesis-profile` (applied after this file loads) overrides it


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by `make gpu-check` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """GPU suites run several pytest-xdist workers on one GPU: give each test's cached blocks back to the driver so
    one worker's peak (a 16k float64 reference, a 2**31-element cache) does not starve the others."""
    yield
    if HAS_CUDA:
        torch.cuda.empty_cache()


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
