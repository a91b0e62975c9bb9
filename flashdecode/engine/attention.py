"""Attention backends: one interface, six implementations, picked by name.

    prefill(q, k, v, meta) -> out    q (tokens, nheads, d), k/v (tokens, nheads_kv, d), causal per sequence
    prefill_last(q, k, v, meta) -> out    q (batch, nheads, d): each sequence's last query only, against all its keys
    prefill_paged(q, k_cache, v_cache, meta) -> out    a prefill chunk after a prefix already in the pages (prefix
                                          caching, chunked prefill): q (tokens, nheads, d) against the pages
    decode(q, k_cache, v_cache, meta) -> out    q (batch, nheads, d), paged cache (num_pages, page_size, hk, d)
    write_kv(k_cache, v_cache, k, v, meta)      k/v (tokens, hk, d) into the page slots meta.slot_mapping

Backends ("flashdecode" is the default on CUDA, "torch" on the CPU):
  flashdecode          flash_attn_varlen for prefill, flash_decode (split-KV, heuristic split count) for decode
  flashdecode-nosplit  the same with num_splits=1 (the no-split ablation; the seeds' FA2-style decode column)
  flashinfer           FlashInfer's paged decode / prefill wrappers (vLLM's and SGLang's kernels), where the
                       flashinfer package is installed: the serving peer (engine/flashinfer_backend.py)
  sdpa                 torch scaled_dot_product_attention (prefill per sequence); a REFERENCE for decode, not a
                       paged-attention peer: SDPA reads dense K/V, so every decode step first copies every page
                       of the block table into a dense tensor (CUDA-graph shapes: the table's full width)
  eager                matmul - softmax - matmul in PyTorch (HF's "eager"; the seeds' PyTorch column)
  torch                flashdecode.reference (attention_varlen_ref / decode_ref): the spec, CPU only (host syncs)

The K/V write is a plain index_copy_ into the flattened page pool (slot = page * page_size + offset) for every
backend: one kernel, no host sync, so it sits inside the decode CUDA graph; padded graph rows write to a scratch
page that no sequence owns.

A paged prefill writes the chunk's K/V into the pages first, then attends the pages (meta.block_tables, meta.seqlens_k
keys each), causal bottom-right. The flashdecode backend reads the pages in the kernel where flash_attn_varlen takes
a block table (8-bit pages with their scales); the others gather the pages into contiguous K/V first (correct, a copy
per step).

ContextParallelBackend wraps flashdecode or torch for context parallelism: decode attends this rank's pages and
merges the context-parallel group's (out, lse) partial states (flashdecode.distributed.StateExchange).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import inspect

import torch
import torch.nn.functional as F

from flashdecode import reference
from flashdecode.engine.kv_quant import QuantPages, write_quantized

BACKENDS = ("flashdecode", "flashdecode-nosplit", "flashinfer", "sdpa", "eager", "torch")


@dataclasses.dataclass
class AttentionMetadata:
    """Per-step inputs shared by all layers.

    slot_mapping: int64 (tokens,) flat page slot of each new token.
    Prefill: cu_seqlens int32 (batch + 1,), max_seqlen, seqlens (host list).
    Decode: block_tables int32 (batch, max_pages), context_lens int32 (batch,) = live tokens incl. the new one.
    Paged prefill (a chunk after a prefix already in the pages): cu_seqlens / max_seqlen / seqlens of the chunk's
    queries, block_tables and context_lens as in decode (keys per sequence = prefix + chunk), seqlens_k the host
    list of those key counts and max_seqlen_k their maximum.
    rope_lens: int64 (tokens,), the sequence length each token's rotary uses (only dynamic rope reads it).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    seqlens: list[int] | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    rope_lens: torch.Tensor | None = None
    seqlens_k: list[int] | None = None
    max_seqlen_k: int = 0

    @property
    def reads_pages(self) -> bool:
        """A prefill whose queries attend K/V in the pages (a cached prefix or earlier chunks)."""
        return self.is_prefill and self.block_tables is not None


