"""Warp-specialised Hopper (sm_90) attention forward in Gluon, after FlashAttention-3's structure.

A tile is ``NUM_CONSUMERS * 64`` query rows of one (batch, head); it walks that head's keys in blocks of
``BLOCK_N``. A CTA takes one tile, or (persistent) tiles program_id, program_id + num_programs, ... Its warps are
split into partitions (``gl.warp_specialize``), each with its own register budget (setmaxnreg):

- a producer warp issues TMA loads: each tile's Q rows (fwd_partitions.QChannel), then K and V blocks into a ring
  of ``NUM_STAGES`` shared-memory slots (fwd_partitions.KVRing). Each slot has a ``k_ready`` / ``v_ready``
  mbarrier (TMA completes them by byte count) and a ``kv_empty`` mbarrier that every consumer warpgroup arrives
  on once it no longer reads the slot; the ring runs on across a persistent CTA's tiles.
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
- Three consumer warpgroups (192-row tiles, FA3's hd64 shape; 160 registers each) are hd64's tile from 16k keys
  (ops/gluon_attention.py resolve_gluon_config). ``TILE_ORDER`` (two Q buffer sets): round robin, pairs of a
  head's heavy and light causal tiles, or per-CTA lists made on the host (attn_fwd_ws_lpt_kernel; hd128 causal
  launches beyond 4k keys and non-causal ones of 1k-8k keys); see fwd_tiles.
- Removed after they lost their measurements (docs/decisions.md "Removed options"): the warpgroup ping-pong, exp2 on
  the FMA pipe and the zigzag tile order (``TILE_ORDER`` 1 stays unused).

Masking: key blocks lying entirely inside every row's visible range take the unmasked loop; only the blocks that
straddle the causal diagonal (bottom-right aligned: row i sees key j <= i + seqlen_k - seqlen_q) or the end of the
keys take the masked one. Rows that see no key give out = 0 and lse = -inf.

e4m3 (``attn_fwd_fp8_ws_kernel``, FP8 attention with FA3's descales): the same partitions with both GEMMs on the
8-bit wgmma. Its B operands must be K-major, so V comes transposed (V^T slots, read through their transpose); P is
rounded to e4m3 in registers (times 2**8, see layouts.p_log2_scale) and, with its keys renumbered within each 32 to
match the order the transpose pass writes, is the A operand without any data movement (fwd_softmax.p_operand). The
q * k descale of the tile's head multiplies the logit scale, the v descale the output.

Tensors (all contiguous in (seq, head, dim) order, see ``flashdecode.ops.gluon_attention``):
  q: (batch * seqlen_q, nheads * HEAD_DIM) fp16/bf16 behind ``q_desc`` (TMA block [64, HEAD_DIM])
  k, v: (batch * seqlen_k, nheads_kv * HEAD_DIM) same dtype behind ``k_desc``/``v_desc`` (block [BLOCK_N, HEAD_DIM])
  out: (batch, seqlen_q, nheads, HEAD_DIM) same dtype; lse: (batch, nheads, seqlen_q) float32, natural log.
Rows a TMA tile reads past a sequence's end belong to the next sequence (or are zero past the tensor): the key
mask hides their scores, the output store skips query rows past the sequence, and (V_TAIL: ragged and paged
launches, fixed-length batches whose keys end inside a block) the consumers zero the V rows past the keys, since
their zero probabilities times a NaN or inf value would be NaN. The e4m3 kernel's V^T holds zeros there.

Paged KV caches (``attn_fwd_ws_paged_kernel``, prefill over cache pages): the same partitions; the producer maps
each key block to its page through the block table (fwd_tiles.KVPages) and loads it by TMA from the cache viewed
as rows, pages holding whole key blocks. It also takes a sliding window and a softcap (fwd_tiles.ScoreOptions,
fwd_softmax.RowMask): a windowed tile visits only the blocks its rows see, all through the masked path.

Code: the partitions and their channels (FwdConfig, QChannel, KVRing) are fwd_partitions, the per-block math
fwd_softmax, the tile space (coordinates, ragged rows, tile orders) fwd_tiles; this module holds the entry kernels.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from flashdecode.kernels.gluon.fwd_partitions import FwdConfig, FwdOutputs, KVRing, QChannel, consumer, producer
from flashdecode.kernels.gluon.fwd_tiles import (TILE_ORDER_LPT, TILE_ORDER_PAIRS,  # noqa: F401 (re-exported)
                                                 TILE_ORDER_ROUND_ROBIN, KVPages, ScoreOptions, TileSpace)


@gluon.jit
def attn_fwd_ws_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, num_tiles, seqlen_q, seqlen_k, qk_scale_log2,
                       NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                       OVERLAP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       PRODUCER_REGS: gl.constexpr, Q_BUFFERS: gl.constexpr = 1,
                       TILE_ORDER: gl.constexpr = 0, SPLIT_KV_RELEASE: gl.constexpr = False,
                       V_TAIL: gl.constexpr = False):
    """fp16/bf16: 1-D grid of up to num_tiles CTAs (num_tiles = cdiv(seqlen_q, NUM_CONSUMERS * 64) * batch *
    NUM_HEADS); a CTA takes tiles program_id, program_id + num_programs, ... (persistent when the grid is smaller
    than num_tiles). num_warps=4: the default partition is consumer 0. qk_scale_log2 = softmax_scale * log2(e).
    GROUP = nheads // nheads_kv (GQA). NUM_CONSUMERS 1, 2 or 3 (3: 192-row tiles, FA3's hd64 shape; its register
    budgets must fit 65536 per SM: see GluonFwdConfig). TILE_ORDER (Q_BUFFERS == 2): how CTAs walk the tiles
    (TILE_ORDER_ROUND_ROBIN, TILE_ORDER_PAIRS; TILE_ORDER_LPT is attn_fwd_ws_lpt_kernel's). V_TAIL (batch > 1
    with seqlen_k not a multiple of BLOCK_N: a sequence's last key block reads the next one's rows): zero those V
    rows before PV (FwdConfig); off, the instructions of the other launches stay as they were."""
    _attn_fwd_ws(q_desc, k_desc, v_desc, FwdOutputs(out_ptr, lse_ptr, None, None),
                 TileSpace(num_tiles, None, seqlen_q, seqlen_k, None, None), qk_scale_log2,
                 FwdConfig(NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, Q_BUFFERS,
                           TILE_ORDER, SPLIT_KV_RELEASE, False, V_TAIL), CONSUMER_REGS, PRODUCER_REGS)


@gluon.jit
def attn_fwd_ws_lpt_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, num_tiles, seqlen_q, seqlen_k, qk_scale_log2,
                           sched_ptr, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
                           NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                           OVERLAP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           PRODUCER_REGS: gl.constexpr, SPLIT_KV_RELEASE: gl.constexpr = False,
                           V_TAIL: gl.constexpr = False):
    """attn_fwd_ws_kernel (fp16/bf16) with persistent CTAs that walk host-made tile lists (TILE_ORDER_LPT, two Q
    buffer sets): sched_ptr int32, [S, then per CTA: count, tiles, padding] (fwd_tiles._lpt_row;
    ops/gluon_attention.py lpt_schedule); a grid of as many CTAs as the lists; V_TAIL as there. A kernel of its
    own so that the others keep their parameter lists."""
    _attn_fwd_ws(q_desc, k_desc, v_desc, FwdOutputs(out_ptr, lse_ptr, None, None),
                 TileSpace(num_tiles, sched_ptr, seqlen_q, seqlen_k, None, None), qk_scale_log2,
                 FwdConfig(NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, 2, TILE_ORDER_LPT,
                           SPLIT_KV_RELEASE, False, V_TAIL), CONSUMER_REGS, PRODUCER_REGS)


@gluon.jit
def attn_fwd_ws_varlen_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, num_tiles, seqlen_q, seqlen_k,
                              qk_scale_log2, cu_q_ptr, cu_k_ptr, v_rows_ptr, NUM_HEADS: gl.constexpr,
                              GROUP: gl.constexpr,
                              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                              CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, Q_BUFFERS: gl.constexpr = 1,
                              TILE_ORDER: gl.constexpr = 0, SPLIT_KV_RELEASE: gl.constexpr = False,
                              V_TAIL: gl.constexpr = True, V_BOUND: gl.constexpr = False):
    """attn_fwd_ws_kernel (fp16/bf16) over a ragged batch packed along the tokens (flash_attn_varlen's layout).

    q_desc: (total_q, nheads * HEAD_DIM) rows; k_desc / v_desc: (total_k, nheads_kv * HEAD_DIM) rows; out (total_q,
    nheads, HEAD_DIM) contiguous; lse (nheads, total_q) float32 contiguous. cu_q_ptr / cu_k_ptr: int32 (batch + 1,)
    cumulative lengths, read on the device (no host sync). seqlen_q = the longest sequence's query count (the
    tile numbering's rows per (sequence, head); num_tiles = cdiv(seqlen_q, NUM_CONSUMERS * 64) * batch *
    NUM_HEADS), seqlen_k = total_q (lse's head stride). Tiles past a sequence's rows are empty (TileSpace.coords).
    A sequence's last key block reads the next sequence's rows: their V rows are zeroed before PV (V_TAIL in
    FwdConfig), so a NaN or inf there reaches only the rows that read it (V_TAIL False: GluonFwdConfig.v_tail's
    timing ablation). V_BOUND (V_TAIL False; GluonFwdConfig.v_bound): the producer reads those blocks' V through a
    descriptor made on the device from v_rows_ptr (the tensor behind v_desc) that ends at the sequence's last key,
    so TMA reads zeros past it (FwdConfig); the launch then needs global scratch for that descriptor. Without it
    v_rows_ptr is unused (None). A kernel of its own so that the others keep their parameter lists."""
    _attn_fwd_ws(q_desc, k_desc, v_desc, FwdOutputs(out_ptr, lse_ptr, None, None),
                 TileSpace(num_tiles, None, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, v_rows_ptr=v_rows_ptr),
                 qk_scale_log2,
                 FwdConfig(NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, Q_BUFFERS,
                           TILE_ORDER, SPLIT_KV_RELEASE, False, V_TAIL, V_BOUND), CONSUMER_REGS, PRODUCER_REGS)


@gluon.jit
def attn_fwd_ws_paged_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, num_tiles, seqlen_q, seqlen_k,
                             qk_scale_log2, cu_q_ptr, seqused_ptr, block_table_ptr, bt_stride, max_pages, num_pages,
                             window_left, window_right, softcap_log2, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
                             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                             CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             PRODUCER_REGS: gl.constexpr, PAGE_SIZE: gl.constexpr, Q_BUFFERS: gl.constexpr = 1,
                             TILE_ORDER: gl.constexpr = 0, SPLIT_KV_RELEASE: gl.constexpr = False,
                             WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = False):
    """attn_fwd_ws_varlen_kernel (fp16/bf16, q packed by cu_q_ptr) over a paged KV cache: prefill of new tokens
    against keys already in cache pages (ops/gluon_attention.py gluon_paged_forward_into).

    k_desc / v_desc view the caches (num_pages, PAGE_SIZE, nheads_kv, HEAD_DIM) as (num_pages * PAGE_SIZE,
    nheads_kv * HEAD_DIM) rows (pages back to back, heads packed), blocks [BLOCK_N, HEAD_DIM]; PAGE_SIZE a multiple
    of BLOCK_N, so the producer loads each key block from one page: the block-table entry gives the page, the key's
    place in it the row (fwd_tiles.KVPages). block_table_ptr int32 (batch, max_pages) with row stride bt_stride;
    seqused_ptr int32 (batch,) key counts (read on the device; clamped into [0, max_pages * PAGE_SIZE]); num_pages
    the cache's page count (ids outside [0, num_pages) read zeros, never memory outside the cache). Masks are
    bottom-right aligned per sequence. WINDOW: keys j of row i visible for -window_left <= j - (i + len_k - len_q)
    <= window_right (the host gives an unbounded side as 2**30, every length below it; CAUSAL False then, a causal
    window has window_right 0); SOFTCAP: qk_scale_log2 = softmax_scale / softcap and softcap_log2 = softcap *
    log2(e). out, lse, seqlen_q, seqlen_k, num_tiles as attn_fwd_ws_varlen_kernel's."""
    _attn_fwd_ws(q_desc, k_desc, v_desc, FwdOutputs(out_ptr, lse_ptr, None, None),
                 TileSpace(num_tiles, None, seqlen_q, seqlen_k, cu_q_ptr, None,
                           KVPages(block_table_ptr, seqused_ptr, bt_stride, max_pages, num_pages, PAGE_SIZE),
                           ScoreOptions(window_left, window_right, softcap_log2, WINDOW, SOFTCAP)), qk_scale_log2,
                 FwdConfig(NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, Q_BUFFERS,
                           TILE_ORDER, SPLIT_KV_RELEASE, False, True), CONSUMER_REGS, PRODUCER_REGS)


@gluon.jit
def attn_fwd_fp8_ws_kernel(q_desc, k_desc, vt_desc, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, num_tiles,
                           seqlen_q, seqlen_k, qk_scale_log2, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
                           BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                           CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, Q_BUFFERS: gl.constexpr = 1,
                           TILE_ORDER: gl.constexpr = 0, SPLIT_KV_RELEASE: gl.constexpr = False):
    """e4m3 (float8e4nv) q, k and V^T, bf16 out; grid and constexprs as attn_fwd_ws_kernel.

    q_desc, k_desc as there (blocks [64, HEAD_DIM], [BLOCK_N, HEAD_DIM]); vt_desc views V^T as the 2-D
    (batch * nheads_kv * HEAD_DIM, keys_pad) rows of a contiguous (batch, nheads_kv, HEAD_DIM, keys_pad) tensor,
    block [HEAD_DIM, BLOCK_N]: keys_pad = seqlen_k rounded up to 32, keys renumbered within each 32 as
    fwd_softmax.p_operand renumbers P's columns, zeros past seqlen_k (ops/fp8_v_transpose.py, key_order="wgmma").
    qk_descale_ptr: float32 (batch, nheads) contiguous, q_descale * k_descale of each query head, folded into the
    logit scale; v_descale_ptr: float32 (batch, nheads_kv) contiguous, applied to the output. out bfloat16."""
    _attn_fwd_ws(q_desc, k_desc, vt_desc, FwdOutputs(out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr),
                 TileSpace(num_tiles, None, seqlen_q, seqlen_k, None, None), qk_scale_log2,
                 FwdConfig(NUM_HEADS, GROUP, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, OVERLAP, Q_BUFFERS,
                           TILE_ORDER, SPLIT_KV_RELEASE, True), CONSUMER_REGS, PRODUCER_REGS)


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, outs, tiles, qk_scale_log2, cfg, CONSUMER_REGS: gl.constexpr,
                 PRODUCER_REGS: gl.constexpr):
    """Every entry kernel's body: shared memory, barriers, and the partitions (one producer warp and
    NUM_CONSUMERS warpgroups, the first of them the default partition). cfg.V_T: v_desc's blocks are V^T tiles."""
    gl.static_assert(cfg.TILE_ORDER != 1, "TILE_ORDER: the zigzag order (1) was removed")
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_slots: gl.constexpr = cfg.Q_BUFFERS * cfg.NUM_CONSUMERS
    q_smem = gl.allocate_shared_memory(dtype, [q_slots, 64, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [cfg.NUM_STAGES, cfg.BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [cfg.NUM_STAGES, v_desc.block_type.shape[0],
                                               v_desc.block_type.shape[1]], v_desc.layout)
    q_chan = QChannel(q_smem, gl.allocate_shared_memory(gl.int64, [q_slots, 1], mbarrier.MBarrierLayout()),
                      gl.allocate_shared_memory(gl.int64, [q_slots, 1], mbarrier.MBarrierLayout()))
    ring = KVRing(k_smem, v_smem, gl.allocate_shared_memory(gl.int64, [cfg.NUM_STAGES, 1], mbarrier.MBarrierLayout()),
                  gl.allocate_shared_memory(gl.int64, [cfg.NUM_STAGES, 1], mbarrier.MBarrierLayout()),
                  gl.allocate_shared_memory(gl.int64, [cfg.NUM_STAGES, 1], mbarrier.MBarrierLayout()),
                  gl.allocate_shared_memory(gl.int64, [cfg.NUM_STAGES, 1], mbarrier.MBarrierLayout()),
                  cfg.SPLIT_KV_RELEASE)
    q_chan.init()
    ring.init(cfg.NUM_CONSUMERS)
    # One tuple literal per partition count (a partition's warps and registers are fixed per entry).
    if cfg.NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (consumer, (0, cfg, q_chan, ring, outs, tiles, qk_scale_log2)),
            (consumer, (1, cfg, q_chan, ring, outs, tiles, qk_scale_log2)),
            (producer, (cfg, q_desc, k_desc, v_desc, q_chan, ring, tiles)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif cfg.NUM_CONSUMERS == 3:
        gl.warp_specialize([
            (consumer, (0, cfg, q_chan, ring, outs, tiles, qk_scale_log2)),
            (consumer, (1, cfg, q_chan, ring, outs, tiles, qk_scale_log2)),
            (consumer, (2, cfg, q_chan, ring, outs, tiles, qk_scale_log2)),
            (producer, (cfg, q_desc, k_desc, v_desc, q_chan, ring, tiles)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (consumer, (0, cfg, q_chan, ring, outs, tiles, qk_scale_log2)),
            (producer, (cfg, q_desc, k_desc, v_desc, q_chan, ring, tiles)),
        ], [1], [PRODUCER_REGS])
