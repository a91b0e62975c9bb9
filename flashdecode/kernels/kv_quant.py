"""8-bit KV caches (float8_e4m3fn or symmetric int8 with float32 scales): the decode KV loop's per-key scales and
append_kv's quantisation of new tokens.

A dequantised key is k_cache.float() * k_scale (one scale per token and kv head, or one per kv head / tensor). The
decode loop never builds that tile: it converts the 8-bit tile to q's dtype for the dot (an e4m3 K tile to fp16
against q scaled into fp16's range: keys_operand), multiplies the scores
column-wise by each key's k_scale, and the probabilities column-wise by each key's v_scale before the PV dot
(sum_j p_j v_scale_j v_j), so the bytes read per key are the 8-bit row plus two float32 scales.

KV_QUANT (constexpr): 0 = no quantisation (the bf16/fp16/fp32 cache path, compiled without any of this), 1 = one
scale per kv head for every token (a scalar broadcast too: loaded once per split), 2 = a scale per token and kv
head (loaded per block through the scale strides, which are 0 along broadcast dims; paged: each key's page id is
looked up again for them), 3 = the same with the scales' sequence / page and token strides the cache's divided by
the head dim (the layout append_kv and the engine use): a key's scale offset is its K offset // HEADDIM.

QUANT_CONVERT (constexpr, a DecodeConfig's quant_convert): how an e4m3 tile becomes a 16-bit dot operand.
CONVERT_CVT: Triton's conversion (sm_90: F2FP.F16.E4M3.UNPACK_B per two values, and for bf16 an F2F.BF16.F16 per
value on top). CONVERT_BITS / CONVERT_BITS_ASM: integer bit operations (e4m3_bits: the e4m3 code's sign and its
seven exponent-mantissa bits moved into a fp16 / bf16 code, which then stands for the value times a power of two;
docs/decisions.md, "8-bit cache tiles"), written as Triton integer ops (what the CPU interpreter runs) or as packed
PTX on four codes per 32-bit register (one PRMT, one shift, one LOP3 per two values; the Triton form compiles to
about twice that). CONVERT_BITS_ASM also takes int8 K tiles to fp16 (int8_to_fp16: the 1024 + byte magic number, no
conversion-unit work) against a fp16 q_k; int8 V tiles and fp32 dots keep the conversion.
"""

import triton
import triton.language as tl

# the largest finite magnitude of each 8-bit format (e4m3fn: 448; int8 symmetric: 127)
E4M3_MAX = 448.0
INT8_MAX = 127.0

# QUANT_CONVERT values (module doc)
CONVERT_CVT = tl.constexpr(0)
CONVERT_BITS = tl.constexpr(1)
CONVERT_BITS_ASM = tl.constexpr(2)
# e4m3_bits' fp16 / bf16 codes stand for the e4m3 value times 2**-E4M3_FP16_SHIFT / 2**-E4M3_BF16_SHIFT: the
# exponent biases differ by 15 - 7 and 127 - 7
E4M3_FP16_SHIFT = tl.constexpr(8)
E4M3_BF16_SHIFT = tl.constexpr(120)