class AttentionBackend(abc.ABC):
    """One attention implementation for the engine: prefill over packed prompts, decode over the paged cache."""

    name = "base"
    supports_cuda_graphs = True

    def __init__(self, window_left: int = -1):
        self.window_size = (window_left, 0)  # causal, optionally a sliding window of window_left + 1 keys

    def with_window(self, window_left: int) -> "AttentionBackend":
        """This backend with another sliding window, for models whose layers differ (Gemma 3's sliding layers). A
        shallow copy made once per window (so every call for a window returns the same object, and a flashdecode
        twin shares its decode plans: the window is an argument of each run)."""
        if window_left == self.window_size[0]:
            return self
        twins = self.__dict__.setdefault("_window_twins", {})
        if window_left not in twins:
            twin = copy.copy(self)
            twin.window_size, twin._window_twins = (window_left, 0), {self.window_size[0]: self}
            twins[window_left] = twin
        return twins[window_left]

    @staticmethod
    def check_engine(device, dtype, model_config) -> None:
        """ValueError naming the option when an engine on this device / dtype / model cannot use the backend."""

    def plan_decode(self, batch: int, context_lens, block_tables, page_size: int) -> None:
        """Host-side planning of a decode step before it is launched (outside any CUDA graph): context_lens int
        (batch,) keys per row including the new token, block_tables int32 (batch, width): numpy host copies of
        what the step reads. Nothing here: these backends read the lengths on the device (FlashInfer plans)."""

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
        if isinstance(k_cache, QuantPages):  # 8-bit pages: quantised by append_kv (engine/kv_quant.py)
            write_quantized(k_cache, v_cache, k, v, meta.slot_mapping)
            return
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v)

    @abc.abstractmethod
    def prefill(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q (total, nheads, headdim), k/v (total, nheads_kv, headdim) packed by meta.cu_seqlens -> out like q."""

    def prefill_last(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q (batch, nheads, headdim): the query of each sequence's last token; k/v (total, nheads_kv, headdim)
        packed by meta.cu_seqlens -> out like q (each query sees every key of its sequence, within the window).
        The model's last layer in a prefill that only needs last-token logits. Generic version: one masked
        attention per sequence (_masked_attention)."""
        out = torch.empty_like(q)
        start = 0
        for i, n in enumerate(meta.seqlens):
            ks, vs = (_expand_heads(x[start:start + n].transpose(0, 1)[None], q.shape[1]) for x in (k, v))
            pos = torch.arange(n, device=q.device)
            mask = _visible(1, pos[None, :], pos[-1:, None], self.window_size[0])  # (1, n)
            out[i] = self._masked_attention(q[i][None, :, None, :], ks, vs, mask)[0, :, 0, :]
            start += n
        return out

    @staticmethod
    def _masked_attention(q, k, v, mask):
        """q (b, h, sq, d), k/v (b, h, sk, d), bool mask broadcastable to (b, h, sq, sk)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def prefill_paged(self, q, k_cache, v_cache, meta: AttentionMetadata, last_only: bool = False) -> torch.Tensor:
        """q (tokens, nheads, headdim): each sequence's newest tokens (packed by meta.cu_seqlens; last_only: one
        row per sequence, its last token), whose K/V are already written, against the first meta.seqlens_k[b]
        keys of its pages (meta.block_tables), causal bottom-right (within the window) -> out like q.
        Generic version: the pages gathered into contiguous K/V, then attend_varlen."""
        k, v, cu_k = gather_pages(k_cache, v_cache, meta, q.dtype)
        cu_q, max_q, q_lens = _paged_queries(q, meta, last_only)
        return self.attend_varlen(q, k, v, cu_q, cu_k, max_q, meta.max_seqlen_k, q_lens, meta.seqlens_k)

    def attend_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                      q_lens: list[int], k_lens: list[int]) -> torch.Tensor:
        """q (total_q, nheads, d), k/v (total_k, nheads_kv, d) packed by the int32 cu_seqlens (host lengths q_lens,
        k_lens): causal bottom-right within the window -> out like q. Generic version: one masked attention per
        sequence (_masked_attention)."""
        out = torch.empty_like(q)
        q0 = k0 = 0
        for nq, nk in zip(q_lens, k_lens):
            qs = q[q0:q0 + nq].transpose(0, 1)[None]
            ks, vs = (_expand_heads(x[k0:k0 + nk].transpose(0, 1)[None], q.shape[1]) for x in (k, v))
            query_pos = torch.arange(nk - nq, nk, device=q.device)[:, None]
            mask = _visible(nq, torch.arange(nk, device=q.device)[None, :], query_pos, self.window_size[0])
            out[q0:q0 + nq] = self._masked_attention(qs, ks, vs, mask)[0].transpose(0, 1)
            q0, k0 = q0 + nq, k0 + nk
        return out

    @abc.abstractmethod
    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q (batch, nheads, headdim) against the paged cache (meta.block_tables, meta.context_lens) -> like q."""


