"""ModelRunner: owns the page pool and the step buffers, turns scheduled sequences into model inputs, runs the
model (decode steps through CUDA graphs when on CUDA), and returns float32 logits.

Decode batches are padded up to a bucket (1, 2, 4, 8, 16, 32, ...) in graph and eager mode alike, so both run the
very same kernels on the very same shapes (identical results). Padded rows read one token of the scratch page and
write their K/V there. The step inputs go through one pinned host buffer and one non-blocking copy; a sequence's
block table is copied incrementally (only the pages it gained since the last step, and only on steps where some
row gained one), so a 128k-token context does not cost a host-side rebuild per token. Without async scheduling the
GPU idles while the host prepares a step, so this path is kept free of per-element torch calls. The greedy argmax
runs inside the graph; with async scheduling (``LLM(async_scheduling=)``) the next step is launched before the
host has read it (``decode(..., ahead=True)``: its input tokens are copied on the device from the token buffer of
the step in flight - the argmax, with any sampled rows' draws written over it) and the tokens come back through
``greedy_tokens_to_host``.

Parallel ranks (``parallel``): the pool holds this rank's KV heads; under context parallelism it holds this rank's
pages of every sequence (logical pages r, r + cp, ... of rank r, flashdecode.engine.kv_cache), a token is written
by its page's owner only (the other ranks write it to the scratch page), the decode lengths are the rank's local
token counts, and decode attention goes through ContextParallelBackend (partial states merged over the group).
A prefill runs whole on every rank of a context-parallel group (its attention reads the step's own K/V, not the
cache) and each rank keeps its pages.
"""

from __future__ import annotations

import numpy as np
import torch

