"""Typed configurations: every launch decision of an op, made once.

A config is a frozen dataclass resolved by a pure function of a problem description and device facts
(flashdecode/heuristics.py); ops take ``config=`` to override it (``dataclasses.replace`` of the resolved one).
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["DecodePath", "DecodeConfig", "check_decode_config", "AttentionProblem", "AttentionConfig", "GluonFwdConfig",
           "GluonBwdConfig"]


# ----------------------------------------------------------------------------------------------------------------
# Decode (flash_decode, DecodePlan)
# ----------------------------------------------------------------------------------------------------------------

class DecodePath(enum.Enum):
    """How a decode call is launched (docs/architecture.md, "Decode dispatch")."""

    UNSPLIT = "unsplit"                      # one stage-1 launch over (1, kv programs, batch) writes the result
    SPLIT_GRID = "split_grid"                # stage 1 over (num_splits, kv programs, batch), then the merge kernel
    DEVICE_SPLIT_GRID = "device_split_grid"  # stage 1, one program per work item, split counts chosen on the device
    PERSISTENT = "persistent"                # one launch of fixed programs, static shares, merge in-kernel
    PERSISTENT_QUEUE = "persistent_queue"    # the same, programs draw work items from an atomic queue
    FIXED_SPLIT = "fixed_split"              # batch-invariant: splits of split_keys keys each, then an in-order merge


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Every launch decision of one decode call (or of one DecodePlan run shape).

    Resolved by ``heuristics.resolve_decode_config``; ``flash_decode(..., config=)`` and ``DecodePlan(...,
    config=)`` take an override, typically ``dataclasses.replace`` of ``flashdecode.ops.decode.decode_config(...)``
    or of ``DecodePlan.config_for(...)``. Geometry that follows from these fields and the shapes (pages preloaded
    per split, pipeline depth with table reads, grid sizes) is derived at launch, never chosen here.
    """

    path: DecodePath
    num_splits: int                  # splits per sequence: the launch's count, or the most the device may choose
    #                                  (FIXED_SPLIT: the most a launch may take; its grid follows from the cache)
    block_n: int                     # keys per KV step (a power of two >= 16)
    num_warps: int
    num_stages: int                  # software pipeline depth (before the table-read stages below)
    table_read_extra_stages: int     # + stages where the KV loop reads page ids from the block table ...
    table_read_min_split_blocks: int  # ... and a split may hold at least this many blocks
    preload_pages_max: int           # most block-table ids a split holds in registers (0: read them in the loop)
    preload_gather_max: int          # the same for pages smaller than a block (ids gathered per key)
    preload_key_ids: bool            # pages of 1, 2, 4 keys preload their ids too
    use_tma: bool                    # K/V through host tensor descriptors (Hopper)
    use_pdl: bool                    # the next kernel (merge, next call) may launch early (Hopper)
    pdl_wait: bool                   # stage 1 is a programmatic dependent of the kernel before it (Hopper)
    prefetch_blocks: int             # blocks of its split stage 1 prefetches into L2 before the PDL wait (0: off)
    merge_early_trigger: bool        # the merge lets the next kernel launch before its own wait
    merge_d_chunks: int              # merge programs per row over head-dim chunks (1, 2 or 4)
    merge_max_rows: int              # rows per merge program (0: the merge's default tile)
    offs_32: bool                    # 32-bit gather offsets (every cache offset < 2**31)
    spec_pages: bool                 # paged: a split's page ids read beside its length after the PDL wait
    persistent_programs: int         # PERSISTENT*: programs of the fixed grid
    persistent_slots: int            # PERSISTENT_QUEUE: split slots per program
    queue_splits: int                # PERSISTENT_QUEUE: equal lengths split up to this many ways (0: off)
    queue_full_fraction: float       # PERSISTENT_QUEUE: ... where its last round would hold fewer than this
    #                                  fraction of the programs (kernels/decode_schedule.py queue_split_ways) ...
    queue_split_cost: float          # ... each further split costing this fraction of a round
    device_split_slots: int          # DEVICE_SPLIT_GRID: work items the split counts share
    split_keys: int = 0              # FIXED_SPLIT: keys per split (a multiple of block_n), whatever the batch
    merge_block_s: int = 0           # states the merge folds per step (0: sized from the launch's split count)
    quant_v_convert_first: bool = False  # 8-bit caches: V converted to q's dtype before shared memory (GPU)
    quant_convert: int = 0           # e4m3 caches: tiles to 16 bits by 0 conversion instructions, 1 integer bit ops
    #                                  in Triton, 2 the same in packed PTX (GPU) (kernels/kv_quant.py)
    quant_k_convert_first: bool = False  # 8-bit caches: K converted before its layout change too (GPU)
    softmax_sum_tile: bool = False   # the KV loop's softmax row sums kept per key column, summed once after it (no
    #                                  cross-warp sum per block; kernels/softmax_state.py online_softmax_step_sum_tile)
    quant_warp_split: bool = False   # 8-bit caches: each warp owns block_n / num_warps keys of every block with its
    #                                  own softmax state, folded once after the loop (kernels/decode_blocks.py
    #                                  _attend_blocks_warps)
    merge_live_only: bool = False    # the merge reads a state's partial output only where its lse is live: one more
    #                                  L2 round trip, and no reads of the empty slots (DEVICE_SPLIT_GRID: most of
    #                                  its num_splits slots per row are empty)
    merge_in_kernel: bool = False    # DEVICE_SPLIT_GRID: no merge kernel - a sequence given one split writes its
    #                                  result directly, the last split of a longer one to finish merges its splits
    #                                  (tickets, as the persistent kernel does)
    max_registers: int = 0           # stage 1's registers per thread, a cap for ptxas (maxnreg; 0: its choice, GPU):
    #                                  <= 65536 / (2 * 32 * num_warps) lets two programs share an SM


