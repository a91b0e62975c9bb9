"""The launch plan of the Gluon attention forward (flashdecode.kernels.gluon.attn_fwd) on Hopper: everything a call
computes besides the data, kept per launch key (ops/launch_cache.py's PlanCache). A key's first launch goes through
Triton's JIT; later launches call the compiled kernel's C launcher directly with the CUtensorMaps of the addresses
seen (direct_launch.TensormapLauncher). Which calls take the kernel, and with which config, is decided by
ops/gluon_attention.py and heuristics.py; this module only launches.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from flashdecode.config import TILE_ORDERS, GluonFwdConfig
from flashdecode.heuristics import LPT_TILE_OVERHEAD_BLOCKS
from flashdecode.ops import direct_launch
from flashdecode.ops.checks import FP8_DTYPE
from flashdecode.ops.launch_cache import PlanCache, ensure_triton_allocator, launch_through_triton, recordable
from flashdecode.ops.score_transform import log2_scale_of
from flashdecode.ops.util import cdiv, num_sms

__all__ = ["GluonPlan", "PLANS", "NOT_APPLICABLE", "run_plan", "tile_key_blocks", "lpt_schedule", "rows_view"]

_RUNTIME_ARGS = 9  # attn_fwd_ws_kernel's parameters before its constexprs: q_desc ... qk_scale_log2
_LPT_EXTRA_ARGS = 1  # attn_fwd_ws_lpt_kernel's sched_ptr after qk_scale_log2
_FP8_EXTRA_ARGS = 2  # attn_fwd_fp8_ws_kernel's descale pointers after out_ptr and lse_ptr
# attn_fwd_ws_varlen_kernel's arguments after qk_scale_log2: the cu_seqlens pointers and v_rows_ptr (V_BOUND's
# V tensor, else None)
_RAGGED_EXTRA_ARGS = 3
# attn_fwd_ws_paged_kernel's arguments after qk_scale_log2: cu_q_ptr, seqused_ptr, block_table_ptr, bt_stride,
# max_pages, num_pages, window_left, window_right, softcap_log2
_PAGED_EXTRA_ARGS = 9
NOT_APPLICABLE = False  # the cached "no Gluon launch for this key" (a PlanCache miss is None)
PLANS = PlanCache()  # launch key -> GluonPlan or NOT_APPLICABLE (ops/gluon_attention.py's dispatch fills it)


def _vt_view(v: torch.Tensor) -> tuple[list, list]:
    """(shape, strides) of the e4m3 kernel's V^T of v (batch, seqlen_k, nheads_kv, headdim): fp8_v_transposed's
    (batch, nheads_kv, headdim, keys_pad) contiguous copy (key_order "wgmma", keys_pad = seqlen_k rounded up to 32,
    zeros past seqlen_k) read as the 2-D (batch * nheads_kv * headdim, keys_pad) rows. The view takes the padding
    in: keys are renumbered within each 32, so a column past seqlen_k may hold a key before it."""
    b, sk, h, d = v.shape
    pad = cdiv(sk, 32) * 32
    return [b * h * d, pad], [pad, 1]


def rows_view(x: torch.Tensor) -> tuple[list, list]:
    """(shape, strides) of x (batch, seqlen, heads, headdim) - or a ragged batch's (total, heads, headdim) - read
    as the 2-D (batch * seqlen, heads * headdim) rows view the kernel's TMA descriptors take."""
    if x.dim() == 3:
        t, h, d = x.shape
        return [t, h * d], [x.stride(0), 1]
    b, s, h, d = x.shape
    return [b * s, h * d], [x.stride(1), 1]


_HostDescriptor = direct_launch.HostDescriptor
_current_stream = direct_launch.current_stream
_current_device = direct_launch.current_device


