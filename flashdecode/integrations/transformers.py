"""A transformers attention backend on flashdecode's kernels.

    from flashdecode.integrations.transformers import register
    name = register()                      # "fd_attention"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

``register`` adds an attention function to transformers' AttentionInterface and a mask function to its
AttentionMaskInterface under a name without "flash" (transformers 5 treats names containing "flash" as Hub kernels
to download).

One metadata build per step: transformers calls the mask function once per forward step (per layer type) and hands
its result to every layer, so what the layers share is built there. It returns None when every key position holds a
token; for a decode step otherwise a step table (int32 (1, 1, 1, n): the sequences' lengths where each row's valid
keys are a prefix of the cache - no padding, right padding, a StaticCache's tokens seen - or a block table of the
valid positions); for several query tokens the 2-D boolean padding mask (batch, kv_len), whose host facts (all
valid, or the unpadding indices) the step's first layer reads once and the other layers find by the mask's identity.
No layer syncs the host; a decode step's mask is read on the host once in the mask function (as transformers' own
SDPA mask is), never while torch.compile traces. Then:

  - several query tokens (prefill, chunked prefill, training): without padding, flashdecode.flash_attn on the
    keys the cache holds (copied into the heads-packed layout where the sm_90 dispatch then takes the Gluon kernel,
    else strided views of transformers' (batch, heads, seqlen, headdim) tensors); with padding (left or right), the
    valid tokens are gathered ("unpadded") and run through flashdecode.flash_attn_varlen, and the output is
    scattered back with zeros on padded query rows. Differentiable.
  - one query token (generation): flashdecode.flash_decode reads transformers' own cache tensors (DynamicCache,
    StaticCache) in place: as a contiguous cache with the step's lengths, or, where padding is not a suffix (left
    padding), as pages of one token through the step's block table (no copy of the cache; the kernels then gather
    keys one by one, slower on the GPU than the contiguous read).
  - causal masks are bottom-right aligned (the query rows are the last rows of the keys), sliding windows
    (sliding_window = w -> window (w - 1, 0)), softcap and attention sinks (``s_aux``, GPT-OSS) are supported.
  - under torch.compile (e.g. a StaticCache decode step, fullgraph=True, mode="reduce-overhead") the attention is
    one torch.library op (flashdecode_transformers::attention, with a fake implementation), so tracing has no graph
    break; generate builds a StaticCache step's mask before the compiled forward, and the step table's shape
    depends only on the batch and the cache length, so every decode step replays one graph. That op has no
    autograd formula: compiled training is not supported (eager training is: prefill is differentiable); a compiled
    prefill of a padded batch reads the mask on the host (not capturable in a CUDA graph).

Not supported (ValueError): dropout > 0, 4-D / custom masks (an attention_mask that is not 2-D boolean padding).
``output_attentions`` returns None for the weights, like transformers' flash-attention backends.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdecode.ops.attention import flash_attn, flash_attn_varlen, flash_attn_varlen_with_sinks, flash_attn_with_sinks
from flashdecode.ops.decode import flash_decode
from flashdecode.ops.sinks import apply_sinks
from flashdecode.ops.util import call_scoped_buffers, keeps_nothing

__all__ = ["NAME", "register", "attention_forward", "padding_mask"]

NAME = "fd_attention"


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=None, attention_mask: Optional[torch.Tensor] = None, device=None, config=None,
                 **kwargs):
    """transformers mask interface, called once per forward step (per layer type) before the layers run: what every
    layer's attention reads of the step's keys (module doc, "One metadata build per step").

    Returns None when every key position [0, kv_length) holds a token (but never for a StaticCache's decode step,
    see below); for a decode step (q_length 1) otherwise a step table (int32 (1, 1, 1, n), see "the decode step
    table" below); for several query tokens the 2-D boolean padding mask (batch, L <= kv_length) whose last
    q_length positions are the queries (the attention reads keys [0, L)).

    attention_mask is cut to its last kv_length positions (sliding-window layers keep only those). Without an
    attention_mask, a cache longer than the tokens seen (StaticCache: q_offset is a device tensor) holds
    q_offset + q_length tokens. Outside torch.compile a decode step's mask is read on the host once (one sync a step,
    as transformers' SDPA mask does): a mask whose valid keys are a prefix of each row (no padding, or right
    padding) gives the step table of lengths, which the decode reads as a contiguous cache; other masks give the
    table of valid positions (one-token pages). While torch.compile traces, the mask cannot be read: decode steps
    get the positions table, computed in the graph."""
    if q_length == 1:
        return _decode_step_table(batch_size, kv_length, q_offset, kv_offset, attention_mask, device, config)
    if attention_mask is None:
        if kv_offset != 0 or (not isinstance(q_offset, torch.Tensor) and q_offset + q_length >= kv_length):
            return None
        if not isinstance(q_offset, torch.Tensor):
            return torch.ones(batch_size, q_offset + q_length, dtype=torch.bool, device=device)
        if not torch.compiler.is_compiling():
            return torch.ones(batch_size, int(q_offset) + q_length, dtype=torch.bool, device=q_offset.device)
        raise ValueError(f"the {NAME} attention needs an attention_mask for a compiled forward of several tokens "
                         "on a cache longer than the tokens seen (StaticCache)")
    attention_mask = attention_mask[:, -kv_length:]
    # (while torch.compile traces, the mask is kept: testing it would read it on the host, a graph break)
    if not torch.compiler.is_compiling() and attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


# ---------------------------------------------------------------------------------------------------------------
# One metadata build per step: the decode step table
# ---------------------------------------------------------------------------------------------------------------
# A decode step's table is an int32 tensor of shape (1, 1, 1, n) that transformers hands every layer as its
# attention_mask (4-D, so a mask built ahead of the forward - generate's StaticCache path - passes through
# create_causal_mask untouched). Two forms, told apart by n (batch b; the cache's kv heads hk and length s):
#   n == b                   lengths: sequence i's tokens are the cache positions [0, n_i) (a contiguous read)
#   n == b * hk * (1 + s)    positions: b * hk lengths, then a (b * hk, s) block table over one-token pages, page
#                            (i * hk + j) * s + t holding token t of kv head j of sequence i, valid positions first
# Its shape depends on the batch and the cache's length only, so a StaticCache's compiled decode step keeps one
# graph for every step. A StaticCache's step (q_offset, the tokens seen, a device tensor) gets a table even where
# every position holds a token (the step that fills the cache): a None there would drop attention_mask from the
# compiled forward's inputs and compile it again (transformers 5.17 hands generate's 2-D mask of the tokens seen
# to the mask function, so the last step of a generation that fills its cache is such a step).


def _decode_step_table(batch: int, kv_length: int, q_offset, kv_offset: int, attention_mask, device, config):
    """padding_mask of a decode step: None or a step table (see above)."""
    if attention_mask is None:
        if kv_offset != 0 or (not isinstance(q_offset, torch.Tensor) and q_offset + 1 >= kv_length):
            return None
        seen = q_offset + 1  # tokens in the cache after this step's (a device tensor for a StaticCache)
        if isinstance(seen, torch.Tensor):
            return seen.to(torch.int32).reshape(1, 1, 1, 1).expand(1, 1, 1, batch).contiguous()
        return torch.full((1, 1, 1, batch), seen, dtype=torch.int32, device=device)
    mask = _fit_mask(attention_mask, kv_length)
    if not torch.compiler.is_compiling():
        # one host read a step: is each row its valid keys then padding (a prefix), and is every key valid
        prefix, full = torch.stack([(mask[:, 1:] <= mask[:, :-1]).all(), mask.all()]).tolist()
        if full and not isinstance(q_offset, torch.Tensor):
            return None
        if prefix:
            return mask.sum(1, dtype=torch.int32).view(1, 1, 1, batch)
    heads_kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    if not isinstance(heads_kv, int):
        return mask  # the layers build the positions table each (no kv head count to build it once)
    return _positions_table(mask, heads_kv)


def _fit_mask(attention_mask: torch.Tensor, kv_length: int) -> torch.Tensor:
    """The 2-D padding mask over the cache's kv_length positions: its last kv_length, or padded with False (a
    StaticCache's positions beyond the tokens seen)."""
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if mask.shape[1] < kv_length:
        mask = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[1]))
    return mask


