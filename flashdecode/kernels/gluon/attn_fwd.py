"""Warp-specialised Hopper (sm_90) attention forward in Gluon, after FlashAttention-3's structure.

A tile is ``NUM_CONSUMERS * 64`` query rows of one (batch, head); it walks that head's keys in blocks of
``BLOCK_N``. A CTA takes one tile, or (persistent) tiles program_id, program_id + num_programs, ... Its warps are
split into partitions (``gl.warp_specialize``), each with its own register budget (setmaxnreg):

- a producer warp issues TMA loads: each tile's Q rows, then K and V blocks into a ring of ``NUM_STAGES``
  shared-memory slots. Each slot has a ``k_ready`` / ``v_ready`` mbarrier (TMA completes them by byte count) and a
  ``kv_empty`` mbarrier that every consumer warpgroup arrives on once it no longer reads the slot; the ring runs on
  across a persistent CTA's tiles.
- ``NUM_CONSUMERS`` (1-3) consumer warpgroups (4 warps each, the first is the default partition) each own 64
  query rows: async wgmma S = Q K^T from shared memory, online softmax in registers with exp2 and the scale folded
  into one multiply-add, then async wgmma O += P V with P as a register operand (it never touches shared memory).
  Two warpgroups per CTA already interleave on their own: while one runs its softmax the other's wgmma keeps the
  tensor cores busy.
- ``OVERLAP`` with ``SPLIT_KV_RELEASE`` (hd128's resolved loop; ops/gluon_attention.py resolve_gluon_config):
  FA3's intra-warpgroup overlap - QK^T of block j and PV of block j-1 issued together, block j's softmax under
  that PV - with a slot's K released once its scores are in registers (``k_empty``) and its V after PV
  (``kv_empty``), as FA3's two pipelines do. The overlapped loop holds a V slot one block longer; with one release
  per slot the producer's next K load into it waited for that PV (our reading of why OVERLAP alone measured 2-13%
  slower than the plain loop earlier). H100 kernel time, hd128 16k: plain 648.5, overlap + split release 713.1
  TFLOP/s; split release alone 615.6 (docs/decisions.md).
- Options measured as ablations (H100, bf16; benchmarks/probes/gluon_fwd.py): ``PINGPONG`` (the warpgroups take
  turns issuing wgmma through a pair of mbarriers, like FA3's named barriers) gave -7% to +2% on the plain loop
  and lost on the overlapped one (648.3 vs 705.7 at hd128 16k); it stays selectable for the probe. Three consumer
  warpgroups (192-row tiles,
  FA3's hd64 shape; 160 registers each) are hd64's tile from 16k keys (ops/gluon_attention.py
  resolve_gluon_config). ``EXP2_EMU_COLS`` (off: slower at every shape timed, docs/decisions.md): the first
  columns of each score block take their exp2 as a polynomial on the FMA pipe (_exp2_fma, FlashAttention-4's
  trick), the rest on the MUFU unit. ``TILE_ORDER`` (two Q buffer sets): round robin, a boustrophedon order of
  persistent tiles (zigzag, off, not timed), pairs of a head's heavy and light causal tiles (_pair_tiles), or
  per-CTA lists made on the host (attn_fwd_ws_lpt_kernel, _lpt_row; hd128 causal launches beyond 4k keys and
  non-causal ones of 1k-8k keys).

Masking: key blocks lying entirely inside every row's visible range take the unmasked loop; only the blocks that
straddle the causal diagonal (bottom-right aligned: row i sees key j <= i + seqlen_k - seqlen_q) or the end of the
keys take the masked one. Rows that see no key give out = 0 and lse = -inf.

e4m3 (``attn_fwd_fp8_ws_kernel``, FP8 attention with FA3's descales): the same partitions with both GEMMs on the
8-bit wgmma. Its B operands must be K-major, so V comes transposed (V^T slots, read through their transpose); P is
rounded to e4m3 in registers (times 2**8, see _p_log2_scale) and, with its keys renumbered within each 32 to match
the order the transpose pass writes, is the A operand without any data movement (_p_operand). The q * k descale of
the tile's head multiplies the logit scale, the v descale the output.

Tensors (all contiguous in (seq, head, dim) order, see ``flashdecode.ops.gluon_attention``):
  q: (batch * seqlen_q, nheads * HEAD_DIM) fp16/bf16 behind ``q_desc`` (TMA block [64, HEAD_DIM])
  k, v: (batch * seqlen_k, nheads_kv * HEAD_DIM) same dtype behind ``k_desc``/``v_desc`` (block [BLOCK_N, HEAD_DIM])
  out: (batch, seqlen_q, nheads, HEAD_DIM) same dtype; lse: (batch, nheads, seqlen_q) float32, natural log.
Rows a TMA tile reads past a sequence's end belong to the next sequence (or are zero past the tensor): the key
mask hides them and the output store skips them.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from flashdecode.kernels.gluon.compat import tma_load



LN2 = gl.constexpr(0.6931471805599453)  # lse is stored in natural-log units
# How CTAs with two Q buffer sets walk the tiles (TILE_ORDER; ops/gluon_attention.py TILE_ORDERS names them):
TILE_ORDER_ROUND_ROBIN = gl.constexpr(0)  # tiles program_id, program_id + num_programs, ...
TILE_ORDER_ZIGZAG = gl.constexpr(1)  # rounds of num_programs tiles taken forwards, then backwards (_second_tile)
TILE_ORDER_PAIRS = gl.constexpr(2)  # a head's k-th tile with its k-th from the end (_pair_tiles)
TILE_ORDER_LPT = gl.constexpr(3)  # each CTA's list of tiles, made on the host (_lpt_tiles)


@gluon.constexpr_function
def _mma_layout(n, dtype=None):
    """Accumulator layout of a 64 x n wgmma over one warpgroup with operands of ``dtype`` (instruction n = the
    whole tile width; instruction k = 32 bytes: 16 for fp16/bf16 - also dtype None, as the backward passes it -,
    32 for e4m3)."""
    k = 16 if dtype is None else 256 // dtype.primitive_bitwidth
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, k])


@gluon.constexpr_function
def _p_layout(o_layout, dtype):
    """Register layout of P as the A operand of O += P V: k_width = the elements of ``dtype`` per 32-bit register
    (2 for fp16/bf16, 4 for e4m3: see _p_operand for how P gets there without moving data)."""
    return gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=32 // dtype.primitive_bitwidth)


@gluon.constexpr_function
def _p_log2_scale(dtype):
    """log2 of the factor P (in [0, 1]) carries into an e4m3 PV wgmma: P * 2**8 <= 256 stays below e4m3's 448 and
    keeps probabilities down to 2**-17 (e4m3's smallest subnormal is 2**-9) instead of flushing them to 0; the
    factor cancels in O / l and comes out of the lse. 0 (no factor) for fp16/bf16."""
    return 8.0 if dtype.primitive_bitwidth == 8 else 0.0


@gluon.constexpr_function
def _store_layout(head_dim):
    """Row-major blocked layout for the output store: 8 contiguous elements (16 bytes) per thread."""
    cols = head_dim // 8
    cols = 32 if cols > 32 else cols
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // cols, cols], warps_per_cta=[4, 1],
                            order=[1, 0])


@gluon.jit
def _tile_coords(tile, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, NUM_HEADS: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Which rows tile ``tile`` owns and which key blocks it visits.

    Tiles are numbered head-major (all query blocks of one (batch, head) are consecutive, so CTAs that run at the
    same time share that head's K/V in L2); causal heads visit their query blocks heaviest (last rows) first, so
    the light tiles fill the tail of a persistent schedule.
    Fixed-length batches (cu_q_ptr None): sequence ``batch`` holds rows [batch * seqlen_q, ...) of q and
    [batch * seqlen_k, ...) of k / v. Ragged batches: its rows start at cu_q_ptr[batch] / cu_k_ptr[batch] (int32
    cumulative lengths, read here on the device) and seqlen_q is the longest sequence's query count, which numbers
    the tiles; a tile past its own sequence's rows is empty (``live`` 0, else 1: no loads, no store, no key block).
    Returns (batch, head, m_start, n_full_end, n_end, q_base, kv_base, len_q, len_k, live): keys [0, n_full_end)
    need no mask for any of the tile's rows, keys [n_full_end, n_end) are the masked blocks (diagonal and/or the
    ragged end), both multiples of BLOCK_N; q_base / kv_base the sequence's first rows, len_q / len_k its
    lengths."""
    num_m = gl.cdiv(seqlen_q, BLOCK_M)
    bh = tile // num_m
    pid_m = tile % num_m
    if CAUSAL:
        pid_m = num_m - 1 - pid_m
    batch = bh // NUM_HEADS
    head = bh % NUM_HEADS
    m_start = pid_m * BLOCK_M
    if cu_q_ptr is None:
        q_base = batch * seqlen_q
        kv_base = batch * seqlen_k
        len_q = seqlen_q
        len_k = seqlen_k
    else:
        q_base = gl.load(cu_q_ptr + batch)
        len_q = gl.load(cu_q_ptr + batch + 1) - q_base
        kv_base = gl.load(cu_k_ptr + batch)
        len_k = gl.load(cu_k_ptr + batch + 1) - kv_base
    n_end = len_k
    full_keys = len_k
    if CAUSAL:
        shift = len_k - len_q
        n_end = gl.minimum(len_k, gl.maximum(m_start + BLOCK_M + shift, 0))
        full_keys = gl.minimum(len_k, gl.maximum(m_start + shift + 1, 0))
    n_end = gl.cdiv(n_end, BLOCK_N) * BLOCK_N
    n_full_end = (full_keys // BLOCK_N) * BLOCK_N
    if cu_q_ptr is None:
        live = 1  # every tile of a fixed-length batch has rows (the producer's 24 registers hold no more)
    else:
        live = (m_start < len_q).to(gl.int32)
        n_end = n_end * live
        n_full_end = n_full_end * live
    return batch, head, m_start, n_full_end, n_end, q_base, kv_base, len_q, len_k, live


@gluon.jit
def _produce_tile(tile, uses, blocks_done, BUF: gl.constexpr, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem,
                  q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr,
                  NUM_HEADS: gl.constexpr,
                  GROUP: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, V_T: gl.constexpr,
                  SPLIT_KV_RELEASE: gl.constexpr):
    """The producer's work for one tile: its Q rows into Q buffer set BUF (once the consumers have released that
    set's previous tile; ``uses`` = tiles the set held before, its barrier phase), then every visited K/V block
    into the slot ring (slot and phase from ``blocks_done``, the CTA's block counter); an empty tile (ragged
    batches, see _tile_coords) loads nothing. Returns the new (block counter, uses)."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * 64
    batch, head, m_start, n_full_end, n_end, q_base, kv_row, len_q, len_k, live = _tile_coords(
        tile, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, NUM_HEADS, BLOCK_M, BLOCK_N, CAUSAL)
    if live != 0:
        for c in gl.static_range(NUM_CONSUMERS):
            # A buffer's first use waits on the parity before the barrier's initial phase, which passes at once.
            mbarrier.wait(q_empty.index(BUF * NUM_CONSUMERS + c), (uses & 1) ^ 1)
            mbarrier.expect(q_ready.index(BUF * NUM_CONSUMERS + c), q_desc.block_type.nbytes)
            tma_load(q_desc, [q_base + m_start + c * 64, head * HEAD_DIM],
                     q_ready.index(BUF * NUM_CONSUMERS + c),
                     q_smem.index(BUF * NUM_CONSUMERS + c))
    kv_col = (head // GROUP) * HEAD_DIM
    for i in range(n_end // BLOCK_N):
        slot = (blocks_done + i) % NUM_STAGES
        empty_phase = (((blocks_done + i) // NUM_STAGES) & 1) ^ 1
        if SPLIT_KV_RELEASE:  # K and V slots are released apart: K's as soon as its scores are in registers
            mbarrier.wait(k_empty.index(slot), empty_phase)
        else:
            mbarrier.wait(kv_empty.index(slot), empty_phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma_load(k_desc, [kv_row + i * BLOCK_N, kv_col], k_ready.index(slot),
                                        k_smem.index(slot))
        if SPLIT_KV_RELEASE:
            mbarrier.wait(kv_empty.index(slot), empty_phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        if V_T:
            tma_load(v_desc, [(batch * (NUM_HEADS // GROUP) + head // GROUP) * HEAD_DIM,
                                                     i * BLOCK_N], v_ready.index(slot), v_smem.index(slot))
        else:
            tma_load(v_desc, [kv_row + i * BLOCK_N, kv_col], v_ready.index(slot),
                                            v_smem.index(slot))
    return blocks_done + n_end // BLOCK_N, uses + live


@gluon.jit
def _second_tile(tile, ZIGZAG: gl.constexpr):
    """The second tile of a two-Q-buffer CTA's pair that starts at tile (= program_id + 2 k num_programs, the
    CTA's place in an even round of num_programs tiles): the next round's tile at the same place (round robin), or
    at the mirrored place (ZIGZAG: a boustrophedon order). Causal tiles come heaviest first within each head, so
    with ZIGZAG a CTA that takes a round's heavy tile takes the next round's light one, and every pair carries
    about the same work (the round robin hands the first CTAs the heavy tiles of every round)."""
    if ZIGZAG:
        second = tile + 2 * gl.num_programs(0) - 1 - 2 * gl.program_id(0)
    else:
        second = tile + gl.num_programs(0)
    return second


@gluon.jit
def _units(num_tiles, seqlen_q, sched_ptr, BLOCK_M: gl.constexpr, TILE_ORDER: gl.constexpr):
    """A two-Q-buffer CTA's work units as its loop's (start, stop, step); a unit is two tiles (_unit_tiles):
    TILE_ORDER_PAIRS: ceil(query blocks / 2) units per (batch, head), round robin over the CTAs; TILE_ORDER_LPT:
    this CTA's list from the host, two entries a unit; else one unit per round of num_programs tiles."""
    if TILE_ORDER == TILE_ORDER_PAIRS:
        num_m = gl.cdiv(seqlen_q, BLOCK_M)
        start = gl.program_id(0)
        stop = (num_tiles // num_m) * ((num_m + 1) // 2)
        step = gl.num_programs(0)
    elif TILE_ORDER == TILE_ORDER_LPT:
        start = 0
        stop = (gl.load(_lpt_row(sched_ptr)) + 1) // 2
        step = 1
    else:
        start = gl.program_id(0)
        stop = num_tiles
        step = 2 * gl.num_programs(0)
    return start, stop, step


@gluon.jit
def _lpt_row(sched_ptr):
    """This CTA's row of the host's schedule (ops/gluon_attention.py lpt_schedule): int32 sched[0] = the row
    stride S; row p at sched[1 + p S] = [count, tile, tile, ..., num_tiles padding]."""
    return sched_ptr + 1 + gl.program_id(0) * gl.load(sched_ptr)


@gluon.jit
def _unit_tiles(unit, num_tiles, seqlen_q, sched_ptr, BLOCK_M: gl.constexpr, TILE_ORDER: gl.constexpr):
    """The two tiles of work unit ``unit`` (_units): (first, second), second = num_tiles where there is none."""
    if TILE_ORDER == TILE_ORDER_PAIRS:
        first, second = _pair_tiles(unit, seqlen_q, BLOCK_M)
        if second == first:
            second = num_tiles
    elif TILE_ORDER == TILE_ORDER_LPT:  # rows are padded with num_tiles to an even count of entries
        row = _lpt_row(sched_ptr)
        first = gl.load(row + 1 + 2 * unit)
        second = gl.load(row + 2 + 2 * unit)
    else:
        first = unit
        second = _second_tile(unit, TILE_ORDER == TILE_ORDER_ZIGZAG)
    return first, second


@gluon.jit
def _pair_tiles(pair, seqlen_q, BLOCK_M: gl.constexpr):
    """TILE_ORDER_PAIRS: unit ``pair`` is the k-th tile and the k-th from the end of one (batch, head)'s query
    blocks (k = pair % ceil(blocks / 2)), in _tile_coords' numbering. Causal tiles come heaviest first within a
    head, so the two carry k + 1 and blocks - k key blocks' worth of rows: every unit about the same work, and a
    grid of units needs no scheduler to balance (the second tile's Q and first K/V blocks load under the first
    tile's last blocks). Returns (first, second); second == first for the middle block of an odd count."""
    num_m = gl.cdiv(seqlen_q, BLOCK_M)
    half = (num_m + 1) // 2
    base = (pair // half) * num_m
    k = pair % half
    return base + k, base + num_m - 1 - k


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty,
              num_tiles, sched_ptr, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, NUM_HEADS: gl.constexpr,
              GROUP: gl.constexpr,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
              V_T: gl.constexpr, Q_BUFFERS: gl.constexpr, TILE_ORDER: gl.constexpr,
              SPLIT_KV_RELEASE: gl.constexpr):
    """One warp: for each of the CTA's tiles, TMA loads of its Q rows and of every visited K/V block into the slot
    ring (_produce_tile). The ring runs on across tiles: its slot and phase come from a block counter over the
    whole CTA, so the next tile's first K/V blocks load while the consumers still finish the current one.
    Q_BUFFERS = 2 (persistent CTAs): two Q buffer sets, tiles alternating between them, so the next tile's Q loads
    while the consumers still read the current one's; the loop is unrolled by two so every buffer index is static
    (a buffer picked by a runtime index made causal launches read shared memory out of bounds, compute-sanitizer).
    With one set the next tile's Q waits for the current one's release. TILE_ORDER (two sets only): which two
    tiles a loop step takes (_units, _unit_tiles).
    V_T (e4m3): v_desc views V^T, one row per (batch, kv head, dim) and one column per key, so a block is the
    [HEAD_DIM, BLOCK_N] tile at the kv head's rows and the block's keys."""
    blocks_done = 0
    uses = 0
    if Q_BUFFERS == 1:
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            blocks_done, uses = _produce_tile(tile, uses, blocks_done, 0, q_desc, k_desc, v_desc, q_smem, k_smem,
                                              v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty, seqlen_q,
                                              seqlen_k, cu_q_ptr, cu_k_ptr, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES,
                                              NUM_CONSUMERS, CAUSAL, V_T, SPLIT_KV_RELEASE)
    else:
        uses_second = 0  # the second set can sit out a unit (no second tile), so it keeps its own phase count
        start, stop, step = _units(num_tiles, seqlen_q, sched_ptr, NUM_CONSUMERS * 64, TILE_ORDER)
        for unit in range(start, stop, step):
            tile, second = _unit_tiles(unit, num_tiles, seqlen_q, sched_ptr, NUM_CONSUMERS * 64, TILE_ORDER)
            blocks_done, uses = _produce_tile(tile, uses, blocks_done, 0, q_desc, k_desc, v_desc, q_smem, k_smem,
                                              v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty, seqlen_q,
                                              seqlen_k, cu_q_ptr, cu_k_ptr, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES,
                                              NUM_CONSUMERS, CAUSAL, V_T, SPLIT_KV_RELEASE)
            if second < num_tiles:
                blocks_done, uses_second = _produce_tile(second, uses_second, blocks_done, 1, q_desc, k_desc, v_desc,
                                            q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                                            k_empty, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, NUM_HEADS, GROUP, BLOCK_N,
                                            NUM_STAGES,
                                            NUM_CONSUMERS, CAUSAL, V_T, SPLIT_KV_RELEASE)



@gluon.jit
def _masked_scores(s, n_start, rows, seqlen_q, seqlen_k, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Scores s (64, BLOCK_N) fp32 with hidden keys set to -inf (past seqlen_k; right of the causal diagonal)."""
    s_layout: gl.constexpr = s.type.layout
    cols = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    visible = gl.expand_dims(cols < seqlen_k, 0)
    if CAUSAL:
        visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + (seqlen_k - seqlen_q), 1))
    return gl.where(visible, s, -float("inf"))


# 2**f ~= 1 + c1 f + ... + cd f**d for f in [-1/2, 1/2]: coefficients (c1, ..., cd) of degree d, fitted for the
# least maximum relative error (Lawson's reweighted least squares) and rounded to float32. The constant term is
# exactly 1, so that 2**-127 comes out as exactly 0 (see _exp2_fma). Relative error of _exp2_fma on x >= -126
# (tests/test_exp2_emulation.py, float32 arithmetic): degree 3 ~1.0e-4, 4 ~3e-6, 5 ~2e-7 (MUFU's ex2.approx: ~2e-7).
EXP2_POLY = {
    3: (0.6932829022407532, 0.2422109693288803, 0.05500892922282219),
    4: (0.6931241750717163, 0.24024099111557007, 0.055906426161527634, 0.009582852944731712),
    5: (0.6931470036506653, 0.24022242426872253, 0.05550733581185341, 0.009671512991189957, 0.001326472731307149),
}
EXP2_CLAMP = gl.constexpr(-127.0)
ROUND_MAGIC = gl.constexpr(12582912.0)  # 1.5 * 2**23: x + it rounds x to an integer, kept in the low mantissa bits


@gluon.constexpr_function
def _exp2_coeff(degree, i):
    """c_i of EXP2_POLY[degree] (c_0 = 1)."""
    return 1.0 if i == 0 else EXP2_POLY[degree][i - 1]


@gluon.jit
def _exp2_fma(x, DEGREE: gl.constexpr):
    """2**x of float32 x (any shape and layout) on the FMA/ALU pipes instead of the MUFU unit (FlashAttention-4's
    trick: the MUFU unit's 16 exp2 / clock / SM is as busy as the tensor cores at head dim 64).

    Cody-Waite split x = j + f with j = rint(x), f in [-1/2, 1/2]: adding 1.5 * 2**23 rounds x to j and leaves j
    (two's complement) in the sum's low mantissa bits, so j << 23 is that sum's bits shifted (its exponent and
    leading mantissa bits shift out); 2**f is a degree-DEGREE polynomial (Horner, FMAs), and j is added to its
    exponent field as an integer. x is clamped to >= -127 first: -inf (masked keys) gives j = -127, f = 0, a
    polynomial of exactly 1.0 and so exactly +0.0. Results below 2**-126 (x < -126) are not the float32 subnormal
    2**x but are below 2**-126 (ex2.approx.ftz flushes them to 0). Per element: 3 FADD, 1 FMNMX, DEGREE FFMA and an
    integer shift-add, no MUFU."""
    x = gl.maximum(x, EXP2_CLAMP)
    t = x + ROUND_MAGIC
    f = x - (t - ROUND_MAGIC)
    p = f * _exp2_coeff(DEGREE, DEGREE) + _exp2_coeff(DEGREE, DEGREE - 1)
    for k in gl.static_range(DEGREE - 1):
        p = p * f + _exp2_coeff(DEGREE, DEGREE - 2 - k)
    bits = p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _exp2_mixed(x, EMU_COLS: gl.constexpr, EMU_DEGREE: gl.constexpr):
    """2**x of x (64, BLOCK_N) fp32 in an accumulator layout: columns [0, EMU_COLS) by _exp2_fma, the others on
    the MUFU unit (gl.exp2). The column test is on a static arange: each thread's registers hold fixed columns, so
    it folds away at compile time and each register gets one of the two (a multiple of 8 gives every thread the same
    share: the wgmma layout gives a thread 2 of every 8 columns)."""
    if EMU_COLS == 0:
        p = gl.exp2(x)
    elif EMU_COLS >= x.shape[1]:
        p = _exp2_fma(x, EMU_DEGREE)
    else:
        cols = gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, x.type.layout))
        p = gl.where(gl.expand_dims(cols < EMU_COLS, 0), _exp2_fma(x, EMU_DEGREE), gl.exp2(x))
    return p


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale_log2, P_LOG2_SCALE: gl.constexpr, EMU_COLS: gl.constexpr,
                  EMU_DEGREE: gl.constexpr):
    """Online-softmax update for one block of raw scores s (64, BLOCK_N) fp32.

    m_i is the running row max in scaled log2 units (scores * softmax_scale * log2 e), l_i the running row sum of
    exp2(score - m_i) (times 2**P_LOG2_SCALE, see _p_log2_scale). Returns (p, alpha, m_new, l_new) with
    p = exp2(scaled score - m_new) * 2**P_LOG2_SCALE fp32 and alpha the factor that rescales what was accumulated
    under the old max. Rows with no visible key so far keep m = -inf and shift by 0, so exp2(-inf - -inf) never
    happens. The block's first EMU_COLS columns take their exp2 on the FMA pipe (_exp2_mixed)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale_log2)
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    if P_LOG2_SCALE != 0.0:  # P * 2**P_LOG2_SCALE: a per-row shift of the exponent, no per-element multiply
        p = _exp2_mixed(s * qk_scale_log2 - gl.expand_dims(m_use - P_LOG2_SCALE, 1), EMU_COLS, EMU_DEGREE)
    else:
        p = _exp2_mixed(s * qk_scale_log2 - gl.expand_dims(m_use, 1), EMU_COLS, EMU_DEGREE)
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def _scale_before_mask(s, qk_scale_log2, P_LOG2_SCALE: gl.constexpr):
    """(scores, scale) for _softmax_step in a masked block. e4m3: the scores scaled before the mask, and scale 1.
    The scale holds the tile's q_descale * k_descale there, so it may be 0 (an all-zero tensor's descale: -inf * 0
    would be NaN) or negative (max(s) * scale would be the row minimum); tiles whose scale is not > 0 take every
    block through this path (see _consumer). fp16/bf16: unchanged (raw scores, the row max scaled once per row)."""
    if P_LOG2_SCALE != 0.0:
        s = s * qk_scale_log2
        qk_scale_log2 = 1.0
    return s, qk_scale_log2


@gluon.jit
def _p_operand(p, p_layout: gl.constexpr):
    """P (64, BLOCK_N) in the scores' accumulator layout as the A operand (p_layout) of O += P V.

    fp16/bf16: a layout conversion that moves nothing. e4m3: the accumulator gives a thread keys in pairs
    (8 jl + 2 c + e within each 32 keys: jl, e in {0, 1}, c = lane % 4) where the 8-bit operand wants 4
    consecutive keys per register (4 c + 2 jl + e); reading that as a conversion costs shuffles and byte permutes
    per block. Instead P's keys are renumbered within each 32 (key 32 ch + 16 jh + 8 jl + 2 c + e becomes column
    32 ch + 16 jh + 4 c + 2 jl + e), which makes the conversion a register-for-register identity (asserted), and
    the V^T operand holds its keys in the same order (ops/fp8_v_transpose.py, key_order="wgmma"), so P V is
    unchanged."""
    if p.dtype.primitive_bitwidth == 8:
        BLOCK_N: gl.constexpr = p.shape[1]
        p = gl.reshape(p, [64, BLOCK_N // 32, 2, 2, 4, 2])  # (row, ch, jh, jl, c, e)
        p = gl.permute(p, [0, 1, 2, 4, 3, 5])  # (row, ch, jh, c, jl, e)
        p = gl.convert_layout(gl.reshape(p, [64, BLOCK_N]), p_layout, assert_trivial=True)
    else:
        p = gl.convert_layout(p, p_layout)
    return p


@gluon.jit
def _pv_operand(v_tile):
    """A V slot as the B operand (BLOCK_N keys x HEAD_DIM) of O += P V. fp16/bf16 slots hold V's rows as they are;
    an e4m3 slot holds V^T (HEAD_DIM x BLOCK_N, keys contiguous), read through its transpose: the 8-bit wgmma
    takes B K-major (keys contiguous) only."""
    if v_tile.dtype.primitive_bitwidth == 8:
        v_tile = v_tile.permute((1, 0))
    return v_tile


@gluon.jit
def _pingpong_enter(turn, g, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
    """FA3's warpgroup ping-pong: before issuing the wgmma of its g-th block, a consumer waits until the other one
    has issued its own (consumer 0 goes first: its first wait is on the parity before the initial phase). The
    tensor cores then alternate between the warpgroups, and each one's softmax runs under the other's GEMMs."""
    if PINGPONG:
        mbarrier.wait(turn.index(CONSUMER), (g + 1 - CONSUMER) & 1)


@gluon.jit
def _pingpong_leave(turn, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - CONSUMER), count=1)


@gluon.jit
def _consumer_block_plain(q, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn, g, n_start, rows, acc, m_i, l_i,
                          seqlen_q, seqlen_k, qk_scale_log2, CONSUMER: gl.constexpr, BLOCK_N: gl.constexpr,
                          NUM_STAGES: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                          PINGPONG: gl.constexpr, EMU_COLS: gl.constexpr, EMU_DEGREE: gl.constexpr,
                          SPLIT_KV_RELEASE: gl.constexpr):
    """One key block (the CTA's g-th, keys from n_start) without cross-block overlap: S = Q K^T, softmax,
    O = alpha O + P V, release the slot."""
    HEAD_DIM: gl.constexpr = q.type.shape[1]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, q.dtype)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, q.dtype)
    p_layout: gl.constexpr = _p_layout(o_layout, q.dtype)
    slot = g % NUM_STAGES
    phase = (g // NUM_STAGES) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    _pingpong_enter(turn, g, CONSUMER, PINGPONG)
    s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    _pingpong_leave(turn, CONSUMER, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s, ))
    if SPLIT_KV_RELEASE:
        mbarrier.arrive(k_empty.index(slot), count=1)
    scale = qk_scale_log2
    if MASKED:
        s, scale = _scale_before_mask(s, qk_scale_log2, _p_log2_scale(q.dtype))
        s = _masked_scores(s, n_start, rows, seqlen_q, seqlen_k, BLOCK_N, CAUSAL)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, scale, _p_log2_scale(q.dtype), EMU_COLS, EMU_DEGREE)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p = _p_operand(p.to(q.dtype), p_layout)
    mbarrier.wait(v_ready.index(slot), phase)
    acc = warpgroup_mma(p, _pv_operand(v_smem.index(slot)), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(kv_empty.index(slot), count=1)
    return acc, m_i, l_i


@gluon.jit
def _consumer_block_overlap(q, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn, g, n_start, rows, acc, p, m_i,
                            l_i, seqlen_q, seqlen_k, qk_scale_log2, CONSUMER: gl.constexpr, BLOCK_N: gl.constexpr,
                            NUM_STAGES: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                            PINGPONG: gl.constexpr, EMU_COLS: gl.constexpr, EMU_DEGREE: gl.constexpr,
                            SPLIT_KV_RELEASE: gl.constexpr):
    """The CTA's g-th key block with FA3's intra-warpgroup overlap; p holds block g-1's probabilities.

    Issue S_g = Q K_g^T and O += P_{g-1} V_{g-1} back to back (both async), wait for S_g only, run block g's softmax
    while the PV wgmma still runs, then wait for PV, release block g-1's slot and rescale O by block g's alpha.
    Returns (acc, p_g, m_i, l_i)."""
    HEAD_DIM: gl.constexpr = q.type.shape[1]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, q.dtype)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, q.dtype)
    p_layout: gl.constexpr = _p_layout(o_layout, q.dtype)
    slot = g % NUM_STAGES
    prev = (g - 1) % NUM_STAGES
    mbarrier.wait(k_ready.index(slot), (g // NUM_STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((g - 1) // NUM_STAGES) & 1)
    _pingpong_enter(turn, g, CONSUMER, PINGPONG)
    s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    acc = warpgroup_mma(p, _pv_operand(v_smem.index(prev)), acc, is_async=True)
    _pingpong_leave(turn, CONSUMER, PINGPONG)
    s = warpgroup_mma_wait(1, deps=(s, ))  # wgmma groups retire in order: S_g is done, PV may still run
    if SPLIT_KV_RELEASE:
        mbarrier.arrive(k_empty.index(slot), count=1)
    scale = qk_scale_log2
    if MASKED:
        s, scale = _scale_before_mask(s, qk_scale_log2, _p_log2_scale(q.dtype))
        s = _masked_scores(s, n_start, rows, seqlen_q, seqlen_k, BLOCK_N, CAUSAL)
    p_new, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, scale, _p_log2_scale(q.dtype), EMU_COLS,
                                           EMU_DEGREE)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    mbarrier.arrive(kv_empty.index(prev), count=1)
    # P_g rounded only once PV_{g-1} has retired (as FA3 does): its 16-bit registers then replace P_{g-1}'s
    # instead of living beside them, which kept the causal loop spilling
    p_new = _p_operand(p_new.to(q.dtype), p_layout)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return acc, p_new, m_i, l_i


@gluon.jit
def _consumer_tile_plain(q, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn, blocks_done, n_full, n_blocks,
                         rows, seqlen_q, seqlen_k, qk_scale_log2, CONSUMER: gl.constexpr, BLOCK_N: gl.constexpr,
                         NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                         EMU_COLS: gl.constexpr, EMU_DEGREE: gl.constexpr, SPLIT_KV_RELEASE: gl.constexpr):
    """All key blocks of one tile for one warpgroup, unmasked blocks first. Returns (acc, m_i, l_i)."""
    HEAD_DIM: gl.constexpr = q.type.shape[1]
    row_layout: gl.constexpr = gl.SliceLayout(1, _mma_layout(BLOCK_N, q.dtype))
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, q.dtype)
    m_i = gl.full([64], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([64], gl.float32, row_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    for i in range(0, n_full):
        acc, m_i, l_i = _consumer_block_plain(q, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn,
                                              blocks_done + i, i * BLOCK_N, rows, acc, m_i, l_i, seqlen_q, seqlen_k,
                                              qk_scale_log2, CONSUMER, BLOCK_N, NUM_STAGES, False, CAUSAL, PINGPONG,
                                              EMU_COLS, EMU_DEGREE, SPLIT_KV_RELEASE)
    for i in range(n_full, n_blocks):
        acc, m_i, l_i = _consumer_block_plain(q, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn,
                                              blocks_done + i, i * BLOCK_N, rows, acc, m_i, l_i, seqlen_q, seqlen_k,
                                              qk_scale_log2, CONSUMER, BLOCK_N, NUM_STAGES, True, CAUSAL, PINGPONG,
                                              EMU_COLS, EMU_DEGREE, SPLIT_KV_RELEASE)
    return acc, m_i, l_i


@gluon.jit
def _consumer_tile_overlap(q, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn, blocks_done, n_full, n_blocks,
                           rows, seqlen_q, seqlen_k, qk_scale_log2, CONSUMER: gl.constexpr, BLOCK_N: gl.constexpr,
                           NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                           EMU_COLS: gl.constexpr, EMU_DEGREE: gl.constexpr, SPLIT_KV_RELEASE: gl.constexpr):
    """All key blocks of one tile with intra-warpgroup overlap: block 0's scores and softmax alone, then the
    overlapped steps (unmasked ones first), then the last block's PV. Returns (acc, m_i, l_i)."""
    HEAD_DIM: gl.constexpr = q.type.shape[1]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, q.dtype)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, q.dtype)
    p_layout: gl.constexpr = _p_layout(o_layout, q.dtype)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([64], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([64], gl.float32, row_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    p = gl.zeros([64, BLOCK_N], q.dtype, p_layout)
    if n_blocks > 0:
        first = blocks_done % NUM_STAGES
        mbarrier.wait(k_ready.index(first), (blocks_done // NUM_STAGES) & 1)
        _pingpong_enter(turn, blocks_done, CONSUMER, PINGPONG)
        s = warpgroup_mma(q, k_smem.index(first).permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        _pingpong_leave(turn, CONSUMER, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s, ))
        if SPLIT_KV_RELEASE:
            mbarrier.arrive(k_empty.index(first), count=1)
        scale = qk_scale_log2
        if n_full == 0:
            s, scale = _scale_before_mask(s, qk_scale_log2, _p_log2_scale(q.dtype))
            s = _masked_scores(s, 0, rows, seqlen_q, seqlen_k, BLOCK_N, CAUSAL)
        p0, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, scale, _p_log2_scale(q.dtype), EMU_COLS,
                                            EMU_DEGREE)
        p = _p_operand(p0.to(q.dtype), p_layout)
    for i in range(1, n_full):
        acc, p, m_i, l_i = _consumer_block_overlap(q, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn,
                                                   blocks_done + i, i * BLOCK_N, rows, acc, p, m_i, l_i, seqlen_q,
                                                   seqlen_k, qk_scale_log2, CONSUMER, BLOCK_N, NUM_STAGES, False,
                                                   CAUSAL, PINGPONG, EMU_COLS, EMU_DEGREE, SPLIT_KV_RELEASE)
    for i in range(gl.maximum(n_full, 1), n_blocks):
        acc, p, m_i, l_i = _consumer_block_overlap(q, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn,
                                                   blocks_done + i, i * BLOCK_N, rows, acc, p, m_i, l_i, seqlen_q,
                                                   seqlen_k, qk_scale_log2, CONSUMER, BLOCK_N, NUM_STAGES, True,
                                                   CAUSAL, PINGPONG, EMU_COLS, EMU_DEGREE, SPLIT_KV_RELEASE)
    if n_blocks > 0:
        g_last = blocks_done + n_blocks - 1
        last = g_last % NUM_STAGES
        mbarrier.wait(v_ready.index(last), (g_last // NUM_STAGES) & 1)
        acc = warpgroup_mma(p, _pv_operand(v_smem.index(last)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index(last), count=1)
    return acc, m_i, l_i


@gluon.jit
def _consume_tile(tile, uses, blocks_done, BUF: gl.constexpr, CONSUMER: gl.constexpr, q_smem, k_smem, v_smem,
                  q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty, turn, out_ptr, lse_ptr, qk_descale_ptr,
                  v_descale_ptr, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, qk_scale_log2, NUM_HEADS: gl.constexpr,
                  GROUP: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
                  EMU_COLS: gl.constexpr, EMU_DEGREE: gl.constexpr, SPLIT_KV_RELEASE: gl.constexpr):
    """One warpgroup's rows [CONSUMER * 64, CONSUMER * 64 + 64) of one tile, its Q in buffer set BUF (``uses`` =
    tiles the set held before): all visited key blocks, then the output and lse (_consume_rows); an empty tile
    (ragged batches, see _tile_coords) does nothing. Returns the new (block counter, uses)."""
    batch, head, m_start, n_full_end, n_end, q_base, kv_base, len_q, len_k, live = _tile_coords(
        tile, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, NUM_HEADS, NUM_CONSUMERS * 64, BLOCK_N, CAUSAL)
    if cu_q_ptr is None:  # every tile is live: no branch around the loop (it cost the hd128 loop a spill)
        _consume_rows(uses, blocks_done, BUF, CONSUMER, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                      kv_empty, k_empty, turn, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, batch, head, m_start,
                      n_full_end, n_end, q_base, len_q, len_k, seqlen_k, cu_q_ptr, qk_scale_log2, NUM_HEADS,
                      GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, PINGPONG, EMU_COLS, EMU_DEGREE,
                      SPLIT_KV_RELEASE)
    elif live != 0:
        _consume_rows(uses, blocks_done, BUF, CONSUMER, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                      kv_empty, k_empty, turn, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, batch, head, m_start,
                      n_full_end, n_end, q_base, len_q, len_k, seqlen_k, cu_q_ptr, qk_scale_log2, NUM_HEADS,
                      GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, PINGPONG, EMU_COLS, EMU_DEGREE,
                      SPLIT_KV_RELEASE)
    return blocks_done + n_end // BLOCK_N, uses + live


@gluon.jit
def _consume_rows(uses, blocks_done, BUF: gl.constexpr, CONSUMER: gl.constexpr, q_smem, k_smem, v_smem, q_ready,
                  q_empty, k_ready, v_ready, kv_empty, k_empty, turn, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr,
                  batch, head, m_start, n_full_end, n_end, q_base, len_q, len_k, seqlen_k, cu_q_ptr,
                  qk_scale_log2, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
                  PINGPONG: gl.constexpr, EMU_COLS: gl.constexpr, EMU_DEGREE: gl.constexpr,
                  SPLIT_KV_RELEASE: gl.constexpr):
    """_consume_tile's work on a live tile (coordinates from _tile_coords)."""
    P_LOG2_SCALE: gl.constexpr = _p_log2_scale(q_smem.dtype)
    row_layout: gl.constexpr = gl.SliceLayout(1, _mma_layout(BLOCK_N, q_smem.dtype))
    rows = m_start + CONSUMER * 64 + gl.arange(0, 64, layout=row_layout)
    if P_LOG2_SCALE != 0.0:
        scale_log2 = qk_scale_log2 * gl.load(qk_descale_ptr + batch * NUM_HEADS + head)
        out_scale = gl.load(v_descale_ptr + batch * (NUM_HEADS // GROUP) + head // GROUP)
        # A scale that is not > 0 (a descale of 0 or below) takes every block through the masked path, which
        # scales the scores before masking them (_scale_before_mask); NaN descales give NaN either way.
        n_full_end = gl.where(scale_log2 > 0.0, n_full_end, 0)
    else:
        scale_log2 = qk_scale_log2
        out_scale = 1.0
    q = q_smem.index(BUF * NUM_CONSUMERS + CONSUMER)
    mbarrier.wait(q_ready.index(BUF * NUM_CONSUMERS + CONSUMER), uses & 1)
    n_blocks = n_end // BLOCK_N
    if OVERLAP:
        acc, m_i, l_i = _consumer_tile_overlap(q, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn,
                                               blocks_done, n_full_end // BLOCK_N, n_blocks, rows, len_q, len_k,
                                               scale_log2, CONSUMER, BLOCK_N, NUM_STAGES, CAUSAL, PINGPONG,
                                               EMU_COLS, EMU_DEGREE, SPLIT_KV_RELEASE)
    else:
        acc, m_i, l_i = _consumer_tile_plain(q, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, turn, blocks_done,
                                             n_full_end // BLOCK_N, n_blocks, rows, len_q, len_k,
                                             scale_log2, CONSUMER, BLOCK_N, NUM_STAGES, CAUSAL, PINGPONG,
                                             EMU_COLS, EMU_DEGREE, SPLIT_KV_RELEASE)
    # Every wgmma reading this Q has retired (the tile ends on a wait for 0 outstanding): free the buffer.
    mbarrier.arrive(q_empty.index(BUF * NUM_CONSUMERS + CONSUMER), count=1)
    # lse: (batch, NUM_HEADS, seqlen_q) for fixed-length batches, (NUM_HEADS, total_q = seqlen_k) for ragged ones;
    # its offset taken after the loop (a 64-bit pointer live across the loop cost the hd128 loop a spill)
    if cu_q_ptr is None:
        lse_row0 = (batch * NUM_HEADS + head).to(gl.int64) * len_q  # (len_q = seqlen_q here)
    else:
        lse_row0 = head.to(gl.int64) * seqlen_k + q_base
    _store_tile(acc, m_i, l_i, rows, out_ptr, lse_ptr + lse_row0, q_base, head, len_q, NUM_HEADS, out_scale,
                P_LOG2_SCALE)


@gluon.jit
def _consumer(CONSUMER: gl.constexpr, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty,
              turn, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, num_tiles, sched_ptr, seqlen_q, seqlen_k, cu_q_ptr,
              cu_k_ptr, qk_scale_log2, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
              PINGPONG: gl.constexpr, Q_BUFFERS: gl.constexpr, EMU_COLS: gl.constexpr, EMU_DEGREE: gl.constexpr,
              TILE_ORDER: gl.constexpr, SPLIT_KV_RELEASE: gl.constexpr):
    """One warpgroup: for each of the CTA's tiles (in the producer's order and Q buffer sets), rows
    [CONSUMER * 64, CONSUMER * 64 + 64) against all visited key blocks, then the normalised output (masked pointer
    store) and the natural-log lse (_consume_tile). e4m3 inputs: the tile's q_descale * k_descale joins the logit
    scale and its v_descale the output's (None for fp16/bf16)."""
    blocks_done = 0
    uses = 0
    if Q_BUFFERS == 1:
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            blocks_done, uses = _consume_tile(tile, uses, blocks_done, 0, CONSUMER, q_smem, k_smem, v_smem, q_ready,
                                        q_empty, k_ready, v_ready, kv_empty, k_empty, turn, out_ptr, lse_ptr,
                                        qk_descale_ptr, v_descale_ptr, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr,
                                        qk_scale_log2, NUM_HEADS,
                                        GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, PINGPONG,
                                        EMU_COLS, EMU_DEGREE, SPLIT_KV_RELEASE)
    else:
        uses_second = 0
        start, stop, step = _units(num_tiles, seqlen_q, sched_ptr, NUM_CONSUMERS * 64, TILE_ORDER)
        for unit in range(start, stop, step):
            tile, second = _unit_tiles(unit, num_tiles, seqlen_q, sched_ptr, NUM_CONSUMERS * 64, TILE_ORDER)
            blocks_done, uses = _consume_tile(tile, uses, blocks_done, 0, CONSUMER, q_smem, k_smem, v_smem, q_ready,
                                        q_empty, k_ready, v_ready, kv_empty, k_empty, turn, out_ptr, lse_ptr,
                                        qk_descale_ptr, v_descale_ptr, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr,
                                        qk_scale_log2, NUM_HEADS,
                                        GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, PINGPONG,
                                        EMU_COLS, EMU_DEGREE, SPLIT_KV_RELEASE)
            if second < num_tiles:
                blocks_done, uses_second = _consume_tile(second, uses_second, blocks_done, 1, CONSUMER, q_smem, k_smem,
                                                         v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty,
                                                         turn, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr,
                                                         seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, qk_scale_log2,
                                                         NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL,
                                                         OVERLAP, PINGPONG, EMU_COLS, EMU_DEGREE, SPLIT_KV_RELEASE)



@gluon.jit
def _store_tile(acc, m_i, l_i, rows, out_ptr, lse_ptr, q_base, head, len_q, NUM_HEADS: gl.constexpr, out_scale,
                P_LOG2_SCALE: gl.constexpr):
    """out = acc * out_scale / l (0 on rows without a visible key) and lse = (m + log2 l - P_LOG2_SCALE) * ln 2
    (-inf there). out_scale and P_LOG2_SCALE (see _p_log2_scale) only for e4m3 inputs: 1.0 and 0 otherwise.
    The sequence's rows [0, len_q) are out's rows q_base + row (out: (rows, NUM_HEADS, HEAD_DIM) contiguous) and
    lse_ptr[row] (lse_ptr at this (sequence, head)'s first row)."""
    HEAD_DIM: gl.constexpr = acc.type.shape[1]
    o_layout: gl.constexpr = acc.type.layout
    st_layout: gl.constexpr = _store_layout(HEAD_DIM)
    safe_l = gl.where(l_i == 0.0, 1.0, l_i)
    if P_LOG2_SCALE != 0.0:
        out = acc * gl.expand_dims(gl.convert_layout(out_scale / safe_l, gl.SliceLayout(1, o_layout)), 1)
        m_i = m_i - P_LOG2_SCALE
    else:
        out = acc * gl.expand_dims(gl.convert_layout(1.0 / safe_l, gl.SliceLayout(1, o_layout)), 1)
    out = gl.convert_layout(out.to(out_ptr.dtype.element_ty), st_layout)
    o_rows = gl.convert_layout(rows, gl.SliceLayout(1, st_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, st_layout))
    # int64 row index: q_base + rows times the row size can pass 2**31
    row_off = ((q_base + o_rows).to(gl.int64) * NUM_HEADS + head) * HEAD_DIM
    ptrs = out_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, out, mask=gl.expand_dims(o_rows < len_q, 1))
    lse = gl.where(l_i == 0.0, -float("inf"), (m_i + gl.log2(safe_l)) * LN2)
    gl.store(lse_ptr + rows, lse, mask=rows < len_q)


@gluon.jit
def attn_fwd_ws_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, num_tiles, seqlen_q, seqlen_k, qk_scale_log2,
                       NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                       OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       PRODUCER_REGS: gl.constexpr, Q_BUFFERS: gl.constexpr = 1,
                       EXP2_EMU_COLS: gl.constexpr = 0, EXP2_EMU_DEGREE: gl.constexpr = 5,
                       TILE_ORDER: gl.constexpr = 0, SPLIT_KV_RELEASE: gl.constexpr = False):
    """fp16/bf16: 1-D grid of up to num_tiles CTAs (num_tiles = cdiv(seqlen_q, NUM_CONSUMERS * 64) * batch *
    NUM_HEADS); a CTA takes tiles program_id, program_id + num_programs, ... (persistent when the grid is smaller
    than num_tiles). num_warps=4: the default partition is consumer 0. qk_scale_log2 = softmax_scale * log2(e).
    GROUP = nheads // nheads_kv (GQA). PINGPONG needs NUM_CONSUMERS == 2. NUM_CONSUMERS 1, 2 or 3 (3: 192-row tiles,
    FA3's hd64 shape; its register budgets must fit 65536 per SM: see GluonFwdConfig). EXP2_EMU_COLS of each
    block's BLOCK_N columns take their exp2 on the FMA pipe, a degree-EXP2_EMU_DEGREE polynomial (_exp2_mixed).
    TILE_ORDER (Q_BUFFERS == 2): how CTAs walk the tiles (TILE_ORDER_ROUND_ROBIN, _ZIGZAG, _PAIRS above;
    TILE_ORDER_LPT is attn_fwd_ws_lpt_kernel's)."""
    _attn_fwd_ws(q_desc, k_desc, v_desc, out_ptr, lse_ptr, None, None, num_tiles, None, seqlen_q, seqlen_k, None,
                 None, qk_scale_log2, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, PINGPONG,
                 CONSUMER_REGS, PRODUCER_REGS, False, Q_BUFFERS, EXP2_EMU_COLS, EXP2_EMU_DEGREE, TILE_ORDER,
                 SPLIT_KV_RELEASE)


@gluon.jit
def attn_fwd_ws_lpt_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, num_tiles, seqlen_q, seqlen_k, qk_scale_log2,
                           sched_ptr, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
                           NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                           OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           PRODUCER_REGS: gl.constexpr, SPLIT_KV_RELEASE: gl.constexpr = False):
    """attn_fwd_ws_kernel (fp16/bf16) with persistent CTAs that walk host-made tile lists (TILE_ORDER_LPT, two Q
    buffer sets): sched_ptr int32, [S, then per CTA: count, tiles, padding] (_lpt_row; ops/gluon_attention.py
    lpt_schedule); a grid of as many CTAs as the lists. A kernel of its own so that the others keep their
    parameter lists."""
    _attn_fwd_ws(q_desc, k_desc, v_desc, out_ptr, lse_ptr, None, None, num_tiles, sched_ptr, seqlen_q, seqlen_k, None,
                 None, qk_scale_log2, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, PINGPONG,
                 CONSUMER_REGS, PRODUCER_REGS, False, 2, 0, 5, TILE_ORDER_LPT, SPLIT_KV_RELEASE)


@gluon.jit
def attn_fwd_ws_varlen_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, num_tiles, seqlen_q, seqlen_k,
                              qk_scale_log2, cu_q_ptr, cu_k_ptr, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
                              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                              CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, Q_BUFFERS: gl.constexpr = 1,
                              TILE_ORDER: gl.constexpr = 0, SPLIT_KV_RELEASE: gl.constexpr = False):
    """attn_fwd_ws_kernel (fp16/bf16) over a ragged batch packed along the tokens (flash_attn_varlen's layout).

    q_desc: (total_q, nheads * HEAD_DIM) rows; k_desc / v_desc: (total_k, nheads_kv * HEAD_DIM) rows; out (total_q,
    nheads, HEAD_DIM) contiguous; lse (nheads, total_q) float32 contiguous. cu_q_ptr / cu_k_ptr: int32 (batch + 1,)
    cumulative lengths, read on the device (no host sync). seqlen_q = the longest sequence's query count (the
    tile numbering's rows per (sequence, head); num_tiles = cdiv(seqlen_q, NUM_CONSUMERS * 64) * batch *
    NUM_HEADS), seqlen_k = total_q (lse's head stride). Tiles past a sequence's rows are empty (_tile_coords). A
    kernel of its own so that the others keep their parameter lists."""
    _attn_fwd_ws(q_desc, k_desc, v_desc, out_ptr, lse_ptr, None, None, num_tiles, None, seqlen_q, seqlen_k,
                 cu_q_ptr, cu_k_ptr, qk_scale_log2, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL,
                 OVERLAP, PINGPONG, CONSUMER_REGS, PRODUCER_REGS, False, Q_BUFFERS, 0, 5, TILE_ORDER,
                 SPLIT_KV_RELEASE)


@gluon.jit
def attn_fwd_fp8_ws_kernel(q_desc, k_desc, vt_desc, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, num_tiles,
                           seqlen_q, seqlen_k, qk_scale_log2, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
                           BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                           CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, Q_BUFFERS: gl.constexpr = 1,
                           TILE_ORDER: gl.constexpr = 0, SPLIT_KV_RELEASE: gl.constexpr = False):
    """e4m3 (float8e4nv) q, k and V^T, bf16 out; grid and constexprs as attn_fwd_ws_kernel.

    q_desc, k_desc as there (blocks [64, HEAD_DIM], [BLOCK_N, HEAD_DIM]); vt_desc views V^T as the 2-D
    (batch * nheads_kv * HEAD_DIM, keys_pad) rows of a contiguous (batch, nheads_kv, HEAD_DIM, keys_pad) tensor,
    block [HEAD_DIM, BLOCK_N]: keys_pad = seqlen_k rounded up to 32, keys renumbered within each 32 as _p_operand
    renumbers P's columns, zeros past seqlen_k (ops/fp8_v_transpose.py, key_order="wgmma").
    qk_descale_ptr: float32 (batch, nheads) contiguous, q_descale * k_descale of each query head, folded into the
    logit scale; v_descale_ptr: float32 (batch, nheads_kv) contiguous, applied to the output. out bfloat16."""
    _attn_fwd_ws(q_desc, k_desc, vt_desc, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, num_tiles, None, seqlen_q,
                 seqlen_k, None, None, qk_scale_log2, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL,
                 OVERLAP, PINGPONG, CONSUMER_REGS, PRODUCER_REGS, True, Q_BUFFERS, 0, 5, TILE_ORDER, SPLIT_KV_RELEASE)


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, num_tiles, sched_ptr,
                 seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, qk_scale_log2, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
                 BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                 OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                 PRODUCER_REGS: gl.constexpr, V_T: gl.constexpr, Q_BUFFERS: gl.constexpr, EMU_COLS: gl.constexpr,
                 EMU_DEGREE: gl.constexpr, TILE_ORDER: gl.constexpr, SPLIT_KV_RELEASE: gl.constexpr):
    """Both kernels' body: shared memory, barriers, and the partitions. V_T: v_desc's blocks are V^T tiles.
    Q_BUFFERS: Q buffer sets (1, or 2 for persistent CTAs: see _producer). EMU_COLS / EMU_DEGREE: see
    _exp2_mixed (0: every exp2 on the MUFU unit). TILE_ORDER: see _units."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS * NUM_CONSUMERS, 64, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, v_desc.block_type.shape[0], v_desc.block_type.shape[1]],
                                       v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(Q_BUFFERS * NUM_CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=NUM_CONSUMERS)
        mbarrier.init(k_empty.index(s), count=NUM_CONSUMERS)
    for c in gl.static_range(2):
        mbarrier.init(turn.index(c), count=1)
    # Tuple literals for the partitions' arguments (each one spelled out: constexprs must reach them as such).
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty, turn,
                         out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, num_tiles, sched_ptr, seqlen_q, seqlen_k,
                         cu_q_ptr, cu_k_ptr, qk_scale_log2, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS,
                         CAUSAL, OVERLAP, PINGPONG, Q_BUFFERS, EMU_COLS, EMU_DEGREE, TILE_ORDER, SPLIT_KV_RELEASE)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty, turn,
                         out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, num_tiles, sched_ptr, seqlen_q, seqlen_k,
                         cu_q_ptr, cu_k_ptr, qk_scale_log2, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS,
                         CAUSAL, OVERLAP, PINGPONG, Q_BUFFERS, EMU_COLS, EMU_DEGREE, TILE_ORDER, SPLIT_KV_RELEASE)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                         k_empty, num_tiles, sched_ptr, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, NUM_HEADS, GROUP,
                         BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, V_T, Q_BUFFERS, TILE_ORDER, SPLIT_KV_RELEASE)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif NUM_CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty, turn,
                         out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, num_tiles, sched_ptr, seqlen_q, seqlen_k,
                         cu_q_ptr, cu_k_ptr, qk_scale_log2, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS,
                         CAUSAL, OVERLAP, False, Q_BUFFERS, EMU_COLS, EMU_DEGREE, TILE_ORDER, SPLIT_KV_RELEASE)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty, turn,
                         out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, num_tiles, sched_ptr, seqlen_q, seqlen_k,
                         cu_q_ptr, cu_k_ptr, qk_scale_log2, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS,
                         CAUSAL, OVERLAP, False, Q_BUFFERS, EMU_COLS, EMU_DEGREE, TILE_ORDER, SPLIT_KV_RELEASE)),
            (_consumer, (2, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty, turn,
                         out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, num_tiles, sched_ptr, seqlen_q, seqlen_k,
                         cu_q_ptr, cu_k_ptr, qk_scale_log2, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS,
                         CAUSAL, OVERLAP, False, Q_BUFFERS, EMU_COLS, EMU_DEGREE, TILE_ORDER, SPLIT_KV_RELEASE)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                         k_empty, num_tiles, sched_ptr, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, NUM_HEADS, GROUP,
                         BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, V_T, Q_BUFFERS, TILE_ORDER, SPLIT_KV_RELEASE)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, k_empty, turn,
                         out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, num_tiles, sched_ptr, seqlen_q, seqlen_k,
                         cu_q_ptr, cu_k_ptr, qk_scale_log2, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS,
                         CAUSAL, OVERLAP, False, Q_BUFFERS, EMU_COLS, EMU_DEGREE, TILE_ORDER, SPLIT_KV_RELEASE)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                         k_empty, num_tiles, sched_ptr, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, NUM_HEADS, GROUP,
                         BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, V_T, Q_BUFFERS, TILE_ORDER, SPLIT_KV_RELEASE)),
        ], [1], [PRODUCER_REGS])
