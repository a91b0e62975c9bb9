"""The Gluon forward's warp-specialised partitions (see attn_fwd for the design): the producer warp's TMA loads and
the consumer warpgroups' key-block loops, over two shared-memory channels (the Q buffer sets and the K/V slot
ring) and the launch's compile-time configuration (FwdConfig)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from flashdecode.kernels.gluon.compat import thread_barrier, tma_load
from flashdecode.kernels.gluon.fwd_softmax import RowMask, p_operand, pv_operand, softmax_step, store_tile
from flashdecode.kernels.gluon.layouts import (RUNTIME, aggregate, mma_layout, p_layout, p_log2_scale, runtime,
                                               store_layout)


@aggregate
class FwdConfig:
    """The launch's compile-time choices (the entry kernels' constexprs; ops/gluon_attention.py GluonFwdConfig):
    NUM_HEADS query heads, GROUP = nheads // nheads_kv, BLOCK_N keys a block, NUM_STAGES K/V slots, NUM_CONSUMERS
    warpgroups of 64 rows (BLOCK_M = NUM_CONSUMERS * 64 rows a tile), CAUSAL, OVERLAP (FA3's intra-warpgroup
    overlap), Q_BUFFERS Q buffer sets, TILE_ORDER (fwd_tiles), SPLIT_KV_RELEASE (K and V slots released apart),
    V_T (the V descriptor's blocks are V^T tiles: e4m3) and V_TAIL (a key block's V rows past the sequence's keys
    may be non-zero - another sequence's rows of a packed batch, a page's tail - so the consumers zero them before
    PV: fwd_softmax.RowMask). V_BOUND (ragged batches, V_TAIL False): the producer loads a sequence's last V block
    through a descriptor made on the device that ends at the sequence's last key, so TMA fills the rows past it with
    zeros and the consumers' loop stays as without V_TAIL (bounded_v_load)."""
    NUM_HEADS: gl.constexpr
    GROUP: gl.constexpr
    BLOCK_N: gl.constexpr
    BLOCK_M: gl.constexpr
    NUM_STAGES: gl.constexpr
    NUM_CONSUMERS: gl.constexpr
    CAUSAL: gl.constexpr
    OVERLAP: gl.constexpr
    Q_BUFFERS: gl.constexpr
    TILE_ORDER: gl.constexpr
    SPLIT_KV_RELEASE: gl.constexpr
    V_T: gl.constexpr
    V_TAIL: gl.constexpr
    V_BOUND: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, Q_BUFFERS, TILE_ORDER,
                 SPLIT_KV_RELEASE, V_T, V_TAIL=False, V_BOUND=False):
        self.NUM_HEADS = gl.constexpr(NUM_HEADS)
        self.GROUP = gl.constexpr(GROUP)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.BLOCK_M = gl.constexpr(NUM_CONSUMERS * 64)
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)
        self.NUM_CONSUMERS = gl.constexpr(NUM_CONSUMERS)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.OVERLAP = gl.constexpr(OVERLAP)
        self.Q_BUFFERS = gl.constexpr(Q_BUFFERS)
        self.TILE_ORDER = gl.constexpr(TILE_ORDER)
        self.SPLIT_KV_RELEASE = gl.constexpr(SPLIT_KV_RELEASE)
        self.V_T = gl.constexpr(V_T)
        self.V_TAIL = gl.constexpr(V_TAIL)
        self.V_BOUND = gl.constexpr(V_BOUND)


