"""Paged KV cache: the page pool (device tensors) and the block manager (pure-Python bookkeeping).

The pool is one tensor (2, num_layers, num_pages + 1, page_size, nheads_kv, head_dim): layer l's K pages are
``pool[0, l]``, contiguous, in the (num_pages, page_size, nheads_kv, head_dim) "NHD" layout flash_decode reads.
The extra last page is scratch: padded rows of a CUDA-graph batch write there; the block manager never hands it out.
A token at position p of a sequence lives in page block_table[p // page_size], slot p % page_size.
"""

from __future__ import annotations

import collections

import torch


def bytes_per_page(num_layers: int, page_size: int, nheads_kv: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one page across all layers."""
    return 2 * num_layers * page_size * nheads_kv * head_dim * torch.empty((), dtype=dtype).element_size()


def num_pages_for_budget(budget_bytes: int, page_bytes: int) -> int:
    return int(budget_bytes // page_bytes)


def allocate_pool(num_layers: int, num_pages: int, page_size: int, nheads_kv: int, head_dim: int,
                  dtype: torch.dtype, device) -> torch.Tensor:
    """(2, num_layers, num_pages + 1, page_size, nheads_kv, head_dim); the +1 is the scratch page."""
    return torch.zeros((2, num_layers, num_pages + 1, page_size, nheads_kv, head_dim), dtype=dtype, device=device)


class BlockManager:
    """Free list of page ids and a block table (list of page ids) per sequence id.

    A sequence of n tokens owns ceil(n / page_size) pages. ``allocate`` gives a new sequence its pages,
    ``ensure`` grows a running sequence to hold n tokens, ``free`` returns all of a sequence's pages.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.free_pages = collections.deque(range(num_pages))
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= self.num_free

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Pages for a new sequence of ``num_tokens`` tokens. RuntimeError if it has pages or they are lacking."""
        if seq_id in self.tables:
            raise RuntimeError(f"sequence {seq_id} already has pages")
        need = self.pages_for(num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"out of pages: sequence {seq_id} needs {need}, {self.num_free} free")
        self.tables[seq_id] = [self.free_pages.popleft() for _ in range(need)]
        return self.tables[seq_id]

    def pages_missing(self, seq_id: int, num_tokens: int) -> int:
        return max(0, self.pages_for(num_tokens) - len(self.tables[seq_id]))

    def can_ensure(self, seq_id: int, num_tokens: int) -> bool:
        return self.pages_missing(seq_id, num_tokens) <= self.num_free

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens (a decode step adds at most one page)."""
        missing = self.pages_missing(seq_id, num_tokens)
        if missing > self.num_free:
            raise RuntimeError(f"out of pages: sequence {seq_id} needs {missing} more, {self.num_free} free")
        table = self.tables[seq_id]
        table.extend(self.free_pages.popleft() for _ in range(missing))
        return table

    def free(self, seq_id: int) -> None:
        """Return every page of ``seq_id`` (no-op for a sequence without pages)."""
        for page in self.tables.pop(seq_id, []):
            self.free_pages.append(page)

    def table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]
