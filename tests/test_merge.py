"""merge_states / merge_states_many against reference.merge_states_ref / merge_states_many_ref (float64)."""

import math

import pytest
import torch

import flashdecode
from flashdecode import reference as ref
from helpers import DEVICE, KERNEL_DTYPES, assert_fa_close, randn

INF = float("inf")


def _states(gen, n, lead, nheads, headdim, dtype, lse_scale=3.0):
    outs = randn(n, *lead, nheads, headdim, gen=gen, dtype=dtype)
    lses = randn(n, *lead, nheads, gen=gen, dtype=torch.float32, scale=lse_scale)
    return outs, lses


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("headdim", [64, 80])
def test_merge_two_matches_reference(gen, dtype, headdim):
    outs, lses = _states(gen, 2, (3, 5), 6, headdim, dtype)
    lses[0, 0, 0, 0] = -INF  # one side empty -> the other side
    lses[1, 0, 1, 2] = -INF
    lses[:, 1, 2, 3] = -INF  # both empty -> (0, -inf)
    o, lse = flashdecode.merge_states(outs[0], lses[0], outs[1], lses[1])
    o64, lse64 = ref.merge_states_ref(outs[0].double(), lses[0].double(), outs[1].double(), lses[1].double())
    o_same, lse_same = ref.merge_states_ref(outs[0], lses[0], outs[1], lses[1])
    assert o.dtype == dtype and lse.dtype == torch.float32 and o.shape == outs[0].shape
    assert_fa_close(o, o64, o_same, factor=3.0, atol=1e-5)
    assert_fa_close(lse, lse64, lse_same.float(), factor=3.0, atol=1e-5, name="lse")
    assert torch.equal(o[0, 0, 0].cpu(), outs[1, 0, 0, 0].cpu())  # exactly the other side
    assert torch.all(o[1, 2, 3] == 0) and lse[1, 2, 3] == -INF


def test_merge_two_ignores_garbage_on_empty_side(gen):
    outs, lses = _states(gen, 2, (4,), 3, 64, torch.float32)
    outs[0, :, 0] = float("nan")
    lses[0, :, 0] = -INF
    o, lse = flashdecode.merge_states(outs[0], lses[0], outs[1], lses[1])
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o[:, 0], outs[1, :, 0])
    torch.testing.assert_close(lse[:, 0], lses[1, :, 0])


@pytest.mark.parametrize("n", [1, 3, 70])
def test_merge_many_matches_reference(gen, n):
    outs, lses = _states(gen, n, (2,), 4, 64, torch.float16)
    lses[0, 0, 0] = -INF
    lses[:, 1, 3] = -INF
    outs[:, 1, 3] = float("nan")  # never read
    o, lse = flashdecode.merge_states_many(outs, lses)
    o64, lse64 = ref.merge_states_many_ref(outs.double().nan_to_num(), lses.double())
    o_same, lse_same = ref.merge_states_many_ref(outs.nan_to_num(), lses)
    assert_fa_close(o, o64, o_same, factor=3.0, atol=1e-5)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-5, name="lse")


def test_merge_many_accepts_lists_and_is_associative(gen):
    outs, lses = _states(gen, 4, (), 8, 64, torch.float32)
    o_all, lse_all = flashdecode.merge_states_many(list(outs), list(lses))
    o_ab, lse_ab = flashdecode.merge_states(outs[0], lses[0], outs[1], lses[1])
    o_cd, lse_cd = flashdecode.merge_states_many(outs[2:], lses[2:])
    o_tree, lse_tree = flashdecode.merge_states(o_ab, lse_ab, o_cd, lse_cd)
    torch.testing.assert_close(o_all, o_tree, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_all, lse_tree, atol=1e-5, rtol=1e-5)


def test_merge_of_split_attention_is_full_attention(gen):
    """Attention over keys [0, 40) == merge of attention over [0, 17) and [17, 40) (cascade attention)."""
    q = randn(1, 1, 4, 64, gen=gen, dtype=torch.float32)
    k = randn(1, 40, 4, 64, gen=gen, dtype=torch.float32)
    v = randn(1, 40, 4, 64, gen=gen, dtype=torch.float32)
    o_full, lse_full = ref.attention_ref(q, k, v)
    o_a, lse_a = ref.attention_ref(q, k[:, :17], v[:, :17])
    o_b, lse_b = ref.attention_ref(q, k[:, 17:], v[:, 17:])
    to_nh = lambda lse: lse.transpose(1, 2).contiguous()  # (b, h, sq) -> (b, sq, h)
    o, lse = flashdecode.merge_states(o_a, to_nh(lse_a), o_b, to_nh(lse_b))
    torch.testing.assert_close(o, o_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, to_nh(lse_full), atol=1e-5, rtol=1e-5)
    assert math.isfinite(lse.max().item())


