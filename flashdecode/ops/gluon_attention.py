"""Launcher of the warp-specialised Gluon attention forward (flashdecode.kernels.gluon.attn_fwd) on Hopper.

``gluon_supported`` says when the kernel applies; callers fall back to the Triton path otherwise. The launch
decisions live in one frozen config resolved from the head dim; ``config=`` overrides it (benchmarks, probes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch

from flashdecode import heuristics
from flashdecode.ops import direct_launch
from flashdecode.ops.fp8_v_transpose import fp8_v_transposed
from flashdecode.ops.checks import LOG2E, check_bool, check_tensor, interpreting, resolve_scale

GLUON_HEAD_DIMS = (64, 128)
GLUON_DTYPES = (torch.float16, torch.bfloat16)
GLUON_HD64_MIN_KEYS = 1024  # gluon_pays: hd64 calls take the Gluon kernel from this many keys
FP8_DTYPE = torch.float8_e4m3fn
FP8_HEAD_DIMS = (64, 128, 256)  # the e4m3 kernel's head dims (no register spills at any, 2 stages fit hd256)
TILE_ORDERS = {"round_robin": 0, "zigzag": 1, "pairs": 2, "lpt": 3}  # kernels/gluon/attn_fwd.py TILE_ORDER_*
LPT_TILE_OVERHEAD_BLOCKS = 2.0  # lpt_schedule's cost of a tile beyond its key blocks (Q load, epilogue), in blocks
EXP2_EMU_DEGREES = (3, 4, 5)  # the exp2 polynomials the kernel has (kernels/gluon/attn_fwd.py EXP2_POLY)
_SM_REGISTERS = 65536  # an H100 SM's register file, shared by every partition's warpgroup (setmaxnreg)


@dataclasses.dataclass(frozen=True)
class GluonFwdConfig:
    """One launch of attn_fwd_ws_kernel: a tile is num_consumers * 64 query rows; key blocks of block_n rows flow
    through a ring of num_stages shared-memory slots; overlap = FA3's intra-warpgroup QK^T / softmax / PV overlap;
    pingpong = the two consumer warpgroups take turns issuing wgmma; persistent = one CTA per SM looping over tiles
    (else one CTA per tile); q_buffers = Q buffer sets (2: a persistent CTA loads its next tile's Q rows while the
    consumers still read the current tile's; kernels/gluon/attn_fwd.py _producer); consumer_regs / producer_regs =
    per-thread register budgets of the worker partitions (setmaxnreg; the default partition, consumer 0, gets what
    is left of the SM's 65536: num_consumers * 128 * consumer_regs + 128 * producer_regs must fit, so 3 consumers
    take consumer_regs <= 160, FA3's hd64 budget); exp2_emu_cols = columns of each key block whose exp2 runs as a
    degree-exp2_emu_degree polynomial on the FMA pipe instead of the MUFU unit (0 = none; a multiple of 8 up to
    block_n; kernels/gluon/attn_fwd.py _exp2_mixed; fp16/bf16 only); tile_order = how CTAs with two Q buffer sets
    take their tiles (TILE_ORDERS): "round_robin" (program_id, program_id + num_programs, ...), "zigzag"
    (persistent: round j of num_programs tiles, CTA c takes the c-th on even j, the c-th from the end on odd j;
    _second_tile), "pairs" (a CTA per unit of two tiles of one head, its k-th heaviest and k-th lightest query
    blocks: with causal tiles every unit carries about the same work; _pair_tiles) or "lpt" (persistent: each CTA
    walks a list made on the host by handing the tiles, in the order the grid would run them, to whichever CTA
    is free first by a cost model - what the hardware's block dispatch does for one CTA per tile, with the
    next tile's loads under the current tile's end; lpt_schedule); split_release = the consumers release a
    slot's K as soon as their scores are in registers and its V after PV (FA3's two pipelines), so the producer
    can load the next K into it during the softmax and PV (else one release after PV frees both)."""

    num_consumers: int = 2
    block_n: int = 128
    num_stages: int = 2
    overlap: bool = False
    pingpong: bool = False
    persistent: bool = False
    q_buffers: int = 1
    consumer_regs: int = 240
    producer_regs: int = 24
    exp2_emu_cols: int = 0
    exp2_emu_degree: int = 5
    tile_order: str = "round_robin"
    split_release: bool = False

    def __post_init__(self):
        if self.num_consumers not in (1, 2, 3):
            raise ValueError(f"num_consumers: 1, 2 or 3 warpgroups, got {self.num_consumers}")
        for name in ("consumer_regs", "producer_regs"):
            regs = getattr(self, name)
            if not (isinstance(regs, int) and 24 <= regs <= 256 and regs % 8 == 0):
                raise ValueError(f"{name}: setmaxnreg takes a multiple of 8 in [24, 256], got {regs}")
        if 128 * (self.num_consumers * self.consumer_regs + self.producer_regs) > _SM_REGISTERS:
            raise ValueError(f"consumer_regs: {self.num_consumers} consumer warpgroups of {self.consumer_regs} and a "
                             f"producer of {self.producer_regs} registers per thread exceed {_SM_REGISTERS} per SM")
        if not (isinstance(self.exp2_emu_cols, int) and 0 <= self.exp2_emu_cols <= self.block_n
                and self.exp2_emu_cols % 8 == 0):
            raise ValueError(f"exp2_emu_cols: a multiple of 8 in [0, block_n={self.block_n}], got "
                             f"{self.exp2_emu_cols}")
        if self.exp2_emu_degree not in EXP2_EMU_DEGREES:
            raise ValueError(f"exp2_emu_degree: one of {EXP2_EMU_DEGREES}, got {self.exp2_emu_degree}")
        if self.tile_order not in TILE_ORDERS:
            raise ValueError(f"tile_order: one of {tuple(TILE_ORDERS)}, got {self.tile_order!r}")
        if self.tile_order != "round_robin" and self.q_buffers != 2:
            raise ValueError(f"tile_order: {self.tile_order!r} orders the tile pairs of CTAs with two Q buffer sets "
                             f"(q_buffers=2)")
        if self.tile_order in ("zigzag", "lpt") and not self.persistent:
            raise ValueError(f"tile_order: {self.tile_order!r} orders a persistent CTA's tiles (persistent=True)")
        if self.tile_order == "lpt" and self.exp2_emu_cols:
            raise ValueError("tile_order: the 'lpt' kernel has no exp2 emulation (exp2_emu_cols=0)")

    @property
    def block_m(self) -> int:
        return 64 * self.num_consumers


THREE_CONSUMERS_MIN_KEYS = 16384  # hd64: three consumer warpgroups from here (resolve_gluon_config)
PERSISTENT_MAX_KEYS = 2048  # persistent CTAs (one per SM) up to this many keys (resolve_gluon_config)
PERSISTENT_MID_MAX_KEYS = 8192  # ... and up to this many for causal launches and hd64 (resolve_gluon_config)
LPT_OVERLAP_CAUSAL_MIN_KEYS = 4096  # hd128 causal: host tile lists + the overlapped loop beyond this many keys
LPT_OVERLAP_MIN_KEYS = 1024  # hd128 non-causal: ... from this many keys up to PERSISTENT_MID_MAX_KEYS
FP8_BN256_MIN_KEYS = 16384  # e4m3 hd128: 256-key blocks from here (resolve_gluon_fp8_config)


def resolve_gluon_config(headdim: int, causal: bool = False, seqlen_k: int = 0) -> GluonFwdConfig:
    """hd128: two stages of 128-key K/V (64 KiB each) beside a 128-row Q tile fill most of the 227 KiB of shared
    memory; hd64 tiles are half the size, so three stages fit with room to spare.

    Persistent CTAs only for short keys (to 2k; to 8k for causal launches and hd64; hd128 causal launches beyond
    4k and non-causal ones of 1k-8k keys take the host-made longest-first tile lists of tile_order="lpt" with the
    overlapped loop, see below): there each tile is a few
    blocks, and a CTA that stays resident loads the next tile's first K/V blocks under the current tile's last ones
    and its epilogue (H100, 16 x 1k: +10-11% hd128, +6-12% hd64); at 16k keys it measured 1-7% slower at hd128,
    and at 4k-8k non-causal hd128 2-6% slower. A causal persistent CTA takes its tiles in
    pairs of one head's k-th heaviest and k-th lightest (tile_order="pairs"): a static round robin over single
    tiles gave some CTAs far more work than others (16k causal hd128: ~400 vs 580-630 TFLOP/s). Long causal
    launches at hd128 take tile_order="lpt" instead (each persistent CTA gets a host-made list of tiles, heaviest
    first, greedily balanced by key blocks: H100 kernel time, 1 x 16k causal 611.2 -> 618.5 TFLOP/s, the engine's
    64k x 32 / 8 heads 566.2 -> 575.1; docs/decisions.md); hd64 (unmeasured there) stays one CTA per tile.

    hd64 from THREE_CONSUMERS_MIN_KEYS keys: three consumer warpgroups (192-row tiles, 160 registers each), FA3's
    hd64 tile - at hd64 a block's softmax costs as much as its two GEMMs, and a third warpgroup keeps the tensor
    cores fed while two run softmax (H100, 16k keys: 538.8 vs 452.3 TFLOP/s, causal 483.9 vs 464.6; cuDNN 497.6 /
    452.2 in the same run). At 16 x 1k it lost (412 vs 418; causal 168 vs 238: few blocks per tile), and lengths
    between were not measured."""
    persistent = 0 < seqlen_k <= PERSISTENT_MAX_KEYS or (
        0 < seqlen_k <= PERSISTENT_MID_MAX_KEYS and (causal or headdim == 64))
    if headdim == 64 and seqlen_k >= THREE_CONSUMERS_MIN_KEYS:
        return GluonFwdConfig(num_consumers=3, consumer_regs=160, num_stages=3)
    # two Q buffer sets where CTAs are persistent: 16 x 1k non-causal 1.056x (hd128) / 1.074x (hd64) on the H100;
    # one set elsewhere (16k keys: 0.97x; forced-persistent causal 0.985x) - docs/decisions.md. Causal persistent
    # CTAs take pairs of one head's heavy and light tiles (equal work per unit, so the round robin balances):
    # 16 x 1k causal 352 -> 408 TFLOP/s at hd128, 235 -> 277 at hd64, 4 x 4k 517 -> 564 / 374 -> 398, 2 x 8k
    # 573 -> 586 / 418 -> 422; at 16k keys pairs gave nothing. hd64 non-causal persistent to 8k: 4 x 4k 424 -> 462,
    # 2 x 8k 438 -> 477 (hd128 lost there: 607 -> 595, 617 -> 581).
    # hd128: FA3's intra-warpgroup overlap (block j's softmax under PV of block j - 1) with K and V slots released
    # apart (the overlapped loop holds a V slot a block longer, so with one release per slot the next K load waited
    # on it): H100 kernel time, 1 x 16k x 16 heads, 652.2 -> 705.7 TFLOP/s, causal 628.8 -> 690.9 (cuDNN 647.9 /
    # 634.6, FA3 707.5 / 715.6 in the same run; docs/decisions.md). Not on the short persistent launches: with the
    # two Q buffer sets' unrolled tile loop they spill and lost (16 x 1k causal 427.7 -> 241.1, 4 x 4k causal
    # 589.7 -> 551.5; non-causal 16 x 1k 592.4 -> 588.9).
    # Host tile lists with the overlapped loop instead: causal launches beyond 4k keys, non-causal ones of 1k-8k
    # keys (kernel time: 2 x 8k causal 617.7 -> 643.1; non-causal 16 x 1k 595.5 -> 616.5, 4 x 4k 687.7 -> 707.2,
    # 2 x 8k 707.9 -> 713.7; 4 x 4k causal lost, 587.5 -> 569.6).
    if headdim == 128 and (seqlen_k > LPT_OVERLAP_CAUSAL_MIN_KEYS if causal
                           else LPT_OVERLAP_MIN_KEYS <= seqlen_k <= PERSISTENT_MID_MAX_KEYS):
        return GluonFwdConfig(num_stages=2, persistent=True, q_buffers=2, tile_order="lpt", overlap=True,
                              split_release=True)
    stages = 2 if headdim > 64 else 3
    if persistent:
        return GluonFwdConfig(num_stages=stages, persistent=True, q_buffers=2,
                              tile_order="pairs" if causal else "round_robin")
    # causal launches get here only with seqlen_k unknown (0): the overlapped causal loop spills one CTA per tile
    fa3_loop = headdim == 128 and not causal
    return GluonFwdConfig(num_stages=stages, overlap=fa3_loop, split_release=fa3_loop)


def resolve_gluon_fp8_config(headdim: int, causal: bool = False, seqlen_k: int = 0) -> GluonFwdConfig:
    """The e4m3 kernel's launch: K and V^T slots are half the bf16 size, so the ring gets more stages in the same
    shared memory (hd64: 4, hd128: 3, hd256: 2 - 196 KiB with the 64 KiB Q tile); persistent CTAs for non-causal
    launches to 2k keys (tile pairs are not timed for e4m3). hd128 from FP8_BN256_MIN_KEYS keys: 256-key blocks in
    two stages (the per-block rescale and bookkeeping amortised over twice the keys; H100, 16k keys: 906.0 vs 830.5
    TFLOP/s, causal 957.4 vs 837.9, docs/decisions.md; shorter keys not timed), non-causal ones on persistent CTAs
    with two Q buffer sets (each tile's first loads under the previous tile's last blocks and store: 986.4 vs 891.9
    TFLOP/s; causal ones spill there and lose, 634.3 vs 925.5). No OVERLAP: its P (e4m3) would be a dependency of a
    wgmma wait, which Triton 3.6 cannot lower for 8-bit values."""
    persistent = not causal and 0 < seqlen_k <= PERSISTENT_MAX_KEYS
    if headdim == 128 and seqlen_k >= FP8_BN256_MIN_KEYS:
        if causal:
            return GluonFwdConfig(num_stages=2, block_n=256)
        return GluonFwdConfig(num_stages=2, block_n=256, persistent=True, q_buffers=2)
    return GluonFwdConfig(num_stages={64: 4, 128: 3}.get(headdim, 2), persistent=persistent)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _rows_layout_ok(x: torch.Tensor) -> bool:
    """x (batch, seqlen, heads, headdim) can be read as a 2-D (batch * seqlen, heads * headdim) TMA view: unit dim
    stride, heads packed, batch rows follow seq rows, 16-byte row stride (the base pointer is checked per call)."""
    b, s, h, d = x.shape
    st = x.stride()
    return (st[3] == 1 and st[2] == d and (b == 1 or st[0] == s * st[1])
            and (st[1] * x.element_size()) % 16 == 0)


def _aligned16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """TMA reads from 16-byte aligned base addresses only."""
    return (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0


def gluon_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0, varlen: bool = False) -> bool:
    """Whether gluon_attention_forward computes this call: Hopper, fp16/bf16, head dim 64 or 128, no window, no
    softcap, fixed-length batches, non-empty sequences, TMA-viewable layouts (see _rows_layout_ok) at 16-byte
    aligned addresses."""
    if varlen or softcap != 0.0 or tuple(window_size) != (-1, -1):
        return False
    return _supported_problem(q, k, v) and _aligned16(q, k, v)


def _supported_problem(q, k, v) -> bool:
    """gluon_supported's part that a launch key fixes (all but the pointers), for a plain fixed-length call."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return False
    if q.dtype not in GLUON_DTYPES or not (q.dtype == k.dtype == v.dtype) or not _is_hopper(q.device):
        return False
    if q.shape[-1] not in GLUON_HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape != k.shape:
        return False
    if not (q.device == k.device == v.device) or q.shape[0] != k.shape[0]:
        return False
    if min(q.shape[:3]) == 0 or min(k.shape[:3]) == 0 or q.shape[2] % k.shape[2] != 0:
        return False
    return all(_rows_layout_ok(t) for t in (q, k, v))


def _supported_fp8_problem(q, k, v) -> bool:
    """The e4m3 kernel takes q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_kv, headdim) in
    TMA-viewable layouts and v like k (any strides: the kernel reads its transposed copy), all float8_e4m3fn on one
    sm_90 device, head dim in FP8_HEAD_DIMS, non-empty sequences."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.dtype == FP8_DTYPE for t in (q, k, v)):
        return False
    if not (q.device == k.device == v.device) or not _is_hopper(q.device):
        return False
    b, sk, hkv, d = k.shape
    if q.shape[-1] != d or d not in FP8_HEAD_DIMS or q.shape[0] != b or q.shape[2] % hkv != 0 or v.shape != k.shape:
        return False
    if min(q.shape[:3]) == 0 or min(k.shape[:3]) == 0:
        return False
    return _rows_layout_ok(q) and _rows_layout_ok(k)


# ----------------------------------------------------------------------------------------------------------------
# Launch plans: everything a call computes besides the data, cached per launch key; after a key's first launch
# (through Triton's JIT) its calls go to the compiled kernel's launcher directly
# ----------------------------------------------------------------------------------------------------------------

_RUNTIME_ARGS = 9  # attn_fwd_ws_kernel's parameters before its constexprs: q_desc ... qk_scale_log2
_LPT_EXTRA_ARGS = 1  # attn_fwd_ws_lpt_kernel's sched_ptr after qk_scale_log2
_FP8_EXTRA_ARGS = 2  # attn_fwd_fp8_ws_kernel's descale pointers after out_ptr and lse_ptr
_RAGGED_EXTRA_ARGS = 2  # attn_fwd_ws_varlen_kernel's cu_seqlens pointers after qk_scale_log2
_PLAN_CACHE_SIZE = 4096  # launch keys kept (a dict cleared when full: a plan is cheap to rebuild)
_NOT_APPLICABLE = False  # the cached "no Gluon launch for this key" (None means "not seen yet")
_PLANS: dict = {}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _vt_view(v: torch.Tensor) -> tuple[list, list]:
    """(shape, strides) of the e4m3 kernel's V^T of v (batch, seqlen_k, nheads_kv, headdim): fp8_v_transposed's
    (batch, nheads_kv, headdim, keys_pad) contiguous copy (key_order "wgmma", keys_pad = seqlen_k rounded up to 32,
    zeros past seqlen_k) read as the 2-D (batch * nheads_kv * headdim, keys_pad) rows. The view takes the padding
    in: keys are renumbered within each 32, so a column past seqlen_k may hold a key before it."""
    b, sk, h, d = v.shape
    pad = _cdiv(sk, 32) * 32
    return [b * h * d, pad], [pad, 1]


def _rows_view(x: torch.Tensor) -> tuple[list, list]:
    """(shape, strides) of x (batch, seqlen, heads, headdim) - or a ragged batch's (total, heads, headdim) - read
    as the 2-D (batch * seqlen, heads * headdim) rows view the kernel's TMA descriptors take."""
    if x.dim() == 3:
        t, h, d = x.shape
        return [t, h * d], [x.stride(0), 1]
    b, s, h, d = x.shape
    return [b * s, h * d], [x.stride(1), 1]


_HostDescriptor = direct_launch.HostDescriptor


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


def _kernel(fp8: bool = False, lpt: bool = False, ragged: bool = False):
    """The Gluon forward kernel: fp16/bf16, e4m3 (which takes V^T and two descale pointers more), fp16/bf16 on
    host-made tile lists (tile_order "lpt": the sched pointer after qk_scale_log2) or over a ragged batch (the
    cu_seqlens pointers after qk_scale_log2)."""
    from flashdecode.kernels.gluon import attn_fwd

    if lpt:
        return attn_fwd.attn_fwd_ws_lpt_kernel
    if ragged:
        return attn_fwd.attn_fwd_ws_varlen_kernel
    return attn_fwd.attn_fwd_fp8_ws_kernel if fp8 else attn_fwd.attn_fwd_ws_kernel


def _jit_launch(grid: tuple, args: tuple, constexprs: dict, fp8: bool = False, lpt: bool = False,
                ragged: bool = False):
    """One launch through Triton's JIT (binds, specialises, compiles on a miss); returns the compiled kernel."""
    compiled = _kernel(fp8, lpt, ragged)[grid](*args, **constexprs, num_warps=4)
    return compiled.result() if hasattr(compiled, "result") else compiled  # asynchronous compilation


def _kernel_arg_names(fp8: bool = False, lpt: bool = False, ragged: bool = False) -> list:
    return _kernel(fp8, lpt, ragged).arg_names


_current_stream = direct_launch.current_stream
_current_device = direct_launch.current_device


def tile_key_blocks(seqlen_q: int, seqlen_k: int, heads: int, cfg: GluonFwdConfig, causal: bool) -> list[int]:
    """Key blocks each tile visits, in the kernel's tile numbering (kernels/gluon/attn_fwd.py _tile_coords: head
    major; causal heads heaviest query block first) for ``heads`` = batch * nheads."""
    num_m = _cdiv(seqlen_q, cfg.block_m)
    per_head = []
    for i in range(num_m):
        m_start = (num_m - 1 - i if causal else i) * cfg.block_m
        n_end = seqlen_k
        if causal:
            n_end = min(seqlen_k, max(m_start + cfg.block_m + seqlen_k - seqlen_q, 0))
        per_head.append(_cdiv(n_end, cfg.block_n))
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


class _GluonPlan:
    """One launch key's launch: the resolved config, grid, lse shape, the TMA views of q, k, v, the constexprs, and
    (after the first launch) the compiled kernel with its launcher, handle and packed metadata, and its C launcher
    with the CUtensorMaps of the addresses seen (direct_launch.TensormapLauncher; None where Triton's launcher
    does not have the layout it expects). fp8 (e4m3 q, k, v): each launch gets V^T (see _vt_view) as v and the
    descale pointers after out and lse."""

    __slots__ = ("cfg", "grid", "num_tiles", "seqlen_q", "seqlen_k", "lse_shape", "views", "constexprs", "tail",
                 "sched", "sched_ptr", "ragged",
                 "compiled", "run", "function", "packed", "direct", "direct_launches", "device", "index", "shapes",
                 "discard_lse", "q_contiguous", "lse_template", "fp8")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, cfg: GluonFwdConfig,
                 ragged: Optional[tuple] = None):
        """ragged: None for q (batch, seqlen_q, nheads, headdim), k / v (batch, seqlen_k, nheads_kv, headdim); or
        (batch, max_seqlen_q) for a ragged batch packed along the tokens: q (total_q, nheads, headdim), k / v
        (total_k, nheads_kv, headdim), each launch given the int32 cu_seqlens (attn_fwd_ws_varlen_kernel)."""
        self.cfg = cfg
        self.fp8 = q.dtype == FP8_DTYPE
        self.device, self.index = q.device, q.device.index
        self.q_contiguous = q.is_contiguous()
        self.ragged = ragged is not None
        if self.ragged:  # the tiles are numbered by the longest sequence; lse (nheads, total_q), its head stride
            (batch, seqlen_q), nheads = ragged, q.shape[1]
            self.seqlen_q, self.seqlen_k = seqlen_q, q.shape[0]
            self.lse_shape = (nheads, q.shape[0])
        else:
            batch, seqlen_q, nheads, _ = q.shape
            self.seqlen_q, self.seqlen_k = seqlen_q, k.shape[1]
            self.lse_shape = (batch, nheads, seqlen_q)
        num_m = _cdiv(seqlen_q, cfg.block_m)
        self.num_tiles = num_m * batch * nheads
        self.shapes = (self.num_tiles, seqlen_q, self.seqlen_k)  # the kernel's runtime arguments after lse_ptr
        units = _cdiv(num_m, 2) * batch * nheads if cfg.tile_order == "pairs" else self.num_tiles
        # the compiled kernel's launcher reads three grid entries
        self.grid = (min(units, _num_sms(q.device)) if cfg.persistent else units, 1, 1)
        self.lse_template = direct_launch.empty_template(self.lse_shape, torch.float32, q.device)
        self.views = (_rows_view(q), _rows_view(k), _vt_view(v) if self.fp8 else _rows_view(v))
        constexprs = dict(NUM_HEADS=nheads, GROUP=nheads // k.shape[-2], BLOCK_N=cfg.block_n,
                          NUM_STAGES=cfg.num_stages, NUM_CONSUMERS=cfg.num_consumers, CAUSAL=causal,
                          OVERLAP=cfg.overlap, PINGPONG=cfg.pingpong and cfg.num_consumers == 2,
                          CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, Q_BUFFERS=cfg.q_buffers,
                          TILE_ORDER=TILE_ORDERS[cfg.tile_order], EXP2_EMU_COLS=cfg.exp2_emu_cols,
                          EXP2_EMU_DEGREE=cfg.exp2_emu_degree, SPLIT_KV_RELEASE=cfg.split_release)
        # the ones this plan's kernel takes (e4m3: no exp2 emulation; lpt: Q_BUFFERS and TILE_ORDER fixed too)
        params = set(_kernel_arg_names(self.fp8, cfg.tile_order == "lpt", self.ragged))
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
        data_ptr() ints after the first launch)."""
        if self.index == _current_device():
            self._launch(q, k, v, out, lse, qk_scale_log2, ptrs, descales, cu_seqlens)
        else:
            with torch.cuda.device(self.device):
                self._launch(q, k, v, out, lse, qk_scale_log2, ptrs, descales, cu_seqlens)

    def _launch(self, q, k, v, out, lse, qk_scale_log2: float, ptrs: Optional[tuple], descales: tuple,
                cu_seqlens: tuple) -> None:
        if self.compiled is None:
            v_block = (v.shape[2], self.cfg.block_n) if self.fp8 else (self.cfg.block_n,)
            descs = (_descriptor(q, self.views[0], 64), _descriptor(k, self.views[1], self.cfg.block_n),
                     _descriptor(v, self.views[2], *v_block))
            # (the bf16 call as it always was: tests stub it)
            kernel = (dict(fp8=True) if self.fp8 else dict(lpt=True) if self.sched
                      else dict(ragged=True) if self.ragged else {})
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
            meta = None if enter is None else self.compiled.launch_metadata(self.grid, stream, *args)
            self.run(self.grid[0], self.grid[1], self.grid[2], stream, self.function, self.packed, meta, enter,
                     exit_, *args)
        self.direct_launches += 1

    def lse_discard(self):
        """Where a call that wants no lse lets the kernel write it: a data_ptr() int into
        direct_launch.discard_buffer (shared, never read), or None where it is too large (allocate it)."""
        if self.discard_lse is None:
            nbytes = math.prod(self.lse_shape) * 4
            buffer = direct_launch.discard_buffer(self.device, nbytes)
            self.discard_lse = False if buffer is None else buffer.data_ptr()
        return self.discard_lse or None

    def _record(self, compiled) -> None:
        """Keep what a direct launch needs; anything unexpected leaves the key on the JIT's path."""
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
            return
        extra = (_FP8_EXTRA_ARGS if self.fp8 else _LPT_EXTRA_ARGS if self.sched
                 else _RAGGED_EXTRA_ARGS if self.ragged else 0)
        names = _kernel_arg_names(self.fp8, bool(self.sched), self.ragged)[_RUNTIME_ARGS + extra:]
        if any(n not in self.constexprs for n in names):
            return
        self.tail = tuple(self.constexprs[n] for n in names)
        self.run, self.function, self.packed = compiled.run, compiled.function, compiled.packed_metadata
        self.direct = direct_launch.TensormapLauncher.of(compiled, self.views, self.grid)
        self.compiled = compiled


