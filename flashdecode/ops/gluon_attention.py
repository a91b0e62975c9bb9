"""The dispatch of the warp-specialised Gluon attention forward (flashdecode.kernels.gluon.attn_fwd) on Hopper:
which calls it takes (``gluon_supported``; callers fall back to the Triton path otherwise), with which launch
(heuristics.resolve_gluon_config and its fp8 / ragged / paged siblings, a GluonFwdConfig from flashdecode/config.py;
``config=`` overrides it), and the public forwards over ops/gluon_plan.py's launch plans. The backward is
ops/gluon_backward.py.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from flashdecode import heuristics
from flashdecode.config import TILE_ORDERS, GluonBwdConfig, GluonFwdConfig  # noqa: F401
from flashdecode.heuristics import (FP8_BN256_MIN_KEYS, FP8_HEAD_DIMS, GLUON_HD64_MIN_KEYS,  # noqa: F401
                                    GLUON_HEAD_DIMS, LPT_TILE_OVERHEAD_BLOCKS, RAGGED_PAIRS_MAX_KEYS,
                                    THREE_CONSUMERS_MIN_KEYS, gluon_pays, gluon_varlen_pays, resolve_gluon_bwd_config,
                                    resolve_gluon_config, resolve_gluon_fp8_config, resolve_gluon_varlen_config)
from flashdecode.ops.checks import FP8_DTYPE, check_bool, check_tensor, interpreting, resolve_scale
from flashdecode.ops.fp8_v_transpose import fp8_v_transposed
from flashdecode.ops.gluon_plan import (NOT_APPLICABLE, PLANS, GluonPlan, lpt_schedule, run_plan,  # noqa: F401
                                        tile_key_blocks, v_rows)
from flashdecode.ops.score_transform import log2_scale_of, logit_scales_of
from flashdecode.ops.util import aligned16, cdiv, is_hopper, rows_layout_ok

GLUON_DTYPES = (torch.float16, torch.bfloat16)


def gluon_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0, varlen: bool = False) -> bool:
    """Whether gluon_attention_forward computes this call: Hopper, fp16/bf16, head dim 64 or 128, no window, no
    softcap, fixed-length batches, non-empty sequences, TMA-viewable layouts (util.rows_layout_ok) at 16-byte
    aligned addresses."""
    if varlen or softcap != 0.0 or tuple(window_size) != (-1, -1):
        return False
    return supported_problem(q, k, v) and aligned16(q, k, v)


def supported_problem(q, k, v) -> bool:
    """gluon_supported's part that a launch key fixes (all but the pointers), for a plain fixed-length call."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return False
    if q.dtype not in GLUON_DTYPES or not (q.dtype == k.dtype == v.dtype) or not is_hopper(q.device):
        return False
    if q.shape[-1] not in GLUON_HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape != k.shape:
        return False
    if not (q.device == k.device == v.device) or q.shape[0] != k.shape[0]:
        return False
    if min(q.shape[:3]) == 0 or min(k.shape[:3]) == 0 or q.shape[2] % k.shape[2] != 0:
        return False
    return all(rows_layout_ok(t) for t in (q, k, v))


def supported_fp8_problem(q, k, v) -> bool:
    """The e4m3 kernel takes q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_kv, headdim) in
    TMA-viewable layouts and v like k (any strides: the kernel reads its transposed copy), all float8_e4m3fn on one
    sm_90 device, head dim in FP8_HEAD_DIMS, non-empty sequences."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.dtype == FP8_DTYPE for t in (q, k, v)):
        return False
    if not (q.device == k.device == v.device) or not is_hopper(q.device):
        return False
    b, sk, hkv, d = k.shape
    if q.shape[-1] != d or d not in FP8_HEAD_DIMS or q.shape[0] != b or q.shape[2] % hkv != 0 or v.shape != k.shape:
        return False
    if min(q.shape[:3]) == 0 or min(k.shape[:3]) == 0:
        return False
    return rows_layout_ok(q) and rows_layout_ok(k)


def _plan_for(q, k, v, causal: bool, config: Optional[GluonFwdConfig]):
    """The plan of this launch key (built on its first call), or NOT_APPLICABLE where the Gluon kernel does not
    take the problem or (config None: the dispatch decides) gluon_pays rules it out. Key: shapes, strides, dtypes,
    devices, causal, config; the pointers' 16-byte alignment is the one per-call fact, the caller checks it."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
           k.device, v.device, causal, config)

    def build():
        fp8 = q.dtype == FP8_DTYPE
        supported = supported_fp8_problem(q, k, v) if fp8 else supported_problem(q, k, v)
        if supported and (config is not None or gluon_pays(q.shape[-1], k.shape[1])):
            resolve = resolve_gluon_fp8_config if fp8 else resolve_gluon_config
            return GluonPlan(q, k, v, causal, config or resolve(q.shape[-1], causal, k.shape[1]))
        return NOT_APPLICABLE
    return PLANS.get_or_build(key, build)


