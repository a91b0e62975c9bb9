"""The executable spec (flashdecode.reference) checked against itself and against independent formulas, in float64.

Acceptance (issue 2): blockwise == naive and split-KV + merge == naive within 1e-12; fully masked rows give out 0
and lse -inf with no NaN; softcap survives |logits| > 100; paged round trips are exact.
"""

import math

import pytest
import torch

from flashdecode import reference as ref

F64 = torch.float64
TOL = 1e-12


def rand(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=F64) * scale


def assert_same(a, b, tol=TOL):
    assert not torch.isnan(a).any() and not torch.isnan(b).any()
    inf_a, inf_b = torch.isinf(a), torch.isinf(b)
    assert torch.equal(inf_a, inf_b)
    assert (a[~inf_a] - b[~inf_b]).abs().max().item() <= tol if (~inf_a).any() else True


CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, window, softcap
    (1, 1, 1, 1, 1, 8, False, (-1, -1), 0.0),
    (2, 17, 17, 2, 2, 16, True, (-1, -1), 0.0),
    (1, 97, 97, 4, 2, 32, True, (-1, -1), 0.0),
    (2, 5, 97, 5, 1, 16, True, (-1, -1), 0.0),       # decode-like, bottom-right aligned, MQA ratio 5
    (1, 40, 17, 8, 1, 16, True, (-1, -1), 0.0),      # seqlen_q > seqlen_k: the first 23 rows see nothing
    (2, 33, 65, 8, 1, 16, False, (7, 3), 0.0),       # window, GQA ratio 8
    (1, 33, 33, 2, 1, 16, True, (4, -1), 30.0),      # causal + left window + softcap
    (1, 20, 20, 2, 2, 8, False, (-1, -1), 0.0),
]


@pytest.mark.parametrize("case", CASES)
def test_blockwise_matches_naive(case, gen):
    b, sq, sk, h, hk, d, causal, window, softcap = case
    q, k, v = rand(gen, b, sq, h, d), rand(gen, b, sk, hk, d), rand(gen, b, sk, hk, d)
    o, lse = ref.attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap)
    for block_n in (1, 16, 64):
        ob, lseb = ref.attention_blockwise_ref(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                               block_n=block_n)
        assert_same(ob, o)
        assert_same(lseb, lse)


def test_naive_matches_sdpa_and_logsumexp(gen):
    """An independent check of the spec: torch's SDPA (float64, math backend) and torch.logsumexp."""
    q, k, v = rand(gen, 2, 33, 4, 16), rand(gen, 2, 33, 4, 16), rand(gen, 2, 33, 4, 16)
    for causal in (False, True):
        o, lse = ref.attention_ref(q, k, v, causal=causal)
        o_sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
        assert_same(o, o_sdpa)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(16)
        if causal:
            s = s.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
        assert_same(lse, torch.logsumexp(s, dim=-1))


def test_gqa_equals_repeated_heads(gen):
    q, k, v = rand(gen, 1, 9, 6, 8), rand(gen, 1, 9, 2, 8), rand(gen, 1, 9, 2, 8)
    o, lse = ref.attention_ref(q, k, v, causal=True)
    o2, lse2 = ref.attention_ref(q, k.repeat_interleave(3, 2), v.repeat_interleave(3, 2), causal=True)
    assert_same(o, o2)
    assert_same(lse, lse2)


def test_fully_masked_rows_are_zero_and_neg_inf(gen):
    q, k, v = rand(gen, 1, 10, 2, 8), rand(gen, 1, 4, 2, 8), rand(gen, 1, 4, 2, 8)
    o, lse = ref.attention_ref(q, k, v, causal=True)  # rows 0..5 sit before key 0
    assert torch.all(o[:, :6] == 0) and torch.all(torch.isneginf(lse[:, :, :6]))
    assert torch.isfinite(lse[:, :, 6:]).all() and not torch.isnan(o).any()


def test_empty_sequence(gen):
    q, k = rand(gen, 2, 3, 2, 8), rand(gen, 2, 0, 1, 8)
    for fn in (ref.attention_ref, ref.attention_blockwise_ref):
        o, lse = fn(q, k, k)
        assert torch.all(o == 0) and torch.all(torch.isneginf(lse))


def test_softcap_large_logits_no_overflow(gen):
    q, k, v = rand(gen, 1, 16, 2, 16, scale=40.0), rand(gen, 1, 16, 2, 16, scale=40.0), rand(gen, 1, 16, 2, 16)
    raw = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    assert raw.abs().max() > 100
    o, lse = ref.attention_ref(q, k, v, softcap=20.0)
    ob, lseb = ref.attention_blockwise_ref(q, k, v, softcap=20.0, block_n=5)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert lse.max() <= 20.0 + math.log(16) + 1e-9  # capped logits bound the lse
    assert_same(o, ob)
    assert_same(lse, lseb)


def test_lse_half_precision_is_float32(gen):
    q = rand(gen, 1, 4, 2, 8).half()
    _, lse = ref.attention_ref(q, q, q)
    assert lse.dtype == torch.float32


