"""Where a streaming kernel's microseconds go, program by program (GPU only; a measurement, not a test).

benchmarks/probes/stream.py times whole kernels: stage 1's structure (one pipelined program per split, 64 splits per kv head)
streams 32k keys in ~14.5 us where a flat read of the same bytes by thousands of small programs takes ~12.7. This
records, for every program of one call inside the same CUDA-graph replay with rotated K/V sets, its SM, its start
and end on the global timer and its duration in its SM's cycles, for both kernels. From those: how far apart the
programs start (launch skew), how far apart they end (tail), how evenly the flat read's hardware scheduler spread
its programs over the SMs, and how long the stage-1 programs run against the whole call. ``%globaltimer`` may tick
coarsely; the report gives its smallest step, and durations come from ``%clock64`` (exact, per SM). The "bal"
variants try to even out the programs' ends: each split streams a static share, then draws blocks from a shared
per-kv-head pool (timed_balanced_kernel); every run checks the merged partials against float64 attention.

    PYTHONPATH=. python3 -m benchmarks.probes.timeline [--contexts 32768,131072] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.probes.stream import _descriptor_softmax_step, _fresh_state, _split_bounds

# one record per program: SM id, %clock64 at start and end, %globaltimer (ns) at start and end
FIELDS = ("smid", "clock_start", "clock_end", "gtime_start", "gtime_end")


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _start(TIMED: tl.constexpr):
    """(%globaltimer, %clock64) now, or zeros without TIMED (the CPU interpreter runs no inline assembly)."""
    if TIMED:
        return _globaltimer(), _clock()
    return tl.zeros([], tl.int64), tl.zeros([], tl.int64)


@triton.jit
def _record(TIMES, pid, c0, g0, TIMED: tl.constexpr):
    """Writes program ``pid``'s record (FIELDS) into TIMES int64 (programs, 5), ending now (TIMED only)."""
    if TIMED:
        _write_record(TIMES, pid, c0, g0)


@triton.jit
def _write_record(TIMES, pid, c0, g0):
    """_record's stores: SM id, both clocks at start (c0, g0) and now."""
    c1 = _clock()
    g1 = _globaltimer()
    base = TIMES + pid.to(tl.int64) * 5
    tl.store(base, _smid().to(tl.int64))
    tl.store(base + 1, c0)
    tl.store(base + 2, c1)
    tl.store(base + 3, g0)
    tl.store(base + 4, g1)


