"""Probe: an e4m3 decode stage 1 whose QK^T is an 8-bit wgmma with the keys on its M side.

The resolved 8-bit KV loop converts every K and V byte to fp16 (46% of its instructions, docs/decisions.md "8-bit
cache tiles"), because a 16-row decode tile only gets mma.sync, which sm_90 emulates for e4m3. Put the keys on the
M side instead - S^T = K q^T (BLOCK_N x 16), O^T += V^T P^T (HEADDIM x 16) - and Triton 3.6 emits
wgmma.m64n16k32.e4m3 for QK^T with K straight from shared memory (no conversion). q rides as two e4m3 parts (hi,
and the residual times 2**4), since one e4m3 part is 6-11x a bf16 decode's error (fp8_mma_design.py numerics).
PV two ways: ``v16`` converts V to fp16 and runs an fp16 wgmma; ``v8`` keeps V in e4m3 (Triton transposes it for
the K-major A operand) against P * v_scale in two e4m3 parts under a per-block power of two.

This is a bare stage 1 (b1, contiguous cache, per-token-head scales, no masks: context a multiple of BLOCK_N * the
splits; seqlen_q 1) to learn whether the loop pays before it is built into kernels/decode.py. It times the kernel
alone against the resolved flash_decode on the same caches (graphs, and its kernels by CUDA trace), and checks
both against the float64 reference. Result (H200, docs/decisions.md "8-bit cache tiles"): accurate, but about 2x
slower than the resolved stage 1 (128k: 52.6 / 62.7 us for v16 / v8 against 26.05), so it was not built in.

    PYTHONPATH=. python -m benchmarks.probes.fp8_keys_on_m [--contexts 32768,131072] [--check-only]
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

from flashdecode.kernels.fwd import round_to_e4m3

LOG2E = 1.4426950408889634
Q_LO_SHIFT = 16.0  # the second part of q (and of P * v_scale) is the residual times 2**4


@triton.jit
def _e4m3_two_parts(x, LO: tl.constexpr, INTERPRETER: tl.constexpr):
    """(hi, lo) e4m3 parts of fp32 ``x`` (already scaled into e4m3's range): x ~ hi + lo / LO."""
    if INTERPRETER:
        hi = _signed_round(x)
        lo = _signed_round((x - hi) * LO)
        return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv)
    hi = x.to(tl.float8e4nv)
    return hi, ((x - hi.to(tl.float32)) * LO).to(tl.float8e4nv)


@triton.jit
def _signed_round(x):
    """x rounded to the e4m3 grid (kernels/fwd.round_to_e4m3 on |x|: the CPU interpreter's own cast is off)."""
    r = round_to_e4m3(tl.abs(x))
    return tl.where(x < 0, -r, r)


@triton.jit
def _pow2_scale_for(amax, TOP_EXP: tl.constexpr):
    """(up, down): powers of two with amax * up in [2**TOP_EXP, 2**(TOP_EXP + 1)) (amax 0: the smallest normal)."""
    sh = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -126 + TOP_EXP + 1)
    up = ((127 + TOP_EXP - sh) << 23).to(tl.float32, bitcast=True)
    down = ((127 - TOP_EXP + sh) << 23).to(tl.float32, bitcast=True)
    return up, down


