"""Regression tests of issue 21's hardening: the shared metadata checks (ops/checks.py) and, per op, the defects the
hostile test found - silent wrong answers from caller layouts, memory outside the tensors, weak argument checks
and unclear errors off the GPU."""

from __future__ import annotations

import pytest
import torch

from flashdecode.ops import checks


def _t(values):
    return torch.tensor(values, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------------------------
# ops/checks.py metadata checks
# ----------------------------------------------------------------------------------------------------------------

def test_first_bad_page_looks_only_at_pages_in_use():
    table = _t([[0, 1, -1], [2, 99, 3]])
    # sequence 0 uses columns 0..1 (8 keys of pages of 4), sequence 1 column 0 only: the -1 / 99 are never read
    assert checks.first_bad_page(table, _t([0, 0]), _t([8, 4]), 4, 10) is None
    assert checks.first_bad_page(table, _t([0, 0]), _t([9, 4]), 4, 10) == (0, 2, -1)
    assert checks.first_bad_page(table, _t([0, 0]), _t([8, 5]), 4, 10) == (1, 1, 99)
    # positions [start, end): an append at 4..7 of sequence 1 writes into column 1 only
    assert checks.first_bad_page(table, _t([8, 4]), _t([8, 8]), 4, 10) == (1, 1, 99)
    assert checks.first_bad_page(table, _t([8, 8]), _t([8, 12]), 4, 10) is None
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 99 .*sequence 1 .*positions 4\.\.7"):
        checks.check_host_block_table(table, _t([0, 0]), _t([0, 6]), 4, 10)
    big = _t([[2**30, 2**31 - 1, -2**31]])
    assert checks.first_bad_page(big, _t([0]), _t([12]), 4, 10) == (0, 0, 2**30)


@pytest.mark.parametrize("lens,added,match", [
    ([3, -1, 2], 0, r"cache_seqlens\[1\] = -1 must be >= 0"),
    ([3, 9, 2], 2, r"cache_seqlens\[1\] asks for 11 keys .* 10"),
    ([3, 4, 2], _t([0, 0, 9]), r"cache_seqlens\[2\] asks for 11"),
])
def test_host_lengths_name_the_sequence(lens, added, match):
    with pytest.raises(ValueError, match=match):
        checks.check_host_lengths("cache_seqlens", _t(lens), 10, added)
    checks.check_host_lengths("cache_seqlens", _t([0, 10, 5]), 10)


@pytest.mark.parametrize("cu,match", [
    ([1, 2, 3], r"cu\[0\] = 1 must be 0"),
    ([0, 5, 2], r"non-decreasing: cu\[2\] = 2 < cu\[1\] = 5"),
    ([0, 2, 7], r"cu\[-1\] = 7 runs past the 6 rows of k_new"),
    ([], "none"),
])
def test_host_cu_seqlens(cu, match):
    with pytest.raises(ValueError, match=match):
        checks.check_host_cu_seqlens("cu", _t(cu), 6, "k_new")
    checks.check_host_cu_seqlens("cu", _t([0, 0, 6]), 6, "k_new")


def test_to_host_once_keeps_shapes_and_nones():
    lens, table = _t([1, 2]), _t([[0, 1], [2, 3]])
    got = checks.to_host_once(lens, None, table)
    assert got[1] is None and torch.equal(got[0], lens) and torch.equal(got[2], table)


@pytest.mark.parametrize("value,error", [("4", TypeError), (2.5, TypeError), (True, TypeError), (0, ValueError),
                                         (10**9, ValueError), (torch.tensor(4), TypeError)])
def test_num_splits_typed_and_bounded(value, error):
    with pytest.raises(error, match="num_splits"):
        checks.check_num_splits(value)
    assert checks.check_num_splits(None) is None and checks.check_num_splits(3) == 3


def test_device_and_dtype_args(monkeypatch):
    with pytest.raises(ValueError, match="device"):
        checks.check_device_arg("device", "nonsense")
    with pytest.raises(TypeError, match="device"):
        checks.check_device_arg("device", 3.5)
    with pytest.raises(ValueError, match="device is meta"):
        checks.check_device_arg("device", "meta")
    with pytest.raises(TypeError, match="dtype"):
        checks.check_dtype("dtype", "fp16", checks.FLOAT_DTYPES)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert checks.check_device_arg("device", "cpu") == torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            checks.check_device_arg("device", "cpu")


def test_kernel_device_rejects_meta_even_when_interpreting(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="x is on meta"):
        checks.check_kernel_device("x", torch.empty(2, device="meta"))