def _descriptor(x: torch.Tensor, view: tuple[list, list], block_rows: int, block_cols: int = 0):
    """The real TensorDescriptor of x's rows view, for a key's first (JIT) launch, which specialises on its type.
    Blocks are [block_rows, x's last dim] unless block_cols is given."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shape, strides = view
    rows = x.as_strided(shape, strides)
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, FP8_DTYPE: gl.float8e4nv}[x.dtype]
    block = [block_rows, block_cols or x.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(rows, shape, strides, block, layout)


def _kernel(fp8: bool = False, lpt: bool = False, ragged: bool = False, paged: bool = False):
    """The Gluon forward kernel: fp16/bf16, e4m3 (which takes V^T and two descale pointers more), fp16/bf16 on
    host-made tile lists (tile_order "lpt": the sched pointer after qk_scale_log2), over a ragged batch (the
    cu_seqlens pointers after qk_scale_log2) or over a paged KV cache (paged: its _PAGED_EXTRA_ARGS there)."""
    from flashdecode.kernels.gluon import attn_fwd

    if paged:
        return attn_fwd.attn_fwd_ws_paged_kernel
    if lpt:
        return attn_fwd.attn_fwd_ws_lpt_kernel
    if ragged:
        return attn_fwd.attn_fwd_ws_varlen_kernel
    return attn_fwd.attn_fwd_fp8_ws_kernel if fp8 else attn_fwd.attn_fwd_ws_kernel


def _jit_launch(grid: tuple, args: tuple, constexprs: dict, fp8: bool = False, lpt: bool = False,
                ragged: bool = False, paged: bool = False):
    """One launch through Triton's JIT (binds, specialises, compiles on a miss); returns the compiled kernel."""
    compiled = _kernel(fp8, lpt, ragged, paged)[grid](*args, **constexprs, num_warps=4)
    return compiled.result() if hasattr(compiled, "result") else compiled  # asynchronous compilation


def _kernel_arg_names(fp8: bool = False, lpt: bool = False, ragged: bool = False, paged: bool = False) -> list:
    return _kernel(fp8, lpt, ragged, paged).arg_names


def tile_key_blocks(seqlen_q: int, seqlen_k: int, heads: int, cfg: GluonFwdConfig, causal: bool) -> list[int]:
    """Key blocks each tile visits, in the kernel's tile numbering (kernels/gluon/fwd_tiles.py TileSpace.coords: head
    major; causal heads heaviest query block first) for ``heads`` = batch * nheads."""
    num_m = cdiv(seqlen_q, cfg.block_m)
    per_head = []
    for i in range(num_m):
        m_start = (num_m - 1 - i if causal else i) * cfg.block_m
        n_end = seqlen_k
        if causal:
            n_end = min(seqlen_k, max(m_start + cfg.block_m + seqlen_k - seqlen_q, 0))
        per_head.append(cdiv(n_end, cfg.block_n))
    return per_head * heads


def lpt_schedule(tile_blocks: list[int], num_ctas: int, overhead: float = LPT_TILE_OVERHEAD_BLOCKS) -> torch.Tensor:
    """Each of num_ctas persistent CTAs' tiles (tile_order "lpt"): tile t (in the kernel's numbering, the order a
    grid of one CTA per tile runs them) goes to the CTA that is free first, its work tile_blocks[t] + overhead key
    blocks - list scheduling, the hardware's block dispatch simulated with a cost model, so heavy causal tiles
    start first and the light ones fill the tail, and CTAs running at the same time share a head's K/V in L2.
    Returns int32 (1 + num_ctas * S,) on the CPU: [S, then per CTA: count, its tiles in order, padding]; S = 1 +
    the longest list rounded up to even, padded with len(tile_blocks) (the kernel's "no tile")."""
    import heapq

    lists = [[] for _ in range(num_ctas)]
    free = [(0.0, c) for c in range(num_ctas)]
    for tile, blocks in enumerate(tile_blocks):
        when, cta = heapq.heappop(free)
        lists[cta].append(tile)
        heapq.heappush(free, (when + blocks + overhead, cta))
    width = max(len(tiles) for tiles in lists)
    width += width % 2
    pad = len(tile_blocks)
    rows = [[len(tiles)] + tiles + [pad] * (width - len(tiles)) for tiles in lists]
    return torch.tensor([1 + width] + [x for row in rows for x in row], dtype=torch.int32)


