"""The Gluon backward's compile-time configuration, its shared-memory channels and runtime values as aggregates
(built in attn_bwd_ws_kernel, passed to its partitions), and its work decomposition: which key block a CTA owns and
the order in which it walks the query blocks (key_block, step_block)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flashdecode.kernels.gluon.layouts import RUNTIME, aggregate, runtime


@aggregate
class BwdConfig:
    """The launch's compile-time choices (attn_bwd_ws_kernel's constexprs; BLOCK_M = q_desc's block rows). WINDOW
    (ragged launches): a sliding window of runtime bounds (BwdGlobals.window_left / window_right, -1 unbounded),
    CAUSAL then False (its bounds are the window's). SOFTCAP (ragged launches): scores softcap * tanh(x / softcap)
    (BwdGlobals.softcap_scale / softcap_log2)."""
    NUM_HEADS: gl.constexpr
    GROUP: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    NUM_STAGES: gl.constexpr
    CAUSAL: gl.constexpr
    DETERMINISTIC: gl.constexpr
    DQ_TMA: gl.constexpr
    TAIL_HEAVY_FIRST: gl.constexpr
    WINDOW: gl.constexpr
    SOFTCAP: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, NUM_HEADS, GROUP, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, DETERMINISTIC, DQ_TMA,
                 TAIL_HEAVY_FIRST, WINDOW=False, SOFTCAP=False):
        self.NUM_HEADS = gl.constexpr(NUM_HEADS)
        self.GROUP = gl.constexpr(GROUP)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.NUM_STAGES = gl.constexpr(NUM_STAGES)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.DETERMINISTIC = gl.constexpr(DETERMINISTIC)
        self.DQ_TMA = gl.constexpr(DQ_TMA)
        self.TAIL_HEAVY_FIRST = gl.constexpr(TAIL_HEAVY_FIRST)
        self.WINDOW = gl.constexpr(WINDOW)
        self.SOFTCAP = gl.constexpr(SOFTCAP)


@aggregate
class BwdInputs:
    """The consumers' shared-memory inputs: K and V of the CTA's key block (one slot, ``kv_ready``), and the ring of
    NUM_STAGES query-block slots - Q with its lse2 row tile (``q_ready``), dO with its delta row tile
    (``do_ready``), both released on ``qdo_empty`` by the two consumers."""
    q_smem: gl.shared_memory_descriptor
    do_smem: gl.shared_memory_descriptor
    lse_smem: gl.shared_memory_descriptor
    delta_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    kv_ready: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    do_ready: gl.shared_memory_descriptor
    qdo_empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, kv_ready, q_ready, do_ready, qdo_empty):
        self.q_smem = q_smem
        self.do_smem = do_smem
        self.lse_smem = lse_smem
        self.delta_smem = delta_smem
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.kv_ready = kv_ready
        self.q_ready = q_ready
        self.do_ready = do_ready
        self.qdo_empty = qdo_empty


@aggregate
class DqChannel:
    """dQ's shared memory: ``ds_smem`` (2, BLOCK_N, BLOCK_M), the double-buffered dS^T rows both warpgroups write
    (``ds_ready`` counts their writes), and ``dq_aux``: DQ_TMA, the fp32 dQ column halves staged for the writer
    warp (``dq_full`` when both are in, ``dq_empty`` once its TMA has read them); else K's column halves."""
    dq_aux: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor
    ds_ready: gl.shared_memory_descriptor
    dq_full: gl.shared_memory_descriptor
    dq_empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, dq_aux, ds_smem, ds_ready, dq_full, dq_empty):
        self.dq_aux = dq_aux
        self.ds_smem = ds_smem
        self.ds_ready = ds_ready
        self.dq_full = dq_full
        self.dq_empty = dq_empty