def _plan_for(q, k, v, causal: bool, config: Optional[GluonFwdConfig]):
    """The plan of this launch key (built on its first call), or _NOT_APPLICABLE where the Gluon kernel does not
    take the problem or (config None: the dispatch decides) gluon_pays rules it out. Key: shapes, strides, dtypes,
    devices, causal, config; the pointers' 16-byte alignment is the one per-call fact, the caller checks it."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
           k.device, v.device, causal, config)

    def build():
        fp8 = q.dtype == FP8_DTYPE
        supported = _supported_fp8_problem(q, k, v) if fp8 else _supported_problem(q, k, v)
        if supported and (config is not None or gluon_pays(q.shape[-1], k.shape[1])):
            resolve = resolve_gluon_fp8_config if fp8 else resolve_gluon_config
            return _GluonPlan(q, k, v, causal, config or resolve(q.shape[-1], causal, k.shape[1]))
        return _NOT_APPLICABLE
    return _cached_plan(key, build)


def _cached_plan(key: tuple, build):
    """The plan cached under ``key``, else ``build()``'s (a _GluonPlan or _NOT_APPLICABLE), kept for next time."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = build()
        if len(_PLANS) >= _PLAN_CACHE_SIZE:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def run_plan(plan: _GluonPlan, q, k, v, scale: float, need_lse: bool = True, ptrs: Optional[tuple] = None):
    """(out (batch, seqlen_q, nheads, headdim) contiguous like q, lse (batch, nheads, seqlen_q) float32) of q, k, v
    (the plan's launch key, 16-byte aligned) on the plan's launch. need_lse False: lse is None, and the kernel
    writes it where nobody reads it (no allocation; see _GluonPlan.lse_discard). ptrs: (q, k, v).data_ptr() where
    the caller has them."""
    # a contiguous q (the key fixes its strides) gives a contiguous out without the memory_format argument's parsing
    out = torch.empty_like(q) if plan.q_contiguous else torch.empty_like(q, memory_format=torch.contiguous_format)
    if plan.compiled is None:  # the first (JIT) launch takes tensors
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
        plan.launch(q, k, v, out, lse, scale * LOG2E)
        return out, lse if need_lse else None
    lse_ptr = None if need_lse else plan.lse_discard()
    if lse_ptr is None:
        lse = direct_launch.empty_from(plan.lse_template, plan.lse_shape, torch.float32, q.device)
        plan.launch(q, k, v, out.data_ptr(), lse.data_ptr(), scale * LOG2E, ptrs)
        return out, lse if need_lse else None
    plan.launch(q, k, v, out.data_ptr(), lse_ptr, scale * LOG2E, ptrs)
    return out, None


