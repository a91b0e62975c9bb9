"""Prefill over a paged KV cache: a ragged batch of new query tokens attends to keys already in cache pages.

    flash_attn_varlen(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k,
                      block_table=block_table, seqused_k=seqused_k, ...)        (FlashAttention-3's form)

q (total_q, nheads, headdim) packed by int32 cu_seqlens_q (batch + 1,); k_cache, v_cache (num_pages, page_size,
nheads_kv, headdim) ("NHD" pages, any page size >= 1, unit head-dim stride, one set of strides for both; q's dtype,
or 8-bit with float32 k_scale / v_scale as flash_decode takes them); int32
block_table (batch, max_pages) lists each sequence's pages in key order; int32 seqused_k (batch,) its key count
(the new tokens included: they are appended to the cache first, e.g. by append_kv). Masks are bottom-right aligned
per sequence: query row i of a sequence with Lq new tokens and Lk keys sits at key position i + Lk - Lq.

Forward only (as in FlashAttention-3: no gradient flows into a cache). The Triton forward (kernels/fwd.py,
PAGE_SIZE > 0) finds each key block's pages in the table; keys on an id outside the cache are absent (masked,
never read). On sm_90 the warp-specialised Gluon forward (ops/gluon_attention.py gluon_paged_forward_into) takes
16-bit calls whose pages hold whole key blocks (page sizes that are multiples of 64), without ALiBi, where its
resolver says so (heuristics.PREFILL_PAGED_GLUON) or ``config=`` is a GluonFwdConfig (that launch, forced: a call
it cannot take raises ValueError); there an id outside the cache reads zeros (never memory outside it). Metadata
values (cu_seqlens_q, seqused_k, block_table ids, max_seqlen_q/k bounds) are checked on the
host where they live there; device-resident metadata only with ``validate=True`` (one copy to the host, one sync).
"""

from __future__ import annotations

from typing import Optional

import torch

from flashdecode import heuristics
from flashdecode.config import GluonFwdConfig
from flashdecode.ops import checks, gluon_attention, score_transform
from flashdecode.ops.attention_config import RESOLVE_CONFIG, config_for, config_id_of, gluon_allowed
from flashdecode.ops.attention_plans import _FWD_TILE, _buckets, _common_constexprs
from flashdecode.ops.decode_checks import _check_cache_pair, _check_lengths_and_table
from flashdecode.ops.kv_quant import resolve_kv_quant
from flashdecode.ops.launch_cache import PlanCache, TunedKernel
from flashdecode.ops.sinks import apply_sinks, check_sinks
from flashdecode.ops.util import (aligned_bits, autotune_enabled, capturing, cdiv, constant_slopes, pages_tma_ok,
                                  tma_layout_ok)
from flashdecode.kernels import fwd as fwd_kernels

__all__ = ["paged_prefill", "prepare_paged_prefill"]


def _check_inputs(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, k_scale,
                  v_scale):
    """Types, shapes, dtypes and devices (no values, no sync); returns (batch size, the 8-bit cache's checked scales
    or None)."""
    checks.check_tensor("q", q, (3,), checks.FLOAT_DTYPES)
    checks.check_kernel_device("q", q)
    quant = resolve_kv_quant(q.dtype, k_cache, v_cache, k_scale, v_scale)
    _check_cache_pair(k_cache, v_cache, q.dtype if quant is None else quant.dtype, q.device)
    nheads, headdim = q.shape[1], q.shape[2]
    if k_cache.shape[3] != headdim:
        raise ValueError(f"k_cache head dim ({k_cache.shape[3]}) must equal q's ({headdim})")
    if not 1 <= headdim <= checks.MAX_HEAD_DIM:
        raise ValueError(f"q head dim must be in 1..{checks.MAX_HEAD_DIM}, got {headdim}")
    nheads_kv = k_cache.shape[2]
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of the cache's nheads_kv ({nheads_kv})")
    if k_cache.shape[1] < 1:
        raise ValueError(f"k_cache must have a page size >= 1, got shape {tuple(k_cache.shape)}")
    batch = checks.check_cu_seqlens_layout("cu_seqlens_q", cu_seqlens_q, None, max_seqlen_q, "max_seqlen_q",
                                          q.device)
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
        raise TypeError(f"max_seqlen_k must be an int >= 0, got {max_seqlen_k!r}")
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be an int32 torch.Tensor, got {type(block_table).__name__}")
    _check_lengths_and_table(seqused_k, block_table, batch, q.device, name="seqused_k")
    if torch.is_grad_enabled():
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if x.requires_grad:
                raise ValueError(f"{name} requires grad, but attention over a paged KV cache (block_table=) is "
                                 "forward only (as in FlashAttention-3); detach the inputs or use torch.no_grad()")
    return batch, quant


