"""Warp-specialised Hopper (sm_90) attention backward in Gluon, after FlashAttention-3's structure.

One CTA per (key block of ``BLOCK_N`` = 128 keys, kv head, batch). With P = exp2(S * scale log2 e - lse log2 e),
D = rowsum(dO * O) (a preprocess), dP = dO V^T and dS = P * (dP - D):
    dV = P^T dO,   dK = scale * dS^T Q,   dQ = scale * dS K.
The CTA keeps its keys' dK and dV in registers and walks the query blocks (``BLOCK_M`` = 64 rows) of every query
head of its GQA group (the group sum happens in registers). Its warps are split into partitions
(``gl.warp_specialize``):

- a producer warp loads K and V once, then each query block's Q and dO rows by TMA into a ring of ``NUM_STAGES``
  shared-memory slots (``q_ready`` / ``do_ready`` completed by byte count, ``qdo_empty`` arrived on by both
  consumers once their wgmmas no longer read the slot);
- two consumer warpgroups, each owning 64 of the block's keys, compute the transposed products with the keys as
  the wgmma M dimension: S^T = K Q^T and dP^T = V dO^T from shared memory, so that P^T and dS^T come out as
  register tensors that are directly the A operands of dV += P^T dO and dK += dS^T Q (P never touches shared
  memory);
- dQ needs dS over all 128 keys: each warpgroup writes its dS^T rows into a shared buffer (double-buffered,
  ``ds_ready`` counts both warpgroups' writes), then computes half of dQ's columns, dS (64 x 128, the buffer read
  transposed) times K's column half. DQ_TMA (the default): each warpgroup stages its fp32 half in shared memory
  and a writer warp adds the tile into an fp32 buffer in global memory with TMA reduce-adds (FA3's way: the
  consumers neither hold addresses nor wait for the additions); otherwise the consumers add their halves with
  16-byte vector atomics (and read K's column halves from a copy of their own). DETERMINISTIC orders those
  additions: per (batch, head, query block[, column half]) a semaphore counts the key blocks that have added;
  each key block waits for its turn (_turn: ascending block order, descending for causal - ascending again for the
  grid's last head under TAIL_HEAVY_FIRST, see key_block) before adding, so the fp32 sums happen in one fixed
  order and the result is bitwise reproducible.

Masking: query blocks whose rows all see all 128 keys take the unmasked loop; the causal diagonal (bottom-right:
row i sees key j <= i + seqlen_k - seqlen_q) and a ragged last key block take the masked one. Rows past seqlen_q
get lse2 = +inf, hence P = dS = 0 for finite values, and their dQ additions are masked off (atomics) or fall
outside the batch element's rows (TMA). Rows that see no key have lse = -inf, which the preprocess turns into +inf
too. A tile past its batch element's rows would read the next element's Q / dO / K / V, and 0 * NaN there is NaN:
where a length ends inside a block of a batch > 1 (SEQ_BOUNDED), the CTA reads through descriptors made on the
device that end at its element's last row (TMA reads zeros past it) and adds dQ through one that drops the rows
past it; otherwise tiles only ever run past the tensor's end, where TMA reads zeros and drops writes.

Ragged batches (attn_bwd_ws_varlen_kernel, flash_attn_varlen's packed layout): the same partitions, each CTA
reading its sequence's rows from cu_seqlens on the device (bwd_channels.SeqRows; the grid numbers key blocks by
the longest sequence, and a block past its sequence's keys has no query block). Causal is bottom-right per
sequence. A tile never sees another sequence: q, dO, k and v are read through descriptors made per CTA that end at
the sequence's last row (TMA zero-fills the rest), the row vectors carry +inf / 0 there, dQ's rows past the
sequence land in slack rows of its own, and dK / dV are stored at its key rows only. The ragged entry also has
sliding windows (WINDOW: each key block's walk cut to the query blocks the window reaches, masked at both edges)
and softcap (SOFTCAP: P from softcap * tanh of the raw scores, dS times 1 - tanh^2).

Tensors (all contiguous in (seq, head, dim) order, see ``flashdecode.ops.gluon_attention``):
  q, do: (batch * seqlen_q, nheads * HEAD_DIM) fp16/bf16 behind ``q_desc`` / ``do_desc`` (TMA block [64, HEAD_DIM])
  k, v: (batch * seqlen_k, nheads_kv * HEAD_DIM) behind ``k_desc`` / ``v_desc`` (block [BLOCK_N, HEAD_DIM]) and
        ``kh_desc`` (K again, block [BLOCK_N, HEAD_DIM // 2]: the column halves of the atomic variant)
  dk, dv: (batch, seqlen_k, nheads_kv, HEAD_DIM) q's dtype; dq_acc: (batch, seqlen_q, nheads, HEAD_DIM) float32,
        zeroed, receives scale * dS K; lse2, delta: (batch, nheads, cdiv(seqlen_q, BLOCK_M) * BLOCK_M) float32 (lse
        in log2 units with +inf on rows without a key, and D; the padding rows hold +inf and 0), read as
        (batch * nheads * cdiv(seqlen_q, BLOCK_M), BLOCK_M) through ``lse_desc`` / ``delta_desc`` (block
        [1, BLOCK_M]);
        sem: (batch, nheads, cdiv(seqlen_q, BLOCK_M), 2) int32 zeroed (DETERMINISTIC).

Code: the configuration, channels and work decomposition (BwdConfig, BwdInputs, DqChannel, SeqRows, key_block)
are bwd_channels; this module holds the partitions, the entry kernels, the preprocesses and the ragged dQ copy.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from flashdecode.kernels.gluon.compat import thread_barrier, tma_load
from flashdecode.kernels.gluon.bwd_channels import (BwdConfig, BwdGlobals, BwdInputs, DqChannel, WarpgroupKeys,
                                                   key_block, seq_rows, step_block)
from flashdecode.kernels.gluon.layouts import mma_layout, store_layout
from flashdecode.kernels.gluon.score import capped_scores_and_tanh, softcap_grad

KEYS_PER_CONSUMER = gl.constexpr(64)  # one warpgroup's wgmma M
NUM_CONSUMERS = gl.constexpr(2)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add (cp.reduce.async.bulk.tensor ... .add) of the shared-memory tile src into tensor_desc's
    block at coord. Triton 3.6's Gluon builder has the op (ttng.async_tma_reduce) but the hopper tma module exports
    only the plain copies, so this wraps it as tma.async_copy_shared_to_global does its copy; tma.store_wait
    waits for it like for a TMA store."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _ds_smem_layout(block_m):
    """Shared layout of the dS^T buffer (BLOCK_N keys x block_m queries, 16-bit): rows of block_m * 2 bytes."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, block_m * 2), element_bitwidth=16, rank=2)