def gluon_pays(headdim: int, seqlen_k: int) -> bool:
    """The dispatch rule: whether the Gluon kernel is the faster forward (vs the Triton path) of a supported call.

    Measured per call with do_bench (H100, bf16, benchmarks/probes/gluon_dispatch.py, docs/decisions.md; its L2
    flush between calls hides host work shorter than itself, so short shapes compare kernel times, and the Gluon
    host path measured no slower than the Triton one, benchmarks/probes/gluon_host_overhead.py):
    hd128 faster on every shape timed (1.08-2.25x: 128 to 16k tokens, GQA, a 512-row chunk against 4k keys, 64
    queries against 2k keys, causal or not); hd64 faster from 1024 keys (1.08-1.21x) and slower below (0.30-0.77x
    at 128 and 512 keys)."""
    return headdim == 128 or seqlen_k >= GLUON_HD64_MIN_KEYS


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
                  softcap: float = 0.0, config: Optional[GluonFwdConfig] = None) -> Optional[_GluonPlan]:
    """The plan of a dense forward that the dispatch sends to the Gluon kernel (see gluon_forward_if_supported,
    whose arguments these are; e4m3 q, k, v: see gluon_fp8_forward_into), else None. The answer holds
    for every call that shares the launch key (shapes, strides, dtypes, devices, mask flags) and the pointers'
    16-byte alignment and the interpreter switch: a caller that keys on those may keep it (ops/attention.py's dense
    call cache). config: the launch to use (and no gluon_pays rule), as in gluon_attention_forward."""
    if softcap != 0.0 or window_left != -1 or window_right not in (-1, 0) or interpreting():
        return None
    if not isinstance(q, torch.Tensor) or not _is_hopper(q.device):
        return None
    plan = _plan_for(q, k, v, window_right == 0, config)
    if plan is _NOT_APPLICABLE or not _aligned16(q, k, v):
        return None
    return plan