@aggregate
class BwdGlobals:
    """The consumers' runtime values: dk, dv, dq_acc and sem pointers (see the module docstring), the lengths, the
    scales (qk_scale_log2 = softmax_scale * log2(e), sm_scale = softmax_scale), a ragged batch's int32 (batch +
    1,) cumulative lengths cu_q_ptr / cu_k_ptr (None: fixed-length; key_block reads them), WINDOW's bounds
    window_left / window_right (-1: unbounded; -1 constants without WINDOW), and SOFTCAP's softcap_scale = 2 *
    softmax_scale * log2(e) / softcap (tanh's argument, doubled for its exp2 form) and softcap_log2 = softcap *
    log2(e) (0.0 constants without SOFTCAP; the score transform: kernels/gluon/score.py)."""
    dk_ptr: gl.tensor
    dv_ptr: gl.tensor
    dq_ptr: gl.tensor
    sem_ptr: gl.tensor
    seqlen_q: RUNTIME
    seqlen_k: RUNTIME
    qk_scale_log2: RUNTIME
    sm_scale: RUNTIME
    cu_q_ptr: RUNTIME
    cu_k_ptr: RUNTIME
    window_left: RUNTIME
    window_right: RUNTIME
    softcap_scale: RUNTIME
    softcap_log2: RUNTIME

    @gluon.constexpr_function
    def __init__(self, dk_ptr, dv_ptr, dq_ptr, sem_ptr, seqlen_q, seqlen_k, qk_scale_log2, sm_scale, cu_q_ptr,
                 cu_k_ptr, window_left=-1, window_right=-1, softcap_scale=0.0, softcap_log2=0.0):
        self.dk_ptr = dk_ptr
        self.dv_ptr = dv_ptr
        self.dq_ptr = dq_ptr
        self.sem_ptr = sem_ptr
        self.seqlen_q = runtime(seqlen_q)
        self.seqlen_k = runtime(seqlen_k)
        self.qk_scale_log2 = runtime(qk_scale_log2)
        self.sm_scale = runtime(sm_scale)
        self.cu_q_ptr = runtime(cu_q_ptr)
        self.cu_k_ptr = runtime(cu_k_ptr)
        self.window_left = runtime(window_left)
        self.window_right = runtime(window_right)
        self.softcap_scale = runtime(softcap_scale)
        self.softcap_log2 = runtime(softcap_log2)


@aggregate
class SeqRows:
    """Where a CTA's sequence lies (seq_rows): len_q / len_k its query and key counts; q_row / kv_row its first rows
    in q, dO and k, v, dk, dv; acc_row its first row in dq_acc and in the lse2 / delta rows; m_stride the query
    blocks per (sequence, head) in the semaphores' numbering (a key block past its ragged sequence's keys gets len_q
    0: it visits no query block).
    Fixed-length batches: rows batch * seqlen_q / batch * seqlen_k, acc_row = q_row.
    Ragged batches (cu_seqlens read on the device): q_row = cu_q[batch], kv_row = cu_k[batch], and acc_row =
    q_row + batch * (BLOCK_M + 3) rounded up to a multiple of 4 - each sequence owns at least BLOCK_M rows of
    slack after its own in dq_acc and the row vectors, so a query block's TMA reduce-add of the rows past the
    sequence (exact zeros) lands in its own slack, never on the next sequence's rows; and its row tiles start
    16-byte aligned in the row vectors (their TMA loads' innermost coordinate: TMA faults on an unaligned one)."""
    len_q: RUNTIME
    len_k: RUNTIME
    q_row: RUNTIME
    kv_row: RUNTIME
    acc_row: RUNTIME
    m_stride: RUNTIME

    @gluon.constexpr_function
    def __init__(self, len_q, len_k, q_row, kv_row, acc_row, m_stride):
        self.len_q = runtime(len_q)
        self.len_k = runtime(len_k)
        self.q_row = runtime(q_row)
        self.kv_row = runtime(kv_row)
        self.acc_row = runtime(acc_row)
        self.m_stride = runtime(m_stride)