_POSITIVE = ("num_splits", "block_n", "num_warps", "num_stages", "merge_d_chunks")
_NON_NEGATIVE = ("table_read_extra_stages", "table_read_min_split_blocks", "preload_pages_max",
                 "preload_gather_max", "prefetch_blocks", "merge_max_rows", "persistent_programs",
                 "persistent_slots", "queue_splits", "device_split_slots", "split_keys", "merge_block_s",
                 "quant_convert", "max_registers")
_FLAGS = ("preload_key_ids", "use_tma", "use_pdl", "pdl_wait", "merge_early_trigger", "offs_32", "spec_pages",
          "quant_v_convert_first", "quant_k_convert_first", "softmax_sum_tile", "quant_warp_split",
          "merge_live_only", "merge_in_kernel")
_MAX_SPLITS = 1024
# what ptxas accepts as a per-thread register cap (sm_90: 24 .. 255)
_MIN_REGISTERS, _MAX_REGISTERS = 24, 255


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_decode_config(config, name: str = "config") -> DecodeConfig:
    """``config`` is a DecodeConfig whose fields are in range and agree with each other (TypeError / ValueError
    naming ``name`` and the field). Facts of a particular call (the cache's layout, the GPU) are checked by the op."""
    if not isinstance(config, DecodeConfig):
        raise TypeError(f"{name} must be a flashdecode.DecodeConfig, got {type(config).__name__}")
    if not isinstance(config.path, DecodePath):
        raise TypeError(f"{name}.path must be a DecodePath, got {config.path!r}")
    for field in _POSITIVE + _NON_NEGATIVE:
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}.{field} must be an int, got {value!r}")
        if value < (1 if field in _POSITIVE else 0):
            raise ValueError(f"{name}.{field} must be >= {1 if field in _POSITIVE else 0}, got {value}")
    for field in _FLAGS:
        if not isinstance(getattr(config, field), bool):
            raise TypeError(f"{name}.{field} must be a bool, got {getattr(config, field)!r}")
    if not (_power_of_two(config.block_n) and config.block_n >= 16):
        raise ValueError(f"{name}.block_n must be a power of two >= 16, got {config.block_n}")
    if config.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{name}.num_warps must be 1, 2, 4, 8 or 16, got {config.num_warps}")
    if config.merge_d_chunks not in (1, 2, 4):
        raise ValueError(f"{name}.merge_d_chunks must be 1, 2 or 4, got {config.merge_d_chunks}")
    if config.num_splits > _MAX_SPLITS:
        raise ValueError(f"{name}.num_splits must be <= {_MAX_SPLITS}, got {config.num_splits}")
    if (config.path is DecodePath.UNSPLIT and config.num_splits != 1) or (
            config.num_splits == 1 and config.path not in (DecodePath.UNSPLIT, DecodePath.FIXED_SPLIT)):
        raise ValueError(f"{name}: path UNSPLIT goes with num_splits == 1 and only with it (FIXED_SPLIT may cap "
                         f"the splits at 1), got {config.path.name} with num_splits {config.num_splits}")
    if (config.path is DecodePath.FIXED_SPLIT) != (config.split_keys > 0):
        raise ValueError(f"{name}.split_keys: > 0 goes with path FIXED_SPLIT and only with it, got "
                         f"{config.split_keys} on {config.path.name}")
    if config.split_keys % config.block_n:
        raise ValueError(f"{name}.split_keys must be a multiple of block_n ({config.block_n}), got "
                         f"{config.split_keys}")
    if config.quant_warp_split and config.block_n < 16 * config.num_warps:
        raise ValueError(f"{name}.quant_warp_split needs block_n >= 16 * num_warps (16 keys per warp, the dot's "
                         f"minimum), got block_n {config.block_n} with {config.num_warps} warps")
    if config.quant_convert > 2:
        raise ValueError(f"{name}.quant_convert must be 0, 1 or 2, got {config.quant_convert}")
    if config.max_registers and not _MIN_REGISTERS <= config.max_registers <= _MAX_REGISTERS:
        raise ValueError(f"{name}.max_registers must be 0 (ptxas's choice) or in {_MIN_REGISTERS}.."
                         f"{_MAX_REGISTERS}, got {config.max_registers}")
    if config.merge_block_s & (config.merge_block_s - 1):
        raise ValueError(f"{name}.merge_block_s must be 0 or a power of two, got {config.merge_block_s}")
    if config.path in (DecodePath.PERSISTENT, DecodePath.PERSISTENT_QUEUE) and config.persistent_programs < 1:
        raise ValueError(f"{name}.persistent_programs must be >= 1 on the {config.path.name} path")
    if config.path is DecodePath.PERSISTENT_QUEUE and config.persistent_slots < 1:
        raise ValueError(f"{name}.persistent_slots must be >= 1 on the PERSISTENT_QUEUE path")
    for field in ("queue_full_fraction", "queue_split_cost"):
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}.{field} must be a float, got {value!r}")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}.{field} must be in [0, 1], got {value}")
    if config.merge_in_kernel and config.path is not DecodePath.DEVICE_SPLIT_GRID:
        raise ValueError(f"{name}.merge_in_kernel goes with path DEVICE_SPLIT_GRID only, got {config.path.name}")
    if config.path is DecodePath.DEVICE_SPLIT_GRID and config.device_split_slots < 1:
        raise ValueError(f"{name}.device_split_slots must be >= 1 on the DEVICE_SPLIT_GRID path")
    return config