def test_varlen_matches_per_sequence(gen):
    lens = [1, 17, 5]
    cu = torch.tensor([0, 1, 18, 23], dtype=torch.int32)
    q, k, v = rand(gen, 23, 4, 8), rand(gen, 23, 2, 8), rand(gen, 23, 2, 8)
    o, lse = ref.attention_varlen_ref(q, k, v, cu, cu, causal=True)
    assert o.shape == (23, 4, 8) and lse.shape == (4, 23)
    start = 0
    for n in lens:
        oi, lsei = ref.attention_ref(q[None, start:start + n], k[None, start:start + n], v[None, start:start + n],
                                     causal=True)
        assert_same(o[start:start + n], oi[0])
        assert_same(lse[:, start:start + n], lsei[0])
        start += n


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16, 40])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_split_merge_matches_naive(num_splits, seqlen_q, gen):
    lens = torch.tensor([0, 1, 17, 33], dtype=torch.int32)  # includes an empty sequence; 40 splits > any length
    b, s, h, hk, d = 4, 33, 6, 2, 16
    k, v = rand(gen, b, s, hk, d), rand(gen, b, s, hk, d)
    q = rand(gen, b, seqlen_q, h, d) if seqlen_q > 1 else rand(gen, b, h, d)
    o_s, lse_s = ref.decode_split_ref(q, k, v, lens, num_splits, softcap=5.0)
    assert o_s.shape == (num_splits,) + q.shape
    o, lse = ref.merge_states_many_ref(o_s, lse_s)
    q4 = q if seqlen_q > 1 else q[:, None]
    for i, n in enumerate(lens.tolist()):
        oi, lsei = ref.attention_ref(q4[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=True, softcap=5.0)
        want_o, want_lse = oi[0], lsei[0].transpose(0, 1)
        if seqlen_q == 1:
            want_o, want_lse = want_o[0], want_lse[0]
        assert_same(o[i], want_o)
        assert_same(lse[i], want_lse)


def test_empty_splits_are_zero_and_neg_inf(gen):
    k = rand(gen, 1, 8, 1, 8)
    o_s, lse_s = ref.decode_split_ref(rand(gen, 1, 2, 8), k, k, torch.tensor([3], dtype=torch.int32), 5)
    # chunk = ceil(3/5) = 1: splits 0..2 hold one key each, splits 3 and 4 are empty
    assert torch.all(o_s[3:] == 0) and torch.all(torch.isneginf(lse_s[3:]))
    assert torch.isfinite(lse_s[:3]).all()


def test_split_bounds_cover_exactly():
    for n in (0, 1, 7, 64, 97):
        for s in (1, 2, 3, 8, 100):
            bounds = ref.split_bounds(n, s)
            assert len(bounds) == s and bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_merge_states_algebra(gen):
    o_a, o_b = rand(gen, 3, 4, 8), rand(gen, 3, 4, 8)
    lse_a, lse_b = rand(gen, 3, 4), rand(gen, 3, 4)
    neg_inf = torch.full_like(lse_a, float("-inf"))
    o, lse = ref.merge_states_ref(o_a, lse_a, o_b, neg_inf)  # -inf on one side returns the other
    assert_same(o, o_a)
    assert_same(lse, lse_a)
    o, lse = ref.merge_states_ref(o_a, neg_inf, o_b, neg_inf)  # both empty: (0, -inf)
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse))
    o1, lse1 = ref.merge_states_ref(o_a, lse_a, o_b, lse_b)  # commutative
    o2, lse2 = ref.merge_states_ref(o_b, lse_b, o_a, lse_a)
    assert_same(o1, o2)
    assert_same(lse1, lse2)
    assert_same(lse1, torch.logaddexp(lse_a, lse_b))
    o_c, lse_c = rand(gen, 3, 4, 8), rand(gen, 3, 4)  # associative, and equal to the many-way form
    oab, lseab = ref.merge_states_ref(o_a, lse_a, o_b, lse_b)
    left = ref.merge_states_ref(oab, lseab, o_c, lse_c)
    many = ref.merge_states_many_ref(torch.stack([o_a, o_b, o_c]), torch.stack([lse_a, lse_b, lse_c]))
    assert_same(left[0], many[0])
    assert_same(left[1], many[1])


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_round_trip_exact(page_size, gen):
    k, v = rand(gen, 3, 37, 2, 8), rand(gen, 3, 37, 2, 8)
    kp, vp, bt = ref.paged_from_contiguous(k, v, page_size, extra_pages=4, generator=gen)
    assert bt.dtype == torch.int32 and kp.shape[1] == page_size
    assert sorted(bt.flatten().tolist()) == sorted(set(bt.flatten().tolist()))  # no page shared
    k2, v2 = ref.contiguous_from_paged(kp, vp, bt, max_seqlen=37)
    assert torch.equal(k2, k) and torch.equal(v2, v)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_decode_equals_contiguous(page_size, gen):
    k, v = rand(gen, 2, 29, 2, 8), rand(gen, 2, 29, 2, 8)
    q, lens = rand(gen, 2, 4, 8), torch.tensor([29, 13], dtype=torch.int32)
    kp, vp, bt = ref.paged_from_contiguous(k, v, page_size, generator=gen)
    o, lse = ref.decode_ref(q, k, v, lens)
    op, lsep = ref.decode_ref(q, kp, vp, lens, block_table=bt)
    assert torch.equal(o, op) and torch.equal(lse, lsep)


def test_bad_shapes_raise(gen):
    q, k = rand(gen, 1, 4, 3, 8), rand(gen, 1, 4, 2, 8)
    with pytest.raises(ValueError, match="multiple of nheads_kv"):
        ref.attention_ref(q, k, k)
    with pytest.raises(ValueError, match="4-D"):
        ref.attention_ref(q[0], k, k)
    with pytest.raises(ValueError, match="page_size"):
        ref.paged_from_contiguous(k, k, 0)