def _positions_table(mask: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """The positions step table of bool mask (b, s) for a cache of heads_kv kv heads and s positions."""
    b, s = mask.shape
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices  # valid positions first, in order
    base = torch.arange(b * heads_kv, device=mask.device, dtype=torch.int64).view(b, heads_kv, 1) * s
    table = (base + order.view(b, 1, s)).view(b * heads_kv, s).to(torch.int32)
    lens = mask.sum(1, dtype=torch.int32).repeat_interleave(heads_kv)
    return torch.cat([lens, table.view(-1)]).view(1, 1, 1, -1)


def _read_step_table(table: torch.Tensor, batch: int, heads_kv: int, length: int):
    """(lengths int32 (rows,), block table int32 (rows, length) or None) of a step table: rows = batch for the
    lengths form (no block table), batch * heads_kv for the positions form."""
    n = table.shape[-1]
    flat = table.view(n)
    if n == batch:
        return flat, None
    rows = batch * heads_kv
    if n == rows * (1 + length):
        return flat[:rows], flat[rows:].view(rows, length)
    raise ValueError(f"the {NAME} attention's step table holds {n} entries: neither the batch ({batch}) nor a "
                     f"positions table of {rows} rows over {length} cache positions (a layer whose kv heads or cache "
                     "length differ from the mask's; build the mask for this layer)")


def _step_table_as_mask(table: torch.Tensor, batch: int, heads_kv: int, length: int) -> torch.Tensor:
    """The 2-D boolean padding mask (batch, length) a step table stands for (a step table reaching the prefill
    path: a single bidirectional query)."""
    lens, positions = _read_step_table(table, batch, heads_kv, length)
    keys = torch.arange(length, device=table.device)
    if positions is None:
        return keys.view(1, length) < lens.view(batch, 1)
    rows = torch.arange(batch, device=table.device).view(batch, 1) * (heads_kv * length)
    order = positions.view(batch, heads_kv, length)[:, 0].long() - rows  # kv head 0's positions, valid first
    valid = keys.view(1, length) < lens.view(batch, heads_kv)[:, :1]
    mask = torch.zeros(batch, length, dtype=torch.bool, device=table.device)
    return mask.scatter(1, order, valid)


def _window(sliding_window: Optional[int]):
    """transformers' sliding_window w (a query sees itself and w - 1 keys before it) as flashdecode's (left, -1)."""
    if sliding_window is None:
        return (-1, -1)
    if int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return (int(sliding_window) - 1, -1)


def _decode(q, key, value, mask, scale, window, softcap, sinks):
    """One query token per sequence. q (b, 1, h, d); key/value transformers' (b, hk, s, d) cache tensors; mask None
    (every cache position holds a token), a step table (int32 (1, 1, 1, n), the step's shared metadata) or a bool
    padding mask (b, L <= s) (then this layer builds the positions table itself). Returns out (b, 1, h, d)."""
    b, _, h, d = q.shape
    hk, s = key.shape[1], key.shape[2]
    if mask is None:
        lens, table = _full_lengths(b, s, q.device), None
    else:
        if mask.dtype == torch.bool:
            mask = _positions_table(_fit_mask(mask, s), hk)
        lens, table = _read_step_table(mask, b, hk, s)
    kw = dict(softmax_scale=scale, softcap=softcap, window_size=window)
    if table is None:
        # every layer of a step passes the same lengths, and flash_decode keeps its checks and config per metadata
        # (ops/decode_host.py), with a DynamicCache's growing length in its capacity bucket: the generation's first
        # step of a bucket builds both, every other call only launches
        k_cache, v_cache = key.transpose(1, 2), value.transpose(1, 2)  # (b, s, hk, d) views
        if k_cache.stride() != v_cache.stride():
            k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
        q_rows = q[:, 0]
        if sinks is None:  # no lse to hand back
            return flash_decode(q_rows, k_cache, v_cache, lens, max_seqlen_k=s, **kw).unsqueeze(1)
        out, lse = flash_decode(q_rows, k_cache, v_cache, lens, max_seqlen_k=s, return_lse=True, **kw)
    else:
        # each (sequence, kv head) is its own sequence of one-token pages (the step table's block table lists its
        # valid tokens in order, so padding is skipped without copying the cache), and GQA becomes the group of q
        # heads per (sequence, kv head)
        pages_k, pages_v = (x.contiguous().view(b * hk * s, 1, 1, d) for x in (key, value))
        q_rows = q[:, 0].reshape(b * hk, h // hk, d)
        out, lse = flash_decode(q_rows, pages_k, pages_v, lens, block_table=table, max_seqlen_k=s, return_lse=True,
                                **kw)
        out, lse = out.view(b, h, d), lse.view(b, h)
        if sinks is None:
            return out.unsqueeze(1)
    out, _ = apply_sinks(out, lse, sinks, "decode")
    return out.unsqueeze(1)


_LENGTHS: dict = {}  # (device, batch, length) -> int32 (batch,) filled with length; never written after


def _full_lengths(batch: int, length: int, device) -> torch.Tensor:
    """An int32 (batch,) tensor of ``length`` on ``device``, made once per (batch, length) and shared by the layers
    of a step (made anew while a CUDA graph is captured or inside the compiled op: a tensor of a graph's pool is
    not kept)."""
    key = (device, batch, length)
    lens = _LENGTHS.get(key)
    if lens is None:
        lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        if keeps_nothing(device):
            return lens
        if len(_LENGTHS) >= 64:
            _LENGTHS.clear()
        _LENGTHS[key] = lens
    return lens


# ---------------------------------------------------------------------------------------------------------------
# Prefill: the padding mask's host facts, read once per step
# ---------------------------------------------------------------------------------------------------------------

class _PrefillRows:
    """What a prefill step's layers need of its bool padding mask (b, L), read on the host once (by the step's first
    layer): whether every position is valid (then the keys are the cache's first L positions, no unpadding), else
    the valid tokens' flat indices (int64), int32 cu_seqlens (b + 1,) and longest length, of the queries (the last
    seqlen_q positions) and of the keys."""

    __slots__ = ("all_valid", "q_index", "cu_q", "max_q", "k_index", "cu_k", "max_k")

    def __init__(self, mask: torch.Tensor, seqlen_q: int):
        self.all_valid = bool(mask.all())
        if not self.all_valid:
            self.q_index, self.cu_q, self.max_q = _valid_tokens(mask[:, -seqlen_q:])
            self.k_index, self.cu_k, self.max_k = _valid_tokens(mask)


def _valid_tokens(mask: torch.Tensor):
    """bool mask (b, s) -> (flat indices (n,) int64 of its True entries, int32 cu_seqlens (b + 1,), longest row)."""
    lens = mask.sum(1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    return mask.flatten().nonzero().flatten(), cu, int(lens.max())


_STEP_MASKS: dict = {}  # (id(mask), seqlen_q) -> (mask, its version, _PrefillRows); a handful of steps


def _prefill_rows(mask: torch.Tensor, seqlen_q: int) -> _PrefillRows:
    """The _PrefillRows of ``mask``, shared by the layers of a step: transformers hands every layer the same mask
    tensor, so the step's first layer reads it and the others find it here by identity (and version: a mask
    written in place is read again). Not kept while a CUDA graph is captured nor inside the compiled op (nothing of
    a graph's pool is)."""
    version = getattr(mask, "_version", -1) if not mask.is_inference() else -1
    key = (id(mask), seqlen_q)
    entry = _STEP_MASKS.get(key)
    if entry is not None and entry[0] is mask and entry[1] == version:
        return entry[2]
    rows = _PrefillRows(mask, seqlen_q)
    if not keeps_nothing(mask.device):
        if len(_STEP_MASKS) >= 8:
            _STEP_MASKS.clear()
        _STEP_MASKS[key] = (mask, version, rows)
    return rows


_GLUON_COPY: dict = {}  # call shape -> whether the keys are copied into the Gluon kernel's layout


def _dense_layout(q, k, v, causal: bool, window, softcap: float):
    """q (b, sq, h, d), k/v (b, sk, hk, d) strided views, or contiguous copies of k and v (and q) where the sm_90
    dispatch sends the contiguous call to the Gluon kernel but not these views: transformers' caches are (b, hk,
    s, d), whose keys are not heads-packed rows a TMA descriptor reads. The copies cost a pass over K/V; the Gluon
    kernel's prefill is 1.08-2.25x the Triton kernel's on the shapes it takes (gluon_attention.gluon_pays)."""
    if not q.is_cuda:
        return q, k, v
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, causal, window, softcap)
    copy = _GLUON_COPY.get(key)
    if copy is None:
        from flashdecode.ops import gluon_attention

        left, right = window[0], (0 if causal else window[1])
        probes = [_contiguous_probe(x) for x in (q, k, v)]
        copy = (gluon_attention.dispatch_plan(*probes, left, right, softcap) is not None
                and gluon_attention.dispatch_plan(q, k, v, left, right, softcap) is None)
        if len(_GLUON_COPY) >= 256:
            _GLUON_COPY.clear()
        _GLUON_COPY[key] = copy
    if not copy:
        return q, k, v
    return q.contiguous(), k.contiguous(), v.contiguous()


def _contiguous_probe(x: torch.Tensor) -> torch.Tensor:
    """A tensor of x's shape, dtype and device with contiguous strides, for asking the dispatch about that layout
    (never read): x's own storage read as contiguous where it is large enough, else a new one."""
    strides = torch.empty(x.shape, device="meta").stride()
    if x.storage_offset() + x.numel() <= x.untyped_storage().nbytes() // x.element_size():
        return x.as_strided(x.shape, strides)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _prefill(q, key, value, mask, causal, scale, window, softcap, sinks):
    """Several query tokens. q (b, sq, h, d); key/value (b, hk, s, d); mask None or bool (b, L), L <= s, whose last
    sq positions are the queries. Returns out (b, sq, h, d)."""
    b, sq, h, d = q.shape
    kw = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)
    rows = None if mask is None else _prefill_rows(mask, sq)
    if rows is None or rows.all_valid:
        length = key.shape[2] if mask is None else mask.shape[1]  # the keys: the cache's first positions
        k, v = key[:, :, :length].transpose(1, 2), value[:, :, :length].transpose(1, 2)
        q, k, v = _dense_layout(q, k, v, causal, tuple(window), softcap)
        if sinks is not None:
            return flash_attn_with_sinks(q, k, v, sinks, **kw)
        return flash_attn(q, k, v, **kw)
    length = mask.shape[1]
    k, v = key[:, :, :length].transpose(1, 2), value[:, :, :length].transpose(1, 2)
    q_flat = q.reshape(-1, h, d).index_select(0, rows.q_index)
    k_flat, v_flat = (x.reshape(-1, *x.shape[2:]).index_select(0, rows.k_index) for x in (k, v))
    args = (q_flat, k_flat, v_flat, rows.cu_q, rows.cu_k, rows.max_q, rows.max_k)
    if sinks is not None:
        out_flat = flash_attn_varlen_with_sinks(*args, sinks, **kw)
    else:
        out_flat = flash_attn_varlen(*args, **kw)
    out = out_flat.new_zeros(b * sq, h, d).index_copy(0, rows.q_index, out_flat)
    return out.view(b, sq, h, d)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None, **kwargs):
    """transformers attention function.

    Args:
        query: (batch, nheads, seqlen_q, headdim); key, value: (batch, nheads_kv, seqlen_k, headdim) (the cache
            contents after this step's update); float16 / bfloat16 / float32.
        attention_mask: what ``padding_mask`` returned: None, bool (batch, L <= seqlen_k), or a decode step table
            (int32 (1, 1, 1, n)).
        scaling, sliding_window, softcap, is_causal (default module.is_causal), s_aux (nheads,) sink logits.
    Returns:
        (out (batch, seqlen_q, nheads, headdim), None).
    """
    if dropout:
        raise ValueError(f"dropout={dropout} is not supported by the {NAME} attention (no attention dropout)")
    if attention_mask is not None and not _our_mask(attention_mask):
        raise ValueError(f"the {NAME} attention takes its own mask function's masks (a 2-D boolean padding mask or "
                         f"an int32 step table), got attention_mask of shape {tuple(attention_mask.shape)} and dtype "
                         f"{attention_mask.dtype}")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    dtype = value.dtype
    left = _window(sliding_window)[0]
    args = (query.to(dtype), key.to(dtype), value, attention_mask, causal, scaling, left, float(softcap or 0.0), s_aux)
    if torch.compiler.is_compiling():
        # one opaque node for torch.compile (the launchers' host-side logic would break the graph); forward only
        return torch.ops.flashdecode_transformers.attention(*args), None
    return _attention(*args), None