@triton.jit
def keys_on_m_stage1(Q, K, V, KS, VS, O, LSE, seqlen, score_scale,
                     stride_qh, stride_kt, stride_kh, stride_st, stride_oh, stride_os,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                     NUM_SPLITS: tl.constexpr, V8: tl.constexpr, INTERPRETER: tl.constexpr = False):
    """Grid (NUM_SPLITS, nheads_kv). Q (nheads, D) bf16/fp16 (stride_qh); K, V (seqlen, nheads_kv, D) e4m3
    (stride_kt, stride_kh); KS, VS (seqlen, nheads_kv) fp32 (stride_st, unit head stride); O (nheads, NUM_SPLITS,
    D) fp32 normalised partials, LSE (nheads, NUM_SPLITS) log2. score_scale = softmax scale * log2(e)."""
    split = tl.program_id(0)
    hk = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < GROUP
    head = hk * GROUP + offs_m
    q = tl.load(Q + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_up, q_down = _pow2_scale_for(tl.max(tl.max(tl.abs(q), 1), 0), 7)
    q_hi, q_lo = _e4m3_two_parts(q * q_up, 16.0, INTERPRETER)
    chunk = tl.cdiv(tl.cdiv(seqlen, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_kh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_t = tl.zeros([D, BLOCK_M], tl.float32)
    s_unscale = q_down * score_scale
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + offs_n
        k = tl.load(k_base + keys[:, None] * stride_kt + offs_d[None, :])
        ks = tl.load(KS + keys * stride_st + hk)
        vs = tl.load(VS + keys * stride_st + hk)
        s_t = tl.dot(k, tl.trans(q_hi)) + tl.dot(k, tl.trans(q_lo)) * (1.0 / 16.0)  # (BLOCK_N, BLOCK_M)
        s_t = s_t * (ks * s_unscale)[:, None]
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s_t - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
        v = tl.load(v_base + keys[:, None] * stride_kt + offs_d[None, :])
        pv = p * vs[:, None]
        if V8:
            p_up, p_down = _pow2_scale_for(tl.max(vs, 0), 7)
            p_hi, p_lo = _e4m3_two_parts(pv * p_up, 16.0, INTERPRETER)
            v_t = tl.trans(v)
            pv_t = tl.dot(v_t, p_hi) + tl.dot(v_t, p_lo) * (1.0 / 16.0)
            acc_t = acc_t * alpha[None, :] + pv_t * p_down
        else:
            acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v.to(tl.float16)), pv.to(tl.float16))
    acc_t = acc_t / tl.where(l_i > 0, l_i, 1.0)[None, :]
    lse2 = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
    o_ptrs = O + head[None, :] * stride_oh + split * stride_os + offs_d[:, None]
    tl.store(o_ptrs, acc_t, mask=row_ok[None, :])
    tl.store(LSE + head * NUM_SPLITS + split, lse2, mask=row_ok)


def stage1(q, k, v, ks, vs, num_splits, v8, block_n=128, out=None):
    """q (nheads, D); k, v (seqlen, nheads_kv, D) e4m3; ks, vs (seqlen, nheads_kv) fp32. Returns (o, lse2)."""
    nheads, d = q.shape
    seqlen, nheads_kv, _ = k.shape
    group = nheads // nheads_kv
    if out is None:
        out = (torch.empty(nheads, num_splits, d, device=q.device, dtype=torch.float32),
               torch.empty(nheads, num_splits, device=q.device, dtype=torch.float32))
    o, lse = out
    keys_on_m_stage1[(num_splits, nheads_kv)](
        q, k, v, ks, vs, o, lse, seqlen, d ** -0.5 * LOG2E, q.stride(0), k.stride(0), k.stride(1), ks.stride(0),
        o.stride(0), o.stride(1), GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, D=d,
        NUM_SPLITS=num_splits, V8=v8, INTERPRETER=os.environ.get("TRITON_INTERPRET") == "1", num_warps=4, num_stages=3)
    return o, lse


def merge(o, lse):
    """Merged (nheads, D) fp32 output of the partials."""
    w = torch.softmax(lse * 0.6931471805599453, dim=1)
    return (o * w[..., None]).sum(1)


def reference(q, k, v, ks, vs, dtype=torch.float64):
    """reference.decode_ref on the dequantised cache in ``dtype`` (float64: the reference; q's dtype: the
    FlashAttention rule's same-dtype yardstick): (nheads, D)."""
    from flashdecode.reference import decode_ref

    kd, vd = ((x.double() * s.double()[..., None]).to(dtype)[None] for x, s in ((k, ks), (v, vs)))
    lens = torch.tensor([k.shape[0]], dtype=torch.int32, device=q.device)
    return decode_ref(q.to(dtype)[None], kd, vd, lens)[0][0]


def make_inputs(seqlen, nheads, nheads_kv, d, device, gen):
    """q (nheads, d) bf16 and an e4m3 cache quantised per token and kv head: k, v (seqlen, nheads_kv, d), their
    scales ks, vs (seqlen, nheads_kv) fp32."""
    x = torch.randn(seqlen, 2, nheads_kv, d, device=device, generator=gen)
    scale = (x.abs().amax(-1) / 448.0).clamp_min(1e-12)
    x8 = (x / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    q = torch.randn(nheads, d, device=device, generator=gen).to(torch.bfloat16)
    return q, x8[:, 0].contiguous(), x8[:, 1].contiguous(), scale[:, 0].contiguous(), scale[:, 1].contiguous()


def b1_points(contexts: str, dev: str):
    """Per context of the comma list: (context, make_inputs' b1 16/2 hd128 tensors, the float64 reference, a bf16
    PyTorch decode's max error against it), all from one seeded generator."""
    gen = torch.Generator(device=dev).manual_seed(0)
    for ctx in [int(c) for c in contexts.split(",")]:
        inputs = make_inputs(ctx, 16, 2, 128, dev, gen)
        ref = reference(*inputs)
        yield ctx, inputs, ref, (reference(*inputs, dtype=inputs[0].dtype).double() - ref).abs().max().item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--splits", default="128")
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for ctx, (q, k, v, ks, vs), ref, bf16_err in b1_points(args.contexts, dev):
        for splits in [int(s) for s in args.splits.split(",")]:
            for v8 in (0, 1):
                err = (merge(*stage1(q, k, v, ks, vs, splits, v8)).double() - ref).abs().max().item()
                row = dict(context=ctx, splits=splits, v8=v8, max_err=err, bf16_torch_err=bf16_err)
                if dev == "cuda" and not args.check_only:
                    row["us"] = _time_stage1(q, k, v, ks, vs, splits, v8)
                print(row, flush=True)
        if dev == "cuda" and not args.check_only:
            print(dict(context=ctx, resolved=_time_resolved(q, k, v, ks, vs, ref)), flush=True)
    return 0


def _time_stage1(q, k, v, ks, vs, splits, v8):
    """CUDA-graph us per stage-1 call over copies of the cache rotated beyond L2."""
    from flashdecode.timing import cuda_graph_time_us, rotation_count
    sets = [(q, k.clone(), v.clone(), ks.clone(), vs.clone()) for _ in range(rotation_count(2 * k.numel()))]
    outs = [stage1(*s, splits, v8) for s in sets]
    return cuda_graph_time_us([lambda s=s, o=o: stage1(*s, splits, v8, out=o) for s, o in zip(sets, outs)])


def _time_resolved(q, k, v, ks, vs, ref):
    """flash_decode on the same cache (b1, contiguous): end-to-end us in graphs, its stage-1 kernel alone (trace)
    and its max error against the float64 reference."""
    import itertools

    import flashdecode
    from benchmarks.probes.cuda_trace import kernel_times_us
    from flashdecode.timing import cuda_graph_time_us, rotation_count
    n = rotation_count(2 * k.numel())
    seqlen = k.shape[0]
    lens = torch.tensor([seqlen], dtype=torch.int32, device=q.device)
    sets = [(q[None], k[None].clone(), v[None].clone(), ks[None].clone(), vs[None].clone()) for _ in range(n)]
    plan = flashdecode.DecodePlan(1, q.shape[0], k.shape[1], q.shape[1], max_seqlen_k=seqlen, dtype=q.dtype,
                                  device=q.device, kv_dtype=k.dtype)
    fns = [lambda s=s: plan.run(s[0], s[1], s[2], lens, k_scale=s[3], v_scale=s[4]) for s in sets]
    err = (fns[0]().double()[0] - ref).abs().max().item()
    rot = itertools.cycle(fns)
    kernels = kernel_times_us(lambda: next(rot)(), 3 * n)
    return dict(us=cuda_graph_time_us(fns), max_err=err, kernels={k_: round(t, 2) for k_, t in kernels.items()})


if __name__ == "__main__":
    raise SystemExit(main())
