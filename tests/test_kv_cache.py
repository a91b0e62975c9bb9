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