@gluon.jit
def seq_rows(cfg, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, batch, n_start):
    """This CTA's SeqRows: seqlen_q / seqlen_k the launch's lengths (ragged: the longest sequence's query count,
    which numbers the semaphores' query blocks, and an unused key count); cu_q_ptr / cu_k_ptr None (fixed-length)
    or int32 (batch + 1,) cumulative lengths."""
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    if cu_q_ptr is None:
        seq = SeqRows(seqlen_q, seqlen_k, batch * seqlen_q, batch * seqlen_k, batch * seqlen_q,
                      gl.cdiv(seqlen_q, BLOCK_M))
    else:
        q_row = gl.load(cu_q_ptr + batch)
        len_q = gl.load(cu_q_ptr + batch + 1) - q_row
        kv_row = gl.load(cu_k_ptr + batch)
        len_k = gl.load(cu_k_ptr + batch + 1) - kv_row
        # a key block past its sequence's keys sees no query row: no query block to visit (no loads but K / V,
        # no steps; its dK / dV stores are masked off by len_k)
        len_q = gl.where(n_start < len_k, len_q, 0)
        # (ops.gluon_backward.varlen_acc_row's formula: rounded to 4 rows, so that the producer's TMA loads of the
        # lse2 / delta row tiles start 16-byte aligned - an unaligned start is an illegal instruction)
        acc_row = (q_row + batch * (BLOCK_M + 3) + 3) // 4 * 4
        seq = SeqRows(len_q, len_k, q_row, kv_row, acc_row, gl.cdiv(seqlen_q, BLOCK_M))
    return seq


@aggregate
class KeyBlock:
    """This CTA's key block and its walk over the query blocks (key_block): (batch, head_kv), pid_n (its block
    number, keys from n_start), query blocks [m_lo, m_full) masked, [m_full, m_end) not and [m_end, num_m) masked
    (a window's far side; m_end = num_m without WINDOW), walk_down; and where its sequence lies (SeqRows). num_m
    ends the walk: the sequence's query blocks, or the last a window reaches."""
    batch: RUNTIME
    head_kv: RUNTIME
    pid_n: RUNTIME
    n_start: RUNTIME
    m_lo: RUNTIME
    m_full: RUNTIME
    m_end: RUNTIME
    num_m: RUNTIME
    walk_down: RUNTIME
    seq: SeqRows

    @gluon.constexpr_function
    def __init__(self, batch, head_kv, pid_n, n_start, m_lo, m_full, m_end, num_m, walk_down, seq):
        self.batch = runtime(batch)
        self.head_kv = runtime(head_kv)
        self.pid_n = runtime(pid_n)
        self.n_start = runtime(n_start)
        self.m_lo = runtime(m_lo)
        self.m_full = runtime(m_full)
        self.m_end = runtime(m_end)
        self.num_m = runtime(num_m)
        self.walk_down = runtime(walk_down)
        self.seq = seq


@aggregate
class WarpgroupKeys:
    """One consumer warpgroup's 64 keys: CONSUMER (0 or 1: keys [CONSUMER * 64, CONSUMER * 64 + 64) of the block),
    first_row and last_row (64,) int32, the first and (WINDOW) last query row that sees each key (the masked steps
    keep P where first_row <= row <= last_row; without WINDOW last_row is unused)."""
    CONSUMER: gl.constexpr
    first_row: gl.tensor
    last_row: gl.tensor

    @gluon.constexpr_function
    def __init__(self, CONSUMER, first_row, last_row):
        self.CONSUMER = gl.constexpr(CONSUMER)
        self.first_row = first_row
        self.last_row = last_row