def _reads_next_values(batch: int, seqlen_k: int, block_n: int) -> bool:
    """Whether a fixed-length batch's last key block of a sequence reads the next sequence's values (its keys end
    inside a block and another sequence follows): the kernel must then zero those V rows (V_TAIL), or a NaN / inf
    value there would reach this sequence's rows through 0 * NaN in PV. The ragged kernel zeroes them always
    (V_TAIL True, unless GluonFwdConfig.v_tail's ablation), the paged one always (no V_TAIL parameter), and the e4m3
    kernel's V^T holds zeros there (none either)."""
    return batch > 1 and seqlen_k % block_n != 0


class GluonPlan:
    """One launch key's launch: the resolved config, grid, lse shape, the TMA views of q, k, v, the constexprs, and
    (after the first launch) the compiled kernel with its launcher, handle and packed metadata, and its C launcher
    with the CUtensorMaps of the addresses seen (direct_launch.TensormapLauncher; None where Triton's launcher
    does not have the layout it expects). fp8 (e4m3 q, k, v): each launch gets V^T (see _vt_view) as v and the
    descale pointers after out and lse."""

    __slots__ = ("cfg", "grid", "num_tiles", "seqlen_q", "seqlen_k", "lse_shape", "views", "constexprs", "tail",
                 "sched", "sched_ptr", "ragged", "paged", "v_bound",
                 "compiled", "run", "function", "packed", "direct", "direct_launches", "device", "index", "shapes",
                 "discard_lse", "q_contiguous", "lse_template", "fp8")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, cfg: GluonFwdConfig,
                 ragged: Optional[tuple] = None, paged: Optional[dict] = None):
        """ragged: None for q (batch, seqlen_q, nheads, headdim), k / v (batch, seqlen_k, nheads_kv, headdim); or
        (batch, max_seqlen_q) for a ragged batch packed along the tokens: q (total_q, nheads, headdim), k / v
        (total_k, nheads_kv, headdim), each launch given the int32 cu_seqlens (attn_fwd_ws_varlen_kernel).
        paged (with ragged): k / v are caches (num_pages, page_size, nheads_kv, headdim) read as rows (pages back
        to back, heads packed: rows_view), and paged holds attn_fwd_ws_paged_kernel's score constexprs (WINDOW,
        SOFTCAP); each launch gets its _PAGED_EXTRA_ARGS."""
        self.cfg = cfg
        self.paged = paged is not None
        self.fp8 = q.dtype == FP8_DTYPE
        self.device, self.index = q.device, q.device.index
        self.q_contiguous = q.is_contiguous()
        self.ragged = ragged is not None
        self.v_bound = self.ragged and not self.paged and cfg.v_bound  # launches pass v_rows(v) with cu_seqlens
        if self.ragged:  # the tiles are numbered by the longest sequence; lse (nheads, total_q), its head stride
            (batch, seqlen_q), nheads = ragged, q.shape[1]
            self.seqlen_q, self.seqlen_k = seqlen_q, q.shape[0]
            self.lse_shape = (nheads, q.shape[0])
        else:
            batch, seqlen_q, nheads, _ = q.shape
            self.seqlen_q, self.seqlen_k = seqlen_q, k.shape[1]
            self.lse_shape = (batch, nheads, seqlen_q)
        num_m = cdiv(seqlen_q, cfg.block_m)
        self.num_tiles = num_m * batch * nheads
        self.shapes = (self.num_tiles, seqlen_q, self.seqlen_k)  # the kernel's runtime arguments after lse_ptr
        units = cdiv(num_m, 2) * batch * nheads if cfg.tile_order == "pairs" else self.num_tiles
        # the compiled kernel's launcher reads three grid entries
        self.grid = (min(units, num_sms(q.device)) if cfg.persistent else units, 1, 1)
        self.lse_template = direct_launch.empty_template(self.lse_shape, torch.float32, q.device)
        self.views = (rows_view(q), rows_view(k), _vt_view(v) if self.fp8 else rows_view(v))
        constexprs = dict(NUM_HEADS=nheads, GROUP=nheads // k.shape[-2], BLOCK_N=cfg.block_n,
                          NUM_STAGES=cfg.num_stages, NUM_CONSUMERS=cfg.num_consumers, CAUSAL=causal,
                          OVERLAP=cfg.overlap, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
                          Q_BUFFERS=cfg.q_buffers,
                          TILE_ORDER=TILE_ORDERS[cfg.tile_order], SPLIT_KV_RELEASE=cfg.split_release,
                          V_TAIL=cfg.v_tail and not self.v_bound and (self.ragged or _reads_next_values(
                              batch, self.seqlen_k, cfg.block_n)), V_BOUND=self.v_bound)
        if self.paged:
            constexprs.update(paged, PAGE_SIZE=k.shape[1])
        # the ones this plan's kernel takes (lpt: Q_BUFFERS and TILE_ORDER fixed)
        params = set(_kernel_arg_names(self.fp8, cfg.tile_order == "lpt", self.ragged, self.paged))
        self.constexprs = {name: value for name, value in constexprs.items() if name in params}
        # tile_order "lpt": the host's tile lists, an argument after qk_scale_log2 (attn_fwd_ws_lpt_kernel)
        self.sched = ()
        if cfg.tile_order == "lpt":
            lists = lpt_schedule(tile_key_blocks(seqlen_q, self.seqlen_k, batch * nheads, cfg, causal), self.grid[0])
            self.sched = (lists.to(q.device), )
        self.sched_ptr = tuple(t.data_ptr() for t in self.sched)
        self.compiled = self.direct = self.discard_lse = None
        self.direct_launches = 0  # calls that skipped the JIT (the host-overhead test reads it)

    def launch(self, q, k, v, out, lse, qk_scale_log2: float, ptrs: Optional[tuple] = None,
               descales: tuple = (), cu_seqlens: tuple = ()) -> None:
        """One forward of q, k, v (this plan's launch key, 16-byte aligned) into out (batch, seqlen_q, nheads,
        headdim) contiguous and lse (batch, nheads, seqlen_q) float32 contiguous: tensors, or (after the first
        launch) their data_ptr() ints, which the C launcher takes as they are. ptrs: (q, k, v).data_ptr() where
        the caller has them. descales: () for fp16/bf16; (qk_descale (batch, nheads), v_descale (batch,
        nheads_kv)) float32 contiguous for e4m3 (v is then V^T, see _vt_view). cu_seqlens: () for fixed-length
        batches; a ragged plan's (cu_seqlens_q, cu_seqlens_k) int32 (batch + 1,) contiguous (tensors, or their
        data_ptr() ints after the first launch); a paged plan's _PAGED_EXTRA_ARGS (attn_fwd_ws_paged_kernel's
        arguments after qk_scale_log2, pointers likewise)."""
        if self.index == _current_device():
            self._launch(q, k, v, out, lse, qk_scale_log2, ptrs, descales, cu_seqlens)
        else:
            with torch.cuda.device(self.device):
                self._launch(q, k, v, out, lse, qk_scale_log2, ptrs, descales, cu_seqlens)

    def _launch(self, q, k, v, out, lse, qk_scale_log2: float, ptrs: Optional[tuple], descales: tuple,
                cu_seqlens: tuple) -> None:
        if self.v_bound:  # the kernel makes its bounded V descriptors in a global scratch: Triton's launcher (the
            ensure_triton_allocator()  # first launch, launch hooks) asks this thread's allocator for it
        if self.compiled is None:
            v_block = (v.shape[2], self.cfg.block_n) if self.fp8 else (self.cfg.block_n,)
            descs = (_descriptor(q, self.views[0], 64), _descriptor(k, self.views[1], self.cfg.block_n),
                     _descriptor(v, self.views[2], *v_block))
            # (the bf16 call as it always was: tests stub it)
            kernel = (dict(fp8=True) if self.fp8 else dict(lpt=True) if self.sched
                      else dict(paged=True) if self.paged else dict(ragged=True) if self.ragged else {})
            self._record(_jit_launch(self.grid, descs + (out, lse) + descales + self.shapes
                                     + (qk_scale_log2, ) + self.sched + cu_seqlens, self.constexprs, **kernel))
            return
        stream = _current_stream(self.index)
        enter, exit_ = direct_launch.launch_hooks()
        if enter is None and self.direct is not None:
            self.direct(stream, (q, k, v), (out, lse) + descales + (*self.shapes, qk_scale_log2, *self.sched_ptr,
                                                                    *cu_seqlens, *self.tail), ptrs)
        else:
            qv, kv, vv = self.views
            args = ((_HostDescriptor(q, qv), _HostDescriptor(k, kv), _HostDescriptor(v, vv), out, lse) + descales
                    + self.shapes + (qk_scale_log2, ) + self.sched_ptr + cu_seqlens + self.tail)
            launch_through_triton(self, self.grid, stream, args, enter, exit_)
        self.direct_launches += 1

    def lse_discard(self):
        """Where a call that wants no lse lets the kernel write it: a data_ptr() int into
        direct_launch.discard_buffer (shared, never read), or None where it is too large (allocate it)."""
        if self.discard_lse is None:
            self.discard_lse = direct_launch.discard_address(self.device, math.prod(self.lse_shape) * 4)
        return self.discard_lse or None

    def _record(self, compiled) -> None:
        """Keep what a direct launch needs; anything unexpected leaves the key on the JIT's path."""
        if not recordable(compiled):
            return
        extra = (_FP8_EXTRA_ARGS if self.fp8 else _LPT_EXTRA_ARGS if self.sched
                 else _PAGED_EXTRA_ARGS if self.paged else _RAGGED_EXTRA_ARGS if self.ragged else 0)
        names = _kernel_arg_names(self.fp8, bool(self.sched), self.ragged, self.paged)[_RUNTIME_ARGS + extra:]
        if any(n not in self.constexprs for n in names):
            return
        self.tail = tuple(self.constexprs[n] for n in names)
        self.run, self.function, self.packed = compiled.run, compiled.function, compiled.packed_metadata
        self.direct = direct_launch.TensormapLauncher.of(compiled, self.views, self.grid, self.device)
        self.compiled = compiled


