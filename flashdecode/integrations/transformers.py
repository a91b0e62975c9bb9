"""A transformers attention backend on flashdecode's kernels.

    from flashdecode.integrations.transformers import register
    name = register()                      # "fd_attention"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

``register`` adds an attention function to transformers' AttentionInterface and a mask function to its
AttentionMaskInterface under a name without "flash" (transformers 5 treats names containing "flash" as Hub kernels
to download). The mask function hands the attention function the 2-D boolean padding mask (batch, kv_len), or
None when nothing is padded - the same contract as transformers' own flash-attention backends. Then:

  - several query tokens (prefill, chunked prefill, training): without padding, flashdecode.flash_attn on strided
    views of transformers' (batch, heads, seqlen, headdim) tensors (no copies); with padding (left or right), the
    valid tokens are gathered ("unpadded") and run through flashdecode.flash_attn_varlen, and the output is
    scattered back with zeros on padded query rows. Differentiable.
  - one query token (generation): flashdecode.flash_decode reads transformers' own cache tensors (DynamicCache,
    StaticCache) in place. Without padding it reads them as a contiguous cache; with padding it reads them as
    pages of one token through a block table that lists each sequence's valid positions (so left-padded batches
    need no copy of the cache; the kernels then gather keys one by one, slower on the GPU than the contiguous
    read of unpadded batches).
  - causal masks are bottom-right aligned (the query rows are the last rows of the keys), sliding windows
    (sliding_window = w -> window (w - 1, 0)), softcap and attention sinks (``s_aux``, GPT-OSS) are supported.
  - under torch.compile (e.g. a StaticCache decode step, fullgraph=True) the attention is one torch.library op
    (flashdecode_transformers::attention, with a fake implementation), so tracing has no graph break; that op has
    no autograd formula: compiled training is not supported (eager training is: prefill is differentiable).

Not supported (ValueError): dropout > 0, 4-D / custom masks (an attention_mask that is not 2-D boolean padding).
``output_attentions`` returns None for the weights, like transformers' flash-attention backends.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdecode.ops.attention import flash_attn, flash_attn_varlen, flash_attn_varlen_with_sinks, flash_attn_with_sinks
from flashdecode.ops.decode import flash_decode
from flashdecode.ops.sinks import apply_sinks

__all__ = ["NAME", "register", "attention_forward", "padding_mask"]

NAME = "fd_attention"


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=None, attention_mask: Optional[torch.Tensor] = None, device=None, **kwargs):
    """transformers mask interface: the 2-D boolean padding mask (batch, L <= kv_length), or None when every key
    position holds a token. The attention reads keys [0, L) and takes the last q_length of them as the queries.

    attention_mask is cut to its last kv_length positions (sliding-window layers keep only those); one shorter
    than kv_length (StaticCache: the cache is longer than the tokens seen) is returned as is. Without an
    attention_mask, a cache that starts at position 0 and is longer than the tokens seen (StaticCache, whose
    q_offset is a device tensor) gets an all-True mask of its q_offset + q_length positions in use; while
    torch.compile traces, that length cannot be read, so the mask spans kv_length with the unused tail False,
    which only the one-token (decode) path can take."""
    if attention_mask is None:
        if kv_offset != 0 or (not isinstance(q_offset, torch.Tensor) and q_offset + q_length >= kv_length):
            return None
        if not isinstance(q_offset, torch.Tensor):
            return torch.ones(batch_size, q_offset + q_length, dtype=torch.bool, device=device)
        if not torch.compiler.is_compiling():
            return torch.ones(batch_size, int(q_offset) + q_length, dtype=torch.bool, device=q_offset.device)
        if q_length > 1:
            raise ValueError(f"the {NAME} attention needs an attention_mask for a compiled forward of several tokens "
                             "on a cache longer than the tokens seen (StaticCache)")
        in_use = torch.arange(kv_length, device=q_offset.device) < q_offset + q_length
        return in_use.expand(batch_size, kv_length)
    attention_mask = attention_mask[:, -kv_length:]
    # (while torch.compile traces, the mask is kept: testing it would read it on the host, a graph break)
    if not torch.compiler.is_compiling() and attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _window(sliding_window: Optional[int]):
    """transformers' sliding_window w (a query sees itself and w - 1 keys before it) as flashdecode's (left, -1)."""
    if sliding_window is None:
        return (-1, -1)
    if int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return (int(sliding_window) - 1, -1)


def _decode(q, key, value, mask, scale, window, softcap, sinks):
    """One query token per sequence. q (b, 1, h, d); key/value transformers' (b, hk, s, d) cache tensors; mask
    None or bool (b, L), L <= s. Returns out (b, 1, h, d)."""
    b, _, h, d = q.shape
    hk, s = key.shape[1], key.shape[2]
    kw = dict(softmax_scale=scale, softcap=softcap, window_size=window, return_lse=True)
    if mask is None:
        k_cache, v_cache = key.transpose(1, 2), value.transpose(1, 2)  # (b, s, hk, d) views
        if k_cache.stride() != v_cache.stride():
            k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
        # every layer of a step reads the same lengths, and flash_decode keeps its checks and config per metadata
        # (ops/decode_host.py): the step's first layer builds both, the others only launch
        lens = _full_lengths(b, s, q.device)
        if sinks is None:  # no lse to hand back
            out = flash_decode(q[:, 0], k_cache, v_cache, lens, max_seqlen_k=s, softmax_scale=scale, softcap=softcap,
                               window_size=window)
            return out.unsqueeze(1)
        out, lse = flash_decode(q[:, 0], k_cache, v_cache, lens, max_seqlen_k=s, **kw)
    else:
        # each (sequence, kv head) is its own sequence of one-token pages: page (i * hk + j) * s + t holds token t
        # of kv head j of sequence i; its block-table row lists the valid tokens in order, so padding is skipped
        # without copying the cache, and GQA becomes the group of q heads per (sequence, kv head)
        pages_k, pages_v = (x.contiguous().view(b * hk * s, 1, 1, d) for x in (key, value))
        length = mask.shape[1]
        order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices  # valid positions first, in order
        base = torch.arange(b * hk, device=q.device, dtype=torch.int64).view(b, hk, 1) * s
        table = (base + order.view(b, 1, length)).view(b * hk, length).to(torch.int32)
        lens = mask.sum(1, dtype=torch.int32).repeat_interleave(hk)
        q_rows = q[:, 0].reshape(b * hk, h // hk, d)
        out, lse = flash_decode(q_rows, pages_k, pages_v, lens, block_table=table, max_seqlen_k=length, **kw)
        out, lse = out.view(b, h, d), lse.view(b, h)
    if sinks is not None:
        out, _ = apply_sinks(out, lse, sinks, "decode")
    return out.unsqueeze(1)


_LENGTHS: dict = {}  # (device, batch, length) -> int32 (batch,) filled with length; never written after


def _full_lengths(batch: int, length: int, device) -> torch.Tensor:
    """An int32 (batch,) tensor of ``length`` on ``device``, made once per (batch, length) and shared by the layers
    of a step (made anew while a CUDA graph is captured: a tensor of the graph's pool is not kept)."""
    key = (device, batch, length)
    lens = _LENGTHS.get(key)
    if lens is None:
        lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return lens
        if len(_LENGTHS) >= 64:
            _LENGTHS.clear()
        _LENGTHS[key] = lens
    return lens


def _unpad(x, mask):
    """x (b, s, heads, d) and bool mask (b, s) -> (valid tokens (n, heads, d), flat indices (n,) int64, int32
    cu_seqlens (b + 1,), longest length). Reads the mask on the host (prefill only)."""
    lens = mask.sum(1, dtype=torch.int32)
    indices = mask.flatten().nonzero().flatten()
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    return x.reshape(-1, *x.shape[2:]).index_select(0, indices), indices, cu, int(lens.max())


def _prefill(q, key, value, mask, causal, scale, window, softcap, sinks):
    """Several query tokens. q (b, sq, h, d); key/value (b, hk, s, d); mask None or bool (b, L), L <= s, whose last
    sq positions are the queries. Returns out (b, sq, h, d)."""
    b, sq, h, d = q.shape
    kw = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)
    if mask is None:
        k, v = key.transpose(1, 2), value.transpose(1, 2)
        if sinks is not None:
            return flash_attn_with_sinks(q, k, v, sinks, **kw)
        return flash_attn(q, k, v, **kw)
    length = mask.shape[1]
    k, v = key[:, :, :length].transpose(1, 2), value[:, :, :length].transpose(1, 2)
    q_flat, q_idx, cu_q, max_q = _unpad(q, mask[:, -sq:])
    k_flat, _, cu_k, max_k = _unpad(k, mask)
    v_flat = v.reshape(-1, *v.shape[2:]).index_select(0, mask.flatten().nonzero().flatten())
    if sinks is not None:
        out_flat = flash_attn_varlen_with_sinks(q_flat, k_flat, v_flat, cu_q, cu_k, max_q, max_k, sinks, **kw)
    else:
        out_flat = flash_attn_varlen(q_flat, k_flat, v_flat, cu_q, cu_k, max_q, max_k, **kw)
    out = out_flat.new_zeros(b * sq, h, d).index_copy(0, q_idx, out_flat)
    return out.view(b, sq, h, d)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None, **kwargs):
    """transformers attention function.

    Args:
        query: (batch, nheads, seqlen_q, headdim); key, value: (batch, nheads_kv, seqlen_k, headdim) (the cache
            contents after this step's update); float16 / bfloat16 / float32.
        attention_mask: None or bool (batch, L <= seqlen_k) from ``padding_mask``.
        scaling, sliding_window, softcap, is_causal (default module.is_causal), s_aux (nheads,) sink logits.
    Returns:
        (out (batch, seqlen_q, nheads, headdim), None).
    """
    if dropout:
        raise ValueError(f"dropout={dropout} is not supported by the {NAME} attention (no attention dropout)")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.dtype != torch.bool):
        raise ValueError(f"the {NAME} attention takes a 2-D boolean padding mask, got attention_mask of shape "
                         f"{tuple(attention_mask.shape)} and dtype {attention_mask.dtype}")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    dtype = value.dtype
    left = _window(sliding_window)[0]
    args = (query.to(dtype), key.to(dtype), value, attention_mask, causal, scaling, left, float(softcap or 0.0), s_aux)
    if torch.compiler.is_compiling():
        # one opaque node for torch.compile (the launchers' host-side logic would break the graph); forward only
        return torch.ops.flashdecode_transformers.attention(*args), None
    return _attention(*args), None


def _attention(query, key, value, mask, causal, scale, window_left, softcap, sinks):
    """query (b, h, sq, d), key/value (b, hk, s, d), mask None or bool (b, L) -> out (b, sq, h, d)."""
    q = query.transpose(1, 2)  # (b, sq, h, d) view
    if q.shape[1] == 1 and causal:
        return _decode(q, key, value, mask, scale, (window_left, -1), softcap, sinks)
    # transformers' windows are symmetric for bidirectional layers
    window = (window_left, 0 if causal else window_left)
    return _prefill(q, key, value, mask, causal, scale, window, softcap, sinks)


@torch.library.custom_op("flashdecode_transformers::attention", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                  causal: bool, scale: Optional[float], window_left: int, softcap: float,
                  sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """_attention as a torch.library op, so torch.compile traces the attention as one node (no graph break)."""
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