# ----------------------------------------------------------------------------------------------------------------
# Prefill / training attention (flash_attn, flash_attn_varlen)
# ----------------------------------------------------------------------------------------------------------------

from dataclasses import dataclass  # noqa: E402

# A tile of the forward, the two-launch backward or the atomic backward: (rows held, rows streamed, warps, stages)
Tile = tuple[int, int, int, int]
# A tile of the one-launch backward: (BLOCK_N, BLOCK_M, BLOCK_M2, BLOCK_N2, SPLIT_DKDV, warps, stages)
FusedTile = tuple[int, int, int, int, bool, int, int]


@dataclass(frozen=True)
class AttentionProblem:
    """What the attention launch policy (heuristics.resolve_attention_config) looks at: the problem and the
    device's facts, no tensors."""

    head_dim_pad: int  # head dim rounded up to a power of two >= 16
    elem_bytes: int  # 2 (fp16 / bf16) or 4 (fp32)
    max_seqlen_k: int
    deterministic: bool  # flash_attn(deterministic=...)
    tma_layout: bool  # q, k, v allow tensor descriptors (unit head-dim stride, 16-byte aligned rows)
    capability_major: int  # CUDA compute capability major; 0 off the GPU
    smem_limit: int  # shared memory per block in bytes
    interpret: bool  # Triton's CPU interpreter
    autotune: bool  # FLASHDECODE_AUTOTUNE (default on): time the candidates on the GPU