@gluon.constexpr_function
def _atomic_layout(cols):
    """Blocked layout of a (rows, cols) fp32 dQ tile for the atomic adds: 4 consecutive columns per thread."""
    return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[128 // cols, cols // 4], warps_per_cta=[4, 1],
                            order=[1, 0])


@gluon.jit
def _load_kv(cfg, k_desc, v_desc, kh_desc, inputs, dq_aux, kv_row, kv_col):
    """The producer's one-time loads: the key block's K and V (and, without DQ_TMA, K's column halves into
    dq_aux), all completing kv_ready."""
    HALF: gl.constexpr = k_desc.block_type.shape[1] // 2
    kv_ready = inputs.kv_ready
    if cfg.DQ_TMA:
        mbarrier.expect(kv_ready.index(0), 2 * k_desc.block_type.nbytes)
    else:
        mbarrier.expect(kv_ready.index(0), 2 * k_desc.block_type.nbytes + 2 * kh_desc.block_type.nbytes)
        for h in gl.static_range(2):
            tma_load(kh_desc, [kv_row, kv_col + h * HALF], kv_ready.index(0), dq_aux.index(h))
    tma_load(k_desc, [kv_row, kv_col], kv_ready.index(0), inputs.k_smem.index(0))
    tma_load(v_desc, [kv_row, kv_col], kv_ready.index(0), inputs.v_smem.index(0))


