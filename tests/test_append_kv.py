"""append_kv writes new tokens bit-exactly where the spec says (positions cache_seqlens[b] .. + n - 1) and nowhere
else, for contiguous and paged caches (page sizes 1, 3, 16), dense and varlen (packed prefill) sources."""

import pytest
import torch

import flashdecode
from flashdecode import reference as ref
from helpers import DEVICE, randn


def _lens(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _expected(k_cache, k_new_rows, lens_before):
    """Contiguous expected cache: row b gets its new tokens at lens_before[b] + i."""
    exp = k_cache.clone()
    for b, (start, rows) in enumerate(zip(lens_before, k_new_rows)):
        exp[b, start:start + rows.shape[0]] = rows
    return exp


@pytest.mark.parametrize("page_size", [None, 1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dense_append_exact(gen, page_size, dtype):
    batch, cap, hk, d, s_new = 3, 40, 2, 64, 3
    k = randn(batch, cap, hk, d, gen=gen, dtype=dtype)
    v = randn(batch, cap, hk, d, gen=gen, dtype=dtype)
    k_new = randn(batch, s_new, hk, d, gen=gen, dtype=dtype)
    v_new = randn(batch, s_new, hk, d, gen=gen, dtype=dtype)
    before = [0, 14, cap - s_new]
    lens = _lens(before)
    if page_size is None:
        kc, vc, table = k.clone(), v.clone(), None
    else:
        kc, vc, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=3, generator=gen)
    untouched = kc.clone()
    flashdecode.append_kv(kc, vc, k_new, v_new, lens, table)
    assert torch.equal(lens.cpu(), torch.tensor(before, dtype=torch.int32))  # not modified
    got_k, got_v = (kc, vc) if table is None else ref.contiguous_from_paged(kc, vc, table, cap)
    assert torch.equal(got_k, _expected(k, k_new, before))
    assert torch.equal(got_v, _expected(v, v_new, before))
    if table is not None:  # pages no sequence owns are untouched
        unused = torch.ones(kc.shape[0], dtype=torch.bool)
        unused[table.long().flatten().cpu()] = False
        assert torch.equal(kc[unused.to(DEVICE)], untouched[unused.to(DEVICE)])


@pytest.mark.parametrize("page_size", [None, 3, 16])
def test_varlen_prefill_append_exact(gen, page_size):
    """A ragged prefill (incl. an empty sequence) written in one launch from packed rows."""
    batch, cap, hk, d = 4, 48, 2, 80
    news = [5, 0, 17, 1]
    before = [0, 7, 31, 47]
    cu = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    k = randn(batch, cap, hk, d, gen=gen, dtype=torch.float16)
    v = randn(batch, cap, hk, d, gen=gen, dtype=torch.float16)
    k_new = randn(sum(news), hk, d, gen=gen, dtype=torch.float16)
    v_new = randn(sum(news), hk, d, gen=gen, dtype=torch.float16)
    if page_size is None:
        kc, vc, table = k.clone(), v.clone(), None
    else:
        kc, vc, table = ref.paged_from_contiguous(k, v, page_size, generator=gen)
    flashdecode.append_kv(kc, vc, k_new, v_new, _lens(before), table, cu_seqlens_new=cu, max_seqlen_new=max(news))
    rows_k = [k_new[cu[b]:cu[b + 1]] for b in range(batch)]
    rows_v = [v_new[cu[b]:cu[b + 1]] for b in range(batch)]
    got_k, got_v = (kc, vc) if table is None else ref.contiguous_from_paged(kc, vc, table, cap)
    assert torch.equal(got_k, _expected(k, rows_k, before))
    assert torch.equal(got_v, _expected(v, rows_v, before))


def test_append_then_decode_sees_new_tokens(gen):
    """The engine's order: append_kv at the old lengths, then flash_decode with lengths + 1."""
    batch, cap, h, hk, d = 2, 32, 4, 2, 64
    k = randn(batch, cap, hk, d, gen=gen, dtype=torch.float16)
    v = randn(batch, cap, hk, d, gen=gen, dtype=torch.float16)
    k_new = randn(batch, 1, hk, d, gen=gen, dtype=torch.float16)
    v_new = randn(batch, 1, hk, d, gen=gen, dtype=torch.float16)
    q = randn(batch, h, d, gen=gen, dtype=torch.float16)
    kp, vp, table = ref.paged_from_contiguous(k, v, 3, generator=gen)
    before = _lens([9, 20])
    flashdecode.append_kv(kp, vp, k_new, v_new, before, table)
    out = flashdecode.flash_decode(q, kp, vp, before + 1, block_table=table, num_splits=2)
    k[[0, 1], [9, 20]] = k_new[:, 0]
    v[[0, 1], [9, 20]] = v_new[:, 0]
    expected, _ = ref.decode_ref(q.double(), k.double(), v.double(), before + 1)
    torch.testing.assert_close(out.double(), expected, atol=3e-3, rtol=0)


def _i32(values, device=DEVICE):
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("case,error,word", [
    (dict(cache_seqlens=_i32([0, 38], "cpu")), ValueError, "cache_seqlens"),  # 38 + 3 > 40 (host-checked)
    (dict(cache_seqlens=torch.tensor([0, 1], device=DEVICE)), TypeError, "cache_seqlens"),  # int64
    (dict(k_new=(2, 3, 2, 64, torch.float16)), TypeError, "dtype"),
    (dict(v_new=(2, 2, 2, 64, torch.float32)), ValueError, "v_new"),
    (dict(k_new=(2, 3, 1, 64, torch.float32), v_new=(2, 3, 1, 64, torch.float32)), ValueError, "k_new"),
    (dict(cu_seqlens_new=_i32([0, 1, 2])), ValueError, "cu_seqlens_new"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)), TypeError, "block_table"),
])
def test_bad_input(gen, case, error, word):
    k = randn(2, 40, 2, 64, gen=gen)
    v = randn(2, 40, 2, 64, gen=gen)
    args = dict(k_new=(2, 3, 2, 64, torch.float32), v_new=(2, 3, 2, 64, torch.float32), cache_seqlens=_i32([0, 1]),
                block_table=None, cu_seqlens_new=None)
    args.update(case)
    k_new, v_new = (randn(*a[:-1], gen=gen, dtype=a[-1]) for a in (args["k_new"], args["v_new"]))
    with pytest.raises(error, match=word):
        flashdecode.append_kv(k, v, k_new, v_new, args["cache_seqlens"], args["block_table"],
                              cu_seqlens_new=args["cu_seqlens_new"])


