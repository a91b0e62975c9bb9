"""``attn_backend="flashinfer"``: FlashInfer's paged attention (the serving kernels of vLLM and SGLang) as an engine
backend - a peer in the same engine, with the same weights, the same page pool and the same CUDA graphs.

    decode          BatchDecodeWithPagedKVCacheWrapper in CUDA-graph mode: one wrapper per (padded batch, sliding
                    window) with fixed indptr / indices / last_page_len buffers, planned once per step on the host,
                    outside the graph (ModelRunner.prepare_decode calls plan_decode), as vLLM and SGLang do; tensor
                    cores (FlashInfer's prefill kernel run as decode) when a kv head serves >= 4 query heads
                    (SGLang's rule for 16-bit pages)
    prefill         BatchPrefillWithRaggedKVCacheWrapper over the step's own K/V, causal
    prefill_last    the same with one query row per sequence (its last token; causal aligned bottom-right)
    prefill_paged   BatchPrefillWithPagedKVCacheWrapper: a chunk after a cached prefix or earlier chunks
    write_kv        the engine's (index_copy_ into the pool), as for every backend

Pages without a copy: the pool keeps each layer's K pages and V pages as two contiguous (num_pages + 1, page_size,
nheads_kv, head_dim) tensors (engine/kv_cache.py), FlashInfer's "NHD" layout, passed as a (k_cache, v_cache) tuple
(equal strides, as FlashInfer requires). FlashInfer's single-tensor form (num_pages, 2, page_size, nheads_kv,
head_dim) would need a page's K and V side by side, which this pool (all K, then all V) does not have.

Plans: each wrapper is planned from host-side lengths (indptr and last_page_len are host tensors; page indices are
sent with an asynchronous copy from pageable memory), so planning never waits for the device. FlashInfer stages
each plan through a pinned host buffer of the wrapper and an asynchronous copy, so a wrapper must not be planned
again before the device has run that copy: a prefill wrapper (one per kind, last-rows variant and window) is
planned once per forward, on its first layer (the others reuse the plan, keyed by the step's metadata object), and
the engine reads each prefill's logits before the next; ModelRunner plans a decode step before it records the
event that the next step's prepare_decode waits on.

What FlashInfer cannot do here raises ValueError naming the option (check_engine): a CPU device, float32 (dtype),
head dims other than 64 / 128 / 256, 8-bit pages (kv_cache_dtype: FlashInfer's fp8 pages take one scale per
tensor, ours one per token and kv head), batch_invariant, context parallelism. Sliding windows map to FlashInfer's
window_left (keys pos - window_left .. pos). The engine has no attention-logit softcap (config.py refuses models
with one), so none is passed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from flashdecode.engine.attention import AttentionBackend, AttentionMetadata
from flashdecode.engine.kv_quant import QuantPages

NAME = "flashinfer"
WORKSPACE_BYTES = 256 * 2**20  # the float workspace every wrapper shares (split-KV partial outputs); vLLM's size
TENSOR_CORE_MIN_GROUP = 4  # query heads per kv head from which decode runs on tensor cores (SGLang's rule)
HEAD_DIMS = (64, 128, 256)  # head dims of FlashInfer's prebuilt / JIT kernel families on every backend it picks
DTYPES = (torch.float16, torch.bfloat16)


def import_flashinfer():
    """The flashinfer module, or ImportError in one line saying how to get it."""
    try:
        import flashinfer
    except Exception as e:  # not installed, or its import fails (no CUDA toolkit, ABI mismatch): one line either way
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ImportError(f"attn_backend='flashinfer' needs the flashinfer package (pip install flashinfer-python), "
                          f"which cannot be imported here: {reason}") from None
    return flashinfer


def check_engine(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """ValueError naming the option when an engine with these settings cannot run on FlashInfer."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"attn_backend='flashinfer' needs a CUDA device, got device={str(device)!r}")
    if dtype not in DTYPES:
        raise ValueError(f"attn_backend='flashinfer' needs dtype float16 or bfloat16, got dtype={dtype}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"attn_backend='flashinfer' supports head_dim in {HEAD_DIMS}, the model has "
                         f"head_dim={head_dim}")


