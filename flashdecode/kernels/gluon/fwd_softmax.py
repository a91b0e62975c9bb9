"""The Gluon forward's per-block math in a consumer warpgroup's registers: the key mask, the online softmax, P and
V as the PV wgmma's operands, and the normalised output and lse store."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flashdecode.kernels.gluon.layouts import OPTIONAL, RUNTIME, aggregate, optional, runtime, store_layout
from flashdecode.kernels.gluon.score import capped_scores_log2

LN2 = gl.constexpr(0.6931471805599453)  # lse is stored in natural-log units


@aggregate
class RowMask:
    """The keys a consumer's 64 query rows see and how their scores are made: rows (64,) int32 (within the
    sequence, in the scores' row layout) of a sequence of len_q queries and len_k keys; keys past len_k are hidden
    and, CAUSAL, keys right of the bottom-right aligned diagonal (row i sees key j <= i + len_k - len_q); opts (a
    fwd_tiles.ScoreOptions, or None) adds a sliding window around that diagonal and a softcap. V_TAIL: the K / V
    rows past len_k in a block may hold anything (the next sequence's rows of a packed batch, a paged cache's page
    tail), so the consumer zeroes them in V before PV (fwd_partitions.KVRing.clear_v_rows): their probabilities
    are 0, but 0 * NaN (or inf) in the PV wgmma is NaN; the key mask already hides their scores. Else they are
    TMA's zeros past the tensor."""
    rows: gl.tensor
    len_q: RUNTIME
    len_k: RUNTIME
    CAUSAL: gl.constexpr
    opts: OPTIONAL
    V_TAIL: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, rows, len_q, len_k, CAUSAL, opts=None, V_TAIL=False):
        self.rows = rows
        self.len_q = runtime(len_q)
        self.len_k = runtime(len_k)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.opts = optional(opts)
        self.V_TAIL = gl.constexpr(V_TAIL)

    @gluon.jit
    def apply(self, s, n_start):
        """Scores s (64, BLOCK_N) fp32 of keys from n_start with the hidden keys set to -inf (by position only:
        a NaN score of a visible key stays NaN)."""
        BLOCK_N: gl.constexpr = s.shape[1]
        s_layout: gl.constexpr = s.type.layout
        cols = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(cols < self.len_k, 0)
        if self.CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(self.rows + (self.len_k - self.len_q), 1))
        if self.opts is not None:
            if self.opts.window_left is not None:
                # key offset from the row's diagonal; the host bounds every term below 2**30 (no int32 overflow)
                rel = gl.expand_dims(cols, 0) - gl.expand_dims(self.rows + (self.len_k - self.len_q), 1)
                visible = visible & (rel >= -self.opts.window_left) & (rel <= self.opts.window_right)
        return gl.where(visible, s, -float("inf"))

    @gluon.jit
    def softcap(self, s, qk_scale_log2):
        """(scores, scale) of one block's raw dot products s for softmax_step: with a softcap (opts), the capped
        scores in log2 units (score.capped_scores_log2) and scale 1; else s and qk_scale_log2 as they are."""
        scale = qk_scale_log2
        if self.opts is not None:
            if self.opts.softcap_log2 is not None:
                s = capped_scores_log2(s, qk_scale_log2, self.opts.softcap_log2)
                scale = 1.0
        return s, scale

    @gluon.jit
    def masked(self, s, scale, n_start, P_LOG2_SCALE: gl.constexpr):
        """(scores, scale) of a block that needs the mask: scaled as scale_before_mask says, hidden keys -inf."""
        s, scale = scale_before_mask(s, scale, P_LOG2_SCALE)
        return self.apply(s, n_start), scale

    @gluon.jit
    def scores(self, s, qk_scale_log2, n_start, MASKED: gl.constexpr, P_LOG2_SCALE: gl.constexpr):
        """(scores, scale) of one block for softmax_step: softcap, then (MASKED) masked."""
        s, scale = self.softcap(s, qk_scale_log2)
        if MASKED:
            s, scale = self.masked(s, scale, n_start, P_LOG2_SCALE)
        return s, scale


@gluon.jit
def softmax_step(s, m_i, l_i, qk_scale_log2, P_LOG2_SCALE: gl.constexpr):
    """Online-softmax update for one block of raw scores s (64, BLOCK_N) fp32.

    m_i is the running row max in scaled log2 units (scores * softmax_scale * log2 e), l_i the running row sum of
    exp2(score - m_i) (times 2**P_LOG2_SCALE, see layouts.p_log2_scale). Returns (p, alpha, m_new, l_new) with
    p = exp2(scaled score - m_new) * 2**P_LOG2_SCALE fp32 and alpha the factor that rescales what was accumulated
    under the old max. Rows with no visible key so far keep m = -inf and shift by 0, so exp2(-inf - -inf) never
    happens."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale_log2)
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    if P_LOG2_SCALE != 0.0:  # P * 2**P_LOG2_SCALE: a per-row shift of the exponent, no per-element multiply
        p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(m_use - P_LOG2_SCALE, 1))
    else:
        p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def scale_before_mask(s, qk_scale_log2, P_LOG2_SCALE: gl.constexpr):
    """(scores, scale) for softmax_step in a masked block. e4m3: the scores scaled before the mask, and scale 1.
    The scale holds the tile's q_descale * k_descale there, so it may be 0 (an all-zero tensor's descale: -inf * 0
    would be NaN) or negative (max(s) * scale would be the row minimum); tiles whose scale is not > 0 take every
    block through this path (see fwd_partitions._consume_rows). fp16/bf16: unchanged (raw scores, the row max
    scaled once per row)."""
    if P_LOG2_SCALE != 0.0:
        s = s * qk_scale_log2
        qk_scale_log2 = 1.0
    return s, qk_scale_log2


@gluon.jit
def p_operand(p, p_layout: gl.constexpr):
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
def pv_operand(v_tile):
    """A V slot as the B operand (BLOCK_N keys x HEAD_DIM) of O += P V. fp16/bf16 slots hold V's rows as they are;
    an e4m3 slot holds V^T (HEAD_DIM x BLOCK_N, keys contiguous), read through its transpose: the 8-bit wgmma
    takes B K-major (keys contiguous) only."""
    if v_tile.dtype.primitive_bitwidth == 8:
        v_tile = v_tile.permute((1, 0))
    return v_tile


@gluon.jit
def store_tile(acc, m_i, l_i, rows, out_ptr, lse_ptr, q_base, head, len_q, NUM_HEADS: gl.constexpr, out_scale,
               P_LOG2_SCALE: gl.constexpr):
    """out = acc * out_scale / l (0 on rows without a visible key) and lse = (m + log2 l - P_LOG2_SCALE) * ln 2
    (-inf there). out_scale and P_LOG2_SCALE (see layouts.p_log2_scale) only for e4m3 inputs: 1.0 and 0 otherwise.
    The sequence's rows [0, len_q) are out's rows q_base + row (out: (rows, NUM_HEADS, HEAD_DIM) contiguous) and
    lse_ptr[row] (lse_ptr at this (sequence, head)'s first row)."""
    HEAD_DIM: gl.constexpr = acc.type.shape[1]
    o_layout: gl.constexpr = acc.type.layout
    st_layout: gl.constexpr = store_layout(HEAD_DIM)
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