@triton.jit
def key_scales(k_scale, v_scale, rows, key_ok, offs_n, end, MASKED: tl.constexpr, PAGED: tl.constexpr,
               KV_QUANT: tl.constexpr):
    """(ks, vs): (BLOCK_N,) fp32 per-key scales of a block. KV_QUANT 2: k_scale / v_scale are the scale pointers
    of this sequence (contiguous) or kv head (paged) and ``rows`` the keys' offsets into them (decode_gather.kv_rows
    with the scale strides); KV_QUANT 1: k_scale / v_scale are this kv head's scalars. Masked keys and keys of
    absent pages (PAGED, key_ok false) are never read: scale 0 (the KV loop masks their scores).
    A non-finite k scale reads as NaN (docs/kv_quant.md): the key it stands for, codes * ks, meets q in a dot of
    +-inf and NaN terms, while the loop's (q . codes) * ks alone would give +-inf by the sign of q . codes and drop
    the key (-inf) for some heads. A v scale stays as it is: p * vs * codes is the documented value's own product."""
    ok = key_ok
    if MASKED:
        ok = ok & (offs_n < end)
    if KV_QUANT >= 2:
        ks = tl.load(k_scale + rows, mask=ok, other=0.0)
        vs = tl.load(v_scale + rows, mask=ok, other=0.0)
    else:
        ks = tl.where(ok, k_scale, 0.0)
        vs = tl.where(ok, v_scale, 0.0)
    return ks + ks * 0.0, vs  # (inf * 0 = NaN: a non-finite scale becomes NaN, a finite one stays exact)


@triton.jit
def keys_operand(q, QUANT_CONVERT: tl.constexpr = 0, K_DTYPE: tl.constexpr = tl.float8e4nv):
    """(q_k, unscale): the QK^T operand of (BLOCK_M, BLOCK_D) q against an 8-bit K tile of K_DTYPE (e4m3; int8
    with QUANT_CONVERT 2), and the fp32 factor that scales q_k's scores back. bf16 q: q * 2**-e in fp16, e chosen
    from q's largest magnitude so that it lands in [2**14, 2**15) (bf16 values keep all their 8 significant bits
    there, so nothing rounds but magnitudes below ~2**-28 of the largest), and the K tile goes to fp16 (keys_tile:
    exact, e4m3 and int8 are subsets of fp16) instead of to bf16, which costs two conversions per e4m3 value on
    sm_90 (docs/decisions.md, "8-bit cache tiles"). fp16 and fp32 q are used as they are (unscale 1). With a fp16
    q_k and an e4m3 K tile converted by bit operations (QUANT_CONVERT) the tile holds the keys times 2**-8
    (e4m3_bits): unscale carries the 2**8 back (exact: a power of two on fp32 scores)."""
    q_k = q
    unscale = 1.0
    if q.dtype == tl.bfloat16:
        # the largest finite magnitude: a NaN or inf in one row must not rescale (flush) the other rows' values
        aq = tl.abs(q.to(tl.float32))
        amax = tl.max(tl.max(tl.where(aq < float("inf"), aq, 0.0), 1), 0)
        # unbiased exponent of amax minus 14, as f32 exponent bits (an all-zero q: the smallest normal scale)
        sh = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 141, -126)
        down = ((127 - sh) << 23).to(tl.float32, bitcast=True)
        unscale = ((127 + sh) << 23).to(tl.float32, bitcast=True)
        q_k = (q.to(tl.float32) * down).to(tl.float16)
    if QUANT_CONVERT != CONVERT_CVT and q_k.dtype == tl.float16 and K_DTYPE == tl.float8e4nv:
        unscale = unscale * (2.0 ** E4M3_FP16_SHIFT)
    return q_k, unscale


