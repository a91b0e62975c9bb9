"""Probe: an e4m3 decode stage 1 whose warps split the keys and keep their own softmax state (issue 23's latency
question), timed against our resolved stage 1 on the same caches.

Why: the resolved 8-bit loop (4 warps, 128-key tiles, `softmax_sum_tile`) is latency-bound - on the H200 it reads
its bytes at 46-64% of a bare read's rate (docs/decisions.md, "8-bit cache tiles") - and its warps split one tile's
keys for QK^T, then meet in shared memory for the row max and for P, which the PV dot needs in another layout: 5 CTA
barriers per block (sm_90 SASS). Here each of the W warps owns KW keys of every W * KW-key block with its own running
max, sum and (BLOCK_M, head dim) accumulator: tiles are 3-D (W, ...), the dots batched over W, which Triton lays out
with the warps on that dim, so the row max and sum stay inside a warp and P stays in registers between the two dots.
The warps' states are merged once after the loop; whole blocks run unmasked, a split's last partial block masked.
Cost: each warp keeps a whole accumulator (64 fp32 registers a thread at hd128 instead of 16) and a copy of q's
operand. sm_90 compile (Triton 3.6, bf16 q, e4m3 K/V, per-token scales, K converted late and V first as the resolved
kernel does), per 128 keys: W=4, KW=32, 3 stages, row sums per key column: 2 CTA barriers and 893-898 SASS
instructions a thread (the resolved stage 1: 5 and 989), 236-242 registers, 98 KiB of shared memory, no spills -
two programs per SM, as resolved; W=4, KW=16: 64-key blocks of 520-522 instructions and 2 barriers, 191-212
registers, 49 KiB; W=2, KW=32: 64-key blocks of 893-898, 49 KiB, four 2-warp programs per SM (which wants twice the
splits to fill them).

Run on a GPU (contiguous caches of equal lengths, per-token-head scales, hd128; b1 16 / 2 heads at --contexts and
the Llama-3-8B shape, 32 / 8 heads, at --batched; each variant's stage-1 kernel time from the CUDA trace beside the
resolved stage 1 - `decode_split_kernel` or `decode_persistent_kernel` - and the whole resolved call, K/V sets
rotated beyond L2; the prototype's output checked against the resolved call's):

    PYTHONPATH=. python -m benchmarks.probes.decode_warp_split [--contexts 32768,131072] [--batched 16]

A variant is WxKWxSTAGES, then s for the row sums kept per key column (SUM_TILE), then *N for N times the resolved
call's splits or @S for S splits a sequence (the prototype's stage 1 alone is timed: more splits would also cost
the merge more). Writes decode_warp_split.json to $OUT (or the current directory).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl

from benchmarks.probes.cuda_trace import kernel_times_us
from flashdecode.kernels.kv_quant import CONVERT_BITS_ASM, keys_operand, keys_tile, to_dot_dtype


@triton.jit
def _block(q3, q_unscale, m_i, l_i, acc, k_base, v_base, ks_base, vs_base, start, hi, w_keys, offs_d, score_scale,
           stride_kt, stride_st, DOT_DTYPE: tl.constexpr, MASKED: tl.constexpr, SUM_TILE: tl.constexpr,
           QUANT_CONVERT: tl.constexpr, V_FIRST: tl.constexpr):
    """One W * KW-key block from ``start``: each warp's keys against q (q3: its QK^T operand per warp), its running
    max m_i (W, BLOCK_M), sums l_i ((W, BLOCK_M), or SUM_TILE (W, BLOCK_M, KW) per key column) and accumulator acc
    (W, BLOCK_M, HEADDIM); the PV dot in DOT_DTYPE (q's). MASKED: keys from ``hi`` on are left out (a warp may then
    see none: its state stays empty)."""
    keys = start + w_keys
    kv_off = keys[:, :, None].to(tl.int64) * stride_kt + offs_d[None, None, :]
    s_off = keys * stride_st
    if MASKED:
        ok = keys < hi
        k8 = tl.load(k_base + kv_off, mask=ok[:, :, None], other=0.0)
        ks = tl.load(ks_base + s_off, mask=ok, other=0.0)
        vs = tl.load(vs_base + s_off, mask=ok, other=0.0)
    else:
        k8 = tl.load(k_base + kv_off)
        ks = tl.load(ks_base + s_off)
        vs = tl.load(vs_base + s_off)
    k = keys_tile(k8, q3.dtype, QUANT_CONVERT)
    s = tl.dot(q3, tl.permute(k, (0, 2, 1))) * (ks * (score_scale * q_unscale))[:, None, :]  # (W, BLOCK_M, KW)
    if MASKED:
        s = tl.where(ok[:, None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 2))
    m_use = m_new
    if MASKED:  # a warp with no key yet: alpha and p stay 0
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, :, None])
    if SUM_TILE:
        l_i = l_i * alpha[:, :, None] + p
    else:
        l_i = l_i * alpha + tl.sum(p, 2)
    if MASKED:
        v8 = tl.load(v_base + kv_off, mask=ok[:, :, None], other=0.0)
    else:
        v8 = tl.load(v_base + kv_off)
    v = to_dot_dtype(v8, DOT_DTYPE, V_FIRST, QUANT_CONVERT)
    acc = acc * alpha[:, :, None] + tl.dot((p * vs[:, None, :]).to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def warp_split_stage1(Q, K, V, KS, VS, O, LSE, seqlen, score_scale, stride_kb, stride_kt, stride_kh, stride_sb,
                      stride_st, stride_sh, split_keys, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                      HEADDIM: tl.constexpr, W: tl.constexpr, KW: tl.constexpr, QUANT_CONVERT: tl.constexpr = 0,
                      V_FIRST: tl.constexpr = False, SUM_TILE: tl.constexpr = False):
    """Grid (num_splits, nheads_kv, batch), num_warps=W. Q (batch, nheads, HEADDIM) fp16 / bf16, contiguous; K, V
    (batch, seqlen, nheads_kv, HEADDIM) float8_e4m3fn (strides stride_kb / kt / kh, head dim contiguous); KS, VS
    (batch, seqlen, nheads_kv) float32 per-token-head scales (strides stride_sb / st / sh); every sequence holds
    seqlen keys; score_scale: softmax scale * log2(e). Split s holds keys [s * split_keys, min(.., seqlen)),
    split_keys a multiple of W * KW. Writes O (num_splits, batch, nheads, HEADDIM) float32, each split's normalised
    output, and LSE (num_splits, batch, nheads) float32 log2-sum-exp (-inf for an empty split). QUANT_CONVERT / V_FIRST:
    kernels/kv_quant.py's e4m3 conversions (V_FIRST: GPU only, inline asm); SUM_TILE: the row sums kept per key
    column (no reduction over a warp's keys per block). Whole blocks run unmasked, the split's last partial block
    masked."""
    split = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    nheads = tl.num_programs(1) * GROUP
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    offs_d = tl.arange(0, HEADDIM)
    heads = b * nheads + hk * GROUP + rows  # (batch, head) row of Q
    q = tl.load(Q + heads[:, None] * HEADDIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q_k, q_unscale = keys_operand(q, QUANT_CONVERT)
    # every warp's copy of the QK^T operand: the batched dot's (W, BLOCK_M, HEADDIM) A operand
    q3 = tl.broadcast_to(q_k[None, :, :], (W, BLOCK_M, HEADDIM))
    lo = split * split_keys
    hi = tl.maximum(tl.minimum(lo + split_keys, seqlen), lo)  # an empty split (lo past the end): no block
    w_keys = tl.arange(0, W)[:, None] * KW + tl.arange(0, KW)[None, :]  # (W, KW): warp w's keys of a block
    m_i = tl.full((W, BLOCK_M), float("-inf"), tl.float32)
    if SUM_TILE:
        l_i = tl.zeros((W, BLOCK_M, KW), tl.float32)
    else:
        l_i = tl.zeros((W, BLOCK_M), tl.float32)
    acc = tl.zeros((W, BLOCK_M, HEADDIM), tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + hk * stride_kh
    v_base = V + b.to(tl.int64) * stride_kb + hk * stride_kh
    ks_base = KS + b.to(tl.int64) * stride_sb + hk * stride_sh
    vs_base = VS + b.to(tl.int64) * stride_sb + hk * stride_sh
    full_end = lo + (hi - lo) // (W * KW) * (W * KW)
    for start in range(lo, full_end, W * KW):
        m_i, l_i, acc = _block(q3, q_unscale, m_i, l_i, acc, k_base, v_base, ks_base, vs_base, start, hi, w_keys,
                               offs_d, score_scale, stride_kt, stride_st, q.dtype, False, SUM_TILE, QUANT_CONVERT,
                               V_FIRST)
    if full_end < hi:
        m_i, l_i, acc = _block(q3, q_unscale, m_i, l_i, acc, k_base, v_base, ks_base, vs_base, full_end, hi,
                               w_keys, offs_d, score_scale, stride_kt, stride_st, q.dtype, True, SUM_TILE,
                               QUANT_CONVERT, V_FIRST)
    if SUM_TILE:
        l_i = tl.sum(l_i, 2)
    # the warps' states merged once: weights 2^(m_w - m) (0 for a warp that saw no key)
    m = tl.max(m_i, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(m_i - m_safe[None, :])
    l = tl.sum(l_i * weight, 0)
    o = tl.sum(acc * weight[:, :, None], 0) / tl.where(l > 0, l, 1.0)[:, None]
    lse2 = tl.where(l > 0, m_safe + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
    out_rows = split * tl.num_programs(2) * nheads + heads
    tl.store(O + out_rows[:, None] * HEADDIM + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(LSE + out_rows, lse2, mask=row_ok)


def warp_split_decode(q, k, v, k_scale, v_scale, scale, num_splits, warps=4, keys_per_warp=32, num_stages=3,
                      quant_convert=0, v_first=False, merge=True, sum_tile=False):
    """Attention of one new token per head over e4m3 caches of equal lengths on warp_split_stage1. q (batch, nheads,
    headdim) fp16 / bf16, contiguous; k, v (batch, seqlen, nheads_kv, headdim) float8_e4m3fn; k_scale, v_scale
    (batch, seqlen, nheads_kv) float32. Returns (batch, nheads, headdim) float32 (merged in torch: a probe's check,
    not timed), or with merge=False the split states (o (num_splits, batch, nheads, headdim), lse2 (num_splits,
    batch, nheads)) after one stage-1 launch."""
    batch, seqlen, nheads_kv, headdim = k.shape
    group = q.shape[1] // nheads_kv
    block = warps * keys_per_warp
    split_keys = triton.cdiv(triton.cdiv(seqlen, num_splits), block) * block
    o = torch.empty(num_splits, *q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_splits, *q.shape[:2], dtype=torch.float32, device=q.device)
    warp_split_stage1[(num_splits, nheads_kv, batch)](
        q, k, v, k_scale, v_scale, o, lse, seqlen, scale * 1.4426950408889634, *k.stride()[:3], *k_scale.stride(),
        split_keys, GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)),
        HEADDIM=headdim, W=warps, KW=keys_per_warp, QUANT_CONVERT=quant_convert, V_FIRST=v_first, SUM_TILE=sum_tile,
        num_warps=warps, num_stages=num_stages)
    if not merge:
        return o, lse
    weight = torch.exp2(lse - lse.max(0).values)
    return (o * weight[..., None]).sum(0) / weight.sum(0)[..., None]


def _cache_sets(batch, context, nheads, nheads_kv, headdim, count, gen, dtype=torch.bfloat16):
    """`count` independent e4m3 caches (per-token-head scales) with their queries (on gen's device), so rotating
    through them keeps L2 from holding a set."""
    from benchmarks.probes.fp8_decode import _quant_set

    def randn(*shape):
        return torch.randn(*shape, device=gen.device, generator=gen)
    return [_quant_set(dict(q=randn(batch, nheads, headdim).to(dtype), k=randn(batch, context, nheads_kv, headdim),
                            v=randn(batch, context, nheads_kv, headdim)), per_token=True) for _ in range(count)]


def time_point(context, variants, gen, batch=1, nheads=16, nheads_kv=2, headdim=128, calls=40, dtype=torch.bfloat16,
               quant_convert=CONVERT_BITS_ASM, v_first=True) -> list[dict]:
    """Rows of one shape: the resolved call (stage 1 and all kernels) and each prototype variant's stage 1 (its
    e4m3 conversions: quant_convert / v_first, kernels/kv_quant.py). The caches live on gen's device. A variant
    name: see the module doc (WxKWxSTAGES[s][*N | @S])."""
    import flashdecode
    from flashdecode.ops.decode import decode_config

    l2_sets = max(2, int(4 * 60e6 // (2 * batch * context * nheads_kv * headdim)) + 1)
    sets = _cache_sets(batch, context, nheads, nheads_kv, headdim, l2_sets, gen, dtype)
    lens = torch.full((batch, ), context, dtype=torch.int32, device=gen.device)
    scale = headdim ** -0.5
    s0 = sets[0]
    cfg = decode_config(s0["q"], s0["k"], s0["v"], lens, k_scale=s0["k_scale"], v_scale=s0["v_scale"])
    rotation = itertools.cycle(sets)

    def resolved():
        s = next(rotation)
        return flashdecode.flash_decode(s["q"], s["k"], s["v"], lens, k_scale=s["k_scale"], v_scale=s["v_scale"])
    times = kernel_times_us(resolved, calls)
    stage1 = sum(t for name, t in times.items() if "decode_split" in name or "decode_persistent" in name)
    point = dict(batch=batch, context=context, heads=f"{nheads}/{nheads_kv}")
    rows = [dict(point, variant="resolved", path=cfg.path.name, splits=cfg.num_splits, stage1_us=stage1,
                 all_kernels_us=sum(times.values()), kernels=sorted(times))]
    ref = flashdecode.flash_decode(s0["q"], s0["k"], s0["v"], lens, k_scale=s0["k_scale"],
                                   v_scale=s0["v_scale"]).float()
    for name in variants:
        shape, fixed = name.split("@") if "@" in name else (name, None)
        shape, _, factor = shape.partition("*")
        w, kw, st = (int(x) for x in shape.rstrip("s").split("x"))
        sum_tile = shape.endswith("s")
        splits = int(fixed) if fixed else cfg.num_splits * int(factor or 1)
        check = warp_split_decode(s0["q"], s0["k"], s0["v"], s0["k_scale"], s0["v_scale"], scale, splits, w, kw, st,
                                  quant_convert, v_first, sum_tile=sum_tile)

        def proto(w=w, kw=kw, st=st, sum_tile=sum_tile, splits=splits):
            s = next(rotation)
            return warp_split_decode(s["q"], s["k"], s["v"], s["k_scale"], s["v_scale"], scale, splits, w, kw, st,
                                     quant_convert, v_first, merge=False, sum_tile=sum_tile)
        t = kernel_times_us(proto, calls)
        rows.append(dict(point, variant=name, splits=splits,
                         stage1_us=sum(v for k, v in t.items() if "warp_split" in k), all_kernels_us=sum(t.values()),
                         max_diff_vs_resolved=(check - ref).abs().max().item()))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--variants", default="4x32x3,4x32x3s,4x32x2s,4x16x3s,2x32x3s,2x32x3s*2")
    ap.add_argument("--batched", default="16", help="Llama-3-8B shape (32 / 8 heads) batches at --batched-context")
    ap.add_argument("--batched-context", type=int, default=8192)
    ap.add_argument("--batched-variants", default="4x32x3s@2,4x32x3s@4,4x16x3s@4,2x32x3s@4,2x32x3s@8",
                    help="the variants of the batched points (@S: S splits a sequence)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode_warp_split needs a CUDA GPU")
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    points = [(dict(batch=1), int(c), args.variants) for c in args.contexts.split(",") if c]
    points += [(dict(batch=int(b), nheads=32, nheads_kv=8), args.batched_context, args.batched_variants)
               for b in args.batched.split(",") if b]
    rows = []
    for shape, context, variants in points:
        for r in time_point(context, [v for v in variants.split(",") if v], gen, **shape):
            rows.append(r)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()
                              if k != "kernels"}), flush=True)
    path = os.path.join(args.out, "decode_warp_split.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