@aggregate
class QChannel:
    """Q buffer sets: Q_BUFFERS * NUM_CONSUMERS shared-memory slots of 64 rows (slot BUF * NUM_CONSUMERS + c for
    consumer c), each with a ``ready`` mbarrier (TMA completes it by byte count) and an ``empty`` one (the consumer
    arrives once its wgmmas no longer read the slot). ``uses`` = tiles the slot's set held before: its phase."""
    smem: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, smem, ready, empty):
        self.smem = smem
        self.ready = ready
        self.empty = empty

    @gluon.jit
    def init(self):
        SLOTS: gl.constexpr = self.smem.shape[0]
        for c in gl.static_range(SLOTS):
            mbarrier.init(self.ready.index(c), count=1)
            mbarrier.init(self.empty.index(c), count=1)

    @gluon.jit
    def await_empty(self, slot, uses, nbytes: gl.constexpr):
        """Producer: wait until ``slot`` is free and arm its ready barrier for ``nbytes`` of TMA; returns that
        barrier (the caller issues the load into self.smem.index(slot)). A buffer's first use waits on the parity
        before the barrier's initial phase, which passes at once."""
        mbarrier.wait(self.empty.index(slot), (uses & 1) ^ 1)
        mbarrier.expect(self.ready.index(slot), nbytes)
        return self.ready.index(slot)

    @gluon.jit
    def acquire(self, slot, uses):
        """Consumer: ``slot``'s Q tile once its load has landed."""
        q = self.smem.index(slot)
        mbarrier.wait(self.ready.index(slot), uses & 1)
        return q

    @gluon.jit
    def release(self, slot):
        mbarrier.arrive(self.empty.index(slot), count=1)


