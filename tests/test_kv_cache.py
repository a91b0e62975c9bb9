"""BlockManager (pure-Python page bookkeeping) and the page-pool layout."""

from __future__ import annotations

import pytest
import torch

from flashdecode.engine.kv_cache import BlockManager, allocate_pool, bytes_per_page


def test_allocate_gives_distinct_pages_and_free_returns_them():
    bm = BlockManager(num_pages=10, page_size=4)
    a = bm.allocate(1, 9)  # ceil(9 / 4) = 3 pages
    b = bm.allocate(2, 4)  # exactly one page
    assert len(a) == 3 and len(b) == 1 and not set(a) & set(b)
    assert bm.num_free == 6
    bm.free(1)
    assert bm.num_free == 9 and 1 not in bm.tables
    bm.free(1)  # freeing twice is a no-op
    assert bm.num_free == 9
    c = bm.allocate(3, 20)
    assert len(c) == 5 and not set(c) & set(b)


def test_ensure_grows_one_page_at_page_boundaries():
    bm = BlockManager(num_pages=4, page_size=4)
    table = bm.allocate(7, 4)
    assert bm.pages_missing(7, 4) == 0 and bm.pages_missing(7, 5) == 1
    bm.ensure(7, 4)
    assert len(table) == 1
    bm.ensure(7, 5)  # token at position 4 starts page 2
    assert len(bm.table(7)) == 2 and bm.num_free == 2
    bm.ensure(7, 8)
    assert len(bm.table(7)) == 2


def test_exhaustion_is_reported_not_crashing():
    bm = BlockManager(num_pages=3, page_size=2)
    bm.allocate(1, 4)
    assert not bm.can_allocate(3) and bm.can_allocate(2)
    with pytest.raises(RuntimeError, match="out of pages"):
        bm.allocate(2, 3)
    assert bm.num_free == 1  # a failed allocation takes nothing
    bm.allocate(2, 2)
    assert not bm.can_ensure(1, 5)
    with pytest.raises(RuntimeError, match="out of pages"):
        bm.ensure(1, 5)
    with pytest.raises(RuntimeError, match="already"):
        bm.allocate(2, 1)


def test_preemption_frees_everything_and_reallocation_works():
    bm = BlockManager(num_pages=6, page_size=2)
    for sid in range(3):
        bm.allocate(sid, 4)
    assert bm.num_free == 0
    bm.free(2)  # what the scheduler does to a preempted sequence
    assert bm.num_free == 2 and bm.can_ensure(0, 5)
    bm.ensure(0, 5)
    assert bm.num_free == 1
    pages = [p for t in bm.tables.values() for p in t]
    assert len(pages) == len(set(pages)) == 5


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="num_pages"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="page_size"):
        BlockManager(4, 0)


def test_pool_layout_and_page_bytes():
    pool = allocate_pool(num_layers=3, num_pages=5, page_size=4, nheads_kv=2, head_dim=8, dtype=torch.float16,
                         device="cpu")
    assert pool.shape == (2, 3, 6, 4, 2, 8)  # + the scratch page
    assert pool[0, 1].is_contiguous() and pool[1, 2].shape == (6, 4, 2, 8)
    assert bytes_per_page(3, 4, 2, 8, torch.float16) == 2 * 3 * 4 * 2 * 8 * 2


# ---------------------------------------------------------------------------------------------- prefix caching
def cached_manager(num_pages=8, page_size=4):
    return BlockManager(num_pages, page_size, enable_prefix_caching=True)


def run_to_end(bm, seq_id, tokens, prefix=None):
    """What the scheduler does for a sequence whose prompt is computed: allocate, write, register, free."""
    table = bm.allocate(seq_id, len(tokens), prefix)
    bm.cache_full_pages(seq_id, tokens, len(tokens))
    return list(table)


def test_full_pages_are_found_by_their_tokens_and_everything_before():
    bm = cached_manager()
    a = list(range(10))  # pages [0..3], [4..7], partial [8, 9]
    table = run_to_end(bm, 1, a)
    assert bm.num_cached == 2  # only full pages are registered
    # the same first 8 tokens, then something else: both full pages are shared
    hit = bm.match_prefix(a[:8] + [50, 51, 52])
    assert hit.pages == tuple(table[:2]) and hit.num_tokens(4) == 8
    # the same second page after another first page: nothing (chained to its prefix)
    assert bm.match_prefix([9, 9, 9, 9] + a[4:8] + [1]).pages == ()
    # same first page, another second: the first only
    assert bm.match_prefix(a[:4] + [7, 7, 7, 7, 1]).pages == (table[0],)
    # the last token is always computed: a prompt of exactly the cached 8 tokens reuses one page
    assert bm.match_prefix(a[:8]).pages == (table[0],)
    assert bm.match_prefix(a[:9]).pages == tuple(table[:2])