@triton.jit
def _store_partial(O_PART, LSE, pid, acc, m_i, l_i, HEADDIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Stage 1's epilogue for program pid: the normalised fp32 output of the first BLOCK_M // 2 rows into O_PART
    (programs, BLOCK_M // 2, HEADDIM) and their log2 sum-exp into LSE (programs, BLOCK_M // 2)."""
    rows = tl.arange(0, BLOCK_M)
    ok = rows < BLOCK_M // 2
    out_rows = pid * (BLOCK_M // 2) + rows
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O_PART + out_rows[:, None] * HEADDIM + tl.arange(0, HEADDIM)[None, :], o, mask=ok[:, None])
    tl.store(LSE + out_rows, m_i + tl.log2(l_i), mask=ok)


@triton.jit
def timed_split_kernel(K, V, Q, O_PART, LSE, TIMES, seqlen, SPLITS: tl.constexpr, HEADDIM: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, TIMED: tl.constexpr = True):
    """stream.py's stream_kernel MODE 3 (stage 1's structure: split s of kv head hk streams its chunk of K and V
    through tensor descriptors (seqlen, nheads_kv * HEADDIM), boxes (BLOCK_N, HEADDIM), with the online softmax
    and the fp32 partial store into O_PART (programs, BLOCK_M // 2, HEADDIM) / LSE (log2)) and a timing record
    (TIMED)."""
    g0, c0 = _start(TIMED)
    pid = tl.program_id(0)
    hk, _, start, end = _split_bounds(seqlen, SPLITS, BLOCK_N)
    col = hk * HEADDIM
    q, acc, m_i, l_i = _fresh_state(Q, BLOCK_M, HEADDIM)
    for n in range(start, end, BLOCK_N):
        acc, m_i, l_i = _descriptor_softmax_step(acc, m_i, l_i, q, K, V, n, col)
    _store_partial(O_PART, LSE, pid, acc, m_i, l_i, HEADDIM, BLOCK_M)
    _record(TIMES, pid, c0, g0, TIMED)


@triton.jit
def timed_balanced_kernel(K, V, Q, O_PART, LSE, TIMES, COUNTERS, LAST_COUNTERS, seqlen, SPLITS: tl.constexpr,
                          HEADDIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                          STATIC_SIXTEENTHS: tl.constexpr, GRAB: tl.constexpr, TIMED: tl.constexpr = True):
    """timed_split_kernel with a shared tail: each split streams a fixed share of STATIC_SIXTEENTHS / 16 of its
    kv head's blocks, then draws GRAB blocks at a time from the rest (a pool per kv head, counter COUNTERS[hk],
    int32 zero at rest) into the same softmax state, so programs that got more bandwidth take more of the pool and
    they all end together; still one partial per split. seqlen must be a multiple of BLOCK_N. Program 0 zeroes
    LAST_COUNTERS (the previous call's, finished by now: no programmatic dependent launch here)."""
    g0, c0 = _start(TIMED)
    pid = tl.program_id(0)
    hk = pid // SPLITS
    split = pid % SPLITS
    if pid == 0:
        for h in range(tl.num_programs(0) // SPLITS):
            tl.store(LAST_COUNTERS + h, 0)
    nblocks = seqlen // BLOCK_N
    share = nblocks * STATIC_SIXTEENTHS // (16 * SPLITS)
    pool_start = share * SPLITS
    col = hk * HEADDIM
    q, acc, m_i, l_i = _fresh_state(Q, BLOCK_M, HEADDIM)
    for blk in range(split * share, (split + 1) * share):
        acc, m_i, l_i = _descriptor_softmax_step(acc, m_i, l_i, q, K, V, blk * BLOCK_N, col)
    grab = pool_start + tl.atomic_add(COUNTERS + hk, GRAB, sem="relaxed", scope="gpu")
    while grab < nblocks:
        # the next draw is in flight while this one's blocks stream
        nxt = pool_start + tl.atomic_add(COUNTERS + hk, GRAB, sem="relaxed", scope="gpu")
        for blk in range(grab, tl.minimum(grab + GRAB, nblocks)):
            acc, m_i, l_i = _descriptor_softmax_step(acc, m_i, l_i, q, K, V, blk * BLOCK_N, col)
        grab = nxt
    _store_partial(O_PART, LSE, pid, acc, m_i, l_i, HEADDIM, BLOCK_M)
    _record(TIMES, pid, c0, g0, TIMED)


@triton.jit
def timed_read_kernel(K, V, OUT, TIMES, BLOCK: tl.constexpr, TIMED: tl.constexpr = True):
    """stream.py's read_kernel (program p sums elements [p * BLOCK, (p + 1) * BLOCK) of K and V) with a
    timing record (TIMED)."""
    g0, c0 = _start(TIMED)
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    total = tl.sum(tl.load(K + offs).to(tl.float32), 0) + tl.sum(tl.load(V + offs).to(tl.float32), 0)
    tl.store(OUT + pid, total)
    _record(TIMES, pid, c0, g0, TIMED)


def _split_calls(sets, ctx, nheads_kv, headdim, splits, block_n, stages, times):
    """One timed_split_kernel launch per rotated K/V set; call i writes its records into times[i]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m = 16
    programs = nheads_kv * splits
    o_part = torch.empty(programs * block_m // 2 * headdim, device="cuda", dtype=torch.float32)
    lse = torch.empty(programs * block_m // 2, device="cuda", dtype=torch.float32)
    q = torch.randn(block_m, headdim, device="cuda", dtype=torch.bfloat16)
    calls = []
    for i, (k, v) in enumerate(sets):
        kd, vd = (TensorDescriptor(x, [ctx, nheads_kv * headdim], [nheads_kv * headdim, 1], [block_n, headdim])
                  for x in (k, v))

        def call(kd=kd, vd=vd, rec=times[i]):
            timed_split_kernel[(programs,)](kd, vd, q, o_part, lse, rec, ctx, SPLITS=splits, HEADDIM=headdim,
                                            BLOCK_N=block_n, BLOCK_M=block_m, num_warps=4, num_stages=stages)
        calls.append(call)
    return calls, (q, o_part, lse)


def _balanced_calls(sets, ctx, nheads_kv, headdim, splits, block_n, stages, static_sixteenths, grab, times):
    """One timed_balanced_kernel launch per rotated K/V set, each with its own pool counters (zeroed by the next
    call); call i writes its records into times[i]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m = 16
    programs = nheads_kv * splits
    o_part = torch.empty(programs * block_m // 2 * headdim, device="cuda", dtype=torch.float32)
    lse = torch.empty(programs * block_m // 2, device="cuda", dtype=torch.float32)
    q = torch.randn(block_m, headdim, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(len(sets), nheads_kv, device="cuda", dtype=torch.int32)
    calls = []
    for i, (k, v) in enumerate(sets):
        kd, vd = (TensorDescriptor(x, [ctx, nheads_kv * headdim], [nheads_kv * headdim, 1], [block_n, headdim])
                  for x in (k, v))

        def call(kd=kd, vd=vd, rec=times[i], mine=counters[i], last=counters[i - 1]):
            timed_balanced_kernel[(programs,)](kd, vd, q, o_part, lse, rec, mine, last, ctx, SPLITS=splits,
                                               HEADDIM=headdim, BLOCK_N=block_n, BLOCK_M=block_m,
                                               STATIC_SIXTEENTHS=static_sixteenths, GRAB=grab, num_warps=4,
                                               num_stages=stages)
        calls.append(call)
    return calls, (q, o_part, lse)


def check_partials(k, v, q, o_part, lse, nheads_kv, splits, headdim) -> float:
    """Largest error of the split kernels' merged partials against attention of q's first half of rows over each
    kv head's K, V (float64): 0 up to rounding only if every block was streamed exactly once."""
    rows = q.shape[0] // 2
    o = o_part.view(nheads_kv, splits, rows, headdim).double()
    w = lse.view(nheads_kv, splits, rows).double()
    w = torch.exp2(w - w.max(dim=1, keepdim=True).values)
    merged = (o * w[..., None]).sum(1) / w.sum(1)[..., None]
    err = 0.0
    for h in range(nheads_kv):
        kh, vh = (x[:, h * headdim:(h + 1) * headdim].double() for x in (k, v))
        p = torch.softmax(q[:rows].double() @ kh.T * 0.12753 * math.log(2.0), dim=-1)  # log2 -> natural units
        err = max(err, float((merged[h] - p @ vh).abs().max()))
    return err


def _read_calls(sets, block, warps, times):
    """One timed_read_kernel launch per rotated K/V set (numel / block programs); call i records into times[i]."""
    numel = sets[0][0].numel()
    programs = numel // block
    out = torch.empty(programs, device="cuda", dtype=torch.float32)
    return [lambda k=k, v=v, rec=times[i]: timed_read_kernel[(programs,)](k, v, out, rec, BLOCK=block,
                                                                          num_warps=warps)
            for i, (k, v) in enumerate(sets)]


KINDS = [  # (label, kernel, splits per kv head or BLOCK, BLOCK_N or warps, stages)
    ("split s64 bn64 st3", "split", 64, 64, 3), ("split s128 bn64 st3", "split", 128, 64, 3),
    ("split s64 bn64 st2", "split", 64, 64, 2), ("read b8192 w8", "read", 8192, 8, 0),
    # (label, "balanced", splits per kv head, BLOCK_N, stages, static share in 16ths, blocks per draw)
    ("bal s64 12/16 g2", "balanced", 64, 64, 3, 12, 2), ("bal s64 14/16 g2", "balanced", 64, 64, 3, 14, 2),
    ("bal s64 12/16 g4", "balanced", 64, 64, 3, 12, 4), ("bal s64 14/16 g1", "balanced", 64, 64, 3, 14, 1),
    ("bal s64 0/16 g4", "balanced", 64, 64, 3, 0, 4),
    ("read b4096 w4", "read", 4096, 4, 0),
]


def _pct(values, q):
    """The q-quantile of ``values`` (nearest rank)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def summarize(rec: torch.Tensor, clock_ghz: float) -> dict:
    """Statistics of one call's records, int64 (programs, 5) as FIELDS (host tensor): microseconds from the
    earliest start, durations from the SM clock at ``clock_ghz``, and how the programs spread over the SMs."""
    sm, c0, c1, g0, g1 = (rec[:, i].tolist() for i in range(5))
    t0 = min(g0)
    starts = [(g - t0) / 1e3 for g in g0]
    ends = [(g - t0) / 1e3 for g in g1]
    durations = [(b - a) / (clock_ghz * 1e3) for a, b in zip(c0, c1)]
    per_sm = {}
    for s, d, e in zip(sm, durations, ends):
        busy, count, last = per_sm.get(s, (0.0, 0, 0.0))
        per_sm[s] = (busy + d, count + 1, max(last, e))
    busy = [v[0] for v in per_sm.values()]
    counts = [v[1] for v in per_sm.values()]
    last_end = [v[2] for v in per_sm.values()]
    steps = sorted({b - a for a, b in zip(sorted(set(g0 + g1)), sorted(set(g0 + g1))[1:]) if b > a})
    return {
        "programs": len(sm), "sms_used": len(per_sm), "globaltimer_min_step_ns": steps[0] if steps else None,
        "span_us": max(ends),
        "start_us": {q: round(_pct(starts, q), 3) for q in (0.5, 0.9, 1.0)},
        "end_us": {q: round(_pct(ends, q), 3) for q in (0.0, 0.1, 0.5, 0.9, 1.0)},
        "duration_us": {q: round(_pct(durations, q), 3) for q in (0.0, 0.1, 0.5, 0.9, 1.0)},
        "sm_busy_us": {q: round(_pct(busy, q), 3) for q in (0.0, 0.5, 1.0)},
        "sm_programs": {q: _pct(counts, q) for q in (0.0, 0.5, 1.0)},
        "sm_last_end_us": {q: round(_pct(last_end, q), 3) for q in (0.0, 0.1, 0.5, 1.0)},
    }


def _clock_ghz(rec: torch.Tensor) -> float:
    """The SM clock from the longest programs' %clock64 / %globaltimer deltas (GHz)."""
    dc = (rec[:, 2] - rec[:, 1]).double()
    dg = (rec[:, 4] - rec[:, 3]).double()
    keep = dg >= dg.max() * 0.5
    return float((dc[keep] / dg[keep]).median())


def _gaps(times: torch.Tensor, order: list[int]) -> list[float]:
    """us from each call's last program end to the next call's first program start; ``order``: the sets' indices
    in the order of the replay's last calls (each set's records are its last call's)."""
    first = times[:, :, 3].min(dim=1).values
    last = times[:, :, 4].max(dim=1).values
    return [(int(first[b]) - int(last[a])) / 1e3 for a, b in zip(order, order[1:])]


def main() -> int:
    from flashdecode.bench.report import result_stem, write_json
    from benchmarks.probes.stream import _sets
    from flashdecode.timing import copy_bandwidth_bytes_per_s, cuda_graph_time_us, env_info, rotation_count

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--variants", default=None,
                        help="comma-separated labels of KINDS, in the order to run (repeats allowed; default: all)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    torch.cuda.set_device(0)
    env = env_info()
    bandwidth = copy_bandwidth_bytes_per_s()
    nheads_kv, headdim = 2, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    by_label = {k[0]: k for k in KINDS}
    kinds = KINDS if args.variants is None else [by_label[label] for label in args.variants.split(",")]
    results = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        kv_bytes = 2 * ctx * nheads_kv * headdim * 2
        sets = _sets(ctx, nheads_kv, headdim, rotation_count(kv_bytes), gen)
        for label, kind, a, b, stages, *pool in kinds:
            programs = sets[0][0].numel() // a if kind == "read" else nheads_kv * a
            times = torch.zeros(len(sets), programs, 5, device="cuda", dtype=torch.int64)
            buffers = None
            if kind == "split":
                calls, buffers = _split_calls(sets, ctx, nheads_kv, headdim, a, b, stages, times)
            elif kind == "balanced":
                calls, buffers = _balanced_calls(sets, ctx, nheads_kv, headdim, a, b, stages, *pool, times)
            else:
                calls = _read_calls(sets, a, b, times)
            graph_calls = max(len(sets), 32)  # cuda_graph_time_us's default
            us = cuda_graph_time_us(calls, reps=args.reps, calls_per_graph=graph_calls)
            host = times.cpu()
            order = [i % len(sets) for i in range(graph_calls - len(sets), graph_calls)]
            # the partial buffers hold the replay's last call's results
            error = None if buffers is None else check_partials(*sets[order[-1]], *buffers, nheads_kv, a, headdim)
            ghz = _clock_ghz(host[order[-1]])
            calls_summary = [summarize(host[i], ghz) for i in (order[len(order) // 2], order[-1])]
            row = {"context": ctx, "variant": label, "us_per_call": round(us, 3),
                   "floor_us": round(kv_bytes / bandwidth * 1e6, 3), "clock_ghz": round(ghz, 3),
                   "max_abs_error": error,
                   "gap_us": {q: round(_pct(_gaps(host, order), q), 3) for q in (0.0, 0.5, 1.0)},
                   "calls": calls_summary}
            mid = calls_summary[0]
            print(f"{ctx:>7} {label:<20} {us:6.2f} us/call  gap {row['gap_us'][0.5]:.2f}  span {mid['span_us']:.2f}"
                  f"  ends {mid['end_us'][0.0]:.2f}/{mid['end_us'][0.5]:.2f}/{mid['end_us'][1.0]:.2f}"
                  f"  {mid['sms_used']} SMs x {mid['sm_programs'][0.0]}-{mid['sm_programs'][1.0]}  {ghz:.2f} GHz"
                  f"  err {error if error is None else f'{error:.1e}'}",
                  flush=True)
            results.append(row)
        del sets
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = write_json(out / f"{result_stem('stream_timeline', env)}.json", "stream_timeline",
                      dict(env, copy_bandwidth_TBps=bandwidth / 1e12), results, {"fields": FIELDS})
    print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
