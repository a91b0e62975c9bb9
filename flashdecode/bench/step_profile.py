"""Where a decode step's time goes: ``flashdecode bench e2e --step-breakdown`` and ``--profile``.

``--step-breakdown`` (a record of its own, ``e2e_step_<device>_<date>.json``): for each batch, one engine on the
flashdecode backend with its sequences' K/V filled with random values, its CUDA-graphed decode step replayed under
torch.profiler (CUPTI: every kernel's device start and end); per step, each kernel family's time and share (linear
layers, attention, norms, rope + K/V store, activation, sampling, copies), the time between kernels inside the graph
(gaps: launch latency the graph does not hide, dependent-launch waits) and the largest gaps, the graph replay's
time, the engine step's wall time (the host's share is the difference) and the step's floor: the bytes it must read
(flashdecode.bench.roofline) over the copy and the read-stream bandwidth, the weights' floor beside the linear layers'
time and the K/V's beside attention's.

``--profile`` (``<out>/e2e_profile.json``): engine step vs graph replay, the eager step's top kernels with the Triton
GEMV path and with cuBLAS projections, per weight shape cuBLAS at 1/16/64 tokens vs the GEMV configs vs the
copy-bandwidth floor, and the kernels of one long prefill.
"""

from __future__ import annotations

import re
import time

import torch

from flashdecode import timing
from flashdecode.bench import report
from flashdecode.bench.engine_state import fill_pool_randomly, fill_running, page_bytes
from flashdecode.bench.gpu import release, sync
from flashdecode.bench.roofline import (decode_step_bytes, kv_bytes_per_step, roofline_tokens_per_s,
                                        weight_bytes_per_step)

# (family, pattern on the lower-cased kernel name), first match wins: the engine's Triton kernels by name, cuBLAS's
# and PyTorch's by their library names
KERNEL_FAMILIES = (
    ("linear", re.compile(r"gemv|flat_gemm|gemm|nvjet|cutlass|xmma|splitkreduce")),
    ("attention", re.compile(r"decode_split|decode_persistent|merge_many|merge_two|flash|fmha|attention|attn")),
    ("norm", re.compile(r"norm")),
    ("rope + kv store", re.compile(r"rope|append_kv|quantiz|index_copy|scatter")),
    ("activation", re.compile(r"silu|gelu")),
    ("sampling", re.compile(r"argmax|softmax|sort|topk|exponential")),
    ("copy / fill", re.compile(r"memcpy|memset|copy|fill|index|gather|elementwise")),
)


def kernel_family(name: str) -> str:
    """The family of a kernel (KERNEL_FAMILIES), "other" when no pattern matches."""
    lower = name.lower()
    return next((family for family, pattern in KERNEL_FAMILIES if pattern.search(lower)), "other")