# ----------------------------------------------------------------------------------------------------------------
# Ragged (varlen) batches: flash_attn_varlen's forward on the same kernel, sequences read from cu_seqlens on the device
# ----------------------------------------------------------------------------------------------------------------

RAGGED_PAIRS_MAX_KEYS = 1024  # causal ragged batches: persistent tile pairs up to this mean length (below)


def resolve_gluon_varlen_config(headdim: int, causal: bool, mean_keys: int) -> GluonFwdConfig:
    """The launch of a ragged batch whose sequences hold mean_keys keys on average (total_k / batch: the lengths
    themselves sit on the device). resolve_gluon_config's rule at that length, except:
    - host-made tile lists (tile_order "lpt") would need the lengths on the host: those launches take one CTA per
      tile instead (the hardware's block dispatch balances tiles of unequal sequences), with FA3's overlapped loop
      where it holds its state in registers (non-causal; the causal one spills one CTA per tile);
    - causal hd128 batches averaging more than RAGGED_PAIRS_MAX_KEYS keys take one CTA per tile too (hd64 was not
      measured ragged and keeps resolve_gluon_config's rule): a head's heavy and
      light tiles pair up into equal units only when its sequences are equal, and ragged ones are not (H100, 32 / 8
      heads hd128, kernel time: random lengths 100..4000 one CTA per tile 497.7 vs pairs 447.2 TFLOP/s; 64 x 256
      pairs 203.1 vs 162.7; docs/decisions.md, "Ragged prefill on the Gluon kernel")."""
    cfg = resolve_gluon_config(headdim, causal, mean_keys)
    if cfg.tile_order == "lpt" or (causal and headdim == 128 and mean_keys > RAGGED_PAIRS_MAX_KEYS):
        return GluonFwdConfig(num_stages=cfg.num_stages, overlap=not causal, split_release=not causal)
    return cfg