def gluon_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            softmax_scale: Optional[float] = None,
                            config: Optional[GluonFwdConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention forward on the Gluon kernel (whether or not gluon_pays says it is the faster path).

    q: (batch, seqlen_q, nheads, headdim), k/v: (batch, seqlen_k, nheads_kv, headdim), fp16/bf16 on an sm_90 GPU.
    Returns out (batch, seqlen_q, nheads, headdim) contiguous in q's dtype and lse (batch, nheads, seqlen_q)
    float32, natural log (-inf on rows that see no key). causal is bottom-right aligned. Raises ValueError where
    gluon_supported is False (callers check it first and take the Triton path)."""
    check_tensor("q", q, (4, ), GLUON_DTYPES)
    check_tensor("k", k, (4, ), GLUON_DTYPES)
    check_tensor("v", v, (4, ), GLUON_DTYPES)
    check_bool("causal", causal)
    if not gluon_supported(q, k, v, causal):
        raise ValueError("q, k, v: this call is outside the Gluon kernel's support (see gluon_supported); "
                         "use flashdecode.ops.attention")
    scale = resolve_scale(softmax_scale, q.shape[-1])
    cfg = config or resolve_gluon_config(q.shape[-1], causal, k.shape[1])
    return run_plan(_plan_for(q, k, v, causal, cfg), q, k, v, scale)


def gluon_forward_if_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                               window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                               varlen: bool = False) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The forward on the Gluon kernel where it applies and is the faster path, else None (take the Triton path).

    For flashdecode.ops.attention's forward, after its argument checks, with its normalised options: softmax_scale
    a float, window_left / window_right as there (-1 = unbounded; (-1, 0) is causal, bottom-right aligned).
    q: (batch, seqlen_q, nheads, headdim), k/v: (batch, seqlen_k, nheads_kv, headdim).
    Returns (out, lse) exactly as the Triton forward does for dense inputs: out (batch, seqlen_q, nheads, headdim)
    in q's dtype (contiguous), lse (batch, nheads, seqlen_q) float32 contiguous, natural log, -inf on rows that see
    no key (out 0 there). None for: varlen, a sliding window, softcap, the CPU interpreter, a non-sm_90 device,
    fp32, head dims other than 64/128, layouts TMA cannot read, empty sequences, and problems gluon_pays rules out.
    Host cost on a repeated launch key: one dict lookup, two allocations, one direct launch."""
    plan = None if varlen else dispatch_plan(q, k, v, window_left, window_right, softcap)
    return None if plan is None else run_plan(plan, q, k, v, softmax_scale)


def dispatch_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_left: int = -1, window_right: int = -1,
                  softcap: float = 0.0, config: Optional[GluonFwdConfig] = None) -> Optional[GluonPlan]:
    """The plan of a dense forward that the dispatch sends to the Gluon kernel (see gluon_forward_if_supported,
    whose arguments these are; e4m3 q, k, v: see gluon_fp8_forward_into), else None. The answer holds
    for every call that shares the launch key (shapes, strides, dtypes, devices, mask flags) and the pointers'
    16-byte alignment and the interpreter switch: a caller that keys on those may keep it (the dense call cache,
    ops/attention_plans.py). config: the launch to use (and no gluon_pays rule), as in gluon_attention_forward."""
    if softcap != 0.0 or window_left != -1 or window_right not in (-1, 0) or interpreting():
        return None
    if not isinstance(q, torch.Tensor) or not is_hopper(q.device):
        return None
    plan = _plan_for(q, k, v, window_right == 0, config)
    if plan is NOT_APPLICABLE or not aligned16(q, k, v):
        return None
    return plan


# ----------------------------------------------------------------------------------------------------------------
# Ragged (varlen) batches: flash_attn_varlen's forward on the same kernel, sequences read from cu_seqlens on the device
# ----------------------------------------------------------------------------------------------------------------