from flashdecode.distributed.groups import ParallelState
from flashdecode.engine.attention import AttentionBackend, AttentionMetadata, ContextParallelBackend
from flashdecode.engine.kv_cache import allocate_pool, cp_local_length
from flashdecode.engine.kv_quant import QuantPages, allocate_scales
from flashdecode.engine.scheduler import Sequence


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= max_num_seqs."""
    buckets = [1]
    while buckets[-1] < max_num_seqs:
        buckets.append(buckets[-1] * 2)
    return buckets


class PendingTokens:
    """The greedy tokens of a launched decode step on their way to the host: ``wait()`` -> list[int]."""

    def __init__(self, host: torch.Tensor, done: "torch.cuda.Event | None"):
        self.host, self.done = host, done

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class ModelRunner:
    def __init__(self, model, backend: AttentionBackend, *, num_pages: int, page_size: int, max_model_len: int,
                 max_num_seqs: int, device, dtype: torch.dtype, use_cuda_graphs: bool,
                 parallel: ParallelState | None = None, kv_cache_dtype: torch.dtype | None = None):
        cfg = model.config
        self.model, self.backend, self.device = model, backend, torch.device(device)
        self.page_size, self.num_pages, self.max_model_len = page_size, num_pages, max_model_len
        self.parallel = parallel or ParallelState.single()
        self.cp_size, self.cp_rank = self.parallel.cp_size, self.parallel.cp_rank
        self.buckets = batch_buckets(max_num_seqs)
        if self.cp_size > 1:
            self.backend = ContextParallelBackend(backend, self.parallel.cp_group, max_rows=self.buckets[-1])
        nheads_kv = getattr(model, "cache_kv_heads", cfg.num_key_value_heads)
        self.pool = allocate_pool(cfg.num_hidden_layers, num_pages, page_size, nheads_kv, cfg.head_dim,
                                  kv_cache_dtype or dtype, device)
        self.kv_caches = [(self.pool[0, l], self.pool[1, l]) for l in range(cfg.num_hidden_layers)]
        if kv_cache_dtype is not None:  # 8-bit pages with per-token-head scales (engine/kv_quant.py)
            self.pool_scales = allocate_scales(cfg.num_hidden_layers, num_pages, page_size, nheads_kv, device)
            self.kv_caches = [(QuantPages(self.pool[0, l], self.pool_scales[0, l]),
                               QuantPages(self.pool[1, l], self.pool_scales[1, l]))
                              for l in range(cfg.num_hidden_layers)]
        self.scratch_page = num_pages  # the pool's extra page
        self.dynamic_rope = cfg.rope.rope_type == "dynamic"
        self.max_pages = -(-max_model_len // page_size)
        self._init_decode_buffers(self.buckets[-1])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[int, torch.Tensor] = {}
        if use_cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError("CUDA graphs need a CUDA device (use enforce_eager=True elsewhere)")
            if not self.backend.supports_cuda_graphs:
                raise ValueError(f"attention backend {backend.name!r} cannot run inside CUDA graphs")
            self.capture_graphs()

    # ------------------------------------------------------------------------------------------------ buffers
    def _init_decode_buffers(self, max_bs: int) -> None:
        """Per-step inputs live in one pinned int64 host buffer (rows: input ids, positions, page slots, context
        lengths) written through a numpy view (a numpy store costs ~0.1 us, a torch setitem a few us - per
        sequence and step, at batch 64 that was milliseconds of idle GPU) and sent with one copy. The block
        table has its own buffer and is copied only when a row gained pages."""
        pin = self.device.type == "cuda"
        self.h_step = torch.zeros((4, max_bs), dtype=torch.int64, pin_memory=pin)
        self.h_step_np = self.h_step.numpy()
        self.h_step_np[3] = 1
        self.h_block_tables = torch.full((max_bs, self.max_pages), self.scratch_page, dtype=torch.int32,
                                         pin_memory=pin)
        self.h_block_tables_np = self.h_block_tables.numpy()
        self.row_owner = [(None, 0)] * max_bs  # ((seq_id, preemptions), pages written) per block-table row
        self.step_inputs = self.h_step.to(self.device)
        self.input_ids, self.positions, self.slots, self.context_lens_i64 = self.step_inputs.unbind(0)
        self.context_lens = torch.ones(max_bs, dtype=torch.int32, device=self.device)  # what the kernels read
        self.block_tables = self.h_block_tables.to(self.device)
        self.greedy_tokens = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        # async scheduling (LLM(async_scheduling=)): the next step's host buffers may only be rewritten once the
        # copies of the step before have run; two pinned slots take the greedy tokens of two in-flight steps
        self.inputs_copied = torch.cuda.Event() if pin else None
        self.h_tokens = [torch.zeros(max_bs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.tokens_copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self.tokens_slot = 0

    def bucket(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"decode batch {batch} exceeds max_num_seqs bucket {self.buckets[-1]}")

    def _decode_meta(self, bs: int) -> AttentionMetadata:
        positions = self.positions[:bs]
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slots[:bs], block_tables=self.block_tables[:bs],
                                 context_lens=self.context_lens[:bs],
                                 rope_lens=positions + 1 if self.dynamic_rope else None)

    # ------------------------------------------------------------------------------------------------ decode
    def prepare_decode(self, seqs: list[Sequence], tables: list[list[int]], ahead: bool = False) -> int:
        """Fill the host buffers for one decode step and copy them to the device. Returns the padded batch.
        ahead: the step after the one in flight, whose tokens the host has not read yet: each row's input token is
        the in-flight step's token of the same row (greedy_tokens, copied on the device), one position further on."""
        n, bs = len(seqs), self.bucket(len(seqs))
        ps = self.page_size
        step, bt = self.h_step_np, self.h_block_tables_np
        if self.inputs_copied is not None:
            self.inputs_copied.synchronize()  # the previous step's copies out of these pinned buffers have run
        # the newest token is not in the cache yet (ahead: it is not even on the host yet)
        positions = [len(seq) - 1 + ahead for seq in seqs]
        step[0, :n] = 0 if ahead else [seq.token_ids[-1] for seq in seqs]
        step[1, :n] = positions
        if self.cp_size == 1:
            step[2, :n] = [table[p // ps] * ps + p % ps for table, p in zip(tables, positions)]
            step[3, :n] = [p + 1 for p in positions]
        else:  # this rank's share: the new token's slot if it owns that page, its local token count
            cp, r, scratch = self.cp_size, self.cp_rank, self.scratch_page * ps
            step[2, :n] = [table[p // ps // cp] * ps + p % ps if (p // ps) % cp == r else scratch
                           for table, p in zip(tables, positions)]
            step[3, :n] = [cp_local_length(p + 1, ps, cp, r) for p in positions]
        if bs > n:  # padding rows: one token on the scratch page
            step[:, n:bs] = ((0,), (0,), (self.scratch_page * ps,), (1,))
        dirty_from = None  # first block-table column written this step
        for i, (seq, table) in enumerate(zip(seqs, tables)):
            owner, written = self.row_owner[i]
            # a preempted sequence comes back with new pages: key the row by (id, preemption count)
            key = (seq.seq_id, seq.num_preemptions)
            if owner != key or written > len(table):
                written = 0
            if written < len(table):
                bt[i, written:len(table)] = table[written:]
                dirty_from = written if dirty_from is None else min(dirty_from, written)
            self.row_owner[i] = (key, len(table))
        for i in range(n, bs):
            if self.row_owner[i][0] is not None:
                bt[i, 0] = self.scratch_page
                self.row_owner[i] = (None, 0)
                dirty_from = 0
        self.step_inputs.copy_(self.h_step, non_blocking=True)
        if dirty_from is not None:
            # stale entries beyond a row's length are never read (the kernels stop at context_lens)
            width = max(len(t) for t in tables)
            self.block_tables[:bs, dirty_from:width].copy_(self.h_block_tables[:bs, dirty_from:width],
                                                           non_blocking=True)
        # a backend that plans on the host (FlashInfer) does it here: before the event below, so the next step's
        # wait also covers the copies out of the plan's pinned buffers
        self.backend.plan_decode(bs, step[3, :bs], bt[:bs], ps)
        if self.inputs_copied is not None:
            self.inputs_copied.record()
        if ahead:  # stream order: after the in-flight step wrote greedy_tokens, before this step reads input_ids
            self.input_ids[:n].copy_(self.greedy_tokens[:n])
        return bs

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], tables: list[list[int]],
               ahead: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each sequence. Returns float32 logits (len(seqs), vocab) and their argmax int64
        (len(seqs),) (the greedy tokens, computed on the device in the same graph), views of static buffers.
        Nothing waits for the device. ahead: see prepare_decode (the rows must be the in-flight step's, in order)."""
        n = len(seqs)
        bs = self.prepare_decode(seqs, tables, ahead)
        if bs in self.graphs:
            self.graphs[bs].replay()
            logits = self.graph_logits[bs]
        else:
            logits = self._decode_forward(bs)
        return logits[:n], self.greedy_tokens[:n]

    def greedy_tokens_to_host(self, n: int) -> "PendingTokens":
        """Start copying the greedy tokens of the step just launched (its first ``n`` rows) to a pinned host slot;
        the slot is read by PendingTokens.wait (two slots: the step in flight and the one launched ahead of it)."""
        slot = self.tokens_slot
        self.tokens_slot ^= 1
        host, done = self.h_tokens[slot][:n], self.tokens_copied[slot]
        host.copy_(self.greedy_tokens[:n], non_blocking=True)
        if done is not None:
            done.record()
        return PendingTokens(host, done)

    def _decode_forward(self, bs: int) -> torch.Tensor:
        self.context_lens[:bs].copy_(self.context_lens_i64[:bs])  # int32 for the kernels, inside the graph
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._decode_meta(bs), self.kv_caches,
                            self.backend)
        logits = self.model.compute_logits(hidden)
        torch.argmax(logits, dim=-1, out=self.greedy_tokens[:bs])
        return logits

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture one decode graph per bucket, largest first, sharing one memory pool."""
        self.h_step_np[:] = ((0,), (0,), (self.scratch_page * self.page_size,), (1,))
        self.step_inputs.copy_(self.h_step)
        self.block_tables.fill_(self.scratch_page)
        pool = None
        side = torch.cuda.Stream()
        for bs in reversed(self.buckets):
            # every row one token on the scratch page, as the warm-up and the capture read it
            self.backend.plan_decode(bs, self.h_step_np[3, :bs], np.full((bs, 1), self.scratch_page, np.int32),
                                     self.page_size)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up (Triton compiles/autotunes) outside the capture
                for _ in range(2):
                    self._decode_forward(bs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._decode_forward(bs)
            pool = graph.pool()
            self.graphs[bs], self.graph_logits[bs] = graph, logits
        torch.cuda.synchronize()

    # ------------------------------------------------------------------------------------------------ prefill
    def _prefill_inputs(self, token_lists: list[list[int]], tables: list[list[int]] | None):
        """Packed prefill inputs, built with tensor ops (a 64k-token prompt costs no Python loop per token).
        tables None: logits only, every K/V goes to the scratch page."""
        seqlens = [len(t) for t in token_lists]
        lens = torch.tensor(seqlens, dtype=torch.int64)
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        total = int(cu[-1])
        starts = torch.repeat_interleave(cu[:-1], lens)
        positions = torch.arange(total, dtype=torch.int64) - starts
        ps = self.page_size
        if tables is None:
            slots = torch.full((total,), self.scratch_page * ps, dtype=torch.int64)
        else:
            slots = self._prefill_slots(tables, lens, positions)
        dev = self.device
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=slots.to(dev), cu_seqlens=cu.to(torch.int32).to(dev),
            max_seqlen=max(seqlens), seqlens=seqlens,
            rope_lens=torch.repeat_interleave(lens, lens).to(dev) if self.dynamic_rope else None)
        ids = torch.tensor([tok for t in token_lists for tok in t], dtype=torch.int64).to(dev)
        return ids, positions.to(dev), meta, (cu[1:] - 1).to(dev)

    def _prefill_slots(self, tables: list[list[int]], lens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """int64 (tokens,) page slots of packed prompts: position p of a sequence goes to its logical page
        j = p // ps, which this rank stores as table[j // cp] when j % cp == cp_rank (always without context
        parallelism), offset p % ps; tokens of the other ranks' pages go to the scratch page."""
        ps, cp = self.page_size, self.cp_size
        pages = torch.cat([torch.tensor(t, dtype=torch.int64) for t in tables]
                          + [torch.tensor([self.scratch_page], dtype=torch.int64)])  # last entry: the scratch page
        table_starts = torch.repeat_interleave(
            torch.cumsum(torch.tensor([0] + [len(t) for t in tables[:-1]], dtype=torch.int64), 0), lens)
        logical = positions // ps
        mine = logical % cp == self.cp_rank
        index = torch.where(mine, table_starts + logical // cp, torch.full_like(logical, pages.shape[0] - 1))
        return pages[index] * ps + torch.where(mine, positions % ps, torch.zeros_like(positions))

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], tables: list[list[int]]) -> torch.Tensor:
        """Run each sequence's scheduled chunk (seq.num_scheduled_tokens tokens from seq.num_computed_tokens on;
        the whole prompt when nothing is cached) and write its K/V into the pages. Returns float32 logits of each
        chunk's last token, (len(seqs), vocab). A chunk after K/V already in the pages (a cached prefix, earlier
        chunks) attends those pages (a paged prefill)."""
        chunks = [(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens) for s in seqs]
        if all(start == 0 and end == len(s) for s, (start, end) in zip(seqs, chunks)):
            ids, pos, meta, last = self._prefill_inputs([s.token_ids for s in seqs], tables)
        else:
            ids, pos, meta, last = self._paged_prefill_inputs(seqs, tables, chunks)
        hidden = self.model(ids, pos, meta, self.kv_caches, self.backend, last_rows=last)  # (len(seqs), hidden)
        return self.model.compute_logits(hidden)

    def _paged_prefill_inputs(self, seqs: list[Sequence], tables: list[list[int]], chunks: list[tuple[int, int]]):
        """Packed inputs of chunks [start, end) of the sequences' tokens after K/V already in their pages: the
        chunks' tokens at their absolute positions, their page slots, and a block table + key counts (end) for the
        attention over the pages. Dynamic rope sees each sequence's whole length, as an unchunked prefill does."""
        if self.cp_size > 1:
            raise RuntimeError("a paged prefill does not support context parallelism")
        lens = torch.tensor([end - start for start, end in chunks], dtype=torch.int64)
        cu = torch.zeros(len(chunks) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        starts = torch.tensor([start for start, _ in chunks], dtype=torch.int64)
        positions = torch.arange(int(cu[-1]), dtype=torch.int64) - torch.repeat_interleave(cu[:-1] - starts, lens)
        slots = self._prefill_slots(tables, lens, positions)
        ends = [end for _, end in chunks]
        width = max(-(-end // self.page_size) for end in ends)
        block_tables = torch.full((len(seqs), width), self.scratch_page, dtype=torch.int32)
        for i, (table, end) in enumerate(zip(tables, ends)):
            n = -(-end // self.page_size)
            block_tables[i, :n] = torch.tensor(table[:n], dtype=torch.int32)
        dev = self.device
        full_lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=slots.to(dev), cu_seqlens=cu.to(torch.int32).to(dev),
            max_seqlen=int(lens.max()), seqlens=lens.tolist(), block_tables=block_tables.to(dev),
            context_lens=torch.tensor(ends, dtype=torch.int32).to(dev), seqlens_k=ends, max_seqlen_k=max(ends),
            rope_lens=torch.repeat_interleave(full_lens, lens).to(dev) if self.dynamic_rope else None)
        ids = torch.tensor([t for s, (start, end) in zip(seqs, chunks) for t in s.token_ids[start:end]],
                           dtype=torch.int64).to(dev)
        return ids, positions.to(dev), meta, (cu[1:] - 1).to(dev)

    @torch.inference_mode()
    def warm_up_prefill(self, lengths) -> None:
        """Run, before the first request, the prefill kernels' first calls (where Triton and Gluon compile): for each
        n of ``lengths``, the model's forward over one prompt of n tokens (the dense kernel), two of n // 2 (the
        ragged one) and, without context parallelism, a chunk of n tokens after n keys in the pages (the paged
        one). Every K/V write and page read is the scratch page's: the pool's pages and the prefix cache are
        untouched, and no logits are computed."""
        for n in lengths:
            batches = [[[0] * n], [[0] * (n // 2)] * 2]
            steps = [self._prefill_inputs(tokens, None) for tokens in batches]
            if self.cp_size == 1:
                steps.append(self._scratch_chunk_inputs(n))
            for ids, pos, meta, last in steps:
                self.model(ids, pos, meta, self.kv_caches, self.backend, last_rows=last)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _scratch_chunk_inputs(self, n: int):
        """Paged-prefill inputs of one chunk of n tokens (positions n .. 2n - 1) after n keys, every page of its
        block table the scratch page (which its K/V are written to as well)."""
        ps, dev = self.page_size, self.device
        positions = torch.arange(n, 2 * n, dtype=torch.int64)
        table = torch.full((1, -(-2 * n // ps)), self.scratch_page, dtype=torch.int32)
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=(self.scratch_page * ps + positions % ps).to(dev),
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32).to(dev), max_seqlen=n, seqlens=[n],
            block_tables=table.to(dev), context_lens=torch.tensor([2 * n], dtype=torch.int32).to(dev),
            seqlens_k=[2 * n], max_seqlen_k=2 * n,
            rope_lens=torch.full((n,), 2 * n, dtype=torch.int64).to(dev) if self.dynamic_rope else None)
        ids = torch.zeros(n, dtype=torch.int64, device=dev)
        return ids, positions.to(dev), meta, torch.tensor([n - 1], dtype=torch.int64, device=dev)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits (len, vocab) of every position of one prompt (no pages used)."""
        ids, pos, meta, _ = self._prefill_inputs([list(token_ids)], None)
        hidden = self.model(ids, pos, meta, self.kv_caches, self.backend)
        return self.model.compute_logits(hidden)
