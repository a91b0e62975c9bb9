"""Paged KV cache: the page pool (device tensors) and the block manager (pure-Python bookkeeping).

The pool is one tensor (2, num_layers, num_pages + 1, page_size, nheads_kv, head_dim): layer l's K pages are
``pool[0, l]``, contiguous, in the (num_pages, page_size, nheads_kv, head_dim) "NHD" layout flash_decode reads.
The extra last page is scratch: padded rows of a CUDA-graph batch write there; the block manager never hands it out.
A token at position p of a sequence lives in page block_table[p // page_size], slot p % page_size.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from flashdecode.engine.kv_quant import scale_bytes_per_page


def bytes_per_page(num_layers: int, page_size: int, nheads_kv: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one page across all layers."""
    return 2 * num_layers * page_size * nheads_kv * head_dim * torch.empty((), dtype=dtype).element_size()


def num_pages_for_budget(budget_bytes: int, page_bytes: int) -> int:
    return int(budget_bytes // page_bytes)



def engine_page_bytes(model_config, page_size: int, cache_kv_heads: int, dtype: torch.dtype,
                      kv_cache_dtype: torch.dtype | None) -> int:
    """Bytes of one page across all layers as an engine stores it: K/V in ``kv_cache_dtype`` (None: ``dtype``),
    plus the float32 scales of 8-bit pages. ``cache_kv_heads``: the kv heads this rank keeps."""
    layers = model_config.num_hidden_layers
    total = bytes_per_page(layers, page_size, cache_kv_heads, model_config.head_dim, kv_cache_dtype or dtype)
    if kv_cache_dtype is not None:
        total += scale_bytes_per_page(layers, page_size, cache_kv_heads)
    return total


def activation_reserve(model_config, max_num_batched_tokens: int, dtype: torch.dtype) -> int:
    """Rough bytes a full prefill batch needs beside the pool (gate/up, qkv, hidden states), + 1 GiB slack."""
    cfg = model_config
    width = 3 * cfg.intermediate_size + 6 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size
    return max_num_batched_tokens * width * torch.empty((), dtype=dtype).element_size() + 2**30


def pool_pages(kv_cache_memory: int | float | None, page_bytes: int, wanted_pages: int, device: torch.device,
               reserve: int) -> int:
    """Pages of the KV pool. ``kv_cache_memory``: int bytes, a float in (0, 1] = that fraction of the free GPU memory,
    or None = ``wanted_pages`` (what max_num_seqs sequences of max_model_len need) capped at 90% of the free GPU
    memory less ``reserve`` bytes for activations (CUDA) or 1 GiB (CPU). MemoryError when the default finds no
    room, ValueError when the given budget holds no page."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        cap = int(0.9 * free) - reserve
    else:
        free, cap = None, 2**30
    if kv_cache_memory is None:
        budget = min(wanted_pages * page_bytes, cap)
    elif isinstance(kv_cache_memory, float):
        if free is None:
            raise ValueError("kv_cache_memory as a fraction of free GPU memory needs a CUDA device; give bytes")
        budget = int(kv_cache_memory * free)
    else:
        budget = kv_cache_memory
    pages = num_pages_for_budget(budget, page_bytes)
    if pages < 1 and kv_cache_memory is None:
        raise MemoryError(f"no GPU memory left for the KV cache: {free} bytes free on {device}, of which ~{reserve} "
                          f"are kept for activations; pass kv_cache_memory=<bytes> or free GPU memory")
    if pages < 1:
        raise ValueError(f"kv_cache_memory={budget} bytes holds no page of {page_bytes} bytes")
    return pages

def allocate_pool(num_layers: int, num_pages: int, page_size: int, nheads_kv: int, head_dim: int,
                  dtype: torch.dtype, device) -> torch.Tensor:
    """(2, num_layers, num_pages + 1, page_size, nheads_kv, head_dim); the +1 is the scratch page."""
    return torch.zeros((2, num_layers, num_pages + 1, page_size, nheads_kv, head_dim), dtype=dtype, device=device)


def chain_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """The hash of a full page: its token ids chained with the hash of everything before it (its parent page's)."""
    return hash((parent_hash, tokens))


class PageKey:
    """What a full cached page holds: its token ids after the prefix ``parent`` (the key of the page before it,
    None for a sequence's first page). Hashed by ``chain_hash``; two keys are equal only when their token ids and
    every token id before them compare equal (the parent chains are walked, stopping early at a shared parent),
    so a hash collision can never make a page stand for another prefix."""

    __slots__ = ("parent", "tokens", "hash")

    def __init__(self, parent: "PageKey | None", tokens: tuple[int, ...]):
        self.parent, self.tokens = parent, tokens
        self.hash = chain_hash(None if parent is None else parent.hash, tokens)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        a, b = self, other
        while a is not b:  # iterative: chains are as long as a sequence's pages (no recursion limit)
            if a is None or b is None or a.hash != b.hash or a.tokens != b.tokens:
                return False
            a, b = a.parent, b.parent
        return True


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a token list: its pages' keys and ids (in order) and the tokens they hold."""

    keys: tuple[PageKey, ...] = ()
    pages: tuple[int, ...] = ()

    def num_tokens(self, page_size: int) -> int:
        return len(self.pages) * page_size


class BlockManager:
    """Free list of page ids and a block table (list of page ids) per sequence id.

    A sequence of n tokens owns ceil(n / page_size) pages. ``allocate`` gives a new sequence its pages,
    ``ensure`` grows a running sequence to hold n tokens, ``free`` returns all of a sequence's pages.

    Prefix caching (``enable_prefix_caching``, vLLM's automatic prefix caching): once a page is full and its K/V
    written (``cache_full_pages``), it is registered under a PageKey (its token ids chained with everything before
    it). ``match_prefix`` finds the longest run of registered pages a new token list starts with; ``allocate``
    then shares them (reference counts) and takes fresh pages only for the rest. A freed page whose count drops to
    0 stays registered but evictable; evictable pages are handed out again (least recently used first, a
    sequence's last page before its first) only once the free list is empty, and an evicted page loses its key at
    once, so it is never matched again. Shared pages are full and never written: a sequence writes only its own
    pages past the shared prefix.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_pages = collections.deque(range(num_pages))  # unreferenced and unregistered
        self.tables: dict[int, list[int]] = {}
        self.ref_counts = [0] * num_pages
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # registered, count 0, LRU first
        self.cached: dict[PageKey, int] = {}  # key -> the page registered under it
        self.page_keys: dict[int, PageKey] = {}  # registered page -> its key
        self.seq_keys: dict[int, list[PageKey]] = {}  # a sequence's full, written pages' keys, in order

    @property
    def num_free(self) -> int:
        """Pages a sequence can take: the free list plus the evictable cached pages."""
        return len(self.free_pages) + len(self.evictable)

    @property
    def num_cached(self) -> int:
        return len(self.page_keys)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------------------------------------ prefix caching
    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        """The longest cached prefix of ``token_ids``, at most (len - 1) // page_size pages: the last token is
        always left to compute (its logits give the next token). Nothing changes (see ``allocate``)."""
        if not self.enable_prefix_caching:
            return PrefixMatch()
        ps, keys, pages, parent = self.page_size, [], [], None
        for j in range((len(token_ids) - 1) // ps):
            key = PageKey(parent, tuple(token_ids[j * ps:(j + 1) * ps]))
            page = self.cached.get(key)
            if page is None:
                break
            parent = self.page_keys[page]  # the registered key object: later keys chain onto it (cheap equality)
            keys.append(parent)
            pages.append(page)
        return PrefixMatch(tuple(keys), tuple(pages))

    def cache_full_pages(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Register ``seq_id``'s pages that are full and written: those within its first ``num_computed`` tokens
        (token_ids is the sequence's token list). A page whose content another page already holds stays private
        (freed normally); the chain continues through the registered key."""
        if not self.enable_prefix_caching:
            return
        keys, table, ps = self.seq_keys[seq_id], self.tables[seq_id], self.page_size
        for j in range(len(keys), min(num_computed // ps, len(table))):
            key = PageKey(keys[-1] if keys else None, tuple(token_ids[j * ps:(j + 1) * ps]))
            holder = self.cached.get(key)
            if holder is None:
                self.cached[key], self.page_keys[table[j]] = table[j], key
            else:
                key = self.page_keys[holder]
            keys.append(key)

    def _evict(self) -> int:
        """The least recently used evictable page, unregistered (it is never matched again)."""
        page, _ = self.evictable.popitem(last=False)
        key = self.page_keys.pop(page)
        del self.cached[key]
        return page

    def _take_page(self) -> int:
        page = self.free_pages.popleft() if self.free_pages else self._evict()
        self.ref_counts[page] = 1
        return page

    def reset_prefix_cache(self) -> int:
        """Unregister every evictable page (to the free list); pages in use keep their keys. Returns how many."""
        n = len(self.evictable)
        while self.evictable:
            self.free_pages.append(self._evict())
        return n

    # ------------------------------------------------------------------------------------------ allocation
    def _idle(self, prefix: PrefixMatch | None) -> int:
        """Pages of ``prefix`` that sit evictable now (sharing them takes them off the evictable list)."""
        return 0 if prefix is None else sum(1 for p in prefix.pages if self.ref_counts[p] == 0)

    def can_allocate(self, num_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        shared = 0 if prefix is None else len(prefix.pages)
        return self.pages_for(num_tokens) - shared + self._idle(prefix) <= self.num_free

    def allocate(self, seq_id: int, num_tokens: int, prefix: PrefixMatch | None = None) -> list[int]:
        """Pages for a new sequence of ``num_tokens`` tokens: ``prefix``'s pages shared (from match_prefix, just
        before), fresh ones for the rest. RuntimeError if it has pages or they are lacking (nothing taken then)."""
        if seq_id in self.tables:
            raise RuntimeError(f"sequence {seq_id} already has pages")
        if not self.can_allocate(num_tokens, prefix):
            raise RuntimeError(f"out of pages: sequence {seq_id} needs {self.pages_for(num_tokens)}, "
                               f"{self.num_free} free")
        shared = () if prefix is None else prefix.pages
        for page in shared:
            if self.ref_counts[page] == 0:
                del self.evictable[page]
            self.ref_counts[page] += 1
        table = list(shared)
        table.extend(self._take_page() for _ in range(self.pages_for(num_tokens) - len(shared)))
        self.tables[seq_id] = table
        self.seq_keys[seq_id] = [] if prefix is None else list(prefix.keys)
        return table

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
        table.extend(self._take_page() for _ in range(missing))
        return table

    def free(self, seq_id: int) -> None:
        """Release every page of ``seq_id`` (no-op for a sequence without pages). A page no sequence uses any more
        goes to the free list, or, when registered, to the evictable list: last page first, so a sequence's
        tail is evicted before the prefix other requests are likelier to share."""
        self.seq_keys.pop(seq_id, None)
        for page in reversed(self.tables.pop(seq_id, [])):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if page in self.page_keys:
                    self.evictable[page] = None
                else:
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


def _no_shared_pages(prefix: PrefixMatch | None) -> None:
    """Context-parallel pools keep no prefix cache (its match is always empty): a non-empty one is a caller's bug."""
    if prefix is not None and prefix.pages:
        raise RuntimeError("a context-parallel block manager cannot share cached prefix pages")


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

    def can_allocate(self, num_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        _no_shared_pages(prefix)
        return self._fits(0, self.pages_for(num_tokens))

    def allocate(self, seq_id: int, num_tokens: int, prefix: PrefixMatch | None = None) -> list[int]:
        _no_shared_pages(prefix)
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


def make_block_manager(num_pages: int, page_size: int, cp_size: int = 1, cp_rank: int = 0,
                       enable_prefix_caching: bool = False) -> BlockManager:
    """The block manager for ``num_pages`` pages per rank: plain, or dealt over a context-parallel group (which
    has no prefix caching: ValueError)."""
    if cp_size == 1:
        return BlockManager(num_pages, page_size, enable_prefix_caching)
    if enable_prefix_caching:
        raise ValueError("prefix caching does not support context parallelism (context_parallel_size > 1)")
    return ContextParallelBlockManager(num_pages, page_size, cp_size, cp_rank)
