"""flash-attn 2.x's public functions on top of flashdecode's kernels: same names, argument order, defaults and
return conventions, so a script that did ``from flash_attn.flash_attn_interface import *`` (or
``from flash_attn import flash_attn_func, ...``) can import them from here instead.

    flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func          -> flashdecode.flash_attn
    flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func,
    flash_attn_varlen_kvpacked_func                                               -> flashdecode.flash_attn_varlen
    flash_attn_with_kvcache                                                       -> append_kv + flash_decode

Tensor layouts, masks (causal and windows bottom-right aligned), GQA/MQA, softcap, the (batch, nheads, seqlen_q) /
(nheads, total_q) float32 natural-log softmax_lse, zero output on rows with no visible key, and gradients through
the packed tensors are flash-attn's.

Differences from flash-attn 2.x (everything else is the same):
  - dropout_p > 0 raises ValueError: there is no dropout (dropout_p = 0.0, the inference/eval setting, works).
  - alibi_slopes ((nheads,) or (batch, nheads) float32, flash-attn's bias -slope * |i + seqlen_k - seqlen_q - j|):
    flash_attn_with_kvcache supports it (the decode kernels add the bias after the softcap, like flash-attn),
    except for non-causal attention of seqlen_q > 1 rows (ValueError: the decode kernels see no key after a
    row's position, and the bias of such keys differs per row). The prefill functions (flash_attn_func,
    flash_attn_varlen_func and their packed forms) pass it to flashdecode.flash_attn / flash_attn_varlen where
    those accept ``alibi_slopes``, and raise ValueError naming it where they do not.
  - return_attn_probs=True returns (out, softmax_lse, S_dmask) with S_dmask an empty tensor of shape (0,) - what
    flash-attn itself returns when dropout_p == 0; the attention probabilities are never materialised.
  - flash_attn_varlen_func's block_table (paged K/V, cu_seqlens_k giving each sequence's keys) is forward only
    (ValueError when an input requires grad), as is every paged call.
  - Also accepted where flash-attn refuses: float32 inputs (IEEE-precision dots), any head dim 1..256, any strides
    of q/k/v in the prefill functions (no copies, no unit head-dim stride needed), any page size >= 1 for
    flash_attn_with_kvcache's block_table (flash-attn: a multiple of 256), any even rotary dim (flash-attn: a
    multiple of 16), rotary_cos/rotary_sin in any float dtype (the rotation is computed in float32).
  - flash_attn_with_kvcache:
      * with block_table, chunks of heuristics.KVCACHE_PREFILL_MIN_QUERIES new tokens or more (and shorter ones
        whose mask the decode kernels cannot express) run the paged prefill kernel (ops/paged_prefill.py): every
        window, softcap and ALiBi.
      * without block_table, seqlen_q > 1 with causal=False is supported for full attention and for window_size
        right bounds that do not cut any row (right = -1 or >= seqlen_q - 1, left = -1); other non-causal windows
        with seqlen_q > 1 raise ValueError (the decode kernels mask keys after each row's position only).
      * cache_seqlens=None means every sequence holds the cache's full capacity; it cannot be combined with k/v.
      * block_table with cache_batch_idx or cache_leftpad raises ValueError (flash-attn refuses them too);
        cache_leftpad needs a contiguous cache whose batch stride is seqlen_cache x its row stride (it is read as
        pages of one token).
      * lengths that live on the device are not checked against the capacity (that needs a host sync): keys past
        the capacity are not written / not read, and rotary positions are clamped to the table.
      * num_splits=0 (the heuristic) reads tensor cache_seqlens on the host once per call (an int needs no read);
        while a CUDA graph is being captured it sizes the splits from the cache capacity instead, so a captured
        decode step replays correctly with changed lengths. num_splits >= 1 never reads them.
      * no backward (flash-attn has none either).
  - deterministic=False (flash-attn's default) gives dQ accumulated with fp32 atomics, like flash-attn;
    deterministic=True is bitwise reproducible.
  - Bad input raises ValueError/TypeError naming the argument, where flash-attn asserts or raises RuntimeError.
"""

from __future__ import annotations

import inspect
from typing import Optional, Union

import torch

from flashdecode import heuristics
from flashdecode.ops import checks, decode_host, direct_launch, score_transform
from flashdecode.ops.attention import flash_attn, flash_attn_varlen
from flashdecode.ops.append_kv import checked_append
from flashdecode.ops.decode import (NO_WINDOW, append_kv, decide_flash_decode, flash_decode, launch_decided,
                                    prepare_flash_decode, window_key)
from flashdecode.ops.paged_prefill import prepare_paged_prefill
from flashdecode.ops.checks import check_alibi_slopes
from flashdecode.ops.decode_workspace import stream_workspace
from flashdecode.ops.util import capturing

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]