def _our_mask(mask: torch.Tensor) -> bool:
    """A 2-D boolean padding mask, or a step table (int32 (1, 1, 1, n))."""
    if mask.dtype == torch.bool:
        return mask.dim() == 2
    return mask.dtype == torch.int32 and mask.dim() == 4 and tuple(mask.shape[:3]) == (1, 1, 1)


def _attention(query, key, value, mask, causal, scale, window_left, softcap, sinks):
    """query (b, h, sq, d), key/value (b, hk, s, d), mask None, bool (b, L) or a step table -> out (b, sq, h, d)."""
    q = query.transpose(1, 2)  # (b, sq, h, d) view
    if q.shape[1] == 1 and causal:
        return _decode(q, key, value, mask, scale, (window_left, -1), softcap, sinks)
    if mask is not None and mask.dtype != torch.bool:  # a step table on the prefill path (one bidirectional query)
        mask = _step_table_as_mask(mask, q.shape[0], key.shape[1], key.shape[2])
    # transformers' windows are symmetric for bidirectional layers
    window = (window_left, 0 if causal else window_left)
    return _prefill(q, key, value, mask, causal, scale, window, softcap, sinks)


@torch.library.custom_op("flashdecode_transformers::attention", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                  causal: bool, scale: Optional[float], window_left: int, softcap: float,
                  sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """_attention as a torch.library op, so torch.compile traces the attention as one node (no graph break). Its
    body runs while the compiled graph runs - inside a cudagraph tree's warmup (whose allocations come from the
    graph's memory pool, which must hold nothing the graph does not return) and capture - so it keeps no tensor it
    makes (util.call_scoped_buffers: the decode workspace is the call's own, no cache or pool grows)."""
    with call_scoped_buffers():
        return _attention(query, key, value, mask, causal, scale, window_left, softcap, sinks).contiguous()


@_attention_op.register_fake
def _attention_fake(query, key, value, mask, causal, scale, window_left, softcap, sinks):
    b, h, sq, d = query.shape
    return query.new_empty((b, sq, h, d))


def register(name: str = NAME) -> str:
    """Register ``attention_forward`` and ``padding_mask`` with transformers under ``name`` (no "flash" in it) and
    return the name, for ``attn_implementation=name``."""
    if "flash" in name:
        raise ValueError(f"name must not contain 'flash' (transformers 5 would load it as a Hub kernel), got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name