def test_hash_collisions_never_alias(monkeypatch):
    """Every key hashes alike: pages are still matched only when their tokens and every token before compare equal."""
    from flashdecode.engine import kv_cache

    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent, tokens: 0)
    bm = cached_manager(num_pages=12)
    x = [1, 2, 3, 4, 5, 6, 7, 8, 0]
    y = [9, 9, 9, 9, 5, 6, 7, 8, 0]  # same second page after another first page
    tx = run_to_end(bm, 1, x)
    ty = run_to_end(bm, 2, y)
    assert bm.num_cached == 4 and len(set(tx[:2] + ty[:2])) == 4
    assert bm.match_prefix(x).pages == tuple(tx[:2])
    assert bm.match_prefix(y).pages == tuple(ty[:2])
    assert bm.match_prefix([1, 2, 3, 5, 5, 6, 7, 8, 0]).pages == ()


def test_shared_pages_are_reference_counted():
    bm = cached_manager(num_pages=6)
    a = list(range(9))
    ta = run_to_end(bm, 1, a)  # 3 pages, still running
    hit = bm.match_prefix(a[:8] + [70, 71])
    tb = bm.allocate(2, 10, hit)  # shares 2 pages, takes 1 new
    assert tb[:2] == ta[:2] and tb[2] not in ta and bm.ref_counts[ta[0]] == 2
    assert bm.num_free == 2
    bm.free(1)
    assert bm.ref_counts[ta[0]] == 1 and bm.num_free == 3  # a's private last page is free; shared ones stay taken
    bm.free(2)
    assert bm.num_free == 6 and len(bm.evictable) == 2 and bm.num_cached == 2  # unused but still cached
    # taking an evictable cached page through a hit counts against the free pages
    hit = bm.match_prefix(a)
    assert bm.can_allocate(24, hit)  # 6 pages, 2 of them the cached ones
    bm.allocate(3, 24, hit)
    assert bm.num_free == 0 and not bm.evictable


def test_lru_eviction_only_when_the_free_list_is_dry_and_evicted_pages_are_never_matched():
    bm = cached_manager(num_pages=5)
    old = [1] * 4 + [2] * 4 + [3]
    new = [5] * 4 + [6] * 4 + [7]
    t_old = run_to_end(bm, 1, old)
    bm.free(1)
    t_new = run_to_end(bm, 2, new)
    bm.free(2)
    assert bm.num_free == 5 and len(bm.free_pages) == 1 and bm.num_cached == 4
    # "old" is used again: it becomes the most recently used
    bm.allocate(3, 9, bm.match_prefix(old))
    bm.free(3)
    # 1 page from the free list first, then evictions: least recently used first, a sequence's last page first
    free_before = list(bm.free_pages)
    taken = bm.allocate(4, 12)
    assert free_before == [taken[0]]
    assert taken[1:] == [t_new[1], t_new[0]]
    assert bm.match_prefix(new).pages == ()  # evicted: gone from the cache
    assert bm.match_prefix(old).pages == tuple(t_old[:2])
    bm.allocate(5, 4)  # the LRU of what is left: old's second page
    assert bm.match_prefix(old).pages == (t_old[0],)
    assert bm.num_free == 1 and bm.num_cached == 1 and list(bm.evictable) == [t_old[0]]


def test_duplicate_content_stays_private_and_the_chain_continues():
    """Two sequences compute the same prefix at once: the first registration wins, the second sequence's copy is
    freed normally, and its later pages chain onto the registered key (still found)."""
    bm = cached_manager(num_pages=8)
    a = [1] * 4 + [2] * 4 + [3]
    b = [1] * 4 + [8] * 4 + [9]
    ta = bm.allocate(1, 9)
    tb = bm.allocate(2, 9)
    bm.cache_full_pages(1, a, 9)
    bm.cache_full_pages(2, b, 9)
    assert bm.num_cached == 3  # a's two pages, b's second page (its first is a duplicate)
    assert bm.match_prefix(b).pages == (ta[0], tb[1])
    bm.free(2)
    assert tb[0] in bm.free_pages and tb[1] in bm.evictable


def test_free_list_accounting_under_churn():
    import random

    rng = random.Random(0)
    bm = cached_manager(num_pages=16, page_size=2)
    live = {}
    for step in range(300):
        if live and (rng.random() < 0.4 or bm.num_free < 4):
            sid = rng.choice(list(live))
            bm.cache_full_pages(sid, live.pop(sid), 10**9)
            bm.free(sid)
        else:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
            hit = bm.match_prefix(tokens)
            if bm.can_allocate(len(tokens), hit):
                bm.allocate(step, len(tokens), hit)
                live[step] = tokens
        in_use = {p for t in bm.tables.values() for p in t}
        assert len(in_use) + bm.num_free == bm.num_pages
        assert not in_use & (set(bm.free_pages) | set(bm.evictable))
        assert set(bm.evictable) <= set(bm.page_keys) and not set(bm.free_pages) & set(bm.page_keys)
        assert all(bm.ref_counts[p] == sum(t.count(p) for t in bm.tables.values()) for p in range(16))
        assert {bm.cached[k] for k in bm.cached} == set(bm.page_keys)