# ----------------------------------------------------------------------------------------------------------------
# Arguments flashdecode does not support (ValueError naming them, before any kernel runs)
# ----------------------------------------------------------------------------------------------------------------

def _takes_alibi(op) -> bool:
    """Whether the flashdecode op behind a flash-attn function accepts ``alibi_slopes=``."""
    return op is not None and "alibi_slopes" in inspect.signature(op).parameters


def _check_unsupported(dropout_p=0.0, alibi_slopes=None, op=None):
    """dropout_p must be 0; alibi_slopes must be None unless ``op`` (the flashdecode op the call runs) takes it."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {dropout_p!r}")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p={dropout_p} is not supported: flashdecode has no attention dropout "
                         "(use dropout_p=0.0)")
    if alibi_slopes is not None and not _takes_alibi(op):
        name = getattr(op, "__name__", "this function")
        raise ValueError(f"alibi_slopes is not supported by flashdecode.{name} in this build")


def _result(out, lse, return_attn_probs: bool):
    """flash-attn's return convention: out, or (out, softmax_lse, S_dmask); S_dmask is the empty tensor flash-attn
    returns without dropout (probabilities are never materialised)."""
    checks.check_bool("return_attn_probs", return_attn_probs)
    if not return_attn_probs:
        return out
    return out, lse, torch.empty((0,), dtype=out.dtype, device=out.device)


def _unpack(packed, name: str, dim: int, count: int, ndim: int, layout: str):
    """Split a packed tensor (e.g. qkv (batch, seqlen, 3, nheads, headdim)) into views along ``dim``."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != ndim or packed.shape[dim] != count:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(packed.shape)}")
    return packed.unbind(dim)


def _options(softmax_scale, causal, window_size, softcap, deterministic, alibi_slopes=None):
    """The prefill ops' keyword options; alibi_slopes only when given (checked by _check_unsupported first)."""
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   deterministic=deterministic)
    if alibi_slopes is not None:
        options["alibi_slopes"] = alibi_slopes
    return options


# ----------------------------------------------------------------------------------------------------------------
# Dense and varlen attention (differentiable)
# ----------------------------------------------------------------------------------------------------------------