class TorchBackend(AttentionBackend):
    """The executable spec (flashdecode.reference). Loops on the host: CPU tests, never CUDA graphs."""

    name = "torch"
    supports_cuda_graphs = False

    def prefill(self, q, k, v, meta):
        out, _ = reference.attention_varlen_ref(q, k, v, meta.cu_seqlens, meta.cu_seqlens, causal=True,
                                                window_size=self.window_size)
        return out

    def prefill_last(self, q, k, v, meta):
        out, _ = reference.attention_varlen_ref(q, k, v, _one_query_each(q), meta.cu_seqlens, causal=True,
                                                window_size=self.window_size)
        return out

    def attend_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_lens, k_lens):
        out, _ = reference.attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True,
                                                window_size=self.window_size)
        return out

    def decode(self, q, k_cache, v_cache, meta):
        return self.decode_with_lse(q, k_cache, v_cache, meta)[0]

    def decode_with_lse(self, q, k_cache, v_cache, meta, out=None):
        """decode() (into ``out`` when given) and its lse float32 (batch, nheads) (context parallelism merges
        these)."""
        if isinstance(k_cache, QuantPages):  # the spec reads the values the 8-bit pages stand for
            k_cache, v_cache = k_cache.dequantize(q.dtype), v_cache.dequantize(q.dtype)
        o, lse = reference.decode_ref(q, k_cache, v_cache, meta.context_lens, block_table=meta.block_tables,
                                      window_size=self.window_size)
        return (o if out is None else out.copy_(o)), lse.float()