def _ragged_plan_for(q, k, v, batch: int, max_seqlen_q: int, causal: bool, config: Optional[GluonFwdConfig]):
    """The ragged plan of this launch key (_plan_for's, with the batch and the longest query count, which number
    the tiles), or _NOT_APPLICABLE."""
    key = ("ragged", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device, causal, config, batch, max_seqlen_q)

    def build():
        mean_keys = -(-k.shape[0] // batch)
        # the packed tensors as one sequence of total rows: _supported_problem's checks of a fixed-length batch
        if (_supported_problem(q[None], k[None], v[None])
                and (config is not None or gluon_pays(q.shape[-1], mean_keys))):
            cfg = config or resolve_gluon_varlen_config(q.shape[-1], causal, mean_keys)
            if cfg.tile_order != "lpt":
                return _GluonPlan(q, k, v, causal, cfg, ragged=(batch, max_seqlen_q))
        return _NOT_APPLICABLE
    return _cached_plan(key, build)


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
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not _is_hopper(q.device) or max_seqlen_q <= 0:
        return False
    if not (out.is_contiguous() and lse.is_contiguous() and cu_seqlens_q.is_contiguous()
            and cu_seqlens_k.is_contiguous() and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32):
        return False
    plan = _ragged_plan_for(q, k, v, cu_seqlens_q.shape[0] - 1, max_seqlen_q, window_right == 0, config)
    if plan is _NOT_APPLICABLE or not _aligned16(q, k, v):
        return False
    if plan.compiled is None:  # the first (JIT) launch takes tensors, later ones their addresses
        plan.launch(q, k, v, out, lse, softmax_scale * LOG2E, cu_seqlens=(cu_seqlens_q, cu_seqlens_k))
    else:
        plan.launch(q, k, v, out.data_ptr(), lse.data_ptr(), softmax_scale * LOG2E,
                    cu_seqlens=(cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()))
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
    if config is not None and (config.exp2_emu_cols or config.tile_order == "lpt"):
        raise ValueError("config: the e4m3 kernel has no exp2 emulation or host-made tile lists (exp2_emu_cols=0, "
                         "tile_order other than 'lpt')")
    plan = dispatch_plan(q, k, v, window_left, window_right, softcap, config)
    if plan is None or not (out.is_contiguous() and lse.is_contiguous() and out.dtype == torch.bfloat16):
        return False
    vt, _ = fp8_v_transposed(v, key_order="wgmma")
    plan.launch(q, k, vt, out, lse, softmax_scale * LOG2E,
                descales=(qk_descale.contiguous(), v_descale.contiguous()))
    return True


# ----------------------------------------------------------------------------------------------------------------
# Backward (flashdecode.kernels.gluon.attn_bwd): dispatch and launch
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GluonBwdConfig:
    """One launch of attn_bwd_ws_kernel: a CTA holds block_n = 128 keys (two consumer warpgroups of 64) and walks
    query blocks of block_m rows through a ring of num_stages Q / dO slots; dq_tma = dQ added by a writer warp's
    TMA reduce-adds from a staging buffer (else by the consumers' 16-byte atomics); consumer_regs / producer_regs
    as GluonFwdConfig's. tail_heavy_first (causal, deterministic): the grid's last (batch, kv head) launches its key
    blocks heaviest first instead of last (kernels/gluon/attn_bwd.py _key_block), so that the grid does not end
    on its heaviest blocks (the deterministic causal backward alone on the H200, 16k: hd128 496.4 -> 525.5
    TFLOP/s, hd64 422.9 -> 440.5; docs/decisions.md); other launches ignore it (tail_heavy_first_for)."""

    block_m: int = 64
    num_stages: int = 2
    dq_tma: bool = True
    consumer_regs: int = 240
    producer_regs: int = 24
    tail_heavy_first: bool = True

    @property
    def block_n(self) -> int:
        return 128

    def tail_heavy_first_for(self, causal: bool, deterministic: bool) -> bool:
        """The kernel's TAIL_HEAVY_FIRST for a launch: only causal deterministic launches change their order; the
        others keep the kernels they were timed as (the option's loops would compile differently there)."""
        return self.tail_heavy_first and causal and deterministic


def resolve_gluon_bwd_config(headdim: int) -> GluonBwdConfig:
    """hd128: two 64-row Q / dO stages beside K, V, the double dS buffer and the dQ staging tile use ~208 KiB of
    shared memory. hd64: 128-row query blocks in two stages (~210 KiB): a step of half the head dim has half the
    wgmma work per barrier, dS exchange and dQ reduce-add, so doubling its rows halves those per flop (the S^T /
    dP^T accumulators grow to 64 registers each, which the half-size dK / dV accumulators leave room for).
    Measured on the H200, 16k tokens, deterministic backward alone: 453.6 / 428.9 TFLOP/s non-causal / causal
    against 368.5 / 377.9 with 64-row blocks in three stages (docs/decisions.md)."""
    if headdim > 64:
        return GluonBwdConfig(num_stages=2)
    return GluonBwdConfig(block_m=128, num_stages=2)


def gluon_bwd_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                        window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                        scale: float = 1.0) -> bool:
    """Whether gluon_attention_backward computes this dense call: the forward's conditions (gluon_supported: sm_90,
    fp16/bf16, head dim 64/128, TMA-viewable layouts at 16-byte aligned addresses), no window (causal allowed), no
    softcap, a positive softmax scale (the kernel divides lse by it), and dout in q's shape, dtype and a
    TMA-viewable layout, not in the CPU interpreter."""
    if softcap != 0.0 or window_left != -1 or window_right not in (-1, 0) or not scale > 0.0 or interpreting():
        return False
    if not isinstance(dout, torch.Tensor) or dout.shape != q.shape or dout.dtype != q.dtype:
        return False
    if dout.device != q.device or not _rows_layout_ok(dout) or dout.data_ptr() % 16 != 0:
        return False
    return _supported_problem(q, k, v) and _aligned16(q, k, v)


