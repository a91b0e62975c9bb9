"""Regression tests of issue 21's hardening: the shared metadata checks (ops/checks.py) and, per op, the defects the
hostile test found - silent wrong answers from caller layouts, memory outside the tensors, weak argument checks
and unclear errors off the GPU."""

from __future__ import annotations

import pytest
import torch

import flashdecode
from flashdecode import reference as ref
from flashdecode.ops import checks
from helpers import DEVICE, assert_fa_close, randn


def _t(values):
    """Host int32 metadata (the checks' own input)."""
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


# ----------------------------------------------------------------------------------------------------------------
# flash_decode / DecodePlan / append_kv (issue 21 classes 1-4)
# ----------------------------------------------------------------------------------------------------------------

def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _hf_q(gen, b, sq, h, d, dtype=torch.float16):
    """q as an HF-layout (b, h, sq, d) tensor transposed to (b, sq, h, d): dense, (batch, seqlen_q) not collapsible."""
    return randn(b, h, sq, d, gen=gen, dtype=dtype).transpose(1, 2)


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("layout", ["hf_transpose", "heads_outer", "strided"])
def test_decode_any_q_layout_equals_contiguous(gen, num_splits, layout):
    """Class 1: a permuted or strided q gives exactly the contiguous q's result (the output no longer inherits q's
    strides), also for a sequence of length 0; the output is contiguous."""
    b, sq, h, hk, d = 2, 2, 4, 4, 64
    if layout == "hf_transpose":
        q = _hf_q(gen, b, sq, h, d)
    elif layout == "heads_outer":
        q = randn(h, b, sq, d, gen=gen, dtype=torch.float16).permute(1, 2, 0, 3)
    else:
        q = randn(b, sq, 2 * h, d, gen=gen, dtype=torch.float16)[:, :, ::2]
    k = randn(b, 40, hk, d, gen=gen, dtype=torch.float16)
    v = randn(b, 40, hk, d, gen=gen, dtype=torch.float16)
    lens = _i32([40, 0])
    out, lse = flashdecode.flash_decode(q, k, v, lens, num_splits=num_splits, return_lse=True)
    out_c, lse_c = flashdecode.flash_decode(q.contiguous(), k, v, lens, num_splits=num_splits, return_lse=True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c) and out.is_contiguous()
    o64, _ = ref.decode_ref(q.double(), k.double(), v.double(), lens)
    assert_fa_close(out, o64, ref.decode_ref(q, k, v, lens)[0], factor=3.0, atol=1e-4)
    plan = flashdecode.DecodePlan(b, h, hk, d, max_seqlen_k=40, dtype=torch.float16, device=DEVICE, max_seqlen_q=sq,
                                  num_splits=num_splits)
    assert torch.equal(plan.run(q, k, v, lens), out_c)


def test_decode_out_that_cannot_be_merged_into_is_refused(gen):
    """A caller's out whose (batch, seqlen_q) dims do not collapse is refused with a message naming out (never a
    silent wrong answer); a contiguous out is filled."""
    q = randn(2, 2, 4, 64, gen=gen, dtype=torch.float16)
    k = randn(2, 40, 4, 64, gen=gen, dtype=torch.float16)
    lens = _i32([40, 17])
    bad_out = torch.empty(2, 4, 2, 64, dtype=torch.float16, device=DEVICE).transpose(1, 2)
    with pytest.raises(ValueError, match="out"):
        flashdecode.flash_decode(q, k, k, lens, num_splits=3, out=bad_out)
    out = torch.empty_like(q)
    assert flashdecode.flash_decode(q, k, k, lens, num_splits=3, out=out) is out
    assert torch.equal(out, flashdecode.flash_decode(q, k, k, lens, num_splits=3))


@pytest.mark.parametrize("kw,word", [
    (dict(softmax_scale=float("nan")), "softmax_scale"), (dict(softmax_scale=float("inf")), "softmax_scale"),
    (dict(softcap=float("inf")), "softcap"), (dict(softcap=float("nan")), "softcap"),
    (dict(window_size=(-5, 0)), "window_size"), (dict(window_size=(2.5, 0)), "window_size"),
    (dict(window_size=3), "window_size"), (dict(num_splits=10**9), "num_splits"), (dict(num_splits="4"), "num_splits"),
    (dict(max_seqlen_k=-1), "max_seqlen_k"), (dict(return_lse="yes"), "return_lse"),
])
def test_decode_argument_checks_as_strict_as_flash_attn(gen, kw, word):
    """Class 3, the issue's examples."""
    q = randn(2, 4, 64, gen=gen, dtype=torch.float16)
    k = randn(2, 16, 2, 64, gen=gen, dtype=torch.float16)
    with pytest.raises((ValueError, TypeError), match=word):
        flashdecode.flash_decode(q, k, k, _i32([3, 16]), **kw)