@aggregate
class KVRing:
    """The K/V slot ring: NUM_STAGES K and V slots. Block g (the CTA's g-th, counted across its tiles) goes to slot
    g % NUM_STAGES in phase (g // NUM_STAGES) & 1. ``k_ready`` / ``v_ready`` complete by TMA byte count;
    ``kv_empty`` counts every consumer's release of the slot (after its PV); with SPLIT_KV_RELEASE the K slot has its
    own ``k_empty``, released once the block's scores are in registers, so the next K load need not wait for PV."""
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    kv_empty: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    NUM_STAGES: gl.constexpr
    SPLIT_KV_RELEASE: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, k_smem, v_smem, k_ready, v_ready, kv_empty, k_empty, SPLIT_KV_RELEASE):
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.k_ready = k_ready
        self.v_ready = v_ready
        self.kv_empty = kv_empty
        self.k_empty = k_empty
        self.NUM_STAGES = gl.constexpr(k_smem.shape[0])
        self.SPLIT_KV_RELEASE = gl.constexpr(SPLIT_KV_RELEASE)

    @gluon.jit
    def init(self, num_consumers: gl.constexpr):
        for s in gl.static_range(self.NUM_STAGES):
            mbarrier.init(self.k_ready.index(s), count=1)
            mbarrier.init(self.v_ready.index(s), count=1)
            mbarrier.init(self.kv_empty.index(s), count=num_consumers)
            mbarrier.init(self.k_empty.index(s), count=num_consumers)

    @gluon.jit
    def await_empty_k(self, g, nbytes: gl.constexpr):
        """Producer: wait until block g's K slot is free (with one release per slot: its V too) and arm its ready
        barrier for ``nbytes``; returns that barrier (the caller loads into self.k_smem.index(g % NUM_STAGES))."""
        slot = g % self.NUM_STAGES
        empty_phase = ((g // self.NUM_STAGES) & 1) ^ 1
        if self.SPLIT_KV_RELEASE:
            mbarrier.wait(self.k_empty.index(slot), empty_phase)
        else:
            mbarrier.wait(self.kv_empty.index(slot), empty_phase)
        mbarrier.expect(self.k_ready.index(slot), nbytes)
        return self.k_ready.index(slot)

    @gluon.jit
    def await_empty_v(self, g, nbytes: gl.constexpr):
        """await_empty_k for block g's V slot (after its K: with SPLIT_KV_RELEASE it waits for the PV release)."""
        slot = g % self.NUM_STAGES
        if self.SPLIT_KV_RELEASE:
            mbarrier.wait(self.kv_empty.index(slot), ((g // self.NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(self.v_ready.index(slot), nbytes)
        return self.v_ready.index(slot)

    @gluon.jit
    def wait_k(self, g):
        """Consumer: block g's K tile has landed."""
        slot = g % self.NUM_STAGES
        phase = (g // self.NUM_STAGES) & 1
        mbarrier.wait(self.k_ready.index(slot), phase)

    @gluon.jit
    def wait_v(self, g):
        """Consumer: block g's V tile has landed."""
        slot = g % self.NUM_STAGES
        phase = (g // self.NUM_STAGES) & 1
        mbarrier.wait(self.v_ready.index(slot), phase)

    @gluon.jit
    def k_operand(self, g):
        """Block g's K slot as the B operand (HEAD_DIM x BLOCK_N) of S = Q K^T."""
        return self.k_smem.index(g % self.NUM_STAGES).permute((1, 0))

    @gluon.jit
    def v_operand(self, g):
        return pv_operand(self.v_smem.index(g % self.NUM_STAGES))

    @gluon.jit
    def clear_v_rows(self, g, valid):
        """Zero block g's V slot from row ``valid`` on (nothing where valid >= BLOCK_N), after its load landed and
        before the PV wgmma reads it: the rows past a sequence's keys may hold anything (the next sequence's values
        of a packed batch, a paged cache's page tail), and their zero probabilities times NaN or inf would be NaN.
        ROWS rows at a time through registers; every consumer warpgroup writes the same zeros (so no order among
        them matters), then fences its generic stores against the wgmma's async reads and syncs its warps."""
        BLOCK_N: gl.constexpr = self.v_smem.shape[1]
        HEAD_DIM: gl.constexpr = self.v_smem.shape[2]
        layout: gl.constexpr = store_layout(HEAD_DIM)
        ROWS: gl.constexpr = 8  # rows a step: few registers beside a tile's live state
        if valid < BLOCK_N:
            slot = self.v_smem.index(g % self.NUM_STAGES)
            for c in gl.static_range(BLOCK_N // ROWS):
                if c * ROWS + ROWS > valid:
                    chunk = slot.slice(c * ROWS, ROWS)
                    rows = c * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
                    x = chunk.load(layout)
                    chunk.store(gl.where(gl.expand_dims(rows < valid, 1), x, gl.zeros_like(x)))
            fence_async_shared()
            thread_barrier()

    @gluon.jit
    def release_k(self, g):
        """Block g's scores are in registers: its K slot may refill (SPLIT_KV_RELEASE; else a no-op)."""
        if self.SPLIT_KV_RELEASE:
            mbarrier.arrive(self.k_empty.index(g % self.NUM_STAGES), count=1)

    @gluon.jit
    def release(self, g):
        """Block g's PV has retired: its slot may refill."""
        mbarrier.arrive(self.kv_empty.index(g % self.NUM_STAGES), count=1)


@aggregate
class FwdOutputs:
    """Where a tile's results go: out (rows, NUM_HEADS, HEAD_DIM) and lse (see _consume_rows) pointers; e4m3 inputs'
    qk_descale (batch, nheads) and v_descale (batch, nheads_kv) float32 (None for fp16/bf16)."""
    out_ptr: gl.tensor
    lse_ptr: gl.tensor
    qk_descale_ptr: RUNTIME
    v_descale_ptr: RUNTIME

    @gluon.constexpr_function
    def __init__(self, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr):
        self.out_ptr = out_ptr
        self.lse_ptr = lse_ptr
        self.qk_descale_ptr = runtime(qk_descale_ptr)
        self.v_descale_ptr = runtime(v_descale_ptr)


# ---- producer -------------------------------------------------------------------------------------------------


@gluon.jit
def producer(cfg, q_desc, k_desc, v_desc, q_chan, ring, tiles):
    """One warp: for each of the CTA's tiles, TMA loads of its Q rows and of every visited K/V block into the slot
    ring (_produce_tile). The ring runs on across tiles: its slot and phase come from a block counter over the
    whole CTA, so the next tile's first K/V blocks load while the consumers still finish the current one.
    Q_BUFFERS = 2 (persistent CTAs): two Q buffer sets, tiles alternating between them, so the next tile's Q loads
    while the consumers still read the current one's; the loop is unrolled by two so every buffer index is static
    (a buffer picked by a runtime index made causal launches read shared memory out of bounds, compute-sanitizer).
    With one set the next tile's Q waits for the current one's release. TILE_ORDER (two sets only): which two
    tiles a loop step takes (TileSpace.units, unit_tiles)."""
    blocks_done = 0
    uses = 0
    # the last block each Q buffer set's tiles loaded through a bounded V descriptor (V_BOUND): none yet. One per
    # set because each of _produce_tile's two call sites makes its descriptors in a global-scratch slot of its own
    v_last = -cfg.NUM_STAGES
    if cfg.Q_BUFFERS == 1:
        for tile in range(gl.program_id(0), tiles.num_tiles, gl.num_programs(0)):
            blocks_done, uses, v_last = _produce_tile(tile, uses, blocks_done, v_last, 0, cfg, q_desc, k_desc, v_desc,
                                                      q_chan, ring, tiles)
    else:
        uses_second = 0  # the second set can sit out a unit (no second tile), so it keeps its own phase count
        v_last_second = -cfg.NUM_STAGES
        start, stop, step = tiles.units(cfg)
        for unit in range(start, stop, step):
            tile, second = tiles.unit_tiles(unit, cfg)
            blocks_done, uses, v_last = _produce_tile(tile, uses, blocks_done, v_last, 0, cfg, q_desc, k_desc, v_desc,
                                                      q_chan, ring, tiles)
            if second < tiles.num_tiles:
                blocks_done, uses_second, v_last_second = _produce_tile(second, uses_second, blocks_done,
                                                                        v_last_second, 1, cfg, q_desc, k_desc,
                                                                        v_desc, q_chan, ring, tiles)


@gluon.jit
def _produce_tile(tile, uses, blocks_done, v_last, BUF: gl.constexpr, cfg, q_desc, k_desc, v_desc, q_chan, ring,
                  tiles):
    """The producer's work for one tile: its Q rows into Q buffer set BUF (``uses`` = tiles the set held before),
    then every visited K/V block into the slot ring (slot and phase from ``blocks_done``, the CTA's block counter);
    an empty tile (ragged batches) loads nothing. V_T (e4m3): v_desc views V^T, one row per (batch, kv head, dim)
    and one column per key, so a block is the [HEAD_DIM, BLOCK_N] tile at the kv head's rows and the block's keys.
    V_BOUND: a block that ends past the sequence's keys loads its V through bounded_v_load (v_last: the last block
    this call site loaded so, in the CTA's count). Returns the new (block counter, uses, v_last)."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    t = tiles.coords(tile, cfg)
    if t.live != 0:
        for c in gl.static_range(cfg.NUM_CONSUMERS):
            ready = q_chan.await_empty(BUF * cfg.NUM_CONSUMERS + c, uses, q_desc.block_type.nbytes)
            tma_load(q_desc, [t.q_base + t.m_start + c * 64, t.head * HEAD_DIM], ready,
                     q_chan.smem.index(BUF * cfg.NUM_CONSUMERS + c))
    kv_col = (t.head // cfg.GROUP) * HEAD_DIM
    for i in range(t.num_blocks(BLOCK_N)):
        g = blocks_done + i
        key = t.n_lo + i * BLOCK_N
        if tiles.pages is not None:  # its page's rows; the table read before the slot wait, its latency under it
            row = tiles.pages.row(t.kv_base, key)
        ready = ring.await_empty_k(g, k_desc.block_type.nbytes)
        if tiles.pages is None:  # the packed sequence's rows
            row = t.kv_base + key
        tma_load(k_desc, [row, kv_col], ready, ring.k_smem.index(g % cfg.NUM_STAGES))
        ready = ring.await_empty_v(g, v_desc.block_type.nbytes)
        if cfg.V_T:
            tma_load(v_desc, [(t.batch * (cfg.NUM_HEADS // cfg.GROUP) + t.head // cfg.GROUP) * HEAD_DIM, key],
                     ready, ring.v_smem.index(g % cfg.NUM_STAGES))
        elif cfg.V_BOUND:
            if key + BLOCK_N > t.len_k:
                bounded_v_load(v_desc, tiles.v_rows_ptr, t.kv_base + t.len_k, [row, kv_col], ready, ring, g, v_last)
                v_last = g
            else:
                tma_load(v_desc, [row, kv_col], ready, ring.v_smem.index(g % cfg.NUM_STAGES))
        else:
            tma_load(v_desc, [row, kv_col], ready, ring.v_smem.index(g % cfg.NUM_STAGES))
    return blocks_done + t.num_blocks(BLOCK_N), uses + t.live, v_last


@gluon.jit
def bounded_v_load(v_desc, v_rows_ptr, end_row, coord, ready, ring, g, v_last):
    """Block g's V tile at coord through a copy of v_desc (the (total_k, nheads_kv * HEAD_DIM) rows at
    v_rows_ptr) made on the device and ending at row end_row, the sequence's last key + 1: TMA fills the rows past
    it with zeros (never the next sequence's values, whose NaN or inf would reach this sequence's rows through
    0 * NaN in PV), and still counts the whole box's bytes on ``ready``. The copy lives in the global-scratch slot
    of this call site (inlined), which its every such load rewrites, so its last one (block v_last) must have
    landed first: where that block's ring slot has not been refilled since (g - v_last < NUM_STAGES) the producer
    waits for it; otherwise the refill already waited for the slot's release, which came after the load landed."""
    if g - v_last < ring.NUM_STAGES:
        mbarrier.wait(ring.v_ready.index(v_last % ring.NUM_STAGES), (v_last // ring.NUM_STAGES) & 1)
    bounded = tma.make_tensor_descriptor(v_rows_ptr, [gl.maximum(end_row, 1), v_desc.shape[1]],
                                         [v_desc.strides[0], 1], v_desc.block_type.shape, v_desc.layout)
    tma_load(bounded, coord, ready, ring.v_smem.index(g % ring.NUM_STAGES))


# ---- consumers ------------------------------------------------------------------------------------------------


@gluon.jit
def consumer(CONSUMER: gl.constexpr, cfg, q_chan, ring, outs, tiles, qk_scale_log2):
    """One warpgroup: for each of the CTA's tiles (in the producer's order and Q buffer sets), rows
    [CONSUMER * 64, CONSUMER * 64 + 64) against all visited key blocks, then the normalised output (masked pointer
    store) and the natural-log lse (_consume_tile). e4m3 inputs: the tile's q_descale * k_descale joins the logit
    scale and its v_descale the output's."""
    blocks_done = 0
    uses = 0
    if cfg.Q_BUFFERS == 1:
        for tile in range(gl.program_id(0), tiles.num_tiles, gl.num_programs(0)):
            blocks_done, uses = _consume_tile(tile, uses, blocks_done, 0, CONSUMER, cfg, q_chan, ring, outs, tiles,
                                              qk_scale_log2)
    else:
        uses_second = 0
        start, stop, step = tiles.units(cfg)
        for unit in range(start, stop, step):
            tile, second = tiles.unit_tiles(unit, cfg)
            blocks_done, uses = _consume_tile(tile, uses, blocks_done, 0, CONSUMER, cfg, q_chan, ring, outs, tiles,
                                              qk_scale_log2)
            if second < tiles.num_tiles:
                blocks_done, uses_second = _consume_tile(second, uses_second, blocks_done, 1, CONSUMER, cfg, q_chan,
                                                         ring, outs, tiles, qk_scale_log2)


@gluon.jit
def _consume_tile(tile, uses, blocks_done, BUF: gl.constexpr, CONSUMER: gl.constexpr, cfg, q_chan, ring, outs, tiles,
                  qk_scale_log2):
    """One warpgroup's rows of one tile, its Q in buffer set BUF (``uses`` = tiles the set held before): all visited
    key blocks, then the output and lse (_consume_rows); an empty tile (ragged batches) does nothing. Returns the
    new (block counter, uses)."""
    t = tiles.coords(tile, cfg)
    if tiles.cu_q_ptr is None:  # every tile is live: no branch around the loop (it cost the hd128 loop a spill)
        _consume_rows(uses, blocks_done, BUF, CONSUMER, cfg, q_chan, ring, outs, t, tiles, qk_scale_log2)
    elif t.live != 0:
        _consume_rows(uses, blocks_done, BUF, CONSUMER, cfg, q_chan, ring, outs, t, tiles, qk_scale_log2)
    return blocks_done + t.num_blocks(cfg.BLOCK_N), uses + t.live


@gluon.jit
def _consume_rows(uses, blocks_done, BUF: gl.constexpr, CONSUMER: gl.constexpr, cfg, q_chan, ring, outs, t, tiles,
                  qk_scale_log2):
    """_consume_tile's work on a live tile t (a fwd_tiles.Tile)."""
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    NUM_HEADS: gl.constexpr = cfg.NUM_HEADS
    P_LOG2_SCALE: gl.constexpr = p_log2_scale(q_chan.smem.dtype)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout(BLOCK_N, q_chan.smem.dtype))
    rows = t.m_start + CONSUMER * 64 + gl.arange(0, 64, layout=row_layout)
    n_full_end = t.n_full_end
    if P_LOG2_SCALE != 0.0:
        scale_log2 = qk_scale_log2 * gl.load(outs.qk_descale_ptr + t.batch * NUM_HEADS + t.head)
        out_scale = gl.load(outs.v_descale_ptr + t.batch * (NUM_HEADS // cfg.GROUP) + t.head // cfg.GROUP)
        # A scale that is not > 0 (a descale of 0 or below) takes every block through the masked path, which
        # scales the scores before masking them (scale_before_mask); NaN descales give NaN either way.
        n_full_end = gl.where(scale_log2 > 0.0, n_full_end, t.n_lo)
    else:
        scale_log2 = qk_scale_log2
        out_scale = 1.0
    q_slot: gl.constexpr = BUF * cfg.NUM_CONSUMERS + CONSUMER
    q = q_chan.acquire(q_slot, uses)
    n_blocks = t.num_blocks(BLOCK_N)
    n_full = (n_full_end - t.n_lo) // BLOCK_N
    mask = RowMask(rows, t.len_q, t.len_k, cfg.CAUSAL, tiles.opts, cfg.V_TAIL)
    if cfg.OVERLAP:
        acc, m_i, l_i = _tile_overlap(ring, q, blocks_done, t.n_lo, n_full, n_blocks, mask, scale_log2)
    else:
        acc, m_i, l_i = _tile_plain(ring, q, blocks_done, t.n_lo, n_full, n_blocks, mask, scale_log2)
    # Every wgmma reading this Q has retired (the tile ends on a wait for 0 outstanding): free the buffer.
    q_chan.release(q_slot)
    # lse: (batch, NUM_HEADS, seqlen_q) for fixed-length batches, (NUM_HEADS, total_q = seqlen_k) for ragged ones;
    # its offset taken after the loop (a 64-bit pointer live across the loop cost the hd128 loop a spill)
    if tiles.cu_q_ptr is None:
        lse_row0 = (t.batch * NUM_HEADS + t.head).to(gl.int64) * t.len_q  # (len_q = seqlen_q here)
    else:
        lse_row0 = t.head.to(gl.int64) * tiles.seqlen_k + t.q_base
    store_tile(acc, m_i, l_i, rows, outs.out_ptr, outs.lse_ptr + lse_row0, t.q_base, t.head, t.len_q, NUM_HEADS,
               out_scale, P_LOG2_SCALE)


@gluon.jit
def _tile_plain(ring, q, blocks_done, n_lo, n_full, n_blocks, mask, qk_scale_log2):
    """All key blocks of one tile for one warpgroup (block i: keys from n_lo + i * BLOCK_N) without cross-block
    overlap, unmasked blocks first. Returns (acc, m_i, l_i)."""
    HEAD_DIM: gl.constexpr = q.type.shape[1]
    BLOCK_N: gl.constexpr = ring.k_smem.shape[1]
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout(BLOCK_N, q.dtype))
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, q.dtype)
    m_i = gl.full([64], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([64], gl.float32, row_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    for i in range(0, n_full):
        acc, m_i, l_i = _block_plain(ring, q, blocks_done + i, n_lo + i * BLOCK_N, mask, acc, m_i, l_i,
                                     qk_scale_log2, False)
    for i in range(n_full, n_blocks):
        acc, m_i, l_i = _block_plain(ring, q, blocks_done + i, n_lo + i * BLOCK_N, mask, acc, m_i, l_i,
                                     qk_scale_log2, True)
    return acc, m_i, l_i


@gluon.jit
def _block_plain(ring, q, g, n_start, mask, acc, m_i, l_i, qk_scale_log2, MASKED: gl.constexpr):
    """One key block (the CTA's g-th, keys from n_start): S = Q K^T, softmax, O = alpha O + P V, release the
    slot."""
    HEAD_DIM: gl.constexpr = q.type.shape[1]
    BLOCK_N: gl.constexpr = ring.k_smem.shape[1]
    s_layout: gl.constexpr = mma_layout(BLOCK_N, q.dtype)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, q.dtype)
    pv_layout: gl.constexpr = p_layout(o_layout, q.dtype)
    P_LOG2_SCALE: gl.constexpr = p_log2_scale(q.dtype)
    ring.wait_k(g)
    s = warpgroup_mma(q, ring.k_operand(g), gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    ring.release_k(g)
    s, scale = mask.scores(s, qk_scale_log2, n_start, MASKED, P_LOG2_SCALE)
    p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, scale, P_LOG2_SCALE)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p = p_operand(p.to(q.dtype), pv_layout)
    ring.wait_v(g)
    if MASKED:
        if mask.V_TAIL:  # (only a tile's last block holds keys past len_k)
            ring.clear_v_rows(g, mask.len_k - n_start)
    acc = warpgroup_mma(p, ring.v_operand(g), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    ring.release(g)
    return acc, m_i, l_i


@gluon.jit
def _tile_overlap(ring, q, blocks_done, n_lo, n_full, n_blocks, mask, qk_scale_log2):
    """All key blocks of one tile (block i: keys from n_lo + i * BLOCK_N) with FA3's intra-warpgroup overlap: block
    0's scores and softmax alone, then the overlapped steps (unmasked ones first), then the last block's PV.
    Returns (acc, m_i, l_i)."""
    HEAD_DIM: gl.constexpr = q.type.shape[1]
    BLOCK_N: gl.constexpr = ring.k_smem.shape[1]
    s_layout: gl.constexpr = mma_layout(BLOCK_N, q.dtype)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, q.dtype)
    pv_layout: gl.constexpr = p_layout(o_layout, q.dtype)
    P_LOG2_SCALE: gl.constexpr = p_log2_scale(q.dtype)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([64], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([64], gl.float32, row_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    p = gl.zeros([64, BLOCK_N], q.dtype, pv_layout)
    if n_blocks > 0:
        mbarrier.wait(ring.k_ready.index(blocks_done % ring.NUM_STAGES), (blocks_done // ring.NUM_STAGES) & 1)
        s = warpgroup_mma(q, ring.k_operand(blocks_done), gl.zeros([64, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        ring.release_k(blocks_done)
        s, scale = mask.softcap(s, qk_scale_log2)
        if n_full == 0:
            s, scale = mask.masked(s, scale, n_lo, P_LOG2_SCALE)
        p0, alpha, m_i, l_i = softmax_step(s, m_i, l_i, scale, P_LOG2_SCALE)
        p = p_operand(p0.to(q.dtype), pv_layout)
    for i in range(1, n_full):
        acc, p, m_i, l_i = _block_overlap(ring, q, blocks_done + i, n_lo + i * BLOCK_N, mask, acc, p, m_i, l_i,
                                          qk_scale_log2, False)
    for i in range(gl.maximum(n_full, 1), n_blocks):
        acc, p, m_i, l_i = _block_overlap(ring, q, blocks_done + i, n_lo + i * BLOCK_N, mask, acc, p, m_i, l_i,
                                          qk_scale_log2, True)
    if n_blocks > 0:
        g_last = blocks_done + n_blocks - 1
        mbarrier.wait(ring.v_ready.index(g_last % ring.NUM_STAGES), (g_last // ring.NUM_STAGES) & 1)
        if mask.V_TAIL:  # (only a tile's last block holds keys past len_k)
            ring.clear_v_rows(g_last, mask.len_k - (n_lo + (n_blocks - 1) * BLOCK_N))
        acc = warpgroup_mma(p, ring.v_operand(g_last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        ring.release(g_last)
    return acc, m_i, l_i


@gluon.jit
def _block_overlap(ring, q, g, n_start, mask, acc, p, m_i, l_i, qk_scale_log2, MASKED: gl.constexpr):
    """The CTA's g-th key block with FA3's intra-warpgroup overlap; p holds block g-1's probabilities.

    Issue S_g = Q K_g^T and O += P_{g-1} V_{g-1} back to back (both async), wait for S_g only, run block g's softmax
    while the PV wgmma still runs, then wait for PV, release block g-1's slot and rescale O by block g's alpha.
    Returns (acc, p_g, m_i, l_i)."""
    HEAD_DIM: gl.constexpr = q.type.shape[1]
    BLOCK_N: gl.constexpr = ring.k_smem.shape[1]
    s_layout: gl.constexpr = mma_layout(BLOCK_N, q.dtype)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, q.dtype)
    pv_layout: gl.constexpr = p_layout(o_layout, q.dtype)
    P_LOG2_SCALE: gl.constexpr = p_log2_scale(q.dtype)
    # (both slots before either wait, spelled out rather than through ring.wait_k / wait_v: the instruction order
    # of the loop as it was timed)
    slot = g % ring.NUM_STAGES
    prev = (g - 1) % ring.NUM_STAGES
    mbarrier.wait(ring.k_ready.index(slot), (g // ring.NUM_STAGES) & 1)
    mbarrier.wait(ring.v_ready.index(prev), ((g - 1) // ring.NUM_STAGES) & 1)
    s = warpgroup_mma(q, ring.k_operand(g), gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False,
                      is_async=True)
    acc = warpgroup_mma(p, ring.v_operand(g - 1), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s, ))  # wgmma groups retire in order: S_g is done, PV may still run
    ring.release_k(g)
    s, scale = mask.scores(s, qk_scale_log2, n_start, MASKED, P_LOG2_SCALE)
    p_new, alpha, m_i, l_i = softmax_step(s, m_i, l_i, scale, P_LOG2_SCALE)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    ring.release(g - 1)
    # P_g rounded only once PV_{g-1} has retired (as FA3 does): its 16-bit registers then replace P_{g-1}'s
    # instead of living beside them, which kept the causal loop spilling
    p_new = p_operand(p_new.to(q.dtype), pv_layout)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return acc, p_new, m_i, l_i