def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's flash_attn_func: softmax(scale * Q K^T [masked]) V, differentiable in q, k, v.

    Args:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0;
            float16 / bfloat16 / float32.
        dropout_p: must be 0.0. softmax_scale: default headdim ** -0.5. causal: bottom-right aligned mask.
        window_size: (left, right), -1 = unbounded. softcap: > 0 = softcap * tanh(S / softcap).
        alibi_slopes: (nheads,) or (batch, nheads) float32 where flashdecode.flash_attn takes it (module doc),
            else must be None. deterministic: reproducible dQ (else fp32 atomics, flash-attn's default).
        return_attn_probs: also return softmax_lse (batch, nheads, seqlen_q) float32 and an empty S_dmask.
    Returns:
        out (batch, seqlen_q, nheads, headdim) [, softmax_lse, S_dmask].
    """
    _check_unsupported(dropout_p, alibi_slopes, flash_attn)
    out, lse = flash_attn(q, k, v, return_lse=True, **_options(softmax_scale, causal, window_size, softcap,
                                                               deterministic, alibi_slopes))
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func on qkv (batch, seqlen, 3, nheads, headdim) (views, no copy; the gradient lands in qkv)."""
    _check_unsupported(dropout_p, alibi_slopes, flash_attn)
    q, k, v = _unpack(qkv, "qkv", 2, 3, 5, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func with kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    _check_unsupported(dropout_p, alibi_slopes, flash_attn)
    k, v = _unpack(kv, "kv", 2, 2, 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn's flash_attn_varlen_func over a packed ragged batch, differentiable in q, k, v.

    Args:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) cumulative lengths; max_seqlen_q/k: ints >= the longest.
        block_table: None, or int32 (batch, max_blocks): k, v are then paged caches (num_blocks, block_size,
            nheads_k, headdim) and sequence b attends to its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] cached
            keys (forward only). Other options as flash_attn_func.
    Returns:
        out (total_q, nheads, headdim) [, softmax_lse (nheads, total_q) float32, S_dmask (empty)].
    """
    _check_unsupported(dropout_p, alibi_slopes, flash_attn_varlen)
    out, lse = flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse=True,
                                 block_table=block_table,
                                 **_options(softmax_scale, causal, window_size, softcap, deterministic, alibi_slopes))
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func on qkv (total, 3, nheads, headdim) with one cu_seqlens / max_seqlen."""
    _check_unsupported(dropout_p, alibi_slopes, flash_attn_varlen)
    q, k, v = _unpack(qkv, "qkv", 1, 3, 4, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_func with kv (total_k, 2, nheads_k, headdim)."""
    _check_unsupported(dropout_p, alibi_slopes, flash_attn_varlen)
    k, v = _unpack(kv, "kv", 1, 2, 4, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


# ----------------------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: checks, then rotary -> append_kv -> flash_decode on a view of the cache
# ----------------------------------------------------------------------------------------------------------------

def _check_index_tensor(name: str, x, batch: int, device, upper: Optional[int] = None):
    """An optional int32 (batch,) tensor on q's device; values in [0, upper) are checked only where they live on
    the host (reading device values would sync)."""
    if x is None:
        return None
    checks.check_tensor(name, x, (1,))
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if x.shape[0] != batch:
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(x.shape)}")
    checks.check_device(name, x, device)
    if checks.host_resident(x) and x.numel() and (int(x.min()) < 0 or (upper is not None and int(x.max()) >= upper)):
        raise ValueError(f"{name} values must be in [0, {upper}), got {x.tolist()}")
    return x


def _check_cache_and_new(q, k_cache, v_cache, k, v):
    """Dtypes, devices and head shapes of the cache and the new k/v against q, checked before anything is written
    (flash_decode would check most of them only after append_kv had modified the cache)."""
    batch, _, nheads, headdim = q.shape
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.check_tensor(name, x, (4,), (q.dtype,))
        checks.check_device(name, x, q.device)
        if x.shape[3] != headdim or x.stride(-1) != 1:
            raise ValueError(f"{name} must be (..., nheads_k, {headdim}) (q's head dim) with unit stride on its "
                             f"last dim, got shape {tuple(x.shape)}, strides {x.stride()}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    nheads_k = k_cache.shape[2]
    if nheads % nheads_k:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of the cache's nheads_k ({nheads_k})")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values to append)")
    if k is None:
        return
    for name, x in (("k", k), ("v", v)):
        checks.check_tensor(name, x, (4,), (q.dtype,))
        checks.check_device(name, x, q.device)
        if x.shape[0] != batch or x.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"{name} must be (batch={batch}, seqlen_new, nheads_k={nheads_k}, {headdim}), got "
                             f"{tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")


def _check_cache_seqlens(cache_seqlens, batch: int, device, new_tokens: bool):
    """(the int32 (batch,) tensor or None, the int's value or None): the checks of cache_seqlens; an int stays an
    int (the caller fills its tensor per call, after every check)."""
    if cache_seqlens is None:
        if new_tokens:
            raise ValueError("cache_seqlens is required when k and v are given (it says where they are appended)")
        return None, None
    if isinstance(cache_seqlens, torch.Tensor):
        return _check_index_tensor("cache_seqlens", cache_seqlens, batch, device), None
    return None, checks.check_int("cache_seqlens", cache_seqlens, minimum=0)


def _kvcache_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, alibi_slopes, options: tuple):
    """The key under which a flash_attn_with_kvcache call's checks are kept (decode_host.call_key: every tensor's
    shape, strides, dtype, device and alignment, every option with its type, an int cache_seqlens by type), or
    None where the checks read values (host-resident index tensors: lengths, cache_batch_idx, cache_leftpad, whose
    values _check_index_tensor and the capacity check read) or an argument cannot be keyed."""
    host = checks.host_resident
    if (isinstance(cache_batch_idx, torch.Tensor) and host(cache_batch_idx)) \
            or (isinstance(cache_leftpad, torch.Tensor) and host(cache_leftpad)):
        return None
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
               alibi_slopes)
    if isinstance(cache_seqlens, torch.Tensor):
        if host(cache_seqlens):
            return None
        tensors += (cache_seqlens,)
    else:  # None, or an int whose value the caller checks per call (a generation's steps share the key)
        options += (cache_seqlens is None, cache_seqlens.__class__)
    return decode_host.call_key("flash_attn_with_kvcache", tensors, options)


def _eager_lengths(device, batch: int, slot: str):
    """An int32 (batch,) buffer of the eager workspace pool of ``device``'s current stream, written in place by
    this call (decode_workspace.lengths_view), or None while a CUDA graph is being captured (the call then
    allocates from the graph's pool, whose buffers its replays own)."""
    if capturing(device):
        return None
    stream = direct_launch.current_stream(device.index) if device.type == "cuda" else None
    return stream_workspace(device, stream).lengths_view(slot, batch)


def _filled_lengths(batch: int, value: int, device):
    """int32 (batch,) lengths all ``value`` on ``device`` (an int cache_seqlens, or a full cache's capacity)
    without an allocation per eager call."""
    buffer = _eager_lengths(device, batch, "cache_seqlens")
    if buffer is None:
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    return buffer.fill_(value)


def _seen_lengths(lengths, seqlen_new: int):
    """The keys the attention sees, lengths + seqlen_new (int32 (batch,)): ``lengths`` itself when nothing is
    appended, else written into the stream's pooled buffer (append_kv leaves ``lengths`` as it is)."""
    if seqlen_new == 0:
        return lengths
    buffer = _eager_lengths(lengths.device, lengths.shape[0], "seen")
    if buffer is None:
        return lengths + seqlen_new
    return torch.add(lengths, seqlen_new, out=buffer)


def _score_of(headdim: int, causal, softmax_scale, window_size, softcap, alibi_slopes):
    """The call's ScoreTransform (ops/score_transform.py), causal and window_size checked (a list window taken as
    a tuple); softmax_scale and softcap checked before."""
    checks.check_bool("causal", causal)
    window = checks.check_window(tuple(window_size) if isinstance(window_size, list) else window_size)
    return score_transform.build(headdim, causal, softmax_scale, window, softcap, alibi=alibi_slopes is not None)


def _mask_plan(seqlen_q: int, score):
    """How the decode kernels express flash-attn's (causal, window) - the call's ScoreTransform - for seqlen_q new
    query rows.

    Returns (fold_rows_into_heads, left), or None where they cannot: the kernels always mask keys after a row's
    position (bottom-right aligned) and take a left window. seqlen_q == 1 or a causal right bound (0) map directly.
    Full attention of several rows (non-causal, no window that cuts a row) folds the rows into the head dim: each
    folded row then sees every key. Other non-causal windows with several rows give None."""
    left, right = score.window_left, score.window_right
    if seqlen_q == 1 or right == 0:
        return False, left
    if left == -1 and (right == -1 or right >= seqlen_q - 1):
        return True, -1
    return None


def _check_decode_masks(mask, seqlen_q: int, window_size, alibi_slopes):
    """ValueError where the decode kernels cannot run a call (mask: _mask_plan's answer) and no paged prefill
    takes it instead."""
    if mask is None:
        raise ValueError(f"window_size={tuple(window_size)} with causal=False and seqlen_q={seqlen_q} > 1 is not "
                         "supported by flash_attn_with_kvcache without block_table (only causal masks, or "
                         "non-causal full attention; a paged cache takes any window)")
    if mask[0] and alibi_slopes is not None:
        raise ValueError("alibi_slopes with causal=False and seqlen_q > 1 is not supported by "
                         "flash_attn_with_kvcache without block_table (keys after a row's position would need their "
                         "own bias; a paged cache takes it)")


def _prepare_paged_prefill_with_kvcache(q, k_cache, v_cache, lengths, block_table, max_seqlen_k: int, **options):
    """Attention of q (batch, seqlen_q, nheads, headdim) against a paged cache whose lengths (int32 (batch,)) already
    count the new tokens: the paged prefill kernel over q packed as a varlen batch of seqlen_q rows per sequence.
    Every check runs here, before the caller appends the new tokens; returns a function that runs the attention
    and returns (out like q, lse (batch, nheads, seqlen_q) float32)."""
    batch, seqlen_q, nheads, headdim = q.shape
    cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
    attend = prepare_paged_prefill(q.reshape(batch * seqlen_q, nheads, headdim), k_cache, v_cache, cu_seqlens_q,
                                   lengths, block_table, seqlen_q, max_seqlen_k, return_lse=True, **options)

    def run():
        out, lse = attend()
        return out.view(batch, seqlen_q, nheads, headdim), lse.view(nheads, batch, seqlen_q).transpose(0, 1)
    return run


def _check_rotary(rotary_cos, rotary_sin, q, k, capacity: int):
    """Returns rotary_dim (0 = no rotary). flash-attn's rules: both or neither, only with new k/v, (seqlen_ro,
    rotary_dim / 2) each, seqlen_ro >= the cache capacity; rotary_dim even and <= headdim."""
    if rotary_cos is None and rotary_sin is None:
        return 0
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError("rotary_cos / rotary_sin need the new k and v (rotary is applied to q and the new keys)")
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        checks.check_tensor(name, x, (2,), checks.FLOAT_DTYPES + (torch.float64,))
        checks.check_device(name, x, q.device)
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos {tuple(rotary_cos.shape)} and rotary_sin {tuple(rotary_sin.shape)} must "
                         "have the same shape")
    seqlen_ro, half = rotary_cos.shape
    rotary_dim = 2 * half
    if not 0 < rotary_dim <= q.shape[-1]:
        raise ValueError(f"rotary_cos has {half} columns: rotary_dim = {rotary_dim} must be in 2..headdim "
                         f"({q.shape[-1]})")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos has {seqlen_ro} rows, fewer than the cache's capacity of {capacity} keys")
    return rotary_dim


def _apply_rotary(x, cos, sin, positions, interleaved: bool):
    """Rotate the first rotary_dim features of x (batch, seqlen, nheads, headdim) by the angles at
    ``positions`` (batch, seqlen) int64; float32 math, result in x's dtype (a new tensor).

    interleaved (GPT-J): pairs (2i, 2i + 1); else (GPT-NeoX): pairs (i, i + rotary_dim / 2)."""
    rotary_dim = 2 * cos.shape[1]
    c = cos.float()[positions].unsqueeze(2)  # (batch, seqlen, 1, rotary_dim / 2)
    s = sin.float()[positions].unsqueeze(2)
    xr = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rotary_dim // 2], xr[..., rotary_dim // 2:]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., rotary_dim:]], dim=-1)


def _rotary_positions(start, seqlen: int, consecutive: bool, seqlen_ro: int):
    """(batch, seqlen) int64 table rows: start + i (consecutive) or start for every token, clamped to the table."""
    offsets = torch.arange(seqlen, device=start.device) if consecutive else torch.zeros(seqlen, dtype=torch.long,
                                                                                        device=start.device)
    return (start.long()[:, None] + offsets[None, :]).clamp_(0, seqlen_ro - 1)


def _host_length_bound(q, host_bound, seqlen_new: int, capacity: int):
    """A host-side bound on the attended lengths for the split heuristic: the int cache_seqlens + seqlen_new, else
    None (flash_decode then sizes the splits as it does for any device-resident lengths, capture or not)."""
    if host_bound is not None:
        return host_bound + seqlen_new
    return None


def _check_one_token_pages(k_cache, v_cache):
    """cache_leftpad reads the cache as pages of one token: each cache's batch stride must be seqlen_cache x its
    row stride (e.g. contiguous)."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(0) != x.shape[1] * x.stride(1):
            raise ValueError(f"cache_leftpad needs a {name} whose batch stride is seqlen_cache x its row stride "
                             f"(e.g. contiguous), got strides {x.stride()}")


def _one_token_pages(k_cache, v_cache, rows, leftpad, lengths):
    """The contiguous cache as pages of one token, and an int32 (batch, seqlen_cache) block table whose row b lists
    the tokens leftpad[b], leftpad[b] + 1, ... of cache row rows[b]: the kernels then read keys [leftpad,
    cache_seqlens) as a sequence of length cache_seqlens - leftpad."""
    batch_cache, seqlen_cache = k_cache.shape[:2]
    pages = [x.as_strided((batch_cache * seqlen_cache, 1) + tuple(x.shape[2:]),
                          (x.stride(1), x.stride(1)) + tuple(x.stride()[2:]), x.storage_offset())
             for x in (k_cache, v_cache)]
    token = torch.arange(seqlen_cache, device=k_cache.device, dtype=torch.int64)
    ids = rows.long()[:, None] * seqlen_cache + (leftpad.long()[:, None] + token[None, :]).clamp_(max=seqlen_cache - 1)
    return pages[0], pages[1], ids.to(torch.int32), (lengths - leftpad).clamp_(min=0)


def _checked_kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                         alibi_slopes, num_splits, return_softmax_lse) -> tuple:
    """Every check flash_attn_with_kvcache makes before it writes anything (flash_attn_with_kvcache's arguments);
    returns what they decide: (num_splits int, _mask_plan's answer, whether the paged prefill runs, the cache's
    capacity in keys, rotary_dim (0 = no rotary), the call's ScoreTransform); an int cache_seqlens' value is
    checked per call."""
    _check_unsupported(0.0, alibi_slopes, flash_decode)
    checks.check_tensor("q", q, (4,), checks.FLOAT_DTYPES)
    batch, seqlen_q, nheads, headdim = q.shape
    checks.check_kernel_device("q", q)
    if not (seqlen_q >= 1 and 1 <= headdim <= checks.MAX_HEAD_DIM):
        raise ValueError(f"q must hold >= 1 token and a head dim in 1..{checks.MAX_HEAD_DIM}, got shape "
                         f"{tuple(q.shape)}")
    checks.check_softmax_scale(softmax_scale)
    checks.check_softcap(softcap)
    checks.check_bool("rotary_interleaved", rotary_interleaved)
    checks.check_bool("return_softmax_lse", return_softmax_lse)
    # flash_decode's bound on every route (the paged prefill ignores the count but not a count no call can take)
    num_splits = checks.check_int("num_splits", num_splits, minimum=0, maximum=checks.MAX_NUM_SPLITS)
    _check_cache_and_new(q, k_cache, v_cache, k, v)
    score = _score_of(headdim, causal, softmax_scale, window_size, softcap, alibi_slopes)
    mask = _mask_plan(seqlen_q, score)
    check_alibi_slopes(alibi_slopes, batch, nheads, q.device)  # before the append writes anything
    decode_can_mask = mask is not None and not (mask[0] and alibi_slopes is not None)
    prefill = block_table is not None and heuristics.kvcache_uses_prefill(seqlen_q, decode_can_mask)
    if not prefill:
        _check_decode_masks(mask, seqlen_q, window_size, alibi_slopes)
    if block_table is not None and (cache_batch_idx is not None or cache_leftpad is not None):
        raise ValueError("block_table cannot be combined with cache_batch_idx or cache_leftpad")
    lengths, host_bound = _check_cache_seqlens(cache_seqlens, batch, q.device, k is not None)
    cache_batch_idx = _check_index_tensor("cache_batch_idx", cache_batch_idx, batch, q.device, k_cache.shape[0])
    # leftpad == seqlen_cache is a wholly padded row: it sees no cached key (flash-attn accepts it too)
    cache_leftpad = _check_index_tensor("cache_leftpad", cache_leftpad, batch, q.device, k_cache.shape[1] + 1)
    if cache_leftpad is not None:
        _check_one_token_pages(k_cache, v_cache)
    if block_table is not None:
        checks.check_tensor("block_table", block_table, (2,))
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    rotary_dim = _check_rotary(rotary_cos, rotary_sin, q, k, capacity)
    seqlen_new = 0 if k is None else k.shape[1]
    longest = host_bound
    if longest is None and lengths is not None and checks.host_resident(lengths) and lengths.numel():
        longest = int(lengths.max())  # host-resident lengths: read without a sync, named as the caller named them
    _check_fits(longest, seqlen_new, capacity)
    return num_splits, mask, prefill, capacity, rotary_dim, score


def _check_fits(longest: Optional[int], seqlen_new: int, capacity: int) -> None:
    """The host-known longest length (None: unknown) plus the appended tokens must fit the cache."""
    if longest is not None and longest + seqlen_new > capacity:
        raise ValueError(f"cache_seqlens ({longest}) + seqlen_new ({seqlen_new}) exceeds the cache's capacity "
                         f"of {capacity} keys")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
                            softmax_scale=None, causal=False, window_size=NO_WINDOW, softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn's flash_attn_with_kvcache: attention of new query tokens against a KV cache, optionally
    appending new keys/values (in place) and applying rotary embeddings first. No backward.

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with block_table paged
            (num_blocks, page_block_size, nheads_k, headdim); unit stride on headdim.
        k, v: optional (batch, seqlen_new, nheads_k, headdim), written into the cache at positions
            cache_seqlens[b], cache_seqlens[b] + 1, ... (after rotary on k) before the attention.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2), seqlen_ro >= the cache capacity. The new k
            is rotated at positions cache_seqlens + i; q at cache_seqlens + i if causal or windowed, else every
            query token at cache_seqlens. rotary_interleaved: GPT-J pairs (True) or GPT-NeoX halves (False).
        cache_seqlens: int or int32 (batch,): cached tokens per sequence BEFORE the append (None: the cache is
            full). The attention sees cache_seqlens + seqlen_new keys.
        cache_batch_idx: int32 (batch,): cache row of each sequence (default 0..batch-1); contiguous cache only.
        cache_leftpad: int32 (batch,): each sequence's keys start at this cache position (default 0), at most
            seqlen_cache (a wholly padded row: no cached key; out 0 and lse -inf unless it has keys after it).
        block_table: int32 (batch, max_blocks_per_seq) page ids of a paged cache.
        softmax_scale, causal, window_size, softcap: as flash_attn_func (bottom-right aligned).
        alibi_slopes: optional (nheads,) or (batch, nheads) float32 ALiBi slopes (not with causal=False and
            seqlen_q > 1). num_splits: 0 = heuristic, 1 = no split, n = n splits of the keys.
        return_softmax_lse: also return softmax_lse (batch, nheads, seqlen_q) float32.
    Returns:
        out (batch, seqlen_q, nheads, headdim) [, softmax_lse].
    """
    key = _kvcache_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                       cache_leftpad, block_table, alibi_slopes, (softmax_scale, causal, window_key(window_size),
                                                                  softcap, rotary_interleaved, num_splits,
                                                                  return_softmax_lse))
    checked = decode_host.kept_checks(key)
    if checked is None:
        checked = _KvcacheChecks(*_checked_kvcache_call(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            return_softmax_lse))
        decode_host.keep_checks(key, checked)
    elif checked.direct is not None and checked.direct.decided.in_capture == capturing(q.device):
        return _run_direct(checked, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                           alibi_slopes, return_softmax_lse)
    num_splits, mask, prefill, capacity, rotary_dim, score = checked.decided
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_new = 0 if k is None else k.shape[1]
    lengths, host_bound = cache_seqlens, None  # checked: an int32 (batch,) tensor, an int or None (a full cache)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):  # its value: not in the key
        host_bound = checks.check_int("cache_seqlens", cache_seqlens, minimum=0)
        _check_fits(host_bound, seqlen_new, capacity)
        lengths = _filled_lengths(batch, host_bound, q.device)
    elif lengths is None:
        lengths = _filled_lengths(batch, capacity, q.device)
        host_bound = capacity

    # a contiguous cache whose rows are picked by cache_batch_idx is a paged cache of one page per row
    table = _cache_table(block_table, cache_batch_idx, batch)

    if rotary_dim:
        ro_len = rotary_cos.shape[0]
        k = _apply_rotary(k, rotary_cos, rotary_sin, _rotary_positions(lengths, seqlen_new, True, ro_len),
                          rotary_interleaved)
        consecutive = score.window_left >= 0 or score.window_right >= 0
        q = _apply_rotary(q, rotary_cos, rotary_sin, _rotary_positions(lengths, seqlen_q, consecutive, ro_len),
                          rotary_interleaved)
    k, v = _unit_stride_new(k, v)
    bound = _host_length_bound(q, host_bound, seqlen_new, capacity)
    if prefill or cache_leftpad is not None or rotary_dim:
        return _kvcache_general(q, k_cache, v_cache, k, v, lengths, cache_batch_idx, cache_leftpad, table, prefill,
                                bound, capacity, mask, num_splits, softmax_scale, causal, window_size, softcap,
                                alibi_slopes, return_softmax_lse)
    # the plain decode route: decided once per key (an int cache_seqlens' bound is a per-call value: decided per call)
    fold, left = mask
    q_rows = _fold_rows(q, fold)
    # the append kernel writes the lengths the attention sees, unless the checks read them on the host first
    fused = not checks.host_resident(lengths)
    seen = _seen_buffer(lengths, k) if fused else _seen_lengths(lengths, seqlen_new)
    decided = decide_flash_decode(q_rows, k_cache, v_cache, seen, block_table=table, softmax_scale=softmax_scale,
                                  softcap=softcap, window_size=(left, -1), num_splits=num_splits or None,
                                  alibi_slopes=alibi_slopes, max_seqlen_k=None if num_splits else bound)
    append = None if k is None else checked_append(k_cache, v_cache, k, v, lengths, table)
    # every check has run: now the append writes the cache (and the seen lengths), then the attention runs
    if append is not None and not append.run(k_cache, v_cache, k, v, lengths, table, None, seen if fused else None) \
            and fused:
        seen = lengths  # nothing appended (an empty batch)
    out, lse = launch_decided(decided, q_rows, k_cache, v_cache, seen, table, None, bool(return_softmax_lse),
                              alibi_slopes)
    if (host_bound is None or cache_seqlens is None) and (fused or k is None):  # no per-call value decided it
        checked.direct = _DirectKvcache(decided.kept(), append)
    return _decode_result(out, lse, q.shape, fold, return_softmax_lse)


class _KvcacheChecks:
    """What a flash_attn_with_kvcache call's checks decide (kept per call key, decode_host.keep_checks): ``decided``,
    _checked_kvcache_call's answer; ``direct``, the plain decode route's kept decisions (_DirectKvcache) once a
    call whose decisions read no per-call value has made them (None: that route is decided per call)."""

    __slots__ = ("decided", "direct")

    def __init__(self, *decided):
        self.decided, self.direct = decided, None


class _DirectKvcache:
    """The plain decode route of a flash_attn_with_kvcache key (no rotary, no cache_leftpad, no paged prefill; a
    tensor cache_seqlens or none): flash_decode's decisions for the attention (ops/decode.py DecidedDecode, kept)
    and append_kv's checked launch (None without k / v), made by the key's first call after every check of both."""

    __slots__ = ("decided", "append")

    def __init__(self, decided, append):
        self.decided, self.append = decided, append


def _run_direct(checked, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                return_lse):
    """A repeated key on the plain decode route: the append (which also writes the lengths the attention sees) and
    the attention, launched from the kept decisions (no check, no resolution)."""
    direct, batch = checked.direct, q.shape[0]
    fold = checked.decided[1][0]
    lengths = cache_seqlens
    if lengths is None:
        lengths = _filled_lengths(batch, checked.decided[3], q.device)
    table = _cache_table(block_table, cache_batch_idx, batch)
    seen = lengths
    if k is not None:
        k, v = _unit_stride_new(k, v)
        seen = _seen_buffer(lengths, k)
        if not direct.append.run(k_cache, v_cache, k, v, lengths, table, None, seen):
            seen = lengths
    q_rows = _fold_rows(q, fold)
    out, lse = direct.decided.relaunch(q_rows, alibi_slopes, k_cache, v_cache, seen, table, return_lse)
    return _decode_result(out, lse, q.shape, fold, return_lse)


def _fold_rows(q, fold: bool):
    """q as the decode kernels' query rows: full attention of seqlen_q rows == one row per (head, token) pair (heads
    h * seqlen_q + i share kv head h // group, so the fold keeps the GQA mapping)."""
    if not fold:
        return q
    batch, seqlen_q, nheads, headdim = q.shape
    return q.transpose(1, 2).reshape(batch, nheads * seqlen_q, headdim)


def _decode_result(out, lse, q_shape, fold: bool, return_lse: bool):
    """flash-attn's (out (batch, seqlen_q, nheads, headdim)[, lse (batch, nheads, seqlen_q)]) from the decode
    route's out and lse (folded rows unfolded)."""
    if fold:
        batch, seqlen_q, nheads, headdim = q_shape
        out = out.view(batch, nheads, seqlen_q, headdim).transpose(1, 2).contiguous()
        lse = None if lse is None else lse.view(batch, nheads, seqlen_q)
    elif lse is not None:
        lse = lse.transpose(1, 2)
    return (out, lse.contiguous()) if return_lse else out


def _cache_table(block_table, cache_batch_idx, batch: int):
    """The block table the kernels read: block_table, or (a contiguous cache whose rows cache_batch_idx picks is a
    paged cache of one page per row) cache_batch_idx as (batch, 1), or None."""
    if block_table is None and cache_batch_idx is not None:
        return cache_batch_idx.view(batch, 1)
    return block_table


def _unit_stride_new(k, v):
    """The new keys / values with a unit head-dim stride (the append kernel's layout; copies only where needed)."""
    if k is None or (k.stride(-1) == 1 and v.stride(-1) == 1):
        return k, v
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))


def _seen_buffer(lengths, k):
    """Where the lengths the attention sees (lengths + seqlen_new) go: ``lengths`` itself when nothing is appended,
    else an int32 (batch,) buffer the append kernel writes (the stream's pooled one, or a new one under capture)."""
    if k is None or k.shape[1] == 0:
        return lengths
    buffer = _eager_lengths(lengths.device, lengths.shape[0], "seen")
    return torch.empty_like(lengths) if buffer is None else buffer


def _kvcache_general(q, k_cache, v_cache, k, v, lengths, cache_batch_idx, cache_leftpad, table, prefill, bound,
                     capacity, mask, num_splits, softmax_scale, causal, window_size, softcap, alibi_slopes,
                     return_lse):
    """flash_attn_with_kvcache's routes decided per call: the paged prefill, cache_leftpad's pages of one token and
    rotary embeddings (q, k already rotated). Every check of the attention runs before the append writes the cache:
    a call that raises changed nothing."""
    batch = q.shape[0]
    seqlen_new = 0 if k is None else k.shape[1]
    seen = _seen_lengths(lengths, seqlen_new)  # keys the attention sees
    kv_k, kv_v = k_cache, v_cache
    if cache_leftpad is not None:
        rows = cache_batch_idx if cache_batch_idx is not None else torch.arange(batch, device=q.device)
        kv_k, kv_v, table_read, seen = _one_token_pages(k_cache, v_cache, rows, cache_leftpad, seen)
    else:
        table_read = table
    if prefill:  # a chunk of new tokens over the pages: the paged prefill kernel reads what append_kv wrote
        attend = _prepare_paged_prefill_with_kvcache(
            q, kv_k, kv_v, seen, table_read, bound or capacity,
            causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size), softcap=softcap,
            alibi_slopes=alibi_slopes)
        if k is not None:
            append_kv(k_cache, v_cache, k, v, lengths, table)
        out, lse = attend()
        return (out, lse.contiguous()) if return_lse else out
    fold, left = mask
    # flash_decode's own split policy (no host bound unless the lengths are host ints): the same path and config
    # as a flash_decode call on these tensors, and no lse written where none is returned
    attend = prepare_flash_decode(_fold_rows(q, fold), kv_k, kv_v, seen, block_table=table_read,
                                  softmax_scale=softmax_scale, softcap=softcap, window_size=(left, -1),
                                  num_splits=num_splits or None, return_lse=bool(return_lse),
                                  alibi_slopes=alibi_slopes, max_seqlen_k=None if num_splits else bound)
    if k is not None:
        append_kv(k_cache, v_cache, k, v, lengths, table)
    out, lse = attend()
    return _decode_result(out, lse, q.shape, fold, return_lse)