# ------------------------------------------------------------------------------------------------------------------
# Device-resident metadata is not validated (no sync): the kernel itself must stay inside the tensors
# ------------------------------------------------------------------------------------------------------------------

def _guarded_pages(gen, num_pages, page_size, hk, d, dtype=torch.float16):
    """(pool, k_cache, v_cache): caches that are views of one pool with a guard page before and after each, so a
    write before or past a cache tensor shows up in the pool."""
    pool = randn(2, num_pages + 2, page_size, hk, d, gen=gen, dtype=dtype)
    return pool, pool[0, 1:-1], pool[1, 1:-1]


@pytest.mark.parametrize("bad_id", [-1, "num_pages", 2**30, 2**31 - 1, -2**31])
@pytest.mark.parametrize("varlen", [False, True])
def test_out_of_range_page_ids_write_nothing(gen, device_resident, bad_id, varlen):
    """A page id outside [0, num_pages) drops the tokens that would land in it (no write before the pool, past it,
    or at a 32-bit-wrapped id such as 2**30 * page_stride); every other token is written as usual."""
    batch, page_size, hk, d, s_new, num_pages = 2, 4, 2, 32, 5, 6
    pool, kc, vc = _guarded_pages(gen, num_pages, page_size, hk, d)
    table = _i32([[0, 1, 2], [3, 4, 5]])
    bad = num_pages if bad_id == "num_pages" else bad_id
    table[1, 1] = bad  # sequence 1, positions 4..7
    before = [2, 2]
    k_new = randn(batch, s_new, hk, d, gen=gen, dtype=torch.float16)
    v_new = randn(batch, s_new, hk, d, gen=gen, dtype=torch.float16)
    expected = pool.clone()
    for b in range(batch):
        for i in range(s_new):
            pos = before[b] + i
            page = int(table[b, pos // page_size])
            if 0 <= page < num_pages:
                expected[0, 1 + page, pos % page_size] = k_new[b, i]
                expected[1, 1 + page, pos % page_size] = v_new[b, i]
    if varlen:
        cu = _i32([0, s_new, 2 * s_new])
        flashdecode.append_kv(kc, vc, k_new.flatten(0, 1), v_new.flatten(0, 1), _lens(before), table,
                              cu_seqlens_new=cu, max_seqlen_new=s_new)
    else:
        flashdecode.append_kv(kc, vc, k_new, v_new, _lens(before), table)
    assert torch.equal(pool, expected)  # the whole pool, guards included


@pytest.mark.parametrize("cu,why", [
    ([0, 3, 9], "runs past k_new"),
    ([0, 5, 2], "decreases"),
    ([-3, 2, 6], "starts below 0"),
    ([0, 2**31 - 1, 2**31 - 1], "huge"),
])
def test_bad_device_cu_seqlens_new_stays_inside_k_new(gen, device_resident, cu, why):
    """Device-resident cu_seqlens_new is not validated; rows outside k_new are never read (they would copy
    foreign memory into the cache), and nothing is written outside the cache."""
    total, cap, hk, d = 6, 16, 2, 32
    src = randn(2, total + 8, hk, d, gen=gen, dtype=torch.float32)
    src[:, total:] = float("nan")  # guard rows right behind k_new: reading them would put NaN into the cache
    k_new, v_new = src[0, :total], src[1, :total]
    pool = randn(2, 4, cap, hk, d, gen=gen, dtype=torch.float32)
    kc, vc = pool[0, 1:3], pool[1, 1:3]
    before = pool.clone()
    flashdecode.append_kv(kc, vc, k_new, v_new, _lens([0, 4]), cu_seqlens_new=_i32(cu), max_seqlen_new=9)
    assert not torch.isnan(pool).any(), why
    assert torch.equal(pool[:, [0, 3]], before[:, [0, 3]]), why  # neighbours of the caches untouched
    for b, start in enumerate([0, 4]):  # rows that exist in k_new land where cu says; nothing else changes
        for i in range(max(0, min(cu[b + 1] - cu[b], cap - start))):
            row = cu[b] + i
            if 0 <= row < total:
                assert torch.equal(kc[b, start + i], k_new[row]), why


def test_huge_device_lengths_write_nothing(gen, device_resident):
    """Lengths near 2**31 do not wrap into the cache (int64 positions), nor do negative ones write before it."""
    pool, kc, vc = _guarded_pages(gen, 4, 8, 1, 16, dtype=torch.float32)
    before = pool.clone()
    k_new = randn(2, 9, 1, 16, gen=gen, dtype=torch.float32)
    flashdecode.append_kv(kc, vc, k_new, k_new.clone(), _lens([2**31 - 5, -20]), _i32([[0, 1], [2, 3]]))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("varlen", [False, True])
def test_the_launch_also_writes_the_seen_lengths(gen, varlen):
    """checked_append(...).run(..., seen): the same cache writes as append_kv, and seen = cache_seqlens + each
    sequence's new tokens (what flash_attn_with_kvcache's attention reads, written in the append's launch)."""
    from flashdecode.ops.append_kv import checked_append

    batch, cap, hk, d = 3, 24, 2, 16
    k, v = (randn(batch, cap, hk, d, gen=gen, dtype=torch.float16) for _ in range(2))
    lens = _lens([0, 9, 20])
    if varlen:
        counts = [2, 0, 4]
        k_new, v_new = (randn(sum(counts), hk, d, gen=gen, dtype=torch.float16) for _ in range(2))
        extra = dict(cu_seqlens_new=_lens([0, 2, 2, 6]))
    else:
        counts = [3] * batch
        k_new, v_new = (randn(batch, 3, hk, d, gen=gen, dtype=torch.float16) for _ in range(2))
        extra = {}
    kc, vc = k.clone(), v.clone()
    flashdecode.append_kv(kc, vc, k_new, v_new, lens, **extra)
    seen = torch.full((batch,), -7, dtype=torch.int32, device=DEVICE)
    launch = checked_append(k, v, k_new, v_new, lens, **extra)
    assert launch.run(k, v, k_new, v_new, lens, None, extra.get("cu_seqlens_new"), seen)
    assert torch.equal(k, kc) and torch.equal(v, vc)
    assert seen.tolist() == [n + c for n, c in zip(lens.tolist(), counts)]