def _check_metadata(q, k_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, validate):
    """Values of the metadata, where they live on the host or with validate=True (one copy to the host): cu_seqlens_q
    from 0, non-decreasing, ending at q's rows; seqused_k in [0, the pages the table gives]; block-table ids of the
    pages that hold keys inside the cache; max_seqlen_q / max_seqlen_k >= the longest sequence. ValueError names
    the argument and the first bad sequence."""
    if not (checks.check_bool("validate", validate) or checks.host_resident(seqused_k)):
        return
    if capturing(q.device):
        return  # no host copy inside a CUDA graph capture: the kernels clamp and mask bad values
    cu, lens, table = checks.to_host_once(cu_seqlens_q, seqused_k, block_table)
    checks.check_host_cu_seqlens("cu_seqlens_q", cu, q.shape[0], "q")
    if int(cu[-1]) != q.shape[0]:  # fewer: rows outside every sequence would be left unwritten
        raise ValueError(f"cu_seqlens_q[-1] = {int(cu[-1])} must equal the {q.shape[0]} packed rows of q")
    lens_q = (cu[1:] - cu[:-1]).long()
    if lens_q.numel() and int(lens_q.max()) > max_seqlen_q:
        b = int(lens_q.argmax())
        raise ValueError(f"max_seqlen_q = {max_seqlen_q} is smaller than sequence {b}'s {int(lens_q[b])} query "
                         "rows in cu_seqlens_q")
    page_size = k_cache.shape[1]
    checks.check_host_lengths("seqused_k", lens, block_table.shape[1] * page_size)
    lens = lens.long()
    if lens.numel() and int(lens.max()) > max_seqlen_k:
        b = int(lens.argmax())
        raise ValueError(f"max_seqlen_k = {max_seqlen_k} is smaller than sequence {b}'s {int(lens[b])} keys in "
                         "seqused_k")
    checks.check_host_block_table(table, torch.zeros_like(lens), lens, page_size, k_cache.shape[0])


class _PagedPlan:
    """The paged forward of one launch key: its configuration and kernel (the Triton forward with PAGE_SIZE)."""

    __slots__ = ("kernel", "buckets")

    def __init__(self, q, k_cache, v_cache, out, max_seqlen_q, max_seqlen_k, left, right, softcap, config_id,
                 has_alibi, kv_quant):
        self.buckets = _buckets(max_seqlen_q, max_seqlen_k)
        config = config_for(config_id, q, k_cache, v_cache, max_seqlen_k, True)
        constexprs = _common_constexprs(q.shape[-1], True, left, right, softcap, q.dtype, has_alibi)
        # descriptors for Q and Out, and K/V where pages hold whole KV blocks (not 8-bit caches: pointers): only
        # where the cache's layout allows them
        constexprs["USE_TMA"] = (config.fwd_tma and tma_layout_ok(q, out)
                                 and (kv_quant or pages_tma_ok(k_cache, v_cache)))
        constexprs["PAGE_SIZE"] = k_cache.shape[1]
        self.kernel = TunedKernel("fwd_paged", fwd_kernels.attn_fwd_kernel, config.fwd_tiles, _FWD_TILE,
                                   config.fwd_autotune, constexprs)


_PLANS = PlanCache()


def _plan(q, k_cache, v_cache, out, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, left, right,
          softcap, config_id, alibi_slopes, alibi_stride, quant) -> _PagedPlan:
    """The plan of this launch key (built on its first call): everything Triton specialises on or the configuration
    reads (shapes but the packed length, strides, dtypes, device, pointer alignment, page size, mask flags, shape
    buckets, the configuration and the autotune switch; an 8-bit cache's scale strides)."""
    scales = None if quant is None else (quant.strides, aligned_bits(quant.k_scale, quant.v_scale))
    key = (q.shape[1:], q.stride(), k_cache.shape[1:], k_cache.stride(), block_table.stride(), q.dtype,
           k_cache.dtype, q.device,
           aligned_bits(q, k_cache, v_cache, out, cu_seqlens_q, seqused_k, block_table, alibi_slopes),
           left >= 0, right >= 0, softcap > 0.0, config_id, autotune_enabled(),
           heuristics.seqlen_bucket(max_seqlen_q), heuristics.seqlen_bucket(max_seqlen_k),
           heuristics.prefill_length_class(max_seqlen_k), alibi_slopes is not None, alibi_stride, scales)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _PagedPlan(q, k_cache, v_cache, out, max_seqlen_q, max_seqlen_k, left,
                                          right, softcap, config_id, alibi_slopes is not None,
                                          quant is not None))
    return plan


