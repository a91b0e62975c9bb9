"""The decode kernels' grouped constexpr arguments (kernels/decode.py): each a NamedTuple that a launch passes as one
constexpr and the kernel names field by field, so that neither kernel takes more than 40 arguments.

Runtime arguments are grouped as plain tuples where they are contiguous in the kernel's argument list (strides of one
tensor, (score scale, softcap), (slopes, strides), (scales, strides)): Triton passes a tuple's elements as separate
kernel parameters in the same order and specialises each (divisible by 16, equal to 1) as it would a lone argument,
so the grouping leaves the kernel's parameters and code unchanged.
"""

from __future__ import annotations

from typing import NamedTuple


class Rows(NamedTuple):
    """ROWS: how the query rows of one kv head form row blocks. Row r = t * group + g serves query head g of the kv
    head's GQA group for new token t; the seqlen_q * group rows fill num_m_blocks blocks of Tile.block_m rows."""

    seqlen_q: int
    group: int
    num_m_blocks: int


class Tile(NamedTuple):
    """TILE: query rows per program (padded to the MMA minimum of 16), keys per KV step, head-dim columns (the head
    dim padded to a power of two), and whether the KV loop keeps its softmax row sums as a (block_m, block_n) tile
    summed once after the loop (sum_tile; kernels/decode_blocks.py attend_split) instead of one sum per block; warps: 0,
    or (an 8-bit cache) the program's warps, each owning block_n // warps keys of every block with its own softmax
    state (kernels/decode_blocks.py _attend_blocks_warps)."""

    block_m: int
    block_n: int
    block_d: int
    sum_tile: bool = False
    warps: int = 0


class Splits(NamedTuple):
    """SPLITS: splits per sequence (the launch's count, or the most the device may choose), the fewest keys of a
    non-empty split, num_splits padded to a power of two (the merges' tiles), and split_keys: 0, or the keys of
    every split whatever the split count (batch-invariant decode; kernels/decode_schedule.py split_range)."""

    num_splits: int
    min_chunk: int
    merge_splits: int
    split_keys: int = 0


class Pages(NamedTuple):
    """PAGES: tokens per page (0: a contiguous cache) and the block-table ids a split holds in registers (a power of
    two >= the pages one split spans, or 0: read in the KV loop)."""

    page_size: int
    preload: int


class Pdl(NamedTuple):
    """PDL: let the next kernel (a programmatic dependent) launch early; wait for the previous kernel (this launch is
    itself a programmatic dependent) before reading or writing memory."""

    launch_dependents: bool
    wait: bool


class Prefetch(NamedTuple):
    """PREFETCH: stage 1's L2 prefetch before the PDL wait: keys (0 = off; a power of two), elements per 128-byte
    line, lines per head-dim row (a power of two)."""

    keys: int
    line_elems: int
    num_lines: int


PREFETCH_OFF = Prefetch(0, 64, 2)


class DeviceSplits(NamedTuple):
    """DEVICE_SPLITS of decode_split_kernel (None: the fixed grid): split counts chosen on the device from all lengths,
    one program per work item. slots: work items the sequences' shares divide; batch_pad: the batch padded to a power
    of two; max_split_keys: 0 or the most keys of one split; kv_programs: kv heads x row blocks."""

    slots: int
    batch_pad: int
    max_split_keys: int
    kv_programs: int


class WorkSchedule(NamedTuple):
    """SCHEDULE of decode_persistent_kernel: how its programs find their work items. nheads_kv; batch_pad (the batch
    padded to a power of two); max_split_keys (0 or the most keys of one split); dynamic (draw items from the work
    queue instead of static shares); slots_per_program, queue_splits, queue_full_fraction, queue_split_cost: the
    queue's split counts (kernels/decode_schedule.py device_split_counts)."""

    nheads_kv: int
    batch_pad: int
    max_split_keys: int
    dynamic: bool
    slots_per_program: int
    queue_splits: int
    queue_full_fraction: float
    queue_split_cost: float


class MergeTile(NamedTuple):
    """MERGE of decode_persistent_kernel: the in-kernel merge's rows (a row block's real rows padded to a power of two)
    and splits folded per step."""

    rows: int
    block_s: int


class QuantTiles(NamedTuple):
    """QUANT_TILES: how an 8-bit cache's K / V tiles become the dots' 16-bit operands (kernels/kv_quant.py; a
    DecodeConfig's quant_v_convert_first, quant_convert, quant_k_convert_first). v_first / k_first: V / K converted
    in the layout it was loaded in, before its change to the mma operand (GPU only: inline asm); convert: e4m3 tiles
    by the conversion instructions (0) or by integer bit operations (1: Triton ops, 2: packed PTX, GPU only)."""

    v_first: bool
    convert: int
    k_first: bool


QUANT_TILES_OFF = QuantTiles(False, 0, False)