def v_rows(plan: GluonPlan, v):
    """The ragged kernel's v_rows_ptr argument for v (a tensor or its data_ptr() int): v itself where the plan
    bounds its last V blocks (V_BOUND), else None (the kernel compiled without the parameter)."""
    return v if plan.v_bound else None


def run_plan(plan: GluonPlan, q, k, v, scale: float, need_lse: bool = True, ptrs: Optional[tuple] = None):
    """(out (batch, seqlen_q, nheads, headdim) contiguous like q, lse (batch, nheads, seqlen_q) float32) of q, k, v
    (the plan's launch key, 16-byte aligned) on the plan's launch. need_lse False: lse is None, and the kernel
    writes it where nobody reads it (no allocation; see GluonPlan.lse_discard). ptrs: (q, k, v).data_ptr() where
    the caller has them."""
    # a contiguous q (the key fixes its strides) gives a contiguous out without the memory_format argument's parsing
    out = torch.empty_like(q) if plan.q_contiguous else torch.empty_like(q, memory_format=torch.contiguous_format)
    if plan.compiled is None:  # the first (JIT) launch takes tensors
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
        plan.launch(q, k, v, out, lse, log2_scale_of(scale))
        return out, lse if need_lse else None
    lse_ptr = None if need_lse else plan.lse_discard()
    if lse_ptr is None:
        lse = direct_launch.empty_from(plan.lse_template, plan.lse_shape, torch.float32, q.device)
        plan.launch(q, k, v, out.data_ptr(), lse.data_ptr(), log2_scale_of(scale), ptrs)
        return out, lse if need_lse else None
    plan.launch(q, k, v, out.data_ptr(), lse_ptr, log2_scale_of(scale), ptrs)
    return out, None
