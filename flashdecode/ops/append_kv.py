"""append_kv: write new K/V tokens into a contiguous or paged cache (kernels/append_kv.py)."""

from __future__ import annotations

import torch

from flashdecode import heuristics
from flashdecode.kernels.append_kv import append_kv_kernel
from flashdecode.ops import checks
from flashdecode.ops.decode_checks import _cache_capacity, _check_cache_pair, _check_lengths_and_table
from flashdecode.ops import decode_host
from flashdecode.ops.kv_quant import QMAX, resolve_kv_quant
from flashdecode.ops.launch_cache import BoundLaunch, LaunchSite

__all__ = ["append_kv", "checked_append"]

_DTYPES = checks.FLOAT_DTYPES
_check_tensor, _check_device, _interpreting = checks.check_tensor, checks.check_device, checks.interpreting


def append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=None, *, cu_seqlens_new=None,
              max_seqlen_new=None, validate=False, k_scale=None, v_scale=None):
    """Write new K/V tokens into a contiguous or paged cache, one launch, in place.

    Args:
        k_cache, v_cache: contiguous (batch_cache, max_seqlen, nheads_kv, headdim) or paged (num_pages,
            page_size, nheads_kv, headdim) with ``block_table`` int32 (batch, max_pages_per_seq).
        k_new, v_new: same dtype. Dense: (batch, seqlen_new, nheads_kv, headdim). Varlen/packed (e.g. a whole
            ragged prefill): (total, nheads_kv, headdim) with ``cu_seqlens_new`` int32 (batch + 1,) giving each
            sequence's rows [cu[b], cu[b+1]).
        cache_seqlens: int32 (batch,): each sequence's length BEFORE the append. Token i of sequence b is written
            at position cache_seqlens[b] + i. cache_seqlens is NOT modified (the caller advances it, e.g. before
            flash_decode, whose cache_seqlens counts the new tokens).
        max_seqlen_new: optional host bound on the varlen lengths (sizes the grid; default the packed total, which
            is always enough but launches idle programs). Checked against host-resident cu_seqlens_new; tokens past
            it in a device-resident one are not written.
        validate: True copies device-resident metadata to the host once (one sync) and checks it as host-resident
            metadata is always checked (ValueError naming the first bad sequence and position).
    Host-resident metadata is checked: cu_seqlens_new starts at 0, never decreases and stays within k_new's rows;
    lengths + new tokens fit the capacity; the block-table ids of the written positions are pages of the cache.
    Device-resident metadata is not (that would need a host sync); the kernel then never touches memory outside
    the tensors: tokens at positions outside [0, capacity), in pages whose id is outside [0, num_pages), or from
    rows outside k_new (a cu_seqlens_new that runs past it, decreases or starts below 0) are not written.
    k_scale, v_scale: required with an 8-bit cache (torch.float8_e4m3fn, or int8 symmetric; flash_decode's
        k_scale / v_scale), refused otherwise; the fp16/bf16/fp32 new tokens are quantised in the same launch.
        Per token and kv head (the cache's shape[:-1], float32): each new token's scales are WRITTEN there, absmax
        / 448 (e4m3) or / 127 (int8) over its head dim (an all-zero token gets 0 and reads back as zeros; a token
        holding NaN / inf gets a non-finite scale and reads back as NaN, touching no other token). A scalar () or
        per-kv-head (nheads_kv,) scale is read and used: x / scale, saturated to the format's range.
    """
    checked_append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, cu_seqlens_new, max_seqlen_new,
                   validate, k_scale, v_scale).run(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
                                                   cu_seqlens_new)