def _forward(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, score, config_id,
             alibi_slopes, quant=None, gluon_config=None):
    """(out like q, lse (nheads, total_q) float32) of checked inputs; score: the call's ScoreTransform;
    gluon_config: a GluonFwdConfig that forces the Gluon kernel (prepare_paged_prefill checked that it takes the
    call)."""
    scale, left, right, softcap = score.scale, score.window_left, score.window_right, score.softcap
    total_q, nheads, _ = q.shape
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0 or max_seqlen_q == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    cu_seqlens_q, seqused_k = cu_seqlens_q.contiguous(), seqused_k.contiguous()  # read with a unit stride
    # scale > 0: the Gluon kernel masks scores before it scales them (as flash_attn_varlen's dispatch)
    if (quant is None and alibi_slopes is None and gluon_allowed(config_id) and scale > 0
            and gluon_attention.gluon_paged_forward_into(q, k_cache, v_cache, out, lse, cu_seqlens_q, seqused_k,
                                                         block_table, max_seqlen_q, max_seqlen_k, scale, left,
                                                         right, softcap, config=gluon_config)):
        return out, lse  # the Gluon kernel on Hopper where it applies (ops/gluon_attention.py)
    if gluon_config is not None:  # prepare_paged_prefill found that it takes the call: never fall back silently
        raise ValueError("config: the Gluon paged kernel did not take this call (see paged_unsupported)")
    alibi_stride = alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
    plan = _plan(q, k_cache, v_cache, out, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, left,
                 right, softcap, config_id, alibi_slopes, alibi_stride, quant)
    kv_pages = (block_table, seqused_k, block_table.stride(), block_table.shape[1], k_cache.shape[0])
    if quant is not None:
        kv_pages += ((quant.k_scale, quant.v_scale, quant.strides),)
    args = (q, k_cache, v_cache, out, lse, cu_seqlens_q, None, None, alibi_slopes,
            (0,) + q.stride(), k_cache.stride(), v_cache.stride(), (0,) + out.stride(), (0, total_q),
            nheads // k_cache.shape[2], max_seqlen_q, max_seqlen_k, total_q, 0,
            score.logit_scales, *score.kernel_window, alibi_stride, *plan.buckets, kv_pages)
    plan.kernel(lambda meta: (cdiv(max_seqlen_q, meta["BLOCK_M"]), nheads, batch), args, q.device)
    return out, lse