def gather_pages(k_cache, v_cache, meta: AttentionMetadata, dtype: torch.dtype):
    """Each sequence's first meta.seqlens_k[b] keys copied out of its pages (meta.block_tables), 8-bit pages
    dequantised to ``dtype``. Returns k, v (sum(seqlens_k), nheads_kv, d) and int32 cu_seqlens_k (batch + 1,)."""
    page_size = k_cache.shape[1]
    offsets = torch.arange(page_size, device=meta.block_tables.device)
    slots = []
    for b, n in enumerate(meta.seqlens_k):
        pages = meta.block_tables[b, :-(-n // page_size)].long()
        slots.append((pages[:, None] * page_size + offsets).flatten()[:n])
    slots = torch.cat(slots)

    def take(cache):
        if isinstance(cache, QuantPages):
            data = cache.data.view(-1, *cache.data.shape[2:])[slots]
            return QuantPages(data, cache.scale.view(-1, cache.scale.shape[-1])[slots]).dequantize(dtype)
        return cache.view(-1, *cache.shape[2:])[slots]

    lens = torch.tensor([0] + list(meta.seqlens_k), dtype=torch.int64)
    cu_k = torch.cumsum(lens, 0).to(torch.int32).to(slots.device)
    return take(k_cache), take(v_cache), cu_k


def _paged_queries(q: torch.Tensor, meta: AttentionMetadata, last_only: bool):
    """(cu_seqlens_q, max_seqlen_q, host lengths) of a paged prefill's queries: the chunks, or one row each."""
    if last_only:
        return _one_query_each(q), 1, [1] * q.shape[0]
    return meta.cu_seqlens, meta.max_seqlen, meta.seqlens


def _one_query_each(q: torch.Tensor) -> torch.Tensor:
    """int32 (batch + 1,) cu_seqlens of q (batch, nheads, d) as one query row per sequence: with causal masks
    aligned bottom-right, that row sees every key of its sequence (prefill_last)."""
    return torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)


def _visible(seqlen_q: int, key_pos: torch.Tensor, query_pos: torch.Tensor, window_left: int) -> torch.Tensor:
    """Bool mask (..., seqlen_q, keys): key j visible to query i iff j <= pos_i (and j >= pos_i - window_left)."""
    mask = key_pos <= query_pos
    if window_left >= 0:
        mask &= key_pos >= query_pos - window_left
    return mask


def _gathered_decode_inputs(q, k_cache, v_cache, meta, window_left):
    """Gather each row's pages into (batch, max_pages * page_size, hk, d) and build its visibility mask
    (batch, 1, 1, keys). Shapes are fixed by the block table width, so this is CUDA-graph safe."""
    bt = meta.block_tables.long()
    batch, pages = bt.shape
    k = k_cache[bt].view(batch, pages * k_cache.shape[1], *k_cache.shape[2:])
    v = v_cache[bt].view(batch, pages * v_cache.shape[1], *v_cache.shape[2:])
    key_pos = torch.arange(k.shape[1], device=q.device)[None, :]
    query_pos = (meta.context_lens.long() - 1)[:, None]
    mask = _visible(1, key_pos, query_pos, window_left)
    return k, v, mask[:, None, None, :]


def _expand_heads(x: torch.Tensor, nheads: int) -> torch.Tensor:
    """(batch, hk, keys, d) -> (batch, nheads, keys, d) (GQA: each kv head serves nheads // hk query heads)."""
    group = nheads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


class SdpaBackend(AttentionBackend):
    """torch SDPA: causal per sequence in prefill; masked SDPA over gathered pages in decode.

    Decode is a reference, not a serving kernel: SDPA takes dense K/V, so each step gathers every page of the block
    table (its full width, fixed for CUDA graphs, not only the live pages) into a dense copy - the context is read,
    written and read again every step. GQA costs no further copy: a kv head's query heads are its query rows.
    """

    name = "sdpa"

    def prefill(self, q, k, v, meta):
        out = torch.empty_like(q)
        start = 0
        for n in meta.seqlens:
            qs, ks, vs = (x[start:start + n].transpose(0, 1)[None] for x in (q, k, v))
            ks, vs = _expand_heads(ks, q.shape[1]), _expand_heads(vs, q.shape[1])
            if self.window_size[0] >= 0:
                pos = torch.arange(n, device=q.device)
                mask = _visible(n, pos[None, :], pos[:, None], self.window_size[0])
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            out[start:start + n] = o[0].transpose(0, 1)
            start += n
        return out

    def decode(self, q, k_cache, v_cache, meta):
        k, v, mask = _gathered_decode_inputs(q, k_cache, v_cache, meta, self.window_size[0])
        batch, nheads, headdim = q.shape
        hk = k.shape[2]
        # query head h uses kv head h // group: (b, h, d) -> (b, hk, group, d), the group's heads as query rows of
        # their kv head, so K/V are read once per kv head (no repeat to every query head); mask (b, 1, 1, keys)
        rows = q.reshape(batch, hk, nheads // hk, headdim)
        o = F.scaled_dot_product_attention(rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return o.reshape(batch, nheads, headdim)


class EagerBackend(AttentionBackend):
    """Matmul - softmax (float32) - matmul, like HF's eager attention."""

    name = "eager"
    PREFILL_ROWS = 2048  # query rows per chunk: bounds the (heads, rows, keys) score matrix of long prompts

    @staticmethod
    def _attend(q, k, v, mask):
        """q (b, h, sq, d), k/v (b, h, sk, d), mask bool broadcastable to (b, h, sq, sk)."""
        s = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(p, v)

    _masked_attention = _attend  # prefill_last in the same matmul - softmax - matmul form

    def prefill(self, q, k, v, meta):
        out = torch.empty_like(q)
        start = 0
        for n in meta.seqlens:
            qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))
            ks, vs = _expand_heads(ks[None], q.shape[1])[0], _expand_heads(vs[None], q.shape[1])[0]
            key_pos = torch.arange(n, device=q.device)[None, :]
            for r0 in range(0, n, self.PREFILL_ROWS):
                r1 = min(n, r0 + self.PREFILL_ROWS)
                query_pos = torch.arange(r0, r1, device=q.device)[:, None]
                mask = _visible(r1 - r0, key_pos[:, :r1], query_pos, self.window_size[0])
                o = self._attend(qs[:, r0:r1], ks[:, :r1], vs[:, :r1], mask)
                out[start + r0:start + r1] = o.transpose(0, 1)
            start += n
        return out

    def decode(self, q, k_cache, v_cache, meta):
        k, v, mask = _gathered_decode_inputs(q, k_cache, v_cache, meta, self.window_size[0])
        k, v = _expand_heads(k.transpose(1, 2), q.shape[1]), _expand_heads(v.transpose(1, 2), q.shape[1])
        return self._attend(q[:, :, None, :], k, v, mask)[:, :, 0, :]


class FlashDecodeBackend(AttentionBackend):
    """The Triton kernels: flashdecode.flash_attn_varlen (prefill) and flashdecode.flash_decode (paged decode).

    Decode goes through one flashdecode.DecodePlan per (batch, heads, dtype) - made on the first call of that
    shape, i.e. during the warm-up before a CUDA-graph capture - so the split count is fixed from the block table
    capacity (host-side shape, no sync) and every buffer is preallocated: the call is capturable.
    """

    name = "flashdecode"

    def __init__(self, window_left: int = -1, num_splits: int | None = None):
        super().__init__(window_left)
        import flashdecode

        missing = [f for f in ("flash_attn_varlen", "flash_decode", "DecodePlan") if not hasattr(flashdecode, f)]
        if missing:
            raise RuntimeError(f"attention backend {self.name!r} needs flashdecode.{', '.join(missing)}, which "
                               f"this build does not export; use attn_backend='torch' or 'sdpa'")
        self._varlen = flashdecode.flash_attn_varlen
        params = inspect.signature(self._varlen).parameters
        # the kernel reads pages through a block table where flash_attn_varlen takes one (else: gathered pages),
        # 8-bit pages with their scales where it takes those too
        self.paged_varlen = "block_table" in params and "seqused_k" in params
        self.paged_varlen_quant = self.paged_varlen and "k_scale" in params
        self._dense = flashdecode.flash_attn
        self._plan_cls = flashdecode.DecodePlan
        self.num_splits = num_splits
        self.batch_invariant = False  # LLM(batch_invariant=True): plans made with it (ops/decode_plan.py DecodePlan)
        self.plans: dict[tuple, object] = {}
        # LLM(prefill_autotune=True): the prefill kernels time their candidate tiles on the first call of each
        # (query, key) length bucket - about a second inside a request; off, they take the resolved first tile
        self.prefill_autotune = False
        self._prefill_configs: dict[tuple, object] = {}

    def _config(self, q, k, v, max_seqlen_k: int):
        """config= of a prefill call: None (resolved per call, autotuned) with prefill_autotune, else the
        resolved configuration with autotuning off, made once per length class, dtype, head dim, cache layout and
        tensor-descriptor eligibility (what resolve_config looks at). q (tokens, nheads, headdim) or (1, tokens,
        nheads, headdim); k, v as the call takes them (packed, dense or pages)."""
        if self.prefill_autotune:
            return None
        from flashdecode.heuristics import prefill_length_class
        from flashdecode.ops.attention_config import resolve_config
        from flashdecode.ops.util import tma_layout_ok

        key = (prefill_length_class(max_seqlen_k), q.dtype, k.dtype, q.shape[-1], k.dim(), q.device,
               tma_layout_ok(q, k, v))
        config = self._prefill_configs.get(key)
        if config is None:
            config = dataclasses.replace(resolve_config(q, k, v, max_seqlen_k), fwd_autotune=False)
            self._prefill_configs[key] = config
        return config

    def prefill(self, q, k, v, meta):
        if meta.seqlens is not None and len(meta.seqlens) == 1:
            # one prompt (a long-context prefill): the dense call, which takes the Hopper (Gluon) kernel on sm_90;
            # varlen runs the Triton kernel everywhere
            q, k, v = q[None], k[None], v[None]
            return self._dense(q, k, v, causal=True, window_size=self.window_size,
                               config=self._config(q, k, v, k.shape[1]))[0]
        # the runner built cu_seqlens from host lengths: skip the value check's host sync (one per layer)
        return self._varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen,
                            causal=True, window_size=self.window_size, check_seqlens=False,
                            config=self._config(q, k, v, meta.max_seqlen))

    def prefill_last(self, q, k, v, meta):
        return self._varlen(q, k, v, _one_query_each(q), meta.cu_seqlens, 1, meta.max_seqlen, causal=True,
                            window_size=self.window_size, check_seqlens=False,
                            config=self._config(q, k, v, meta.max_seqlen))

    def prefill_paged(self, q, k_cache, v_cache, meta, last_only: bool = False):
        quant = isinstance(k_cache, QuantPages)
        if not (self.paged_varlen_quant if quant else self.paged_varlen):  # gathered (and dequantised) pages
            return super().prefill_paged(q, k_cache, v_cache, meta, last_only)
        scales = {}
        if quant:  # 8-bit pages read with their scales
            scales = dict(k_scale=k_cache.scale, v_scale=v_cache.scale)
            k_cache, v_cache = k_cache.data, v_cache.data
        cu_q, max_q, _ = _paged_queries(q, meta, last_only)
        return self._varlen(q, k_cache, v_cache, cu_q, None, max_q, meta.max_seqlen_k, causal=True,
                            window_size=self.window_size, block_table=meta.block_tables,
                            seqused_k=meta.context_lens, check_seqlens=False,
                            config=self._config(q, k_cache, v_cache, meta.max_seqlen_k), **scales)

    def attend_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_lens, k_lens):
        return self._varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
                            window_size=self.window_size, check_seqlens=False,
                            config=self._config(q, k, v, max_seqlen_k))

    def _plan(self, q, k_cache, block_tables):
        capacity = block_tables.shape[1] * k_cache.shape[1]
        key = (q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, capacity, k_cache.dtype)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._plan_cls(q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2], max_seqlen_k=capacity,
                                  dtype=q.dtype, device=q.device, num_splits=self.num_splits,
                                  batch_invariant=self.batch_invariant, kv_dtype=k_cache.dtype)
            self.plans[key] = plan
        return plan

    def decode(self, q, k_cache, v_cache, meta):
        return self.decode_with_lse(q, k_cache, v_cache, meta, return_lse=False)

    def decode_with_lse(self, q, k_cache, v_cache, meta, out=None, return_lse: bool = True):
        """decode() (into ``out`` when given) and (return_lse) its lse float32 (batch, nheads) (context
        parallelism merges these)."""
        scales = {}
        if isinstance(k_cache, QuantPages):  # 8-bit pages: flash_decode reads them with their scales
            scales = dict(k_scale=k_cache.scale, v_scale=v_cache.scale)
            k_cache, v_cache = k_cache.data, v_cache.data
        plan = self._plan(q, k_cache, meta.block_tables)
        return plan.run(q, k_cache, v_cache, meta.context_lens, block_table=meta.block_tables,
                        window_size=self.window_size, return_lse=return_lse, out=out, **scales)