PREFILL_BACKENDS = ("gluon", "triton")  # AttentionConfig.backend


@dataclass(frozen=True)
class AttentionConfig:
    """Every launch decision of one flash_attn / flash_attn_varlen call, forward and backward.

    Resolved once per problem by heuristics.resolve_attention_config; ``flash_attn(..., config=)`` takes a
    ``dataclasses.replace`` of it. Descriptor flags are permissions: the launcher still uses pointers where a
    tensor's layout does not allow descriptors. Tiles are tried in order: the first one when autotuning is off,
    every one (timed once per shape bucket) when it is on. The backward takes bwd_atomic_tiles when
    deterministic=False, bwd_fused_tiles when bwd_fused, else bwd_dkdv_tiles and bwd_dq_tiles.
    ``backend`` names the kernel family: "gluon" (resolved on sm_90) runs the warp-specialised Gluon kernels
    wherever the default dispatch would (ops/gluon_attention.py: dense, ragged, FP8 forwards and the dense
    backward; the calls they do not take - softcap, windows, ALiBi, other head dims - run the Triton kernels, as a
    call without config= does), "triton" pins every launch to the Triton kernels and the tiles above. So a
    ``dataclasses.replace`` of a resolved config runs the kernel the call would run without it.
    """

    fwd_tma: bool  # forward through tensor descriptors (TMA)
    fwd_tiles: tuple[Tile, ...]  # (BLOCK_M, BLOCK_N, warps, stages)
    fwd_autotune: bool
    bwd_tma: bool  # backward loads through descriptors (and, deterministic=False, a bulk reduction of dQ)
    bwd_fused: bool  # deterministic backward in one launch (dK/dV of KV block j, then dQ of Q block j)
    bwd_dkdv_tiles: tuple[Tile, ...]  # (BLOCK_N, BLOCK_M, warps, stages)
    bwd_dq_tiles: tuple[Tile, ...]  # (BLOCK_M, BLOCK_N, warps, stages)
    bwd_atomic_tiles: tuple[Tile, ...]  # (BLOCK_N, BLOCK_M, warps, stages)
    bwd_fused_tiles: tuple[FusedTile, ...]
    bwd_autotune: bool
    backend: str = "triton"  # PREFILL_BACKENDS; resolve_attention_config gives "gluon" on sm_90

    def check(self) -> "AttentionConfig":
        """ValueError/TypeError naming ``config`` for a field of the wrong type or a malformed tile list."""
        for name in ("fwd_tma", "fwd_autotune", "bwd_tma", "bwd_fused", "bwd_autotune"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"config.{name} must be a bool, got {getattr(self, name)!r}")
        if self.backend not in PREFILL_BACKENDS:
            raise ValueError(f"config.backend must be one of {PREFILL_BACKENDS}, got {self.backend!r}")
        for name, length in (("fwd_tiles", 4), ("bwd_dkdv_tiles", 4), ("bwd_dq_tiles", 4),
                             ("bwd_atomic_tiles", 4), ("bwd_fused_tiles", 7)):
            tiles = getattr(self, name)
            if not isinstance(tiles, tuple) or not tiles:
                raise ValueError(f"config.{name} must be a non-empty tuple of tiles, got {tiles!r}")
            for tile in tiles:
                if not _is_tile(tile, length):
                    raise ValueError(f"config.{name} entries must be tuples of {length} positive ints"
                                     f"{' (the fifth a bool)' if length == 7 else ''}, got {tile!r}")
        return self


def _is_tile(tile, length: int) -> bool:
    """A tuple of ``length`` positive ints; a fused tile's fifth entry (SPLIT_DKDV) is a bool instead."""
    if not isinstance(tile, tuple) or len(tile) != length:
        return False
    split = length == 7
    if split and not isinstance(tile[4], bool):
        return False
    ints = [x for i, x in enumerate(tile) if not (split and i == 4)]
    return all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in ints)


# ----------------------------------------------------------------------------------------------------------------
# The Gluon kernels (sm_90): one launch of the warp-specialised forward or backward (ops/gluon_attention.py)
# ----------------------------------------------------------------------------------------------------------------