def test_off_the_gpu_without_interpreter_every_op_says_so(monkeypatch):
    """Class 4: CPU tensors without TRITON_INTERPRET get a ValueError that says what is needed, from every op."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 32, dtype=torch.float16)
    k = torch.randn(1, 8, 2, 32, dtype=torch.float16)
    lens = torch.tensor([4], dtype=torch.int32)
    calls = [
        lambda: flashdecode.flash_decode(q, k, k, lens),
        lambda: flashdecode.DecodePlan(1, 2, 2, 32, max_seqlen_k=8, dtype=torch.float16, device="cpu"),
        lambda: flashdecode.append_kv(k, k, k[:, :1], k[:, :1], lens),
        lambda: flashdecode.merge_states(q, q[..., 0].float(), q, q[..., 0].float()),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="CUDA"):
            call()


@pytest.mark.parametrize("cu,match", [
    ([1, 2, 3], r"cu_seqlens_new\[0\] = 1 must be 0"),
    ([0, 3, 2], r"cu_seqlens_new must be non-decreasing"),
    ([0, 2, 9], r"cu_seqlens_new\[-1\] = 9 runs past the 3 rows of k_new"),
])
def test_append_kv_host_cu_seqlens_new_validated(gen, cu, match, host_resident):
    """Host-resident cu_seqlens_new is checked (it used to copy memory beyond k_new into the cache)."""
    kc = randn(2, 16, 2, 32, gen=gen)
    k_new = randn(3, 2, 32, gen=gen)
    with pytest.raises(ValueError, match=match):
        flashdecode.append_kv(kc, kc.clone(), k_new, k_new, _i32([0, 0]), cu_seqlens_new=_i32(cu))


def _paged(gen, lens, page_size=4, pages_per_seq=4, h=4, hk=2, d=32):
    b = len(lens)
    q = randn(b, h, d, gen=gen, dtype=torch.float16)
    k = randn(b, pages_per_seq * page_size, hk, d, gen=gen, dtype=torch.float16)
    v = randn(b, pages_per_seq * page_size, hk, d, gen=gen, dtype=torch.float16)
    kp, vp, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=1, generator=gen)
    return q, k, v, kp, vp, table


@pytest.mark.parametrize("bad_id", [-1, "num_pages", 2**30])
def test_host_block_table_is_validated(gen, bad_id, host_resident):
    """A host-resident block table is checked without validate=: the first bad live entry is named."""
    q, k, v, kp, vp, table = _paged(gen, [9, 13])
    table[1, 2] = kp.shape[0] if bad_id == "num_pages" else bad_id
    lens = _i32([9, 13])
    with pytest.raises(ValueError, match=r"block_table\[1, 2\]"):
        flashdecode.flash_decode(q, kp, vp, lens, block_table=table)
    with pytest.raises(ValueError, match=r"block_table\[1, 2\]"):
        flashdecode.append_kv(kp, vp, k[:, :1], v[:, :1], _i32([8, 9]), table)
    table_ok = table.clone()
    table_ok[1, 2] = table[0, 3]  # a page sequence 0 does not use
    table_ok[0, 3] = -1  # past sequence 0's 9 keys: never read, not an error
    flashdecode.flash_decode(q, kp, vp, lens, block_table=table_ok)


def test_validate_names_the_first_bad_entry(gen, device_resident):
    """validate=True (one copy to the host) on device-resident metadata: the first bad page id or length is named
    with its sequence and position, for flash_decode, DecodePlan.run and append_kv."""
    q, k, v, kp, vp, table = _paged(gen, [9, 13])
    table[1, 3] = 2**30
    lens = _i32([9, 13])
    plan = flashdecode.DecodePlan(2, 4, 2, 32, max_seqlen_k=16, dtype=torch.float16, device=DEVICE, num_splits=2)
    for call in (lambda **kw: flashdecode.flash_decode(q, kp, vp, lens, block_table=table, **kw),
                 lambda **kw: plan.run(q, kp, vp, lens, block_table=table, **kw),
                 lambda **kw: flashdecode.append_kv(kp, vp, k[:, :1], v[:, :1], _i32([8, 12]), table, **kw)):
        with pytest.raises(ValueError, match=r"block_table\[1, 3\] = 1073741824 .*sequence 1 .*positions 12\.\.15"):
            call(validate=True)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = -3"):
        flashdecode.flash_decode(q, kp, vp, _i32([-3, 4]), block_table=table, validate=True)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] asks for 17 keys"):
        flashdecode.flash_decode(q, kp, vp, _i32([3, 17]), block_table=table, validate=True)
    with pytest.raises(ValueError, match=r"cu_seqlens_new\[-1\] = 5 runs past"):
        flashdecode.append_kv(kp, vp, k[0, :2], v[0, :2], _i32([0, 0]), table, cu_seqlens_new=_i32([0, 1, 5]),
                              validate=True)
    with pytest.raises(TypeError, match="validate"):
        flashdecode.flash_decode(q, kp, vp, lens, block_table=table, validate="yes")


def test_device_block_table_out_of_range_reads_as_absent(gen, device_resident):
    """Without validate, device-resident out-of-range page ids are masked by the kernels: the keys of such a page
    read as absent (never memory outside the cache), and the rest of the sequence attends as usual."""
    page_size = 4
    q, k, v, kp, vp, table = _paged(gen, [14, 13], page_size=page_size)
    lens = _i32([14, 13])
    for bad in (-1, kp.shape[0], 2**30):
        table_bad = table.clone()
        table_bad[1, 1] = bad  # sequence 1, keys 4..7
        keep = [k_ for k_ in range(13) if not 4 <= k_ < 8]
        out = flashdecode.flash_decode(q, kp, vp, lens, block_table=table_bad, num_splits=2)
        o64_0, _ = ref.decode_ref(q[:1].double(), k[:1].double(), v[:1].double(), lens[:1])
        o64_1, _ = ref.decode_ref(q[1:].double(), k[1:, keep].double(), v[1:, keep].double(), _i32([len(keep)]))
        torch.testing.assert_close(out.double(), torch.cat([o64_0, o64_1]), atol=3e-3, rtol=0)