class FlashDecodeNoSplitBackend(FlashDecodeBackend):
    name = "flashdecode-nosplit"

    def __init__(self, window_left: int = -1):
        super().__init__(window_left, num_splits=1)


class ContextParallelBackend(AttentionBackend):
    """Decode over a KV cache whose pages are dealt across a context-parallel group: the inner backend attends
    this rank's pages (meta.context_lens = this rank's token counts, 0 allowed) and returns (out, lse); one
    collective merges the group's states exactly. Prefill and the K/V write are the inner backend's (a prefill
    attends the step's own K/V, which every rank computes whole).

    The exchange buffers are made on the first decode of a (heads, headdim, dtype) - the warm-up before a CUDA
    graph capture, which also creates the NCCL communicator - so captured steps allocate nothing.
    """

    def __init__(self, inner: AttentionBackend, group, max_rows: int):
        super().__init__(inner.window_size[0])
        if not hasattr(inner, "decode_with_lse"):
            raise ValueError(f"context_parallel_size > 1 needs attn_backend 'flashdecode', 'flashdecode-nosplit' or "
                             f"'torch' (decode with lse), got {inner.name!r}")
        if inner.window_size[0] >= 0:
            raise ValueError("context_parallel_size > 1 does not support sliding windows")
        self.inner, self.group, self.max_rows = inner, group, max_rows
        self.name, self.supports_cuda_graphs = inner.name, inner.supports_cuda_graphs
        self.exchanges: dict[tuple, object] = {}

    def with_window(self, window_left: int) -> AttentionBackend:
        if window_left >= 0:
            raise ValueError("context_parallel_size > 1 does not support sliding windows")
        return self

    def write_kv(self, k_cache, v_cache, k, v, meta):
        self.inner.write_kv(k_cache, v_cache, k, v, meta)

    def prefill(self, q, k, v, meta):
        return self.inner.prefill(q, k, v, meta)

    def prefill_last(self, q, k, v, meta):
        return self.inner.prefill_last(q, k, v, meta)

    def prefill_paged(self, q, k_cache, v_cache, meta, last_only: bool = False):
        raise RuntimeError("a paged prefill (prefix caching, chunked prefill) does not support context parallelism: "
                           "each rank holds only its own pages")

    def _exchange(self, q):
        from flashdecode.distributed.exchange import StateExchange

        key = (q.shape[1], q.shape[2], q.dtype)
        if key not in self.exchanges:
            self.exchanges[key] = StateExchange(self.max_rows, q.shape[1], q.shape[2], q.dtype, q.device,
                                                group=self.group)
        return self.exchanges[key]

    def decode(self, q, k_cache, v_cache, meta):
        out, _ = self._exchange(q).merge_local(
            q.shape[0], lambda send: self.inner.decode_with_lse(q, k_cache, v_cache, meta, out=send))
        return out  # a view of the exchange's buffer: consumed by o_proj before the next layer's exchange