def checked_append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=None, cu_seqlens_new=None,
                   max_seqlen_new=None, validate=False, k_scale=None, v_scale=None) -> "_AppendLaunch":
    """Every check of append_kv(...) (same arguments) and what they decide, as an _AppendLaunch whose ``run``
    launches the append on tensors of these layouts (nothing is written here). A repeated key whose checks read no
    value (device-resident metadata, validate=False, no 8-bit scales) is kept (decode_host.keep): no check runs."""
    key = None
    if validate is False and k_scale is None and v_scale is None and isinstance(cache_seqlens, torch.Tensor) \
            and not checks.host_resident(cache_seqlens) \
            and (cu_seqlens_new is None or not checks.host_resident(cu_seqlens_new)):  # no value is checked
        key = decode_host.call_key("append_kv", (k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
                                                 cu_seqlens_new), (max_seqlen_new,))
        launch = decode_host.kept(key)
        if launch is not None:
            return launch
    _check_tensor("k_new", k_new, (3, 4), _DTYPES)
    checks.check_kernel_device("k_new", k_new)
    device = k_new.device
    varlen = cu_seqlens_new is not None
    if varlen != (k_new.dim() == 3):
        raise ValueError("k_new must be (total, nheads_kv, headdim) with cu_seqlens_new, or (batch, seqlen_new, "
                         f"nheads_kv, headdim) without it; got shape {tuple(k_new.shape)} and cu_seqlens_new "
                         f"{'given' if varlen else 'None'}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):  # named before their scales are checked on them
        _check_tensor(name, x, (4,))
        _check_device(name, x, device, "k_new")
    quant = resolve_kv_quant(k_new.dtype, k_cache, v_cache, k_scale, v_scale)
    # scales of the cache's shape[:-1] are written per new token; others (one per kv head, or one) are read
    write_scales = quant is not None and tuple(k_scale.shape) == tuple(k_cache.shape[:-1])
    if quant is not None and quant.per_token and not write_scales:
        raise ValueError(f"k_scale / v_scale that append_kv writes per token must have the cache's shape[:-1] "
                         f"{tuple(k_cache.shape[:-1])}, got {tuple(k_scale.shape)} / {tuple(v_scale.shape)}")
    _check_cache_pair(k_cache, v_cache, k_new.dtype if quant is None else k_cache.dtype, device)
    _check_tensor("v_new", v_new, (k_new.dim(),))
    if v_new.shape != k_new.shape or v_new.dtype != k_new.dtype or v_new.device != device:
        raise ValueError(f"v_new must match k_new ({tuple(k_new.shape)}, {k_new.dtype}), got "
                         f"{tuple(v_new.shape)}, {v_new.dtype} on {v_new.device}")
    if k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
        raise ValueError("k_new and v_new must have unit stride on their last (head) dim")
    if tuple(k_new.shape[-2:]) != tuple(k_cache.shape[-2:]):
        raise ValueError(f"k_new (nheads_kv, headdim) {tuple(k_new.shape[-2:])} must match the cache's "
                         f"{tuple(k_cache.shape[-2:])}")
    if varlen:
        _check_tensor("cu_seqlens_new", cu_seqlens_new, (1,))
        if cu_seqlens_new.dtype != torch.int32:
            raise TypeError(f"cu_seqlens_new must be int32, got {cu_seqlens_new.dtype}")
        _check_device("cu_seqlens_new", cu_seqlens_new, device)
        batch = cu_seqlens_new.shape[0] - 1
        if batch < 0:
            raise ValueError("cu_seqlens_new must have batch + 1 >= 1 entries, got none")
        if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.shape[:1] != (batch,):
            raise ValueError(f"cu_seqlens_new has {batch + 1} entries (batch {batch}) but cache_seqlens has shape "
                             f"{tuple(cache_seqlens.shape)}")
        max_new = checks.check_optional_int("max_seqlen_new", max_seqlen_new, 0)
        max_new = k_new.shape[0] if max_new is None else max_new
    else:  # max_seqlen_new is moot: dense k_new gives its length
        checks.check_optional_int("max_seqlen_new", max_seqlen_new, 0)
        batch, max_new = k_new.shape[0], k_new.shape[1]
    _check_lengths_and_table(cache_seqlens, block_table, batch, device)
    capacity = _cache_capacity(k_cache, block_table, batch)
    checks.check_cache_metadata(cache_seqlens, block_table, capacity=capacity,
                                page_size=k_cache.shape[1] if block_table is not None else 0,
                                num_pages=k_cache.shape[0], validate=validate, appending=True,
                                added=0 if varlen else k_new.shape[1], cu_seqlens_new=cu_seqlens_new,
                                new_rows=k_new.shape[0], max_new=max_new)
    launch = _AppendLaunch(key, batch, max_new, k_cache, block_table, varlen, k_new, v_new, quant, write_scales)
    decode_host.keep(key, launch)
    return launch


class _AppendLaunch:
    """What a checked append_kv call's metadata fixes: the grid, the kernel's arguments after its tensors (the
    integers the shapes and strides give, an 8-bit cache's scales; also in place in the BoundLaunch of each launch
    key), the constexprs and the launch-cache key (None: a call whose checks read values, launched without
    recording)."""

    __slots__ = ("key", "seen_key", "grid", "tail", "constexprs", "varlen", "paged", "bound", "seen_bound")

    def __init__(self, key, batch, max_new, k_cache, block_table, varlen, k_new, v_new, quant, write_scales):
        headdim, nheads_kv = k_new.shape[-1], k_new.shape[-2]
        block_t = 16 if _interpreting(k_new.device) else 32
        self.key, self.varlen, self.paged = key, varlen, block_table is not None
        self.seen_key = None if key is None else (key, "seen")  # the launch that also writes the seen lengths
        self.grid = None if batch == 0 or max_new == 0 else (batch, heuristics.cdiv(max_new, block_t), nheads_kv)
        capacity = _cache_capacity(k_cache, block_table, batch)
        kb = (0, k_new.stride(0), k_new.stride(1)) if varlen else k_new.stride()[:3]
        vb = (0, v_new.stride(0), v_new.stride(1)) if varlen else v_new.stride()[:3]
        quant_args = _quant_args(quant, write_scales)
        # the key fixes every layout: the arguments after the tensors are the same for each of its calls
        self.tail = (capacity, 0 if varlen else k_new.shape[1], k_new.shape[0], k_cache.shape[0], *kb, *vb,
                     *k_cache.stride()[:3], block_table.stride(0) if self.paged else 0,
                     *(quant_args.get(n, 0 if n.startswith("stride") else None) for n in _RUNTIME_QUANT_ARGS))
        constexprs = dict(
            HEADDIM=headdim, BLOCK_T=block_t, BLOCK_D=heuristics.next_power_of_2(max(16, headdim)),
            PAGE_SIZE=k_cache.shape[1] if self.paged else 0, VARLEN=varlen, num_warps=4,
            **{n: x for n, x in quant_args.items() if n not in _RUNTIME_QUANT_ARGS})
        self.constexprs = lambda: constexprs
        fixed = dict(zip(_SITE.runtime_names[7:-1], self.tail))  # (the tensors first, SEEN last)
        self.bound = None if key is None else BoundLaunch(_SITE, key, fixed)
        self.seen_bound = None if key is None else BoundLaunch(_SITE, self.seen_key, fixed)

    def run(self, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, cu_seqlens_new, seen=None):
        """The append on these tensors (of the checked layouts); ``seen``: None, or a contiguous int32 (batch,)
        tensor that receives cache_seqlens + each sequence's new tokens in the same launch (the kernel's SEEN).
        Returns whether a kernel ran (none for no sequence or no new token: ``seen`` is then not written)."""
        if self.grid is None:
            return False
        bound = self.bound if seen is None else self.seen_bound
        full = None if bound is None else bound.full()
        if full is not None:  # the key's recorded launch: its argument list, this call's tensors written in
            at_k, at_v, at_kc, at_vc, at_lens, at_cu, at_bt, at_seen = _CALL_TENSORS
            full[at_k], full[at_v], full[at_kc], full[at_vc], full[at_lens] = k_new, v_new, k_cache, v_cache, \
                cache_seqlens
            full[at_cu] = cu_seqlens_new if self.varlen else cache_seqlens
            full[at_bt] = block_table if self.paged else cache_seqlens
            full[at_seen] = seen
            bound.launch(self.grid, full, k_new.device)
            return True
        runtime = (k_new, v_new, k_cache, v_cache, cache_seqlens, cu_seqlens_new if self.varlen else cache_seqlens,
                   block_table if self.paged else cache_seqlens) + self.tail + (seen,)
        _SITE.launch(self.key if seen is None else self.seen_key, self.grid, runtime, self.constexprs, k_new.device)
        return True


_SITE = LaunchSite(append_kv_kernel, "append_kv_kernel")
_CALL_TENSORS = _SITE.positions("K_NEW", "V_NEW", "K_CACHE", "V_CACHE", "SEQLENS", "CU_NEW", "BLOCK_TABLE", "SEEN")
_RUNTIME_QUANT_ARGS = ("K_SCALE", "V_SCALE", "stride_sb", "stride_st", "stride_sh")


def _quant_args(quant, write_scales: bool) -> dict:
    """append_kv_kernel's K_SCALE / V_SCALE / stride_s* / QUANT / QMAX ({} for a float cache)."""
    if quant is None:
        return {}
    sb, st, sh = quant.strides
    return dict(K_SCALE=quant.k_scale, V_SCALE=quant.v_scale, stride_sb=sb, stride_st=st, stride_sh=sh,
                QUANT=2 if write_scales else 1, QMAX=QMAX[quant.dtype])