def _ragged_plan_for(q, k, v, batch: int, max_seqlen_q: int, causal: bool, config: Optional[GluonFwdConfig]):
    """The ragged plan of this launch key (_plan_for's, with the batch and the longest query count, which number
    the tiles), or NOT_APPLICABLE."""
    key = ("ragged", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device, causal, config, batch, max_seqlen_q)

    def build():
        mean_keys = cdiv(k.shape[0], batch)
        # the packed tensors as one sequence of total rows: _supported_problem's checks of a fixed-length batch
        if (supported_problem(q[None], k[None], v[None])
                and (config is not None or gluon_varlen_pays(q.shape[-1]))):
            cfg = config or resolve_gluon_varlen_config(q.shape[-1], causal, mean_keys)
            if cfg.tile_order != "lpt":
                return GluonPlan(q, k, v, causal, cfg, ragged=(batch, max_seqlen_q))
        return NOT_APPLICABLE
    return PLANS.get_or_build(key, build)


def gluon_varlen_forward_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                              lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                              max_seqlen_q: int, softmax_scale: float, window_left: int = -1,
                              window_right: int = -1, softcap: float = 0.0,
                              config: Optional[GluonFwdConfig] = None) -> bool:
    """flash_attn_varlen's forward on the Gluon kernel where it applies and pays (config given: where it
    applies; config None: only while heuristics.PREFILL_RAGGED_GLUON is on): writes out and lse and returns True;
    else returns False having touched nothing (take the Triton path). For flashdecode.ops.attention's forward,
    after its argument checks.

    q (total_q, nheads, headdim), k / v (total_k, nheads_kv, headdim) fp16/bf16 on sm_90, packed along the tokens;
    cu_seqlens_q / cu_seqlens_k int32 (batch + 1,) contiguous on q's device (read there: no host sync);
    max_seqlen_q >= every sequence's query count (it numbers the tiles); out (total_q, nheads, headdim)
    contiguous in q's dtype; lse (nheads, total_q) float32 contiguous (natural log; -inf and out 0 on rows that see
    no key). Options as in gluon_forward_if_supported: causal (bottom-right aligned per sequence) or none."""
    if softcap != 0.0 or window_left != -1 or window_right not in (-1, 0) or interpreting():
        return False
    if config is None and not heuristics.PREFILL_RAGGED_GLUON:
        return False
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not is_hopper(q.device) or max_seqlen_q <= 0:
        return False
    if not (out.is_contiguous() and lse.is_contiguous() and cu_seqlens_q.is_contiguous()
            and cu_seqlens_k.is_contiguous() and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32):
        return False
    plan = _ragged_plan_for(q, k, v, cu_seqlens_q.shape[0] - 1, max_seqlen_q, window_right == 0, config)
    if plan is NOT_APPLICABLE or not aligned16(q, k, v):
        return False
    if plan.compiled is None:  # the first (JIT) launch takes tensors, later ones their addresses
        plan.launch(q, k, v, out, lse, log2_scale_of(softmax_scale),
                    cu_seqlens=(cu_seqlens_q, cu_seqlens_k, v_rows(plan, v)))
    else:
        plan.launch(q, k, v, out.data_ptr(), lse.data_ptr(), log2_scale_of(softmax_scale),
                    cu_seqlens=(cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), v_rows(plan, v.data_ptr())))
    return True


# ----------------------------------------------------------------------------------------------------------------
# Paged KV caches: flash_attn_varlen(block_table=)'s forward (ops/paged_prefill.py) on the same kernel, each key block
# loaded from its page (attn_fwd_ws_paged_kernel)
# ----------------------------------------------------------------------------------------------------------------

# Every length, row and window bound the paged kernel adds or subtracts stays below this (int32 arithmetic on the
# device; an unbounded window side is passed as this bound).
PAGED_INDEX_BOUND = 2**30


def paged_window_args(window_left: int, window_right: int) -> tuple[bool, bool, int, int]:
    """(CAUSAL, WINDOW, window_left, window_right) of the paged kernel for ops/checks.py's normalised window (-1 =
    unbounded, (-1, 0) = causal): causal alone takes the causal tile loop; any other bounded side a window, its
    unbounded side (and any wider than the kernel's lengths) passed as PAGED_INDEX_BOUND."""
    if window_left < 0 and window_right < 0:
        return False, False, 0, 0
    if window_left < 0 and window_right == 0:
        return True, False, 0, 0
    def bound(w: int) -> int:
        return PAGED_INDEX_BOUND if w < 0 else min(w, PAGED_INDEX_BOUND)
    return False, True, bound(window_left), bound(window_right)