@gluon.jit
def _bwd_producer(cfg, q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, kh_desc, inputs, dq_aux, glob):
    """One warp: K, V (and, without DQ_TMA, K's column halves into dq_aux) once, then Q with its lse2 row tile and
    dO with its delta row tile for each visited (query head, query block) into the slot ring, in the consumers'
    order. Ragged (glob.cu_q_ptr not None): nothing for a key block past its sequence's keys; the row tiles at the
    sequence's acc_row of the (nheads, rows) row vectors (see SeqRows). glob: the BwdGlobals (its lengths, cumulative
    lengths and window walk the key block)."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    NUM_STAGES: gl.constexpr = cfg.NUM_STAGES
    cu_q_ptr = glob.cu_q_ptr
    kb = key_block(cfg, glob.seqlen_q, glob.seqlen_k, cu_q_ptr, glob.cu_k_ptr, glob.window_left, glob.window_right)
    kv_row = kb.seq.kv_row + kb.n_start
    kv_col = kb.head_kv * HEAD_DIM
    n_iter = kb.num_m - kb.m_lo
    if cu_q_ptr is None:
        _load_kv(cfg, k_desc, v_desc, kh_desc, inputs, dq_aux, kv_row, kv_col)
    elif n_iter > 0:  # a ragged key block without query blocks (past its keys, or no queries) needs no K / V
        _load_kv(cfg, k_desc, v_desc, kh_desc, inputs, dq_aux, kv_row, kv_col)
    for it in range(cfg.GROUP * n_iter):
        head = kb.head_kv * cfg.GROUP + it // n_iter
        m = step_block(it % n_iter, kb.m_lo, kb.num_m, kb.walk_down)
        q_row = kb.seq.q_row + m * cfg.BLOCK_M
        if cu_q_ptr is None:
            row_tile = (kb.batch * cfg.NUM_HEADS + head) * kb.num_m + m  # the (1, BLOCK_M) tile of lse2 / delta
            row_col = 0
        else:
            row_tile = head
            row_col = kb.seq.acc_row + m * cfg.BLOCK_M
        slot = it % NUM_STAGES
        # A slot's first use waits on the parity before the barrier's initial phase, which passes at once.
        mbarrier.wait(inputs.qdo_empty.index(slot), ((it // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(inputs.q_ready.index(slot), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma_load(q_desc, [q_row, head * HEAD_DIM], inputs.q_ready.index(slot), inputs.q_smem.index(slot))
        tma_load(lse_desc, [row_tile, row_col], inputs.q_ready.index(slot), inputs.lse_smem.index(slot))
        mbarrier.expect(inputs.do_ready.index(slot), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma_load(do_desc, [q_row, head * HEAD_DIM], inputs.do_ready.index(slot), inputs.do_smem.index(slot))
        tma_load(delta_desc, [row_tile, row_col], inputs.do_ready.index(slot), inputs.delta_smem.index(slot))


@gluon.jit
def _turn(kb, m, cfg, seqlen_q, seqlen_k, window_left):
    """DETERMINISTIC's order: how many key blocks add their dQ of query block m before key block pid_n does.

    The key blocks that visit query block m are 0 .. visiting - 1 (a block visits m unless causal hides it from
    all of m's rows, and causal hides later blocks first). Non-causal: ascending. Causal: descending - block j
    starts at its diagonal, where no later block has work, so with every block running at the same pace none
    waits (ascending, block j's first step would wait for block 0 to reach j's diagonal, and every block of a
    head would end with the longest) - except where the blocks walk down from the last query block (walk_down,
    see key_block): there ascending. WINDOW (never CAUSAL): ascending from the first key block the window shows
    query block m (window_left's bound; blocks before it do not visit m)."""
    turn = kb.pid_n
    if cfg.WINDOW:
        first_block = gl.maximum(m * cfg.BLOCK_M + seqlen_k - seqlen_q - window_left, 0) // cfg.BLOCK_N
        turn = kb.pid_n - gl.where(window_left >= 0, first_block, 0)
    if cfg.CAUSAL:
        visiting = gl.minimum(gl.cdiv((m + 1) * cfg.BLOCK_M + seqlen_k - seqlen_q, cfg.BLOCK_N),
                              gl.cdiv(seqlen_k, cfg.BLOCK_N))
        turn = gl.where(kb.walk_down, kb.pid_n, visiting - 1 - kb.pid_n)
    return turn


@gluon.jit
def _wait_turn(sem, ticket):
    """Spin until the semaphore (int32 in global memory) reaches ticket; acquire, so the earlier key blocks' dQ
    additions are ordered before ours."""
    seen = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
    while seen < ticket:
        seen = gl.atomic_add(sem, 0, sem="acquire", scope="gpu")
    thread_barrier()


@gluon.jit
def _add_dq(dq, m, head, CONSUMER: gl.constexpr, cfg, glob, kb):
    """Add this warpgroup's dQ columns dq (BLOCK_M, HEAD_DIM // 2) fp32 of query block m into dq_acc (rows past
    seqlen_q dropped); DETERMINISTIC: in key-block order (see the module docstring)."""
    NUM_HEADS: gl.constexpr = cfg.NUM_HEADS
    HALF: gl.constexpr = dq.type.shape[1]
    HEAD_DIM: gl.constexpr = 2 * HALF
    layout: gl.constexpr = _atomic_layout(HALF)
    # 4 consecutive columns per thread: one 16-byte vector atomic each, and a quarter of the addresses the wgmma
    # layout (2 columns per thread) needs in registers
    dq = gl.convert_layout(dq, layout)
    rows = m * cfg.BLOCK_M + gl.arange(0, cfg.BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = CONSUMER * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    row_off = ((kb.seq.acc_row + rows).to(gl.int64) * NUM_HEADS + head) * HEAD_DIM
    ptrs = glob.dq_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rows < kb.seq.len_q, 1)
    if cfg.DETERMINISTIC:
        sem = glob.sem_ptr + ((kb.batch * NUM_HEADS + head) * kb.seq.m_stride + m) * 2 + CONSUMER
        _wait_turn(sem, _turn(kb, m, cfg, kb.seq.len_q, kb.seq.len_k, glob.window_left))
        gl.atomic_add(ptrs, dq, mask=mask, sem="relaxed")
        thread_barrier()  # every thread's additions before the release below
        gl.atomic_add(sem, 1, sem="release", scope="gpu")
    else:
        gl.atomic_add(ptrs, dq, mask=mask, sem="relaxed")


@gluon.jit
def _bulk_wait_done(x):
    """cp.async.bulk.wait_group 0: this thread's bulk TMA operations have completed, writes included
    (tma.store_wait waits with .read, for the source buffer only). x: any scalar (inline asm wants an operand)."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n mov.u32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _dq_writer(cfg, dq_desc, dqc, glob):
    """DQ_TMA's writer warp: for each visited (query head, query block), once both consumers have staged their
    dQ column halves in dq_aux (fp32, (2, BLOCK_M, HEAD_DIM // 2)), add them into dq_acc with two TMA
    reduce-adds and release the buffer once TMA has read it. DETERMINISTIC: waits for its turn first (key-block
    order), and after the release waits for the sums to be written before passing the turn on. Rows past
    seqlen_q fall outside dq_desc's rows (SEQ_BOUNDED: they end at the batch element's; else the tile only runs
    past the tensor's end) and TMA drops them; in a ragged batch they land in the sequence's own slack rows
    (SeqRows). (seq_bounded off, an ablation: they add the next element's rows, exact zeros for finite values.)
    glob: the BwdGlobals (sem_ptr, and what walks the key block as in _bwd_producer)."""
    BLOCK_M: gl.constexpr = dq_desc.block_type.shape[0]
    HALF: gl.constexpr = dq_desc.block_type.shape[1]
    sem_ptr, window_left = glob.sem_ptr, glob.window_left
    kb = key_block(cfg, glob.seqlen_q, glob.seqlen_k, glob.cu_q_ptr, glob.cu_k_ptr, window_left, glob.window_right)
    n_iter = kb.num_m - kb.m_lo
    # a constexpr branch, not a zero-trip loop: without DQ_TMA, dq_aux is another buffer (16-bit) whose reduce-add
    # into the fp32 dQ would still be traced (Triton 3.9's verifier refuses it)
    if cfg.DQ_TMA:
        for it in range(cfg.GROUP * n_iter):
            head = kb.head_kv * cfg.GROUP + it // n_iter
            m = step_block(it % n_iter, kb.m_lo, kb.num_m, kb.walk_down)
            mbarrier.wait(dqc.dq_full.index(0), it & 1)
            sem = sem_ptr + ((kb.batch * cfg.NUM_HEADS + head) * kb.seq.m_stride + m) * 2
            if cfg.DETERMINISTIC:
                _wait_turn(sem, _turn(kb, m, cfg, kb.seq.len_q, kb.seq.len_k, window_left))
            for c in gl.static_range(2):
                _tma_reduce_add(dq_desc, [kb.seq.acc_row + m * BLOCK_M, head * 2 * HALF + c * HALF],
                                dqc.dq_aux.index(c))
            tma.store_wait(0)  # (cp.async.bulk.wait_group.read: the buffer has been read)
            # The consumers may stage their next dQ now; DETERMINISTIC's wait for the sums to land (a round trip to
            # L2 as long as a step) then overlaps their next step instead of delaying it.
            mbarrier.arrive(dqc.dq_empty.index(0), count=1)
            if cfg.DETERMINISTIC:
                _bulk_wait_done(kb.pid_n)  # our sums are in global memory before the next key block's start
                thread_barrier()  # (the lane that issued the reduces has waited before the release below)
                gl.atomic_add(sem, 1, sem="release", scope="gpu")


@gluon.jit
def _bwd_step(it, m, head, dk, dv, cfg, inputs, dqc, glob, kb, keys, MASKED: gl.constexpr):
    """One query block (the CTA's it-th, block m of query head head) for one warpgroup's 64 keys (keys, a
    WarpgroupKeys): returns the updated (dk, dv), (64, HEAD_DIM) fp32 each, after handing its dQ columns on
    (DQ_TMA: staged in dq_aux for the writer warp; else added to dq_acc with atomics here, B read from K's column
    copies in dq_aux)."""
    CONSUMER: gl.constexpr = keys.CONSUMER
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    NUM_STAGES: gl.constexpr = cfg.NUM_STAGES
    qk_scale_log2 = glob.qk_scale_log2
    dq_aux = dqc.dq_aux
    ds_smem = dqc.ds_smem
    HEAD_DIM: gl.constexpr = dk.type.shape[1]
    dtype: gl.constexpr = inputs.q_smem.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_M)
    acc_layout: gl.constexpr = dk.type.layout
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dq_layout: gl.constexpr = mma_layout(HEAD_DIM // 2)
    slot = it % NUM_STAGES
    phase = (it // NUM_STAGES) & 1
    # K and V are one-slot rings indexed by a zero that the compiler cannot see is constant: with a constant
    # index, the wgmma descriptors of every k-step of K and V (64-bit each) are hoisted out of the loop and
    # spilled; indexed per step they are recomputed in uniform registers for free.
    kv_slot = it >> 30
    k_all = inputs.k_smem.index(kv_slot)
    k_c = k_all.slice(CONSUMER * 64, 64)
    v_c = inputs.v_smem.index(kv_slot).slice(CONSUMER * 64, 64)
    offs = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))  # the step's query rows
    q = inputs.q_smem.index(slot)
    do = inputs.do_smem.index(slot)
    # The accumulators start at -lse2 / scale and -D (rows of the slot's (1, BLOCK_M) tiles, which the producer
    # loaded with Q and dO, broadcast over the keys), so that S^T and dP^T come out already shifted: neither row
    # vector stays live in registers through the softmax and dS (the consumers run at the 240-register limit).
    mbarrier.wait(inputs.q_ready.index(slot), phase)
    if cfg.SOFTCAP:  # (tanh is not linear: the scores come out raw, lse2 applied after it)
        s_init = gl.zeros([64, BLOCK_M], gl.float32, s_layout)
    else:
        s_init = (gl.zeros([64, BLOCK_M], gl.float32, s_layout)
                  - inputs.lse_smem.index(slot).load(s_layout) / qk_scale_log2)
    s_t = warpgroup_mma(k_c, q.permute((1, 0)), s_init, is_async=True)
    mbarrier.wait(inputs.do_ready.index(slot), phase)
    dp_init = gl.zeros([64, BLOCK_M], gl.float32, s_layout) - inputs.delta_smem.index(slot).load(s_layout)
    dp_t = warpgroup_mma(v_c, do.permute((1, 0)), dp_init, is_async=True)
    s_t = warpgroup_mma_wait(1, deps=(s_t, ))  # wgmma groups retire in order: S^T done, dP^T may still run
    if cfg.SOFTCAP:
        capped, tanh = capped_scores_and_tanh(s_t, glob.softcap_scale, glob.softcap_log2)
        p_t = gl.exp2(capped - inputs.lse_smem.index(slot).load(s_layout))
    else:
        p_t = gl.exp2(s_t * qk_scale_log2)
    if MASKED:
        visible = gl.expand_dims(keys.first_row, 1) <= gl.expand_dims(offs, 0)
        if cfg.WINDOW:
            visible = visible & (gl.expand_dims(offs, 0) <= gl.expand_dims(keys.last_row, 1))
        p_t = gl.where(visible, p_t, 0.0)
    p_op = gl.convert_layout(p_t.to(dtype), a_layout)
    if cfg.SOFTCAP:  # dS through softcap * tanh (P's fp32 copy is only dS's from here)
        p_t = softcap_grad(p_t, tanh)
    dv = warpgroup_mma(p_op, do, dv, is_async=True)
    dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
    ds_t = (p_t * dp_t).to(dtype)
    ds_op = gl.convert_layout(ds_t, a_layout)
    dk = warpgroup_mma(ds_op, q, dk, is_async=True)
    # dQ = dS K over all BLOCK_N keys: both warpgroups' dS^T rows meet in shared memory.
    buf = it % 2
    ds_smem.index(buf).slice(CONSUMER * 64, 64).store(ds_t)
    fence_async_shared()
    mbarrier.arrive(dqc.ds_ready.index(buf), count=1)
    mbarrier.wait(dqc.ds_ready.index(buf), (it // 2) & 1)
    if cfg.DQ_TMA:
        k_half = k_all.slice(CONSUMER * (HEAD_DIM // 2), HEAD_DIM // 2, dim=1)
    else:
        k_half = dq_aux.index(CONSUMER + kv_slot)
    dq = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), k_half,
                       gl.zeros([BLOCK_M, HEAD_DIM // 2], gl.float32, dq_layout), use_acc=False, is_async=True)
    dv, dk, dq, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, p_op, ds_op))
    mbarrier.arrive(inputs.qdo_empty.index(slot), count=1)
    dq = dq * glob.sm_scale  # (here, rather than one more pass over dq_acc after the kernel)
    if cfg.DQ_TMA:
        mbarrier.wait(dqc.dq_empty.index(0), (it & 1) ^ 1)
        dq_aux.index(CONSUMER).store(dq)
        fence_async_shared()  # the writer's TMA (async proxy) reads what these generic stores wrote
        mbarrier.arrive(dqc.dq_full.index(0), count=1)
    else:
        _add_dq(dq, m, head, CONSUMER, cfg, glob, kb)
    return dk, dv


@gluon.jit
def _store_rows(x, rows, ptr, base_row, seqlen_k, head_kv, NUM_HEADS_KV: gl.constexpr):
    """Store x (64, HEAD_DIM) fp32 as ptr's dtype at key rows base_row + rows of (rows, NUM_HEADS_KV, HEAD_DIM)
    contiguous (a sequence's keys from base_row), rows past seqlen_k dropped."""
    HEAD_DIM: gl.constexpr = x.type.shape[1]
    st_layout: gl.constexpr = store_layout(HEAD_DIM)
    x = gl.convert_layout(x.to(ptr.dtype.element_ty), st_layout)
    r = gl.convert_layout(rows, gl.SliceLayout(1, st_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, st_layout))
    row_off = ((base_row + r).to(gl.int64) * NUM_HEADS_KV + head_kv) * HEAD_DIM
    gl.store(ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(cols, 0), x, mask=gl.expand_dims(r < seqlen_k, 1))


@gluon.jit
def _bwd_consumer(CONSUMER: gl.constexpr, cfg, inputs, dqc, glob):
    """One warpgroup: keys [CONSUMER * 64, CONSUMER * 64 + 64) of the CTA's block against every visited query
    block of the group's heads (the masked steps first), then its dK (times sm_scale) and dV rows."""
    HEAD_DIM: gl.constexpr = inputs.q_smem.type.shape[2]
    GROUP: gl.constexpr = cfg.GROUP
    acc_layout: gl.constexpr = mma_layout(HEAD_DIM)
    kb = key_block(cfg, glob.seqlen_q, glob.seqlen_k, glob.cu_q_ptr, glob.cu_k_ptr, glob.window_left,
                   glob.window_right)
    seqlen_q = kb.seq.len_q
    seqlen_k = kb.seq.len_k
    m_lo = kb.m_lo
    num_m = kb.num_m
    key_rows = kb.n_start + CONSUMER * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma_layout(cfg.BLOCK_M)))
    # The first query row that sees each key (the masked steps keep P where first_row <= row): causal, key j is
    # seen from row j - (seqlen_k - seqlen_q) on; keys past seqlen_k by none.
    first_row = gl.zeros_like(key_rows)
    last_row = first_row  # (unused without WINDOW)
    if cfg.CAUSAL:
        first_row = key_rows - (seqlen_k - seqlen_q)
    if cfg.WINDOW:  # key j is seen from row j - diag - right to row j - diag + left (-1: unbounded)
        first_row = gl.where(glob.window_right >= 0, key_rows - (seqlen_k - seqlen_q) - glob.window_right, 0)
        last_row = gl.where(glob.window_left >= 0, key_rows - (seqlen_k - seqlen_q) + glob.window_left, 1 << 30)
    first_row = gl.where(key_rows < seqlen_k, first_row, 1 << 30)
    keys = WarpgroupKeys(CONSUMER, first_row, last_row)
    dk = gl.zeros([64, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([64, HEAD_DIM], gl.float32, acc_layout)
    n_iter = num_m - m_lo
    if glob.cu_q_ptr is None:
        mbarrier.wait(inputs.kv_ready.index(0), 0)
    elif n_iter > 0:  # (a ragged key block without query blocks: the producer loads no K / V)
        mbarrier.wait(inputs.kv_ready.index(0), 0)
    for g in range(GROUP):
        head = kb.head_kv * GROUP + g
        if cfg.TAIL_HEAVY_FIRST:
            # in step_block's order, the masked steps first (walk_down: every step). The loops of the default
            # below stay over m, as they were timed: spelled over i they spill at hd128 causal.
            n_masked = gl.where(kb.walk_down, n_iter, kb.m_full - m_lo)
            for i in range(0, n_masked):
                dk, dv = _bwd_step(g * n_iter + i, step_block(i, m_lo, num_m, kb.walk_down), head, dk, dv, cfg,
                                   inputs, dqc, glob, kb, keys, True)
            for i in range(n_masked, n_iter):
                dk, dv = _bwd_step(g * n_iter + i, step_block(i, m_lo, num_m, kb.walk_down), head, dk, dv, cfg,
                                   inputs, dqc, glob, kb, keys, False)
        else:
            for m in range(m_lo, kb.m_full):
                dk, dv = _bwd_step(g * n_iter + m - m_lo, m, head, dk, dv, cfg, inputs, dqc, glob, kb, keys, True)
            for m in range(kb.m_full, kb.m_end):
                dk, dv = _bwd_step(g * n_iter + m - m_lo, m, head, dk, dv, cfg, inputs, dqc, glob, kb, keys, False)
            if cfg.WINDOW:  # the window's far side
                for m in range(kb.m_end, num_m):
                    dk, dv = _bwd_step(g * n_iter + m - m_lo, m, head, dk, dv, cfg, inputs, dqc, glob, kb, keys,
                                       True)
    rows = kb.n_start + CONSUMER * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    # a ragged batch's key rows read again here: held across the loop, they cost hd64's consumers a spill
    seq = seq_rows(cfg, glob.seqlen_q, glob.seqlen_k, glob.cu_q_ptr, glob.cu_k_ptr, kb.batch, kb.n_start)
    _store_rows(dk * glob.sm_scale, rows, glob.dk_ptr, seq.kv_row, seq.len_k, kb.head_kv, cfg.NUM_HEADS // GROUP)
    _store_rows(dv, rows, glob.dv_ptr, seq.kv_row, seq.len_k, kb.head_kv, cfg.NUM_HEADS // GROUP)


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k"])  # (one compile for every length: nothing gains from it)
def attn_bwd_ws_kernel(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, kh_desc, dq_desc, dk_ptr, dv_ptr,
                       dq_ptr, sem_ptr, seqlen_q, seqlen_k, qk_scale_log2, sm_scale, q_ptr, do_ptr, k_ptr, v_ptr,
                       NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr,
                       DQ_TMA: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                       TAIL_HEAVY_FIRST: gl.constexpr, SEQ_BOUNDED: gl.constexpr = False):
    """Grid (cdiv(seqlen_k, BLOCK_N), nheads_kv, batch), num_warps=4 (the default partition is consumer 0).
    BLOCK_N must be 128 (two warpgroups of 64 keys); BLOCK_M (query rows per step) is q_desc's block rows.
    qk_scale_log2 = softmax_scale * log2(e); sm_scale = softmax_scale. GROUP = nheads // nheads_kv (GQA).
    DQ_TMA: dQ goes through a staging buffer and a writer warp's TMA reduce-adds (dq_desc: dq_acc's rows view
    (batch * seqlen_q, nheads * HEAD_DIM) fp32, block [BLOCK_M, HEAD_DIM // 2]; kh_desc unused); else the consumers
    add it with vector atomics through dq_ptr and read K's column halves from their own copy (kh_desc).
    TAIL_HEAVY_FIRST (causal DETERMINISTIC only): the grid's last (batch, kv head) runs its key blocks heaviest
    first (see key_block). SEQ_BOUNDED (batch > 1 with seqlen_q or seqlen_k not a multiple of its block: the
    tiles that would read the next batch element's rows): each CTA reads q, dO, k and v through descriptors of its
    own, made on the device from q_ptr, do_ptr, k_ptr, v_ptr (the tensors behind q_desc, do_desc, k_desc / kh_desc,
    v_desc) and ending at its batch element's last row, so that TMA reads zeros past it - never the next element's
    values, whose NaN or inf would reach this element's gradients through 0 * NaN in a wgmma - and (DQ_TMA) adds
    dQ through a copy of dq_desc ending there too (the query rows past the element: the next element's rows
    otherwise; dropped by TMA). Without it q_ptr, do_ptr, k_ptr, v_ptr are unused (None: the launcher passes no
    parameter, and the kernel compiles as before the option). The launch then needs Triton's allocator (the
    descriptors' global scratch). Tensors as the module docstring says."""
    if SEQ_BOUNDED:
        batch = gl.program_id(2)
        q_desc, do_desc, k_desc, v_desc, kh_desc = _seq_descriptors(
            q_desc, do_desc, k_desc, v_desc, kh_desc, q_ptr, do_ptr, k_ptr, v_ptr, (batch + 1) * seqlen_q,
            (batch + 1) * seqlen_k, DQ_TMA)
        if DQ_TMA:
            dq_desc = _rows_until(dq_ptr, dq_desc, (batch + 1) * seqlen_q)
    _attn_bwd_ws(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, kh_desc, dq_desc,
                 BwdGlobals(dk_ptr, dv_ptr, dq_ptr, sem_ptr, seqlen_q, seqlen_k, qk_scale_log2, sm_scale, None, None),
                 BwdConfig(NUM_HEADS, GROUP, q_desc.block_type.shape[0], BLOCK_N, NUM_STAGES, CAUSAL, DETERMINISTIC,
                           DQ_TMA, TAIL_HEAVY_FIRST), CONSUMER_REGS, PRODUCER_REGS)


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right"])
def attn_bwd_ws_varlen_kernel(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, kh_desc, dq_desc, dk_ptr,
                              dv_ptr, dq_ptr, sem_ptr, seqlen_q, seqlen_k, qk_scale_log2, sm_scale, cu_q_ptr,
                              cu_k_ptr, q_ptr, do_ptr, k_ptr, v_ptr, window_left, window_right, softcap_scale,
                              softcap_log2, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
                              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                              DETERMINISTIC: gl.constexpr, DQ_TMA: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr, TAIL_HEAVY_FIRST: gl.constexpr,
                              SEQ_BOUNDED: gl.constexpr = True, WINDOW: gl.constexpr = False,
                              SOFTCAP: gl.constexpr = False):
    """attn_bwd_ws_kernel over a ragged batch packed along the tokens (flash_attn_varlen's layout): grid
    (cdiv(max_seqlen_k, BLOCK_N), nheads_kv, batch); each CTA reads its sequence's rows from cu_q_ptr / cu_k_ptr
    (int32 (batch + 1,), on the device: no host sync), and a key block past its sequence's keys loads and adds
    nothing. seqlen_q = the longest sequence's query count (max_seqlen_q: it numbers the semaphores' query blocks);
    seqlen_k unused (any value). Causal is bottom-right aligned per sequence. WINDOW (CAUSAL and TAIL_HEAVY_FIRST
    False): a sliding window, row i of a sequence seeing keys i + diag - window_left .. i + diag + window_right
    (diag = its key count - query count; -1: unbounded), the key blocks' walks cut to the query blocks it reaches
    and masked on both of its edges; without WINDOW, window_left / window_right are unused. SOFTCAP: scores
    softcap * tanh(x / softcap), softcap_scale = 2 * softmax_scale * log2(e) / softcap, softcap_log2 = softcap *
    log2(e) (unused without it); lse is the capped scores'.

    Rows past the sequence: the row vectors give them lse2 = +inf and delta = 0, so P = dS = 0 there exactly for
    finite values. SEQ_BOUNDED (the default): each CTA reads q, dO, k and v through descriptors of its own (made
    on the device from q_ptr, do_ptr, k_ptr, v_ptr and the host descriptors' strides) that end at its sequence's
    last row, so TMA fills those rows with zeros - never the next sequence's values, which could be NaN or inf
    (0 * NaN in a wgmma would carry them into this sequence's gradients). Without it the host descriptors read
    the next sequence's rows (4 descriptors fewer to make per CTA).
    q_desc / do_desc: (total_q, nheads * HEAD_DIM) rows; k_desc / v_desc / kh_desc: (total_k, nheads_kv *
    HEAD_DIM) rows (their types and strides: the loads use the per-sequence copies); dk_ptr / dv_ptr: (total_k,
    nheads_kv, HEAD_DIM) contiguous in q's dtype, stored at the sequence's rows only. dq_acc (dq_ptr / dq_desc's
    (rows_pad, nheads * HEAD_DIM) rows, fp32, zeroed) and the row vectors (lse_desc / delta_desc: (nheads,
    rows_pad) float32 contiguous, block [1, BLOCK_M]) hold sequence b's row r at acc_row + r (acc_row = cu_q[b] + b
    * (BLOCK_M + 3) rounded up to 4: 16-byte aligned row tiles, see SeqRows): each sequence is followed by at least
    BLOCK_M slack rows (rows_pad = varlen_rows_pad(total_q, batch, BLOCK_M)), where a query block's dQ
    rows past the sequence land (zeros); attn_bwd_varlen_prep_kernel fills the row vectors, attn_bwd_varlen_dq_
    kernel takes dQ out. sem: (batch, nheads, cdiv(seqlen_q, BLOCK_M), 2) int32 zeroed (DETERMINISTIC). Other
    arguments as attn_bwd_ws_kernel's; the launch needs Triton's allocator (the descriptors' global scratch)."""
    if SEQ_BOUNDED:
        seq = gl.program_id(2)
        q_desc, do_desc, k_desc, v_desc, kh_desc = _seq_descriptors(
            q_desc, do_desc, k_desc, v_desc, kh_desc, q_ptr, do_ptr, k_ptr, v_ptr, gl.load(cu_q_ptr + seq + 1),
            gl.load(cu_k_ptr + seq + 1), DQ_TMA)
    _attn_bwd_ws(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, kh_desc, dq_desc,
                 BwdGlobals(dk_ptr, dv_ptr, dq_ptr, sem_ptr, seqlen_q, seqlen_k, qk_scale_log2, sm_scale, cu_q_ptr,
                            cu_k_ptr, window_left, window_right, softcap_scale, softcap_log2),
                 BwdConfig(NUM_HEADS, GROUP, q_desc.block_type.shape[0], BLOCK_N, NUM_STAGES, CAUSAL, DETERMINISTIC,
                           DQ_TMA, TAIL_HEAVY_FIRST, WINDOW, SOFTCAP), CONSUMER_REGS, PRODUCER_REGS)


@gluon.jit
def _seq_descriptors(q_desc, do_desc, k_desc, v_desc, kh_desc, q_ptr, do_ptr, k_ptr, v_ptr, q_end, kv_end,
                     DQ_TMA: gl.constexpr):
    """SEQ_BOUNDED's loads: device-made copies of q_desc, do_desc (rows until q_end), k_desc, v_desc and, without
    DQ_TMA, kh_desc (rows until kv_end) over the tensors at q_ptr, do_ptr, k_ptr, v_ptr. DQ_TMA: kh_desc is
    unused and comes back as it was (no descriptor to make)."""
    q_desc = _rows_until(q_ptr, q_desc, q_end)
    do_desc = _rows_until(do_ptr, do_desc, q_end)
    k_desc = _rows_until(k_ptr, k_desc, kv_end)
    v_desc = _rows_until(v_ptr, v_desc, kv_end)
    if not DQ_TMA:
        kh_desc = _rows_until(k_ptr, kh_desc, kv_end)
    return q_desc, do_desc, k_desc, v_desc, kh_desc


@gluon.jit
def _rows_until(ptr, desc, end):
    """A device-made copy of desc (a 2-D rows view of the tensor at ptr) whose rows end at row end: TMA reads the
    rows past it as zeros. (At least one row: a descriptor of none is malformed, and an empty sequence loads
    nothing.)"""
    return tma.make_tensor_descriptor(ptr, [gl.maximum(end, 1), desc.shape[1]], [desc.strides[0], 1],
                                      desc.block_type.shape, desc.layout)


@gluon.jit
def _attn_bwd_ws(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, kh_desc, dq_desc, glob, cfg,
                 CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Both entry kernels' body: shared memory, barriers, and the partitions (two consumer warpgroups, the first
    the default partition, a producer warp and the dQ writer warp)."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    NUM_STAGES: gl.constexpr = cfg.NUM_STAGES
    gl.static_assert(BLOCK_N == NUM_CONSUMERS * KEYS_PER_CONSUMER, "BLOCK_N is two warpgroups' 64 keys")
    gl.static_assert(not (cfg.WINDOW and (cfg.CAUSAL or cfg.TAIL_HEAVY_FIRST)), "WINDOW holds its own bounds")
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], delta_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], v_desc.layout)
    if cfg.DQ_TMA:
        dq_aux = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)
    else:
        dq_aux = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM // 2], kh_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], _ds_smem_layout(BLOCK_M))
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    mbarrier.init(dq_full.index(0), count=NUM_CONSUMERS)
    mbarrier.init(dq_empty.index(0), count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(qdo_empty.index(s), count=NUM_CONSUMERS)
    for b in gl.static_range(2):
        mbarrier.init(ds_ready.index(b), count=NUM_CONSUMERS)
    inputs = BwdInputs(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, kv_ready, q_ready, do_ready, qdo_empty)
    dqc = DqChannel(dq_aux, ds_smem, ds_ready, dq_full, dq_empty)
    # Without DQ_TMA the writer warp has nothing to do and returns at once.
    gl.warp_specialize([
        (_bwd_consumer, (0, cfg, inputs, dqc, glob)),
        (_bwd_consumer, (1, cfg, inputs, dqc, glob)),
        (_bwd_producer, (cfg, q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, kh_desc, inputs, dq_aux,
                         glob)),
        (_dq_writer, (cfg, dq_desc, dqc, glob)),
    ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