@triton.jit
def int8_to_fp16(x):
    """An int8 tile (any shape) as fp16, exactly, in packed PTX (GPU only), four values per 32-bit register: one xor
    (x + 128 as an unsigned byte) per four values, then per two values one prmt that puts each byte under the high
    byte 0x64 (the fp16 1024 + byte) and one packed subtract of 1152 (Triton's conversion: I2F.F16.S16, one per
    value on the conversion unit, plus byte permutes)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, c; xor.b32 t, $2, 0x80808080; mov.b32 c, 0x64806480; prmt.b32 $0, t, 0x64646464, 0x5140; "
        "prmt.b32 $1, t, 0x64646464, 0x7362; sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def e4m3_bits(x, dtype, ASM: tl.constexpr):
    """An e4m3 tile (any shape) as a fp16 or bf16 (``dtype``) tile holding x * 2**-8 (fp16) or x * 2**-120 (bf16)
    exactly, by integer operations only: the code s.eeee.mmm sign-extended to 16 bits, shifted so that eeee.mmm
    lands in the low bits of the 16-bit exponent and the top of its mantissa (fp16: << 7; bf16: << 4), and masked
    to the sign and those seven bits. The exponent bias grows from 7 to 15 (fp16) / 127 (bf16) while the field
    keeps its value, hence the factor; e4m3 subnormals (exponent 0) land on fp16 / bf16 subnormals with the same
    factor, so every finite code is exact. The NaN codes (0x7F, 0xFF; torch's cast of a NaN writes 0x7F) read as
    NaN: their seven bits are all ones, so adding one at the lowest of them carries into the bit above, which
    (fp16: bit 14; bf16: bit 11, spread to 14..11) completes an all-ones exponent over a nonzero mantissa; no finite
    code carries that far, and the add never crosses a 16-bit lane (or, fp16 on the GPU, a byte). ASM (GPU): packed
    PTX, four codes per 32-bit register - prmt's sign-replicating byte select builds two sign-extended 16-bit lanes
    at once, then one shift and one and per two values; the NaN codes cost an and, an add and an and-or per four
    codes (fp16: the flag enters as bit 7 of the bytes prmt selects) or an add, an and and a multiply-add per two
    (bf16)."""
    if ASM:
        if dtype == tl.float16:
            # y: the four codes with bit 7 replaced by their NaN flag (the seven low bits + 1 carry into it, no
            # carry across bytes); each 16-bit lane takes y's byte low and the code's sign-replicated byte high, so
            # after the shift bit 15 is the sign, bit 14 the flag, bits 13..7 the code's seven bits
            y = tl.inline_asm_elementwise(
                "{ .reg .b32 a, t, lo, hi; and.b32 a, $2, 0x7F7F7F7F; add.u32 t, a, 0x01010101; "
                "and.b32 t, t, 0x80808080; or.b32 a, a, t; prmt.b32 lo, a, $2, 0xD1C0; prmt.b32 hi, a, $2, 0xF3E2; "
                "shl.b32 lo, lo, 7; shl.b32 hi, hi, 7; and.b32 $0, lo, 0xFF80FF80; and.b32 $1, hi, 0xFF80FF80; }",
                "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=True, pack=4)
        else:
            y = tl.inline_asm_elementwise(
                "{ .reg .b32 lo, hi, c; prmt.b32 lo, $2, 0, 0x9180; prmt.b32 hi, $2, 0, 0xB3A2; shl.b32 lo, lo, 4; "
                "shl.b32 hi, hi, 4; and.b32 lo, lo, 0x87F087F0; and.b32 hi, hi, 0x87F087F0; "
                "add.u32 c, lo, 0x00100010; and.b32 c, c, 0x08000800; mad.lo.u32 $0, c, 15, lo; "
                "add.u32 c, hi, 0x00100010; and.b32 c, c, 0x08000800; mad.lo.u32 $1, c, 15, hi; }",
                "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        w = x.to(tl.int8, bitcast=True).to(tl.int16)  # sign-extended: s in bits 15..7, eeee.mmm in 6..0
        if dtype == tl.float16:
            y = (w << 7) & -16512  # mask 0xBF80: bit 15 and bits 13..7
            y = (y | ((y + 0x80) & 0x4000)).to(tl.float16, bitcast=True)
        else:
            y = (w << 4) & -30736  # mask 0x87F0: bit 15 and bits 10..4
            y = (y | ((y + 0x10) & 0x0800) * 15).to(tl.bfloat16, bitcast=True)
    return y


@triton.jit
def _layout_barrier(y):
    """y unchanged (a 16-bit tile), through an identity move in non-pure inline asm that Triton cannot look
    through: the conversion before it stays in the tile's load layout (keys_tile, to_dot_dtype)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [y], dtype=y.dtype, is_pure=False,
                                     pack=32 // y.dtype.primitive_bitwidth)


@triton.jit
def keys_tile(k, dtype, QUANT_CONVERT: tl.constexpr, CONVERT_FIRST: tl.constexpr = False):
    """An 8-bit K tile (BLOCK_N, BLOCK_D) as the QK^T dot's ``dtype`` (keys_operand's q_k dtype): an e4m3 tile
    against fp16 by e4m3_bits (the keys times 2**-8; keys_operand's unscale carries the 2**8), an int8 tile against
    fp16 with QUANT_CONVERT 2 by int8_to_fp16, else converted.
    CONVERT_FIRST (GPU only: inline asm): converted in the layout it was loaded in, as to_dot_dtype does for V. Left
    to Triton, the conversion follows the tile's layout change to the mma operand, and an operand converted from 8
    bits makes Triton lay out both operands of the dot for 8-bit k-packing: q_k is then read from shared memory
    every block in 8-byte pieces and reassembled into mma fragments by register moves (~80 instructions per block
    at hd128; docs/decisions.md, "8-bit cache tiles"), where a 16-bit K tile gives q_k and K ldmatrix loads."""
    if QUANT_CONVERT != CONVERT_CVT and k.dtype == tl.float8e4nv and dtype == tl.float16:
        y = e4m3_bits(k, dtype, QUANT_CONVERT == CONVERT_BITS_ASM)
    elif QUANT_CONVERT == CONVERT_BITS_ASM and k.dtype == tl.int8 and dtype == tl.float16:
        y = int8_to_fp16(k)
    else:
        y = k.to(dtype)
    if CONVERT_FIRST:
        y = _layout_barrier(y)
    return y


@triton.jit
def to_dot_dtype(x, dtype, CONVERT_FIRST: tl.constexpr, QUANT_CONVERT: tl.constexpr = 0):
    """An 8-bit V tile (BLOCK_N, BLOCK_D) converted to the dot's ``dtype`` (q's). CONVERT_FIRST (GPU only: inline
    asm): in the layout it was loaded in, so that the 16-bit tile, not the 8-bit one, goes through shared memory to
    the mma operand layout. Without it Triton moves the conversion after that layout change; for V (the PV dot's B
    operand, whose k dim - the keys - is strided) that read the 8-bit tile from shared memory one byte per element
    (ldmatrix's transposing load exists for 16-bit elements only) and copied it in 8-byte pieces (docs/decisions.md,
    "8-bit cache tiles"). The asm is an identity move that Triton cannot look through.
    QUANT_CONVERT (module doc): an e4m3 tile against fp16 / bf16 by e4m3_bits, then one packed 16-bit multiply by
    2**8 / 2**120 (one per two values; exact: a power of two that takes every code, subnormals included, to its
    value in the normal range), so P and the v scales stay as they are (folding 2**120 into P * v_scale instead
    would overflow bf16 for v scales >= 2**8)."""
    if QUANT_CONVERT != CONVERT_CVT and x.dtype == tl.float8e4nv and (dtype == tl.float16 or dtype == tl.bfloat16):
        y = e4m3_bits(x, dtype, QUANT_CONVERT == CONVERT_BITS_ASM)
    else:
        y = x.to(dtype)
    if CONVERT_FIRST:
        y = _layout_barrier(y)
    if QUANT_CONVERT != CONVERT_CVT and x.dtype == tl.float8e4nv and dtype == tl.float16:
        y = y * (2.0 ** E4M3_FP16_SHIFT)
    elif QUANT_CONVERT == CONVERT_BITS_ASM and x.dtype == tl.float8e4nv and dtype == tl.bfloat16:
        y = y * (2.0 ** E4M3_BF16_SHIFT)
    elif QUANT_CONVERT == CONVERT_BITS and x.dtype == tl.float8e4nv and dtype == tl.bfloat16:
        # through fp32, widened by bits (the CPU interpreter's bf16 arithmetic is wrong, and it flushes bf16
        # subnormals when it converts them): exact too
        wide = (y.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        y = (wide * (2.0 ** E4M3_BF16_SHIFT)).to(tl.bfloat16)
    return y


@triton.jit
def quantize_rows(x, scale, QMAX: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """(T, D) fp32 rows -> 8-bit OUT_DTYPE with the (T,) scales: x / scale, saturated to [-QMAX, QMAX], rounded to
    nearest (int8) or by the fp8 conversion. A scale of 0 (an all-zero token, or a zero given scale) writes zeros;
    non-finite values write 0 (their row's scale is then non-finite too, so the token reads back as NaN: it stays
    local to its own row)."""
    inv = tl.where(scale > 0, 1.0 / tl.where(scale > 0, scale, 1.0), 0.0)
    y = x * inv[:, None]
    y = tl.where(y == y, y, 0.0)  # NaN -> 0 (the row's scale carries the NaN)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if OUT_DTYPE == tl.int8:
        y = tl.floor(y + 0.5)
    else:
        y = _round_to_e4m3_grid(y)
    return y.to(OUT_DTYPE)


@triton.jit
def _round_to_e4m3_grid(y):
    """y (|y| <= 448) rounded to the nearest e4m3 value in fp32 (3 mantissa bits; subnormals share 2**-6's step),
    so the conversion that follows is exact. (Triton's CPU interpreter converts values that round up to the next
    power of two wrongly, e.g. -127.9 to -64: rounding here first gives the same codes on the GPU and the CPU.)"""
    a = tl.abs(y)
    step = tl.exp2(tl.floor(tl.log2(tl.maximum(a, 2.0**-6))) - 3.0)
    r = tl.floor(a / step + 0.5) * step
    return tl.where(y < 0, -r, r)


@triton.jit
def row_scales(x, QMAX: tl.constexpr):
    """(T,) fp32 per-row scales absmax / QMAX of (T, D) fp32 rows (padded columns must be 0): 0 for an all-zero row,
    NaN for a row holding a NaN, inf for one holding an inf."""
    amax = tl.max(tl.abs(x), 1)
    has_nan = tl.sum((x != x).to(tl.int32), 1) > 0  # tl.max need not propagate NaN
    return tl.where(has_nan, float("nan"), amax / QMAX)


@triton.jit
def quantize_new_tokens(k, v, mask, h, s_rows, t_ok, K_SCALE, V_SCALE, stride_sh, QUANT: tl.constexpr,
                        QMAX: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """append_kv's quantisation of (BLOCK_T, BLOCK_D) new K / V rows of kv head h (``mask``: the real tokens and
    head-dim columns; t_ok (BLOCK_T,): the tokens written). QUANT 2: each token's scales absmax / QMAX are written
    at K_SCALE / V_SCALE + s_rows + h * stride_sh (only for t_ok tokens: a non-finite token's scale stays in its
    own slot); QUANT 1: the given scale of kv head h (stride_sh 0 for one scalar). Returns the 8-bit rows."""
    k = tl.where(mask, k.to(tl.float32), 0.0)
    v = tl.where(mask, v.to(tl.float32), 0.0)
    if QUANT == 2:
        ks = row_scales(k, QMAX)
        vs = row_scales(v, QMAX)
        tl.store(K_SCALE + s_rows + h * stride_sh, ks, mask=t_ok)
        tl.store(V_SCALE + s_rows + h * stride_sh, vs, mask=t_ok)
    else:
        ks = tl.zeros_like(t_ok.to(tl.float32)) + tl.load(K_SCALE + h * stride_sh)
        vs = tl.zeros_like(t_ok.to(tl.float32)) + tl.load(V_SCALE + h * stride_sh)
    return quantize_rows(k, ks, QMAX, OUT_DTYPE), quantize_rows(v, vs, QMAX, OUT_DTYPE)
