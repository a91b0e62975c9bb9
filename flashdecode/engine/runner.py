"""ModelRunner: owns the page pool and the step buffers, turns scheduled sequences into model inputs, runs the
model (decode steps through CUDA graphs when on CUDA), and returns float32 logits.

Decode batches are padded up to a bucket (1, 2, 4, 8, 16, 32, ...) in graph and eager mode alike, so both run the
very same kernels on the very same shapes (identical results). Padded rows read one token of the scratch page and
write their K/V there. Inputs go through pinned host buffers and one non-blocking copy each; a sequence's block
table is copied incrementally (only the pages it gained since the last step), so a 128k-token context does not
cost a host-side rebuild per token.
"""

from __future__ import annotations

import torch

from flashdecode.engine.attention import AttentionBackend, AttentionMetadata
from flashdecode.engine.kv_cache import allocate_pool
from flashdecode.engine.scheduler import Sequence


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= max_num_seqs."""
    buckets = [1]
    while buckets[-1] < max_num_seqs:
        buckets.append(buckets[-1] * 2)
    return buckets


class ModelRunner:
    def __init__(self, model, backend: AttentionBackend, *, num_pages: int, page_size: int, max_model_len: int,
                 max_num_seqs: int, device, dtype: torch.dtype, use_cuda_graphs: bool):
        cfg = model.config
        self.model, self.backend, self.device = model, backend, torch.device(device)
        self.page_size, self.num_pages, self.max_model_len = page_size, num_pages, max_model_len
        self.pool = allocate_pool(cfg.num_hidden_layers, num_pages, page_size, cfg.num_key_value_heads,
                                  cfg.head_dim, dtype, device)
        self.kv_caches = [(self.pool[0, l], self.pool[1, l]) for l in range(cfg.num_hidden_layers)]
        self.scratch_page = num_pages  # the pool's extra page
        self.dynamic_rope = cfg.rope.rope_type == "dynamic"
        self.buckets = batch_buckets(max_num_seqs)
        self.max_pages = -(-max_model_len // page_size)
        self._init_decode_buffers(self.buckets[-1])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[int, torch.Tensor] = {}
        if use_cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError("CUDA graphs need a CUDA device (use enforce_eager=True elsewhere)")
            if not backend.supports_cuda_graphs:
                raise ValueError(f"attention backend {backend.name!r} cannot run inside CUDA graphs")
            self.capture_graphs()

    # ------------------------------------------------------------------------------------------------ buffers
    def _init_decode_buffers(self, max_bs: int) -> None:
        pin = self.device.type == "cuda"
        host = dict(dtype=torch.int64, pin_memory=pin)
        self.h_input_ids = torch.zeros(max_bs, **host)
        self.h_positions = torch.zeros(max_bs, **host)
        self.h_slots = torch.zeros(max_bs, **host)
        self.h_context_lens = torch.ones(max_bs, dtype=torch.int32, pin_memory=pin)
        self.h_block_tables = torch.full((max_bs, self.max_pages), self.scratch_page, dtype=torch.int32,
                                         pin_memory=pin)
        self.row_owner = [(None, 0)] * max_bs  # ((seq_id, preemptions), pages written) per block-table row
        dev = dict(device=self.device)
        self.input_ids = self.h_input_ids.to(**dev)
        self.positions = self.h_positions.to(**dev)
        self.slots = self.h_slots.to(**dev)
        self.context_lens = self.h_context_lens.to(**dev)
        self.block_tables = self.h_block_tables.to(**dev)

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
    def prepare_decode(self, seqs: list[Sequence], tables: list[list[int]]) -> int:
        """Fill the host buffers for one decode step and copy them to the device. Returns the padded batch."""
        n, bs = len(seqs), self.bucket(len(seqs))
        ps = self.page_size
        for i, (seq, table) in enumerate(zip(seqs, tables)):
            pos = len(seq) - 1  # the newest token is not in the cache yet
            self.h_input_ids[i] = seq.token_ids[-1]
            self.h_positions[i] = pos
            self.h_slots[i] = table[pos // ps] * ps + pos % ps
            self.h_context_lens[i] = pos + 1
            owner, written = self.row_owner[i]
            # a preempted sequence comes back with new pages: key the row by (id, preemption count)
            key = (seq.seq_id, seq.num_preemptions)
            if owner != key or written > len(table):
                written = 0
            if written < len(table):
                self.h_block_tables[i, written:len(table)] = torch.tensor(table[written:], dtype=torch.int32)
            self.row_owner[i] = (key, len(table))
        for i in range(n, bs):  # padding rows: one token on the scratch page
            self.h_input_ids[i] = 0
            self.h_positions[i] = 0
            self.h_slots[i] = self.scratch_page * ps
            self.h_context_lens[i] = 1
            if self.row_owner[i][0] is not None:
                self.h_block_tables[i, 0] = self.scratch_page
                self.row_owner[i] = (None, 0)
        width = max(len(t) for t in tables)
        for dst, src in ((self.input_ids, self.h_input_ids), (self.positions, self.h_positions),
                         (self.slots, self.h_slots), (self.context_lens, self.h_context_lens)):
            dst[:bs].copy_(src[:bs], non_blocking=True)
        # stale entries beyond a row's length are never read (the kernels stop at context_lens)
        self.block_tables[:bs, :width].copy_(self.h_block_tables[:bs, :width], non_blocking=True)
        return bs

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], tables: list[list[int]]) -> torch.Tensor:
        """One token for each sequence. Returns float32 logits (len(seqs), vocab) (a view of a static buffer)."""
        bs = self.prepare_decode(seqs, tables)
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.graph_logits[bs][:len(seqs)]
        return self._decode_forward(bs)[:len(seqs)]

    def _decode_forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._decode_meta(bs), self.kv_caches,
                            self.backend)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture one decode graph per bucket, largest first, sharing one memory pool."""
        self.h_slots.fill_(self.scratch_page * self.page_size)
        self.slots.copy_(self.h_slots)
        self.context_lens.fill_(1)
        self.block_tables.fill_(self.scratch_page)
        pool = None
        side = torch.cuda.Stream()
        for bs in reversed(self.buckets):
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
        else:  # slot of position p: page table[p // ps], offset p % ps
            pages = torch.cat([torch.tensor(t, dtype=torch.int64)[:-(-n // ps)] for t, n in zip(tables, seqlens)])
            page_starts = torch.repeat_interleave(
                torch.cumsum(torch.tensor([0] + [-(-n // ps) for n in seqlens[:-1]]), 0), lens)
            slots = pages[page_starts + positions // ps] * ps + positions % ps
        dev = self.device
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=slots.to(dev), cu_seqlens=cu.to(torch.int32).to(dev),
            max_seqlen=max(seqlens), seqlens=seqlens,
            rope_lens=torch.repeat_interleave(lens, lens).to(dev) if self.dynamic_rope else None)
        ids = torch.tensor([tok for t in token_lists for tok in t], dtype=torch.int64).to(dev)
        return ids, positions.to(dev), meta, (cu[1:] - 1).to(dev)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], tables: list[list[int]]) -> torch.Tensor:
        """Run every token of each sequence, write their K/V into its pages. Returns float32 logits of the last
        token of each sequence, (len(seqs), vocab)."""
        ids, pos, meta, last = self._prefill_inputs([s.token_ids for s in seqs], tables)
        hidden = self.model(ids, pos, meta, self.kv_caches, self.backend)
        return self.model.compute_logits(hidden[last])

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits (len, vocab) of every position of one prompt (no pages used)."""
        ids, pos, meta, _ = self._prefill_inputs([list(token_ids)], None)
        hidden = self.model(ids, pos, meta, self.kv_caches, self.backend)
        return self.model.compute_logits(hidden)