def _check_gluon_config(config: GluonFwdConfig, q, k_cache, v_cache, block_table, scale: float, alibi_slopes,
                        quant) -> None:
    """config= a GluonFwdConfig forces the Gluon kernel: ValueError naming what of the call it cannot take (a
    config override never switches kernels silently)."""
    config.check()
    why = gluon_attention.paged_unsupported(q, k_cache, v_cache, block_table, config)
    if why is None and (alibi_slopes is not None or quant is not None or not scale > 0):
        why = "alibi_slopes / an 8-bit cache / softmax_scale <= 0 (the Gluon kernel takes none of them)"
    if why is not None:
        raise ValueError(f"config: a GluonFwdConfig runs the Gluon paged kernel, which cannot take this call ({why})")


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  seqused_k: torch.Tensor, block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                  causal: bool = False, softmax_scale: Optional[float] = None, window_size=(-1, -1),
                  softcap: float = 0.0, return_lse: bool = False, alibi_slopes: Optional[torch.Tensor] = None,
                  sinks: Optional[torch.Tensor] = None, check_seqlens: bool = True, validate: bool = False,
                  config=None, k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None):
    """Attention of a ragged batch of query tokens against a paged KV cache (forward only).

    Args:
        q: (total_q, nheads, headdim) float16 / bfloat16 / float32.
        k_cache, v_cache: (num_pages, page_size, nheads_kv, headdim), q's dtype and device, one shape and one set
            of strides, unit head-dim stride; nheads % nheads_kv == 0 (GQA: query head h reads kv head
            h // (nheads // nheads_kv)).
        cu_seqlens_q: int32 (batch + 1,), from 0, non-decreasing, ending at total_q.
        seqused_k: int32 (batch,): keys of each sequence, at most max_pages * page_size (its query rows are its
            last positions, bottom-right aligned).
        block_table: int32 (batch, max_pages), unit last stride: page ids of each sequence's keys in order.
        max_seqlen_q, max_seqlen_k: ints >= the longest query run / key count (they size the grid and the
            launch buckets).
        causal, softmax_scale, window_size, softcap, alibi_slopes ((nheads,) or (batch, nheads) float32), sinks
            ((nheads,) sink logits): as flash_attn_varlen.
        check_seqlens: False skips the value checks of host-resident metadata too. validate: True copies
            device-resident metadata to the host once (one sync) and checks it (not while a CUDA graph is being
            captured). Unchecked bad values never move a read or write outside the tensors: rows and keys are
            clamped into q and the table, ids outside the cache are absent keys; query rows past max_seqlen_q and
            rows no sequence covers are left unwritten.
        config: None, an AttentionConfig (its fwd_tiles / fwd_autotune / fwd_tma; backend "triton" pins the Triton
            kernel) or a GluonFwdConfig: the Gluon kernel with that launch (sm_90, fp16/bf16, head dim 64 / 128,
            pages holding whole blocks of config.block_n keys, no ALiBi, no 8-bit cache, softmax_scale > 0;
            ValueError naming what it cannot take).
        k_scale, v_scale: with an 8-bit cache (float8_e4m3fn or int8, as flash_decode and append_kv take it):
            float32 scales broadcastable to (num_pages, page_size, nheads_kv): (), (nheads_kv,) or one per token
            and kv head; the attended keys are k_cache.float() * k_scale[..., None] (values likewise).
    Returns:
        out (total_q, nheads, headdim) like q [, lse (nheads, total_q) float32, natural log]; a row that sees no key
        gives out 0 and lse -inf.
    """
    return prepare_paged_prefill(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q,
                                 max_seqlen_k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                 softcap=softcap, return_lse=return_lse, alibi_slopes=alibi_slopes, sinks=sinks,
                                 check_seqlens=check_seqlens, validate=validate, config=config, k_scale=k_scale,
                                 v_scale=v_scale)()


def prepare_paged_prefill(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q: int,
                          max_seqlen_k: int, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                          return_lse=False, alibi_slopes=None, sinks=None, check_seqlens=True, validate=False,
                          config=None, k_scale=None, v_scale=None):
    """Every check of paged_prefill(...) (same arguments), and nothing launched or written: returns a function that
    runs the call and returns what paged_prefill returns. A caller that writes the cache first (append then attend,
    flash_attn_with_kvcache) checks the whole call here before its write, so a call that raises has changed nothing.
    The tensors and the metadata values must stay as they are until the run (the cache's contents may change)."""
    _, quant = _check_inputs(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                             k_scale, v_scale)
    checks.check_attention_options(causal, softmax_scale, window_size, softcap)
    checks.check_bool("return_lse", return_lse)
    checks.check_bool("check_seqlens", check_seqlens)
    batch = cu_seqlens_q.numel() - 1
    if alibi_slopes is not None:
        alibi_slopes = constant_slopes(checks.check_alibi_slopes(alibi_slopes, batch, q.shape[1], q.device))
    if sinks is not None:
        check_sinks(sinks, q.shape[1], q.device)
    gluon_config = config if isinstance(config, GluonFwdConfig) else None
    config_id = RESOLVE_CONFIG if gluon_config is not None else config_id_of(config)
    if check_seqlens or validate:
        _check_metadata(q, k_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, validate)
    score = score_transform.build(q.shape[-1], causal, softmax_scale, window_size, softcap,
                                  alibi=alibi_slopes is not None, sinks=sinks is not None)
    if gluon_config is not None:
        _check_gluon_config(gluon_config, q, k_cache, v_cache, block_table, score.scale, alibi_slopes, quant)

    def run():
        out, lse = _forward(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                            score, config_id, alibi_slopes, quant, gluon_config)
        if score.sinks:
            out, lse = apply_sinks(out, lse, sinks, "varlen")
        return (out, lse) if return_lse else out
    return run