def gluon_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool = False,
                             deterministic: bool = True,
                             config: Optional[GluonBwdConfig] = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of exact attention on the Gluon backward kernel, for a call gluon_bwd_supported accepts.

    q, dout, out: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), fp16/bf16 on an
    sm_90 GPU; lse: (batch, nheads, seqlen_q) float32, natural log (the forward's); scale: the softmax scale; causal
    bottom-right aligned. Returns dq, dk, dv contiguous like q, k, v in their dtype. deterministic: the dQ additions
    happen in one fixed order (bitwise reproducible); otherwise in arrival order (fp32 atomics)."""
    from flashdecode.kernels.gluon.attn_bwd import attn_bwd_prep_kernel, attn_bwd_ws_kernel

    cfg = config or resolve_gluon_bwd_config(q.shape[-1])
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    num_m = _cdiv(seqlen_q, cfg.block_m)
    # Padded row vectors (see attn_bwd_prep_kernel): the backward loads them without masks.
    lse2 = torch.empty((batch, nheads, num_m * cfg.block_m), dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse2)
    attn_bwd_prep_kernel[(num_m, nheads, batch)](out, dout, lse.contiguous(), lse2, delta, out.stride(),
                                                 dout.stride(), seqlen_q, NUM_HEADS=nheads, HEAD_DIM=headdim,
                                                 BLOCK_M=cfg.block_m, num_warps=4)
    dq_acc = torch.zeros((batch, seqlen_q, nheads, headdim), dtype=torch.float32, device=q.device)
    sem = torch.zeros((batch, nheads, num_m, 2) if deterministic else (1, ), dtype=torch.int32, device=q.device)
    dk = torch.empty((batch, seqlen_k, nheads_kv, headdim), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    d = headdim
    descs = (_block_descriptor(q, [cfg.block_m, d]), _block_descriptor(dout, [cfg.block_m, d]),
             _row_tile_descriptor(lse2, cfg.block_m), _row_tile_descriptor(delta, cfg.block_m),
             _block_descriptor(k, [cfg.block_n, d]), _block_descriptor(v, [cfg.block_n, d]),
             _block_descriptor(k, [cfg.block_n, d // 2]),
             _block_descriptor(dq_acc, [cfg.block_m, d // 2]))
    grid = (_cdiv(seqlen_k, cfg.block_n), nheads_kv, batch)
    with torch.cuda.device(q.device):
        attn_bwd_ws_kernel[grid](*descs, dk, dv, dq_acc, sem, seqlen_q, seqlen_k, scale * LOG2E,
                                 scale, NUM_HEADS=nheads, GROUP=nheads // nheads_kv, BLOCK_N=cfg.block_n,
                                 NUM_STAGES=cfg.num_stages, CAUSAL=causal, DETERMINISTIC=deterministic,
                                 DQ_TMA=cfg.dq_tma, CONSUMER_REGS=cfg.consumer_regs,
                                 PRODUCER_REGS=cfg.producer_regs,
                                 TAIL_HEAVY_FIRST=cfg.tail_heavy_first_for(causal, deterministic),
                                 num_warps=4)
    return dq_acc.to(q.dtype), dk, dv


def _block_descriptor(x: torch.Tensor, block: list):
    """TensorDescriptor of x's rows view (see _rows_view) with TMA block [rows, cols] (the backward also reads K
    in column halves)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shape, strides = _rows_view(x)
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[x.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(x.as_strided(shape, strides), shape, strides, block, layout)


def _row_tile_descriptor(rows: torch.Tensor, block_m: int):
    """TensorDescriptor of a padded (batch, nheads, num_m * block_m) float32 row vector read as (batch * nheads *
    num_m, block_m) tiles of one row, unswizzled: the backward's producer loads each step's lse2 / delta with
    its Q / dO."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shape = [rows.numel() // block_m, block_m]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(rows.view(shape), shape, [block_m, 1], [1, block_m], layout)


def gluon_backward_if_supported(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, scale: float, window_left: int = -1,
                                window_right: int = -1, softcap: float = 0.0,
                                deterministic: bool = True) -> Optional[tuple]:
    """The backward on the Gluon kernel where it applies, else None (take the Triton path). For
    flashdecode.ops.attention's dense backward, with its normalised options (window_right 0 = causal), on calls
    without an explicit config= (as the forward's dispatch: a config keeps the Triton kernels). Shapes as
    gluon_attention_backward's; a dout that TMA cannot read (autograd may hand an expanded or strided one) is
    made contiguous first.

    Measured (H100, bf16, hd128, 16k tokens, benchmarks/probes/gluon_bwd.py): the backward alone 528 / 499
    TFLOP/s non-causal / causal against the Triton backward's 427 / 416 and cuDNN's 517 / 518."""
    if interpreting() or not isinstance(q, torch.Tensor) or not _is_hopper(q.device):
        return None
    if isinstance(dout, torch.Tensor) and dout.dim() == 4 and not (_rows_layout_ok(dout)
                                                                   and dout.data_ptr() % 16 == 0):
        dout = dout.contiguous()
    if not gluon_bwd_supported(q, k, v, dout, window_left, window_right, softcap, scale):
        return None
    return gluon_attention_backward(dout, q, k, v, out, lse, scale, window_right == 0, deterministic)