TILE_ORDERS = {"round_robin": 0, "pairs": 2, "lpt": 3}  # kernels/gluon/fwd_tiles.py TILE_ORDER_*
SM_REGISTERS = 65536  # an H100 SM's register file, shared by every partition's warpgroup (setmaxnreg)


def _check_registers(config, name: str) -> None:
    """consumer_regs / producer_regs: per-thread budgets setmaxnreg takes."""
    for field in ("consumer_regs", "producer_regs"):
        regs = getattr(config, field)
        if isinstance(regs, bool) or not (isinstance(regs, int) and 24 <= regs <= 256 and regs % 8 == 0):
            raise ValueError(f"{name}.{field}: setmaxnreg takes a multiple of 8 in [24, 256], got {regs!r}")


def _check_register_budget(config, name: str, consumers: int) -> None:
    """The budgets of ``consumers`` consumer warpgroups and a producer fit the SM's register file together."""
    _check_registers(config, name)
    if 128 * (consumers * config.consumer_regs + config.producer_regs) > SM_REGISTERS:
        raise ValueError(f"{name}.consumer_regs: {consumers} consumer warpgroups of {config.consumer_regs} and a "
                         f"producer of {config.producer_regs} registers per thread exceed {SM_REGISTERS} per SM")


def _check_bools(config, name: str, fields: tuple) -> None:
    for field in fields:
        if not isinstance(getattr(config, field), bool):
            raise TypeError(f"{name}.{field} must be a bool, got {getattr(config, field)!r}")