def paged_unsupported(q, k_cache, v_cache, block_table, config: Optional[GluonFwdConfig] = None) -> Optional[str]:
    """Why the Gluon paged kernel cannot take this call (a phrase naming the argument), or None where it can (the
    dispatch then asks resolve_gluon_paged_config whether it should, unless config is given). Shapes, strides,
    dtypes, devices and addresses only - no metadata values, no sync. q (total_q, nheads, headdim); caches
    (num_pages, page_size, nheads_kv, headdim) of q's dtype (not 8-bit), read by TMA as (num_pages * page_size,
    nheads_kv * headdim) rows: unit head-dim stride, heads packed, pages back to back, 16-byte aligned bases and
    token stride, k and v one set of strides; block_table int32 (batch, max_pages)."""
    if interpreting():
        return "the CPU interpreter runs no Gluon kernel"
    if not (isinstance(q, torch.Tensor) and q.dim() == 3 and q.dtype in GLUON_DTYPES and is_hopper(q.device)):
        return "q: fp16 / bf16 (total_q, nheads, headdim) on an sm_90 GPU"
    num_pages, page_size, nheads_kv, headdim = k_cache.shape
    if headdim not in GLUON_HEAD_DIMS or q.shape[2] != headdim:
        return f"q: head dim {q.shape[2]} (the kernel takes {GLUON_HEAD_DIMS})"
    if not (k_cache.dtype == v_cache.dtype == q.dtype) or v_cache.shape != k_cache.shape:
        return "k_cache, v_cache: q's dtype, one shape"
    if k_cache.stride() != v_cache.stride() or not _pages_are_rows(k_cache) or not aligned16(q, k_cache, v_cache):
        return ("k_cache, v_cache: pages back to back with packed heads and a unit head-dim stride, 16-byte aligned "
                "(one set of strides)")
    if not rows_layout_ok(q[None]):
        return "q: packed heads, unit head-dim stride, 16-byte row stride"
    if q.shape[1] % nheads_kv:
        return "q: nheads a multiple of the cache's nheads_kv"
    block_n = heuristics.gluon_paged_block_n(page_size) if config is None else config.block_n
    if block_n == 0 or page_size % block_n:
        what = "config.block_n" if config is not None else "k_cache"
        return f"{what}: page size {page_size} holds no whole key block of {block_n or 64}"
    if config is not None and config.tile_order == "lpt":
        return "config.tile_order: 'lpt' needs the lengths on the host (a ragged launch takes no host tile lists)"
    if config is not None and not config.v_tail:
        return "config.v_tail: the paged kernel always zeroes a page's tail (v_tail=False is a ragged ablation)"
    if config is not None and config.v_bound:
        return "config.v_bound: the paged kernel zeroes a page's tail in shared memory (v_bound is the ragged kernel's)"
    # the kernel clamps each key count into its table row: max_pages * page_size keys at most
    if num_pages * page_size >= 2**31 or block_table.shape[1] * page_size + q.shape[0] >= PAGED_INDEX_BOUND:
        return f"k_cache / block_table / q: keys and rows below {PAGED_INDEX_BOUND} (int32 positions)"
    return None


def _pages_are_rows(cache: torch.Tensor) -> bool:
    """cache (num_pages, page_size, nheads_kv, headdim) read as (num_pages * page_size, nheads_kv * headdim) rows
    of a TMA view: unit dim stride, heads packed, page stride = page_size token strides, 16-byte token stride."""
    _, page_size, nheads_kv, headdim = cache.shape
    st = cache.stride()
    return (st[3] == 1 and st[2] == headdim and st[0] == page_size * st[1]
            and (st[1] * cache.element_size()) % 16 == 0)


_resolve_paged = functools.lru_cache(maxsize=1024)(heuristics.resolve_gluon_paged_config)


def _paged_plan_for(q, k_cache, v_cache, block_table, batch: int, max_seqlen_q: int, window: tuple, softcap: bool,
                    cfg: GluonFwdConfig) -> GluonPlan:
    """The paged plan of this launch key: q's and the caches' shapes and strides, the table's, dtypes, device, the
    mask constexprs and window bounds (paged_window_args), softcap or not, batch, the longest query count (it
    numbers the tiles) and the launch cfg. The caller checked paged_unsupported."""
    causal, windowed = window[0], window[1]
    key = ("paged", q.shape, q.stride(), k_cache.shape, k_cache.stride(), block_table.shape, block_table.stride(),
           q.dtype, q.device, window, softcap, cfg, batch, max_seqlen_q)
    return PLANS.get_or_build(key, lambda: GluonPlan(q, k_cache, v_cache, causal, cfg, ragged=(batch, max_seqlen_q),
                                                     paged=dict(WINDOW=windowed, SOFTCAP=softcap)))