@pytest.mark.parametrize("call,error,word", [
    (lambda o, l: flashdecode.merge_states(o, l.double(), o, l), TypeError, "lse_a"),
    (lambda o, l: flashdecode.merge_states(o, l, o[:, :2], l[:, :2]), ValueError, "o_a and o_b"),
    (lambda o, l: flashdecode.merge_states(o, l[:, :2], o, l), ValueError, "lse_a"),
    (lambda o, l: flashdecode.merge_states(o.int(), l, o, l), TypeError, "o_a"),
    (lambda o, l: flashdecode.merge_states_many(o[0], l[0]), ValueError, "outs"),
    (lambda o, l: flashdecode.merge_states_many(o[None], l[None].half()), TypeError, "lses"),
    (lambda o, l: flashdecode.merge_states_many([], []), ValueError, "outs"),
    (lambda o, l: flashdecode.merge_states_many([o, "x"], [l, l]), TypeError, r"outs\[1\]"),
    (lambda o, l: flashdecode.merge_states_many([o, o[:, :2]], [l, l]), ValueError, r"outs\[1\]"),
    (lambda o, l: flashdecode.merge_states_many([o, o], [l, l.double()]), ValueError, r"lses\[1\]"),
    (lambda o, l: flashdecode.merge_states_many(o[None], 3.0), TypeError, "lses"),
    (lambda o, l: flashdecode.merge_states_many([o, o], [l]), ValueError, "lses"),
    (lambda o, l: flashdecode.merge_states(None, l, o, l), TypeError, "o_a"),
    (lambda o, l: flashdecode.merge_states(o, l, o, l.double()), TypeError, "lse_b"),
    (lambda o, l: flashdecode.merge_states(o[0, 0], l[0, 0], o[0, 0], l[0, 0]), ValueError, "o_a"),
    (lambda o, l: flashdecode.merge_states(o, l, o, l[None]), ValueError, "lse_b"),
    (lambda o, l: flashdecode.merge_states(o.new_zeros(2, 1, 2048), l.new_zeros(2, 1), o.new_zeros(2, 1, 2048),
                                           l.new_zeros(2, 1)), ValueError, "head dim"),
])
def test_bad_input(gen, call, error, word):
    o = randn(2, 3, 64, gen=gen, dtype=torch.float32)
    lse = randn(2, 3, gen=gen, dtype=torch.float32)
    with pytest.raises(error, match=word):
        call(o, lse)


def test_device_of_results(gen):
    outs, lses = _states(gen, 2, (1,), 2, 64, torch.float32)
    o, lse = flashdecode.merge_states_many(outs, lses)
    assert o.device.type == DEVICE.type and lse.device.type == DEVICE.type


@pytest.mark.parametrize("d_chunks,headdim,max_rows", [(2, 64, 0), (4, 80, 0), (8, 64, 0), (4, 128, 1), (1, 96, 2)])
def test_merge_many_in_head_dim_chunks(gen, d_chunks, headdim, max_rows):
    """Stage 2 split over head-dim slices (more, smaller programs; chunk 0 writes the lse) and over rows
    (max_rows per program): same results as one program per row block, empty states included; slices of 16
    columns at least (80 columns: a partial last slice)."""
    from flashdecode.ops.merge import launch_merge_many

    outs, lses = _states(gen, 9, (2,), 3, headdim, torch.float32)
    lses[:, 1, 2] = -INF
    lses[0, 0, 0] = -INF
    outs[0, 0, 0] = float("nan")  # never read: its state is empty
    o = torch.full((2, 3, headdim), float("nan"), device=DEVICE)
    lse = torch.full((2, 3), float("nan"), device=DEVICE)
    launch_merge_many(outs, lses, o, lse, states_dim=0, lse_log2=False, d_chunks=d_chunks, max_rows=max_rows)
    o64, lse64 = ref.merge_states_many_ref(outs.double().nan_to_num(), lses.double())
    o_same, lse_same = ref.merge_states_many_ref(outs.nan_to_num(), lses)
    assert_fa_close(o, o64, o_same, factor=3.0, atol=1e-5)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-5, name="lse")
    with pytest.raises(ValueError, match="d_chunks"):
        launch_merge_many(outs, lses, o, lse, states_dim=0, lse_log2=False, d_chunks=3)
    with pytest.raises(ValueError, match="max_rows"):
        launch_merge_many(outs, lses, o, lse, states_dim=0, lse_log2=False, max_rows=3)