@gluon.jit
def key_block(cfg, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, window_left, window_right):
    """This CTA's key block and its walk over the query blocks, a KeyBlock: query blocks [m_lo, m_full) need the
    mask (the causal diagonal, or every block when the key block is ragged), [m_full, num_m) none; m_lo skips the
    query blocks that see none of the keys (causal). For each query head of the group, step i visits query block
    step_block(i, ...): m_lo + i, or where walk_down num_m - 1 - i.
    The grid runs a head's key blocks first to last - causal, the heaviest first (each sees the most query rows)
    - except causal DETERMINISTIC, which runs them last to first: there block j waits for the later blocks'
    additions (_turn), and a CTA must only ever wait for CTAs launched before it (a head's blocks can outnumber
    the SMs: waiting for one not yet resident could deadlock). That puts the grid's heaviest blocks last, where
    nothing is left to fill the SMs beside them; TAIL_HEAVY_FIRST (walk_down) turns the grid's last (batch, kv
    head) around: its blocks launch heaviest first and walk their query blocks last to first, all through the
    masked step, and the earlier key block adds first - so block j waits only for blocks launched before it,
    which start at the same last query block and lead it by one addition.
    seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr: as seq_rows takes them; a ragged batch's key blocks past their
    sequence's keys get no query blocks. WINDOW: the blocks window_left / window_right reach (_window_blocks)."""
    pid_n = gl.program_id(0)
    head_kv = gl.program_id(1)
    batch = gl.program_id(2)
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    walk_down = False  # (a constant unless TAIL_HEAVY_FIRST: the selects below fold away)
    if cfg.CAUSAL and cfg.DETERMINISTIC:
        if cfg.TAIL_HEAVY_FIRST:
            walk_down = (head_kv == gl.num_programs(1) - 1) & (batch == gl.num_programs(2) - 1)
        pid_n = gl.where(walk_down, pid_n, gl.num_programs(0) - 1 - pid_n)
    n_start = pid_n * BLOCK_N
    seq = seq_rows(cfg, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, batch, n_start)
    seqlen_q = seq.len_q
    seqlen_k = seq.len_k
    num_m = gl.cdiv(seqlen_q, BLOCK_M)
    m_lo = 0
    m_full = 0
    m_end = num_m
    if cfg.CAUSAL:
        diag = seqlen_k - seqlen_q
        m_lo = gl.minimum(gl.maximum(n_start - diag, 0) // BLOCK_M, num_m)
        m_full = gl.minimum(gl.cdiv(gl.maximum(n_start + BLOCK_N - 1 - diag, 0), BLOCK_M), num_m)
    if cfg.WINDOW:
        m_lo, m_full, m_end, num_m = _window_blocks(n_start, seqlen_k - seqlen_q, num_m, window_left, window_right,
                                                    BLOCK_M, BLOCK_N)
        if n_start + BLOCK_N > seqlen_k:  # (a ragged key block: every step masked)
            m_full = num_m
            m_end = num_m
    elif n_start + BLOCK_N > seqlen_k:
        m_full = num_m
    return KeyBlock(batch, head_kv, pid_n, n_start, m_lo, m_full, m_end, num_m, walk_down, seq)


@gluon.jit
def _window_blocks(n_start, diag, num_m, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """WINDOW's walk of the key block from n_start (bottom-right aligned: row i sees key j when i + diag - left <=
    j <= i + diag + right, diag = seqlen_k - seqlen_q, -1 = unbounded): (m_lo, m_full, m_end, m_hi) with query
    blocks [m_lo, m_hi) seeing some key of the block, [m_full, m_end) all of them for every row, m_lo <= m_full
    <= m_end <= m_hi. _turn's first_block is the same geometry seen from a query block."""
    m_lo = gl.where(right >= 0, gl.minimum(gl.maximum(n_start - diag - right, 0) // BLOCK_M, num_m), 0)
    m_full = gl.where(right >= 0, gl.cdiv(gl.maximum(n_start + BLOCK_N - 1 - diag - right, 0), BLOCK_M), 0)
    m_hi = gl.where(left >= 0, gl.minimum(gl.cdiv(gl.maximum(n_start + BLOCK_N - diag + left, 0), BLOCK_M), num_m),
                    num_m)
    m_end = gl.where(left >= 0, gl.maximum(n_start - diag + left + 1, 0) // BLOCK_M, num_m)
    m_hi = gl.maximum(m_hi, m_lo)
    m_full = gl.minimum(m_full, m_hi)
    m_end = gl.minimum(gl.maximum(m_end, m_full), m_hi)
    return m_lo, m_full, m_end, m_hi


@gluon.jit
def step_block(i, m_lo, num_m, walk_down):
    """The query block of a CTA's step i within one query head (see key_block)."""
    return gl.where(walk_down, num_m - 1 - i, m_lo + i)