@dataclass(frozen=True)
class GluonFwdConfig:
    """One launch of attn_fwd_ws_kernel: a tile is num_consumers * 64 query rows; key blocks of block_n rows flow
    through a ring of num_stages shared-memory slots; overlap = FA3's intra-warpgroup QK^T / softmax / PV overlap;
    persistent = one CTA per SM looping over tiles (else one CTA per tile); q_buffers = Q buffer sets (2: a persistent
    CTA loads its next tile's Q rows while the consumers still read the current tile's; kernels/gluon/attn_fwd.py
    _producer); consumer_regs / producer_regs = per-thread register budgets of the worker partitions (setmaxnreg; the
    default partition, consumer 0, gets what is left of the SM's 65536: num_consumers * 128 * consumer_regs + 128 *
    producer_regs must fit, so 3 consumers take consumer_regs <= 160, FA3's hd64 budget); tile_order = how CTAs with two
    Q buffer sets take their tiles (TILE_ORDERS): "round_robin" (program_id, program_id + num_programs, ...), "pairs" (a
    CTA per unit of two tiles of one head, its k-th heaviest and k-th lightest query blocks: with causal tiles every
    unit carries about the same work; _pair_tiles) or "lpt" (persistent: each CTA walks a list made on the host by
    handing the tiles, in the order the grid would run them, to whichever CTA is free first by a cost model - what the
    hardware's block dispatch does for one CTA per tile, with the next tile's loads under the current tile's end;
    lpt_schedule); split_release = the consumers release a slot's K as soon as their scores are in registers and its V
    after PV (FA3's two pipelines), so the producer can load the next K into it during the softmax and PV (else one
    release after PV frees both); v_tail = zero a key block's V rows past its sequence's keys before PV where they
    hold another sequence's rows (ragged batches; fixed-length ones whose keys end inside a block): their zero
    probabilities times a NaN or inf there would be NaN. False is a timing ablation only (a neighbour's NaN / inf
    then reaches these rows; the paged kernel always zeroes a page's tail). v_bound = the ragged kernel's other way
    to the same zeros: the producer loads a sequence's last V block through a descriptor made on the device that
    ends at its last key (TMA reads zeros past it), so the consumers' loop carries no zeroing code (v_tail is then
    moot); an experiment, off until its GPU tests and timing say otherwise (docs/decisions.md); ragged launches only.
    """

    num_consumers: int = 2
    block_n: int = 128
    num_stages: int = 2
    overlap: bool = False
    persistent: bool = False
    q_buffers: int = 1
    consumer_regs: int = 240
    producer_regs: int = 24
    tile_order: str = "round_robin"
    split_release: bool = False
    v_tail: bool = True
    v_bound: bool = False

    def __post_init__(self):
        self.check()

    def check(self, name: str = "config") -> "GluonFwdConfig":
        """ValueError/TypeError naming ``config``'s field for a launch the kernel cannot take (run at construction)."""
        if self.num_consumers not in (1, 2, 3):
            raise ValueError(f"{name}.num_consumers: 1, 2 or 3 warpgroups, got {self.num_consumers!r}")
        for field in ("block_n", "num_stages", "q_buffers"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{field} must be a positive int, got {value!r}")
        _check_bools(self, name, ("overlap", "persistent", "split_release", "v_tail", "v_bound"))
        _check_register_budget(self, name, self.num_consumers)
        if self.tile_order not in TILE_ORDERS:
            raise ValueError(f"{name}.tile_order: one of {tuple(TILE_ORDERS)}, got {self.tile_order!r}")
        if self.tile_order != "round_robin" and self.q_buffers != 2:
            raise ValueError(f"{name}.tile_order: {self.tile_order!r} orders the tile pairs of CTAs with two Q "
                             f"buffer sets (q_buffers=2)")
        if self.tile_order == "lpt" and not self.persistent:
            raise ValueError(f"{name}.tile_order: {self.tile_order!r} orders a persistent CTA's tiles "
                             f"(persistent=True)")
        return self

    @property
    def block_m(self) -> int:
        return 64 * self.num_consumers


@dataclass(frozen=True)
class GluonBwdConfig:
    """One launch of attn_bwd_ws_kernel: a CTA holds block_n = 128 keys (two consumer warpgroups of 64) and walks
    query blocks of block_m rows through a ring of num_stages Q / dO slots; dq_tma = dQ added by a writer warp's
    TMA reduce-adds from a staging buffer (else by the consumers' 16-byte atomics); consumer_regs / producer_regs
    as GluonFwdConfig's. tail_heavy_first (causal, deterministic): the grid's last (batch, kv head) launches its key
    blocks heaviest first instead of last (kernels/gluon/bwd_channels.py key_block), so that the grid does not end
    on its heaviest blocks (the deterministic causal backward alone on the H200, 16k: hd128 496.4 -> 525.5
    TFLOP/s, hd64 422.9 -> 440.5; docs/decisions.md); other launches ignore it (tail_heavy_first_for).
    seq_bounded: each CTA reads its sequence through descriptors made on the device that end at the sequence's
    last row (another sequence's NaN or inf never reaches its gradients) - every ragged launch, and the dense
    launches whose tiles would read the next batch element's rows (seq_bounded_for); False reads the packed rows
    through the host's descriptors (finite values past the sequence contribute exact zeros either way)."""

    block_m: int = 64
    num_stages: int = 2
    dq_tma: bool = True
    consumer_regs: int = 240
    producer_regs: int = 24
    tail_heavy_first: bool = True
    seq_bounded: bool = True  # loads through per-sequence descriptors (ragged; dense: seq_bounded_for)

    @property
    def block_n(self) -> int:
        return 128

    def tail_heavy_first_for(self, causal: bool, deterministic: bool) -> bool:
        """The kernel's TAIL_HEAVY_FIRST for a launch: only causal deterministic launches change their order; the
        others keep the kernels they were timed as (the option's loops would compile differently there)."""
        return self.tail_heavy_first and causal and deterministic

    def seq_bounded_for(self, batch: int, seqlen_q: int, seqlen_k: int) -> bool:
        """The dense kernel's SEQ_BOUNDED for a launch: only where a tile runs past its batch element into the
        next one's rows (batch > 1, seqlen_q or seqlen_k not a multiple of its block); elsewhere the host's
        descriptors read only the element's rows or zeros past the tensor, and the kernels stay as timed."""
        return self.seq_bounded and batch > 1 and bool(seqlen_q % self.block_m or seqlen_k % self.block_n)

    def __post_init__(self):
        self.check()

    def check(self, name: str = "config") -> "GluonBwdConfig":
        """ValueError/TypeError naming ``config``'s field for a launch the kernel cannot take (run at construction)."""
        for field in ("block_m", "num_stages"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{field} must be a positive int, got {value!r}")
        if self.block_m % 64:
            raise ValueError(f"{name}.block_m: whole warpgroup tiles of 64 rows, got {self.block_m}")
        _check_bools(self, name, ("dq_tma", "tail_heavy_first", "seq_bounded"))
        _check_registers(self, name)
        return self