# ----------------------------------------------------------------------------------------------- host metadata
def paged_kv_lengths(kv_lens, page_size: int):
    """The lengths half of FlashInfer's paged-KV description: kv_lens (batch,) keys of each row (>= 0) -> int32
    numpy indptr (batch + 1,) (row b's pages are indices[indptr[b]:indptr[b + 1]]) and last_page_len (batch,) (keys
    on each row's last page, in 1..page_size; 0 for a row without keys)."""
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens must be one length per row, got shape {kv_lens.shape}")
    if (kv_lens < 0).any():
        raise ValueError(f"kv_lens must be >= 0, got {kv_lens.tolist()}")
    pages = -(-kv_lens // page_size)
    indptr = np.zeros(len(kv_lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    return indptr, (kv_lens - np.maximum(pages - 1, 0) * page_size).astype(np.int32)


def paged_kv_metadata(block_tables: np.ndarray, kv_lens, page_size: int):
    """FlashInfer's paged-KV description of a batch from our block tables: block_tables int32 (batch, width), row
    b's pages in order (entries past its last page are ignored), kv_lens (batch,) its keys. Returns int32 numpy
    indptr (batch + 1,), indices (indptr[-1],) = each row's pages, concatenated, and last_page_len (batch,)
    (paged_kv_lengths)."""
    if len(kv_lens) != block_tables.shape[0]:
        raise ValueError(f"kv_lens must have one entry per block-table row ({block_tables.shape[0]}), "
                         f"got {len(kv_lens)}")
    indptr, last_page_len = paged_kv_lengths(kv_lens, page_size)
    pages = np.diff(indptr)
    width = int(pages.max(initial=0))
    if width > block_tables.shape[1]:
        raise ValueError(f"a row needs {width} pages but block_tables has {block_tables.shape[1]} columns")
    indices = block_tables[:, :width][np.arange(width) < pages[:, None]].astype(np.int32)
    return indptr, indices, last_page_len


def page_gather_index(kv_lens, width: int, page_size: int) -> np.ndarray:
    """int64 positions, in a (batch, width) block table flattened, of each row's pages holding kv_lens[b] keys, in
    order: ``block_tables.view(-1)[index]`` is paged_kv_metadata's indices, gathered on the device (a paged
    prefill's block table lives there)."""
    pages = -(-np.asarray(kv_lens, dtype=np.int64) // page_size)
    rows, cols = np.nonzero(np.arange(width) < pages[:, None])
    return rows * width + cols


def indptr_of(lengths) -> torch.Tensor:
    """int32 host (len + 1,) running sums of the host ``lengths``: a packed batch's offsets, for a plan."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, out=out[1:])
    return out


# ----------------------------------------------------------------------------------------------- the backend
@dataclasses.dataclass
class _DecodeGeometry:
    """What a decode plan needs besides the step's lengths (the same for every layer of a window)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device


class _Shared:
    """What a backend and its sliding-window twins share: the workspace, the wrappers and the current plans."""

    def __init__(self):
        self.workspace: torch.Tensor | None = None
        # decode: batch -> {window_left: (wrapper, geometry)}; the step's host metadata per batch
        self.decode: dict[int, dict[int, tuple[object, _DecodeGeometry]]] = {}
        self.decode_meta: dict[int, tuple[torch.Tensor, np.ndarray, torch.Tensor]] = {}
        # prefill: (kind, last_only, window_left) -> (wrapper, the metadata it is planned for)
        self.prefill: dict[tuple[str, bool, int], tuple[object, AttentionMetadata | None]] = {}


class FlashInferBackend(AttentionBackend):
    """FlashInfer's paged decode and prefill wrappers behind the engine's attention interface (module docstring)."""

    name = NAME

    def __init__(self, window_left: int = -1):
        super().__init__(window_left)
        self._fi = import_flashinfer()
        self._shared = _Shared()

    @staticmethod
    def check_engine(device, dtype, model_config) -> None:
        check_engine(device, dtype, model_config.head_dim)

    # ------------------------------------------------------------------------------------------- wrappers
    def _workspace(self, device) -> torch.Tensor:
        shared = self._shared
        if shared.workspace is None:  # zeroed before its first use, as FlashInfer asks
            shared.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return shared.workspace

    def _prefill_wrapper(self, kind: str, last_only: bool, meta: AttentionMetadata, device):
        """(the ragged or paged prefill wrapper of this variant and window, made on first use; whether it still
        needs a plan for ``meta``). One wrapper per (kind, last_only, window) and plan per forward: a plan stages
        its schedule through the wrapper's pinned buffer with an asynchronous copy, so planning one wrapper twice
        in a forward (the layers' queries, then the last layer's last rows) could overwrite the first plan before
        the device has read it. Between forwards the engine has read the step's logits (a host sync)."""
        key = (kind, last_only, self.window_size[0])
        entry = self._shared.prefill.get(key)
        if entry is None:
            cls = (self._fi.BatchPrefillWithRaggedKVCacheWrapper if kind == "ragged"
                   else self._fi.BatchPrefillWithPagedKVCacheWrapper)
            entry = (cls(self._workspace(device), "NHD"), None)
        wrapper, planned = entry
        self._shared.prefill[key] = (wrapper, meta)
        return wrapper, planned is not meta

    # ------------------------------------------------------------------------------------------- prefill
    def _ragged(self, q, k, v, meta: AttentionMetadata, last_only: bool) -> torch.Tensor:
        wrapper, needs_plan = self._prefill_wrapper("ragged", last_only, meta, q.device)
        if needs_plan:
            kv_indptr = indptr_of(meta.seqlens)
            qo_indptr = torch.arange(len(meta.seqlens) + 1, dtype=torch.int32) if last_only else kv_indptr
            wrapper.plan(qo_indptr, kv_indptr, q.shape[1], k.shape[1], q.shape[2], causal=True,
                         window_left=self.window_size[0], q_data_type=q.dtype, kv_data_type=k.dtype)
        return wrapper.run(q, k, v)

    def prefill(self, q, k, v, meta):
        return self._ragged(q, k, v, meta, last_only=False)

    def prefill_last(self, q, k, v, meta):
        return self._ragged(q, k, v, meta, last_only=True)

    def prefill_paged(self, q, k_cache, v_cache, meta, last_only: bool = False):
        _refuse_quant_pages(k_cache)
        wrapper, needs_plan = self._prefill_wrapper("paged", last_only, meta, q.device)
        if needs_plan:
            page_size = k_cache.shape[1]
            kv_indptr, last_page_len = paged_kv_lengths(meta.seqlens_k, page_size)
            # the page indices gathered from the block table on the device (no copy back to the host)
            gather = page_gather_index(meta.seqlens_k, meta.block_tables.shape[1], page_size)
            indices = meta.block_tables.reshape(-1)[torch.from_numpy(gather).to(q.device, non_blocking=True)]
            qo_indptr = (torch.arange(len(meta.seqlens_k) + 1, dtype=torch.int32) if last_only
                         else indptr_of(meta.seqlens))
            wrapper.plan(qo_indptr, torch.from_numpy(kv_indptr), indices, torch.from_numpy(last_page_len),
                         q.shape[1], k_cache.shape[2], q.shape[2], page_size, causal=True,
                         window_left=self.window_size[0], q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        return wrapper.run(q, (k_cache, v_cache))

    # ------------------------------------------------------------------------------------------- decode
    def plan_decode(self, batch: int, context_lens: np.ndarray, block_tables: np.ndarray, page_size: int) -> None:
        """Plan this step's decode: context_lens (batch,) keys per row incl. the new token, block_tables int32
        (batch, width) host copies of what the step reads. Plans every decode wrapper of this batch (one per
        window); a wrapper made later in the step (decode()) is planned from what is kept here."""
        indptr, indices, last_page_len = paged_kv_metadata(block_tables, context_lens, page_size)
        step = (torch.from_numpy(indptr), indices, torch.from_numpy(last_page_len))
        self._shared.decode_meta[batch] = step
        for window, (wrapper, geometry) in self._shared.decode.get(batch, {}).items():
            self._plan_decode_wrapper(wrapper, geometry, window, step)

    def _plan_decode_wrapper(self, wrapper, g: _DecodeGeometry, window: int, step) -> None:
        indptr, indices, last_page_len = step
        # pageable host memory: the copy is staged at once (no wait for the device, nothing to keep alive)
        dev_indices = torch.from_numpy(indices).to(g.device, non_blocking=True)
        wrapper.plan(indptr, dev_indices, last_page_len, g.num_qo_heads, g.num_kv_heads, g.head_dim, g.page_size,
                     window_left=window, q_data_type=g.q_dtype, kv_data_type=g.kv_dtype)

    def _decode_wrapper(self, q, k_cache, meta: AttentionMetadata):
        """The CUDA-graph-mode decode wrapper of this (batch, window), made and planned on its first call (the
        warm-up before a graph capture, or the first eager step of the batch)."""
        batch, window = q.shape[0], self.window_size[0]
        entry = self._shared.decode.setdefault(batch, {}).get(window)
        if entry is not None:
            return entry[0]
        step = self._shared.decode_meta.get(batch)
        if step is None:
            raise RuntimeError(f"attention backend 'flashinfer': decode of batch {batch} before plan_decode (the "
                               f"runner plans each decode step before launching it)")
        nheads, nheads_kv = q.shape[1], k_cache.shape[2]
        dev = q.device
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace(dev), "NHD", use_cuda_graph=True,
            use_tensor_cores=nheads // nheads_kv >= TENSOR_CORE_MIN_GROUP,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(batch * meta.block_tables.shape[1], dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=dev))
        geometry = _DecodeGeometry(nheads, nheads_kv, q.shape[2], k_cache.shape[1], q.dtype, k_cache.dtype, dev)
        self._plan_decode_wrapper(wrapper, geometry, window, step)
        self._shared.decode[batch][window] = (wrapper, geometry)
        return wrapper

    def decode(self, q, k_cache, v_cache, meta):
        _refuse_quant_pages(k_cache)
        return self._decode_wrapper(q, k_cache, meta).run(q, (k_cache, v_cache))


def _refuse_quant_pages(k_cache) -> None:
    if isinstance(k_cache, QuantPages):
        raise ValueError("attn_backend='flashinfer' does not read 8-bit pages (kv_cache_dtype must be 'auto'): "
                         "FlashInfer's fp8 pages take one scale per tensor, the engine's one per token and kv head")
