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


# ---------------------------------------------------------------------------------------------------------------
# Context parallelism: a sequence's pages dealt round robin over the ranks of a context-parallel group
# ---------------------------------------------------------------------------------------------------------------

def cp_owner(position: int, page_size: int, cp_size: int) -> int:
    """The rank that stores token ``position``: its logical page (position // page_size) modulo cp_size."""
    return (position // page_size) % cp_size


def cp_local_length(num_tokens: int, page_size: int, cp_size: int, cp_rank: int) -> int:
    """Tokens among positions [0, num_tokens) that rank ``cp_rank`` stores (its pages r, r + cp, r + 2 cp, ...)."""
    full, rem = divmod(num_tokens, page_size)
    full_here = max(0, -(-(full - cp_rank) // cp_size))
    return full_here * page_size + (rem if full % cp_size == cp_rank else 0)


class ContextParallelBlockManager(BlockManager):
    """Block manager of a context-parallel group: logical page j of a sequence lives on rank j % cp_size, in that
    rank's pool of ``num_pages`` pages. Every rank keeps the whole group's bookkeeping (it is cheap, and identical
    decisions on every rank are what keeps the SPMD ranks in step); ``table`` gives this rank's pages, in order.

    ``num_pages`` / ``pages_for`` / ``num_free`` count logical pages over the group, so the scheduler's capacity
    checks read as for one big pool; ``can_allocate`` / ``can_ensure`` check each rank's free list.
    """

    def __init__(self, num_pages: int, page_size: int, cp_size: int, cp_rank: int):
        super().__init__(num_pages, page_size)
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
        self.cp_size, self.cp_rank, self.pages_per_rank = cp_size, cp_rank, num_pages
        self.num_pages = num_pages * cp_size
        self.free_lists = [collections.deque(range(num_pages)) for _ in range(cp_size)]
        self.free_pages = None  # the per-rank free lists replace it

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self.free_lists)

    def _needs(self, have: int, want: int) -> list[int]:
        """New pages per rank to grow a sequence from ``have`` logical pages to ``want``."""
        need = [0] * self.cp_size
        for j in range(have, want):
            need[j % self.cp_size] += 1
        return need

    def _fits(self, have: int, want: int) -> bool:
        return all(n <= len(f) for n, f in zip(self._needs(have, want), self.free_lists))

    def _grow(self, seq_id: int, table: list[int], want: int) -> list[int]:
        if not self._fits(len(table), want):
            raise RuntimeError(f"out of pages: sequence {seq_id} needs {want - len(table)} more across the "
                               f"context-parallel ranks ({[len(f) for f in self.free_lists]} free)")
        table.extend(self.free_lists[j % self.cp_size].popleft() for j in range(len(table), want))
        return table

    def can_allocate(self, num_tokens: int) -> bool:
        return self._fits(0, self.pages_for(num_tokens))

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        if seq_id in self.tables:
            raise RuntimeError(f"sequence {seq_id} already has pages")
        self.tables[seq_id] = self._grow(seq_id, [], self.pages_for(num_tokens))
        return self.table(seq_id)

    def can_ensure(self, seq_id: int, num_tokens: int) -> bool:
        table = self.tables[seq_id]
        return self._fits(len(table), max(len(table), self.pages_for(num_tokens)))

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        table = self.tables[seq_id]
        self._grow(seq_id, table, max(len(table), self.pages_for(num_tokens)))
        return self.table(seq_id)

    def free(self, seq_id: int) -> None:
        for j, page in enumerate(self.tables.pop(seq_id, [])):
            self.free_lists[j % self.cp_size].append(page)

    def table(self, seq_id: int) -> list[int]:
        """This rank's pages of the sequence (its logical pages cp_rank, cp_rank + cp_size, ...), in order."""
        return self.tables[seq_id][self.cp_rank::self.cp_size]


def make_block_manager(num_pages: int, page_size: int, cp_size: int = 1, cp_rank: int = 0) -> BlockManager:
    """The block manager for ``num_pages`` pages per rank: plain, or dealt over a context-parallel group."""
    if cp_size == 1:
        return BlockManager(num_pages, page_size)
    return ContextParallelBlockManager(num_pages, page_size, cp_size, cp_rank)