@pytest.mark.parametrize("d_chunks,max_rows,block_s", [(1, 0, 0), (2, 1, 0), (1, 0, 4)])
@pytest.mark.parametrize("lse_log2", [False, True])
def test_merge_many_live_only(gen, d_chunks, max_rows, block_s, lse_log2):
    """live_only (the device-split grid's merge: most slots empty) reads every lse first, then the live states
    below its rows' last live slot only: empty slots' o NaN (never written, never read), live slots scattered
    (not only a prefix), a row with no live state (0, -inf), a row with one state, a NaN lse (a NaN row, never a
    valid-looking one); against the float64 merge and the merge that reads every slot."""
    from flashdecode.ops.merge import launch_merge_many

    outs, lses = _states(gen, 33, (3,), 4, 64, torch.float32)
    empty = (torch.rand(lses.shape, generator=gen) < 0.8).to(lses.device)
    empty[:, 2, 3] = True  # a row without any live state
    empty[:, 1, 0] = True
    empty[7, 1, 0] = False  # one live state, in the middle of the slots
    empty[32, 0, 1] = False  # the last slot live
    lses[empty] = -INF
    outs[empty] = float("nan")
    lses[0, 2, 1] = float("nan")
    results = []
    for live_only in (False, True):
        o = torch.full((3, 4, 64), 7.0, device=DEVICE)
        lse = torch.full((3, 4), 7.0, device=DEVICE)
        lse_in = lses / math.log(2) if lse_log2 else lses
        launch_merge_many(outs, lse_in, o, lse, states_dim=0, lse_log2=lse_log2, d_chunks=d_chunks,
                          max_rows=max_rows, block_s=block_s, live_only=live_only)
        results.append((o, lse))
    (o_all, lse_all), (o_live, lse_live) = results
    assert o_live[2, 1].isnan().all() and lse_live[2, 1].isnan()
    o_live[2, 1], lse_live[2, 1], o_all[2, 1], lse_all[2, 1] = 0.0, 0.0, 0.0, 0.0
    assert not o_live.isnan().any() and not lse_live.isnan().any()
    assert lse_live[2, 3] == -INF and (o_live[2, 3] == 0).all()
    torch.testing.assert_close(o_live, o_all, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_live, lse_all, rtol=1e-5, atol=1e-6)
    lses[0, 2, 1] = -INF
    o64, lse64 = ref.merge_states_many_ref(outs.double().nan_to_num(), lses.double())
    o_same, lse_same = ref.merge_states_many_ref(outs.nan_to_num(), lses)
    live = lse64 > -INF
    live[2, 1] = False
    assert_fa_close(o_live[live], o64[live], o_same[live], factor=3.0, atol=1e-5)
    assert_fa_close(lse_live[live], lse64[live], lse_same[live], factor=3.0, atol=1e-5, name="lse")


def _layout(x, kind):
    """The same values as x in another memory layout: a permuted dense copy, or a strided (sliced) view."""
    if kind == "permuted":  # dense, but the leading dims swapped in memory (e.g. an HF-style transpose)
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == "strided":  # every other element of a wider tensor on the last dim
        wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device).fill_(float("nan"))
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


@pytest.mark.parametrize("kind", ["permuted", "strided"])
def test_merge_reads_any_layout_and_returns_contiguous(gen, kind):
    """States in permuted or strided layouts merge to exactly what their contiguous copies give; the outputs are
    fresh contiguous tensors, not copies of the callers' strides (the stride class of issue 21)."""
    outs, lses = _states(gen, 3, (4, 2), 3, 32, torch.float32)
    lses[:, 1, 0, 2] = -INF
    o_ref, lse_ref = flashdecode.merge_states(outs[0], lses[0], outs[1], lses[1])
    om_ref, lsem_ref = flashdecode.merge_states_many(outs, lses)
    lay = [_layout(outs[i], kind) for i in range(3)]
    lay_l = [_layout(lses[i], kind) for i in range(3)]
    o, lse = flashdecode.merge_states(lay[0], lay_l[0], lay[1], lay_l[1])
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    assert o.is_contiguous() and lse.is_contiguous()
    om, lsem = flashdecode.merge_states_many(lay, lay_l)
    assert torch.equal(om, om_ref) and torch.equal(lsem, lsem_ref)
    # a tensor whose states dim is not outermost in memory
    om2, lsem2 = flashdecode.merge_states_many(outs.transpose(0, 1).contiguous().transpose(0, 1),
                                               lses.transpose(0, 2).contiguous().transpose(0, 2))
    assert torch.equal(om2, om_ref) and torch.equal(lsem2, lsem_ref) and om2.is_contiguous()


def test_lse_on_another_device_is_named(gen):
    o = randn(2, 3, 64, gen=gen, dtype=torch.float32)
    lse = randn(2, 3, gen=gen, dtype=torch.float32, device="meta" if DEVICE.type == "cpu" else "cpu")
    with pytest.raises(ValueError, match="lse_a"):
        flashdecode.merge_states(o, lse, o, lse)


def test_cpu_tensors_without_interpreter_get_a_clear_error(gen, monkeypatch):
    """Off the GPU without TRITON_INTERPRET, a ValueError that says so, not Triton's '0 active drivers'."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    o = randn(2, 3, 64, gen=gen, dtype=torch.float32, device="cpu")
    lse = randn(2, 3, gen=gen, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="o_a.*CUDA"):
        flashdecode.merge_states(o, lse, o, lse)
    with pytest.raises(ValueError, match="outs.*CUDA"):
        flashdecode.merge_states_many([o, o], [lse, lse])