def gluon_paged_forward_into(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                             block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                             window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                             config: Optional[GluonFwdConfig] = None) -> bool:
    """A paged prefill's forward on the Gluon kernel (ops/paged_prefill.py, after its checks): writes out and lse
    and returns True; else returns False having touched nothing (take the Triton kernel). config None: only while
    heuristics.PREFILL_PAGED_GLUON is on and resolve_gluon_paged_config gives a launch; a GluonFwdConfig: that
    launch wherever paged_unsupported is None (the caller raises for the rest).

    q (total_q, nheads, headdim) fp16/bf16 on sm_90, packed by cu_seqlens_q int32 (batch + 1,) contiguous;
    k_cache / v_cache (num_pages, page_size, nheads_kv, headdim) as paged_unsupported takes them; seqused_k int32
    (batch,) contiguous and block_table int32 (batch, max_pages) with a unit last stride (both read on the device:
    no host sync); max_seqlen_q >= every sequence's query count (it numbers the tiles), max_seqlen_k the longest
    key count (the resolver's length); out (total_q, nheads, headdim) contiguous in q's dtype; lse (nheads,
    total_q) float32 contiguous (natural log; -inf and out 0 on rows that see no key). softmax_scale > 0; window as
    ops/checks.py normalises it (bottom-right aligned per sequence), softcap 0 (off) or > 0."""
    if config is None and not heuristics.PREFILL_PAGED_GLUON:
        return False
    if max_seqlen_q <= 0 or paged_unsupported(q, k_cache, v_cache, block_table, config) is not None:
        return False
    if not (out.is_contiguous() and lse.is_contiguous() and cu_seqlens_q.is_contiguous()
            and seqused_k.is_contiguous() and block_table.stride(-1) == 1):
        return False
    window = paged_window_args(window_left, window_right)
    cfg = config or _resolve_paged(q.shape[-1], window[0], k_cache.shape[1], max_seqlen_k)
    if cfg is None:  # the resolver keeps this call on the Triton kernel
        return False
    plan = _paged_plan_for(q, k_cache, v_cache, block_table, cu_seqlens_q.shape[0] - 1, max_seqlen_q, window,
                           softcap > 0.0, cfg)
    scale, softcap_log2 = logit_scales_of(softmax_scale, softcap)
    pointers = (cu_seqlens_q, seqused_k, block_table)
    if plan.compiled is not None:  # the first (JIT) launch takes tensors, later ones their addresses
        out, lse = out.data_ptr(), lse.data_ptr()
        pointers = tuple(t.data_ptr() for t in pointers)
    extra = pointers + (block_table.stride(0), block_table.shape[1], k_cache.shape[0], window[2], window[3],
                        softcap_log2)
    plan.launch(q, k_cache, v_cache, out, lse, scale, cu_seqlens=extra)
    return True


# ----------------------------------------------------------------------------------------------------------------
# FP8 (float8_e4m3fn): the e4m3 kernel behind flash_attn's FP8 forward
# ----------------------------------------------------------------------------------------------------------------

def gluon_fp8_forward_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           qk_descale: torch.Tensor, v_descale: torch.Tensor, softmax_scale: float,
                           window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                           config: Optional[GluonFwdConfig] = None) -> bool:
    """flash_attn's dense FP8 forward on the e4m3 Gluon kernel where it applies (and gluon_pays, unless config is
    given): writes out and lse and returns True; else returns False having touched nothing (take the Triton path).

    q (batch, seqlen_q, nheads, headdim), k, v (batch, seqlen_k, nheads_kv, headdim) float8_e4m3fn (v is first
    transposed, ops/fp8_v_transpose.py); out (batch, seqlen_q, nheads, headdim) bfloat16 contiguous; lse (batch,
    nheads, seqlen_q) float32 contiguous (natural log; -inf and out 0 on rows that see no key). qk_descale float32
    (batch, nheads):
    q_descale * k_descale per query head; v_descale float32 (batch, nheads_kv). Options as in
    gluon_forward_if_supported; the kernel takes causal or not, without softcap or window, off the interpreter."""
    if config is not None and config.overlap:
        raise ValueError("config: the e4m3 kernel has no OVERLAP (see resolve_gluon_fp8_config)")
    if config is not None and config.tile_order == "lpt":
        raise ValueError("config.tile_order: the e4m3 kernel has no host-made tile lists (a tile order other than "
                         "'lpt')")
    plan = dispatch_plan(q, k, v, window_left, window_right, softcap, config)
    if plan is None or not (out.is_contiguous() and lse.is_contiguous() and out.dtype == torch.bfloat16):
        return False
    vt, _ = fp8_v_transposed(v, key_order="wgmma")
    plan.launch(q, k, vt, out, lse, log2_scale_of(softmax_scale),
                descales=(qk_descale.contiguous(), v_descale.contiguous()))
    return True