def device_events(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every device-side event (kernels, copies, fills) of a torch.profiler run, in
    start order."""
    events = [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events, key=lambda e: e[1])


def split_steps(events: list, steps: int) -> list[list]:
    """``events`` (start order) of ``steps`` graph replays, each after a host sync -> one list per replay: by count
    when every replay traced the same number of events, else at the ``steps - 1`` longest idle gaps (a host sync
    and a graph launch lie between two replays)."""
    if steps < 1 or len(events) < steps:
        raise ValueError(f"{len(events)} device events cannot hold {steps} steps (were the graph's kernels traced?)")
    if len(events) % steps == 0:
        per = len(events) // steps
        return [events[i * per:(i + 1) * per] for i in range(steps)]
    idle, last_end = [], events[0][2]
    for i in range(1, len(events)):  # idle time before event i: its start - the latest end before it
        idle.append((events[i][1] - last_end, i))
        last_end = max(last_end, events[i][2])
    cuts = sorted(i for _, i in sorted(idle)[len(idle) - (steps - 1):]) if steps > 1 else []
    return [events[a:b] for a, b in zip([0] + cuts, cuts + [len(events)])]


def step_summary(events: list[tuple[str, float, float]], top: int = 8) -> dict:
    """One step's device events (name, start us, end us; start order) -> its span, kernel time (the union of the
    intervals, so kernels that overlap under programmatic dependent launch count once), gap time (span - kernel time:
    the device idle between the first kernel's start and the last one's end), per-family time (each kernel's own
    duration) and share of the summed kernel time, and the ``top`` largest gaps (us, the kernel after the gap)."""
    cursor = events[0][1]
    busy, gaps, families = 0.0, [], {}
    for name, start, end in events:
        if start > cursor:
            gaps.append((start - cursor, name))
        busy += max(0.0, end - max(start, cursor))
        cursor = max(cursor, end)
        family = kernel_family(name)
        families[family] = families.get(family, 0.0) + (end - start)
    span = cursor - events[0][1]
    total = sum(families.values())
    gaps.sort(key=lambda g: -g[0])
    return {"span_us": span, "kernel_us": busy, "gap_us": span - busy, "kernels": len(events),
            "families_us": dict(sorted(families.items(), key=lambda f: -f[1])),
            "family_share": {f: t / total for f, t in sorted(families.items(), key=lambda f: -f[1])},
            "largest_gaps": [dict(us=g, before=n[:120]) for g, n in gaps[:top]]}


def median_step(summaries: list[dict]) -> dict:
    """The summary of the step whose span is the median's (a real step, its parts consistent)."""
    ordered = sorted(summaries, key=lambda s: s["span_us"])
    return ordered[len(ordered) // 2]


def top_kernel_times(events: list[tuple[str, float, float]], top: int = 12) -> list[dict]:
    """Per kernel name: total us in the step, launches, family; the ``top`` largest."""
    by = {}
    for name, start, end in events:
        t, n = by.get(name, (0.0, 0))
        by[name] = (t + end - start, n + 1)
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return [dict(name=name[:160], us=t, count=n, family=kernel_family(name)) for name, (t, n) in rows]


def _step_wall_ms(llm, steps: int) -> float:
    sync(llm.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    sync(llm.device)
    return (time.perf_counter() - t0) * 1e3 / steps


def _replay_ms(graph, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def decode_step_breakdown(model, batch: int, context: int, page_size: int, bandwidths: dict[str, float],
                          steps: int = 20, kv_cache_dtype: str = "auto") -> dict:
    """The kernels of one engine's CUDA-graphed decode step at ``batch`` sequences of ``context`` tokens (K/V
    random), ``steps`` replays under the profiler; see the module docstring. ``bandwidths``: {"copy": B/s,
    "read": B/s}."""
    from flashdecode.engine import LLM

    cfg = model.config
    total = 3 + 2 * steps + 8
    max_len = context + total + 1
    pages = batch * -(-max_len // page_size)
    llm = LLM(model, attn_backend="flashdecode", page_size=page_size, max_num_seqs=batch, max_model_len=max_len,
              kv_cache_memory=pages * page_bytes(cfg, page_size, model.lm_head_weight.dtype, kv_cache_dtype),
              kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)  # decode of random pages
    try:
        fill_pool_randomly(llm.runner)
        fill_running(llm, batch, context, total)
        for _ in range(3):
            llm.step()
        step_ms = _step_wall_ms(llm, steps)
        bucket = min(b for b in llm.runner.graphs if b >= batch)
        graph = llm.runner.graphs[bucket]
        replay_ms = _replay_ms(graph, steps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):  # a sync after each: replays apart, so a step's span holds only its own gaps
                graph.replay()
                sync(llm.device)
        events = device_events(prof)
        per_step = split_steps(events, steps)
        summaries = [step_summary(e) for e in per_step]
        step = median_step(summaries)
        step_events = per_step[summaries.index(step)]
        dtype = model.lm_head_weight.dtype
        nbytes = decode_step_bytes(cfg, context, batch, dtype, kv_cache_dtype)
        weights, kv = weight_bytes_per_step(cfg, batch, dtype), kv_bytes_per_step(cfg, context, batch, dtype,
                                                                                   kv_cache_dtype)
        floors = {name: {"step_us": nbytes / bw * 1e6, "weights_us": weights / bw * 1e6, "kv_us": kv / bw * 1e6}
                  for name, bw in bandwidths.items()}
        return dict(batch=batch, context=context, kv_cache_dtype=kv_cache_dtype, graph_bucket=bucket,
                    engine_step_ms=step_ms, replay_ms=replay_ms, host_ms=step_ms - replay_ms, bytes=nbytes,
                    floors=floors, tokens_per_s=batch * 1e3 / step_ms,
                    pct_roofline=100 * batch * 1e3 / step_ms / roofline_tokens_per_s(
                        cfg, context, batch, bandwidths["copy"], kv_cache_dtype, dtype),
                    **step, top_kernels=top_kernel_times(step_events))
    finally:
        del llm
        release()


def _print_breakdown(r: dict) -> None:
    floor = r["floors"]
    print(f"decode step b{r['batch']} ctx{r['context']} ({r['kv_cache_dtype']} pages): engine step "
          f"{r['engine_step_ms']:.3f} ms ({r['pct_roofline']:.1f}% of the copy roofline), graph replay "
          f"{r['replay_ms']:.3f} ms, host {r['host_ms']:.3f} ms; in the graph: {r['kernels']} kernels, span "
          f"{r['span_us']:.0f} us = kernels {r['kernel_us']:.0f} + gaps {r['gap_us']:.0f} us; floor "
          + ", ".join(f"{k} {v['step_us']:.0f} us" for k, v in floor.items()))
    for family, share in r["family_share"].items():
        extra = ""
        if family == "linear":
            extra = "  (weights' floor " + ", ".join(f"{k} {v['weights_us']:.0f}" for k, v in floor.items()) + " us)"
        elif family == "attention":
            extra = "  (K/V's floor " + ", ".join(f"{k} {v['kv_us']:.0f}" for k, v in floor.items()) + " us)"
        print(f"    {family:16s} {r['families_us'][family]:9.1f} us {100 * share:5.1f}%{extra}")
    gaps = r["largest_gaps"][:5]
    print("    largest gaps: " + ", ".join(f"{g['us']:.1f} us before {g['before'][:40]}" for g in gaps))


def step_breakdown(model, args, bandwidths: dict[str, float], readers: dict[str, float], env: dict) -> dict:
    """--step-breakdown: decode_step_breakdown at each of --step-batches (and --step-kv-cache-dtype), printed and
    recorded as e2e_step_<device>_<date>.json."""
    rows, errors = [], []
    for kv in [k.strip() for k in args.step_kv_cache_dtype.split(",") if k.strip()]:
        for batch in [int(b) for b in args.step_batches.split(",") if b.strip()]:
            try:
                r = decode_step_breakdown(model, batch, args.step_context, args.page_size, bandwidths,
                                          kv_cache_dtype=kv)
            except (RuntimeError, ValueError) as e:  # OOM, or a trace without the graph's kernels: say so, go on
                errors.append(f"b{batch} {kv}: {type(e).__name__}: {str(e)[:200]}")
                print(f"decode step breakdown {errors[-1]}")
                release()
                continue
            _print_breakdown(r)
            rows.append(r)
    summary = [f"b{r['batch']} ctx{r['context']} {r['kv_cache_dtype']}: step {r['engine_step_ms']:.3f} ms "
               f"(graph {r['replay_ms']:.3f}, host {r['host_ms']:.3f}); gaps {r['gap_us']:.0f} us of "
               f"{r['span_us']:.0f}; " + ", ".join(f"{f} {100 * s:.1f}%" for f, s in r["family_share"].items())
               for r in rows]
    path = report.write_json(report.results_dir(args.out) / f"{report.result_stem('e2e_step', env)}.json",
                             "e2e_step", env, rows,
                             {"summary": summary, "errors": errors, "copy_bandwidth_bytes_per_s": bandwidths["copy"],
                              "read_bandwidth_bytes_per_s": bandwidths["read"], "read_stream_rates": readers,
                              "notes": "one CUDA-graphed decode step replayed under torch.profiler (CUPTI kernel "
                                       "times), median step by span; family shares of the summed kernel time; "
                                       "gaps = device idle between kernels inside the graph; host = engine step "
                                       "wall - graph replay; K/V random, flashdecode backend"})
    print(f"wrote {path}")
    return {"rows": rows, "summary": summary}


GEMV_SWEEP = ((8, 512, 4), (16, 512, 4), (16, 256, 4), (32, 256, 4), (32, 512, 8), (16, 1024, 8), (64, 128, 4))


def _top_kernels(prof, steps: int, top: int = 18) -> dict:
    """Kernels (and copies) of a torch.profiler run, by device time per step."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        if t > 0:
            rows.append((t / steps, e.count / steps, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    launches = sum(r[1] for r in rows)
    print(f"  kernel time {total / 1e3:.3f} ms/step over {launches:.0f} kernels/step; top:")
    for t, n, name in rows[:top]:
        print(f"    {t:9.1f} us {n:6.1f}x  {name[:110]}")
    return {"kernel_ms_per_step": total / 1e3, "kernels_per_step": launches,
            "top": [dict(us=t, count=n, name=name[:200]) for t, n, name in rows[:top]]}


def _decode_profile(model, backend: str, context: int, use_gemv: bool, bandwidth: float, page_size: int) -> dict:
    """One engine at batch 1: step wall time vs graph replay vs the eager step's kernels."""
    from flashdecode.engine import LLM

    model.use_gemv = use_gemv
    llm = LLM(model, attn_backend=backend, max_model_len=context + 200, max_num_seqs=1, page_size=page_size,
              enable_prefix_caching=False)
    try:
        llm.runner.pool.normal_()
        fill_running(llm, 1, context, 150)
        for _ in range(3):
            llm.step()
        sync(llm.device)
        n = 30
        t0 = time.perf_counter()
        for _ in range(n):
            llm.step()
        sync(llm.device)
        step_ms = (time.perf_counter() - t0) * 1e3 / n
        graph = llm.runner.graphs[1]
        t0 = time.perf_counter()
        for _ in range(n):
            graph.replay()
        sync(llm.device)
        replay_ms = (time.perf_counter() - t0) * 1e3 / n
        with torch.inference_mode():
            for _ in range(2):
                llm.runner._decode_forward(1)
            sync(llm.device)
            t0 = time.perf_counter()
            for _ in range(5):
                llm.runner._decode_forward(1)
            sync(llm.device)
            eager_ms = (time.perf_counter() - t0) * 1e3 / 5
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    llm.runner._decode_forward(1)
                sync(llm.device)
        roof = roofline_tokens_per_s(model.config, context, 1, bandwidth)
        print(f"decode b1 ctx{context} {backend} gemv={use_gemv}: engine step {step_ms:.3f} ms "
              f"({1e3 / step_ms:.1f} tok/s, {100 * 1e3 / step_ms / roof:.0f}% of roofline {roof:.1f}), graph replay "
              f"{replay_ms:.3f} ms (host share {step_ms - replay_ms:.3f} ms), eager step {eager_ms:.3f} ms")
        kern = _top_kernels(prof, 3)
        return dict(backend=backend, context=context, use_gemv=use_gemv, step_ms=step_ms, replay_ms=replay_ms,
                    eager_ms=eager_ms, roofline_tok_s=roof, **kern)
    finally:
        del llm
        release()


def _weight_shapes(model) -> dict[str, list[torch.Tensor]]:
    layers = model.model.layers
    return {"qkv": [l.self_attn.qkv_proj.weight for l in layers], "o": [l.self_attn.o_proj.weight for l in layers],
            "gate_up": [l.mlp.gate_up_proj.weight for l in layers], "down": [l.mlp.down_proj.weight for l in layers],
            "lm_head": [model.lm_head_weight]}


def _matmul_floors(model, bandwidth: float) -> dict:
    """us per call of each weight shape (cycling over all layers' weights, so L2 holds none) with cuBLAS
    (F.linear) at 1/16/64 tokens and with the Triton GEMV configs at 1 token; bandwidth and the per-step sums."""
    import torch.nn.functional as F

    from flashdecode.engine.layers import gemv

    out, per_step = {}, {}
    for name, ws in _weight_shapes(model).items():
        n, k = ws[0].shape
        nbytes = ws[0].numel() * ws[0].element_size()
        calls = len(ws)
        res = {"shape": [n, k], "mb": nbytes / 1e6}
        for m in (1, 16, 64):
            x = torch.randn(m, k, device="cuda", dtype=ws[0].dtype)
            us = timing.cuda_graph_time_us([lambda w=w: F.linear(x, w) for w in ws], reps=10,
                                           calls_per_graph=max(4, calls))
            res[f"cublas_m{m}_us"] = us
            res[f"cublas_m{m}_tbs"] = nbytes / us / 1e6
        x = torch.randn(1, k, device="cuda", dtype=ws[0].dtype)
        best = None
        for cfg in GEMV_SWEEP:
            try:
                us = timing.cuda_graph_time_us([lambda w=w: gemv.gemv(x, w, config=cfg) for w in ws], reps=10,
                                               calls_per_graph=max(4, calls))
            except Exception as e:  # a config the GPU refuses (resources): skip it, say so
                print(f"  gemv {name} {cfg}: {type(e).__name__}: {str(e)[:100]}")
                continue
            res[f"gemv_{cfg[0]}x{cfg[1]}w{cfg[2]}_us"] = us
            if best is None or us < best[1]:
                best = (cfg, us)
        res["gemv_best"] = list(best[0])
        res["gemv_best_us"] = best[1]
        res["gemv_best_tbs"] = nbytes / best[1] / 1e6
        res["floor_us"] = nbytes / bandwidth * 1e6
        out[name] = res
        for key in ("cublas_m1_us", "gemv_best_us", "floor_us", "cublas_m16_us", "cublas_m64_us"):
            per_step[key] = per_step.get(key, 0.0) + res[key] * len(ws)
        print(f"  {name:8s} ({n}x{k}, {res['mb']:.0f} MB): cuBLAS m1 {res['cublas_m1_us']:.1f} us "
              f"({res['cublas_m1_tbs']:.2f} TB/s), m16 {res['cublas_m16_us']:.1f}, m64 {res['cublas_m64_us']:.1f}; "
              f"Triton GEMV best {best[0]} {best[1]:.1f} us ({res['gemv_best_tbs']:.2f} TB/s); "
              f"copy-bandwidth floor {res['floor_us']:.1f} us")
    print("  per decode step (all layers + lm_head), ms: " + ", ".join(f"{k[:-3]} {v / 1e3:.3f}"
                                                                        for k, v in per_step.items()))
    out["per_step_us"] = per_step
    return out


def _prefill_profile(model, length: int, page_size: int, backend: str = "flashdecode") -> dict:
    """Kernels of one ``length``-token prefill through the eager engine, after a warm-up prefill of the same length
    (so the attention autotune of that length's bucket is not in the profile)."""
    from flashdecode.engine import LLM
    from flashdecode.engine.kv_cache import bytes_per_page
    from flashdecode.engine.sampling import SamplingParams

    cfg = model.config
    budget = (-(-(length + 2) // page_size)) * bytes_per_page(cfg.num_hidden_layers, page_size,
                                                              cfg.num_key_value_heads, cfg.head_dim,
                                                              model.lm_head_weight.dtype)
    llm = LLM(model, attn_backend=backend, page_size=page_size, kv_cache_memory=budget, max_num_seqs=1,
              max_model_len=length + 2, enforce_eager=True, enable_prefix_caching=False)  # the prompt repeats
    try:
        ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(1)).tolist()
        llm.generate([ids], SamplingParams(max_new_tokens=1))
        llm.add_request(ids, SamplingParams(max_new_tokens=1))
        sync(llm.device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            llm.step()
            sync(llm.device)
            wall = time.perf_counter() - t0
        print(f"prefill {length} tokens ({backend} backend, under the profiler): wall {wall:.3f} s")
        return dict(length=length, backend=backend, wall_s=wall, **_top_kernels(prof, 1, top=14))
    finally:
        del llm
        release()


def profile(model, args, bandwidth: float) -> dict:
    """Where the time goes (printed, and <out>/e2e_profile.json)."""
    import json

    print("== profile: batch-1 decode ==")
    result = {"decode": []}
    for use_gemv in (False, True):  # cuBLAS projections + separate norm/silu kernels vs the fused Triton GEMV
        result["decode"].append(_decode_profile(model, "flashdecode", 512, use_gemv, bandwidth, args.page_size))
    model.use_gemv = True
    if not args.no_sweep:
        print("== profile: matmul floors per weight shape ==")
        result["matmul"] = _matmul_floors(model, bandwidth)
    if args.prefill:
        print("== profile: prefill ==")
        result["prefill"] = [_prefill_profile(model, args.prefill, args.page_size, b) for b in ("flashdecode", "sdpa")]
    path = report.results_dir(args.out) / "e2e_profile.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    return result
