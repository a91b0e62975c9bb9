"""End-to-end decode tokens/s of the engine per attention backend and context, against the bandwidth roofline.

Decode: for each backend and context, a fresh engine (same random weights) gets ``batch`` sequences whose KV cache
is filled with random values instead of running the prefill (decode speed does not depend on the cache content; a
64k prefill per backend would cost minutes), then the normal engine loop (CUDA-graphed decode step, greedy sampling,
scheduler) runs ``--steps`` timed tokens. Roofline tokens/s = batch x bandwidth / the bytes a step must read (every
weight matrix once, the lm_head, one embedding row per sequence, each sequence's K/V and 8-bit scales;
flashdecode.bench.roofline), at the copy bandwidth ("% roofline", the targets' measure) and, beside it, at the
read-stream bandwidth ("% read roofline"), both measured in the same run. Prefill: one prompt of
``--prefill`` tokens through the engine (flashdecode, flashinfer and sdpa backends), wall time.

Peer ``flashinfer`` (in --backends, run where the flashinfer package imports, else dropped with the reason
printed): the same engine, weights, pages and CUDA graphs with FlashInfer's paged decode / prefill as its attention
backend (engine/flashinfer_backend.py), at every point flashdecode runs; the summary gives flashdecode's tokens/s
over it at each point and whether it is >= 1.0x at all of them.

Peer ``--hf sdpa,eager``: transformers' own *ForCausalLM whose parameters are views of our model's tensors (same
random weights, no second 16 GB copy): batch-1 greedy decode as users run it (``model(next_token,
cache)`` in a Python loop, CUDA-event timed) with a DynamicCache pre-filled with random K/V of each
context, and an hf-sdpa forward over the ``--prefill`` prompt (last-position logits). Skipped, with the reason
printed, when transformers cannot be imported (flashdecode.bench.hf_peer).

    flashdecode bench e2e --random-weights llama3-8b --contexts 512,4096,16384,65536,131072 \\
        --backends flashdecode,flashdecode-nosplit,sdpa,eager --batch 1

``--step-breakdown`` then records each kernel family's share of one CUDA-graphed decode step and the gaps between
its kernels at batch 1 and 16 (flashdecode.bench.step_profile); ``--profile`` says where a batch-1 step's time goes:
engine step vs graph replay, the eager step's kernels, per weight shape cuBLAS vs the GEMV configs vs the floor,
and the kernels of one long prefill (the first call of a new prefill length also autotunes the attention: read its
totals with care).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashdecode import timing
from flashdecode.bench import report
from flashdecode.bench.engine_state import fill_pool_randomly, fill_running, page_bytes
from flashdecode.bench.gpu import release, sync
from flashdecode.bench.hf_peer import (HF_IMPLEMENTATIONS, HF_KV_NOTE, HF_PEER_TYPES, hf_peer_rows,
                                      hf_unavailable_reason)
from flashdecode.bench.roofline import roofline_tokens_per_s
from flashdecode.engine.cli import ON_OFF

DEFAULT_BACKENDS = "flashdecode,flashinfer,flashdecode-nosplit,sdpa,eager"
BATCHED_BACKENDS = ("flashdecode", "flashinfer", "sdpa")  # the backends of the batched points and the prefill


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF checkpoint directory")
    src.add_argument("--random-weights", metavar="CONFIG_NAME", default=None,
                     help="named shape with random weights (llama3-8b [default], llama3.2-1b, qwen2.5-1.5b, "
                          "codellama-34b, qwen3-8b, gemma3-12b)")
    parser.add_argument("--layers", type=int, default=None, help="keep only N layers (quick runs; roofline follows)")
    parser.add_argument("--contexts", default="512,4096,16384,65536,131072")
    parser.add_argument("--backends", default=DEFAULT_BACKENDS)
    parser.add_argument("--batch", default="1", help="comma-separated decode batch sizes")
    parser.add_argument("--batched", default="16,64", help="extra batch sizes run at --batched-context "
                                                           "(flashdecode, flashinfer and sdpa); '' to skip")
    parser.add_argument("--batched-context", type=int, default=4096)
    parser.add_argument("--prefill", type=int, default=65536, help="prefill length timed (0 to skip)")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per point")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median)")
    parser.add_argument("--hf", default="auto",
                        help="transformers peer sharing our random weights, batch-1 decode per context + an sdpa "
                             "prefill: comma-separated attn_implementations (sdpa,eager); 'auto' = sdpa,eager "
                             "(--quick: sdpa); 'none' to skip. Skipped with a printed reason without transformers")
    parser.add_argument("--page-size", type=int, default=128,
                        help="KV page size (the engine's CUDA default; 16 for the run before 2026-11-22 05:40)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="comma list of KV page dtypes for the flashdecode backends: auto (the model's), fp8, "
                             "int8 (8-bit pages + per-token-head scales); each 8-bit one is a '<backend>+<dtype>' "
                             "column beside the bf16 one")
    parser.add_argument("--cublas-column", action="store_true",
                        help="also run the batched points with the flat GEMM off (cuBLAS for every linear; the "
                             "engine's default takes the flat GEMM where its measured table says it wins): a "
                             "'flashdecode+cublas' column")
    parser.add_argument("--pdl", choices=("auto", "on", "off", "both"), default="auto",
                        help="programmatic dependent launch of the engine's decode-step kernels (LLM(pdl=)): the "
                             "engine's default (auto), on, off, or both: every flashdecode point run with PDL off "
                             "and then on, same run, the second as a '<column>+pdl' column")
    parser.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                        help="LLM(async_scheduling=) of the flashdecode engines: launch each greedy decode step "
                             "before the host reads the one in flight (auto: on for a single-GPU CUDA engine)")
    parser.add_argument("--quick", action="store_true",
                        help="<= 3 min on an H100: full llama3-8b, contexts 512,4096,16384,65536, 32 steps")
    parser.add_argument("--profile", action="store_true",
                        help="before the benchmark: where a batch-1 decode step (and the prefill) spends its time - "
                             "engine step vs graph replay, top kernels of the eager step, per-weight-shape matmul "
                             "floors (cuBLAS vs the Triton GEMV configs); results go to <out>/e2e_profile.json")
    parser.add_argument("--profile-only", action="store_true", help="--profile, then stop")
    parser.add_argument("--step-breakdown", action="store_true",
                        help="after the benchmark: each kernel family's share of one CUDA-graphed decode step and "
                             "the gaps between kernels (CUPTI via torch.profiler) at --step-batches x "
                             "--batched-context tokens; a record e2e_step_<device>_<date>.json (+ .png)")
    parser.add_argument("--step-batches", default="1,16", help="batch sizes of --step-breakdown")
    parser.add_argument("--step-kv-cache-dtype", default="auto", help="KV page dtypes of --step-breakdown (comma "
                                                                      "list: auto, fp8, int8)")
    parser.add_argument("--no-sweep", action="store_true", help="--profile without the per-shape matmul sweep")
    parser.add_argument("--out", default=None)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _build_model(args, max_positions: int):
    from flashdecode.engine.config import load_config, named_config
    from flashdecode.engine.models import build_model

    if args.model:
        cfg = load_config(args.model)
        if args.layers:
            raise ValueError("--layers only applies to --random-weights")
    else:
        cfg = named_config(args.random_weights or "llama3-8b", args.layers)
    return build_model(cfg, args.model or None, torch.bfloat16, torch.device("cuda"), max_model_len=max_positions,
                       parallel=None, seed=0, use_tqdm=False)


def decode_tokens_per_s(model, backend: str, context: int, batch: int, steps: int, repeats: int,
                        page_size: int, kv_cache_dtype: str = "auto", flat_gemm="auto", pdl="auto",
                        async_scheduling="auto") -> float:
    """Sequence tokens/s (all sequences together) of the engine's decode loop at ``context`` tokens.
    ``flat_gemm``, ``pdl``, ``async_scheduling``: the engine's LLM(flat_gemm=, pdl=, async_scheduling=) (default:
    its own)."""
    from flashdecode.engine import LLM

    cfg = model.config
    warm = 3
    total_steps = warm + repeats * steps + 1
    max_len = context + total_steps + 1
    pages = batch * -(-max_len // page_size)
    budget = pages * page_bytes(cfg, page_size, model.lm_head_weight.dtype, kv_cache_dtype)
    llm = LLM(model, attn_backend=backend, page_size=page_size, kv_cache_memory=budget, max_num_seqs=batch,
              max_model_len=max_len, kv_cache_dtype=kv_cache_dtype, flat_gemm=flat_gemm, pdl=pdl,
              async_scheduling=async_scheduling, enable_prefix_caching=False)  # decode of random pages
    try:
        fill_pool_randomly(llm.runner)
        fill_running(llm, batch, context, total_steps)
        for _ in range(warm):
            llm.step()
        sync(llm.device)
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                llm.step()
            sync(llm.device)
            rates.append(batch * steps / (time.perf_counter() - t0))
        return statistics.median(rates)
    finally:
        del llm
        release()


def prefill_seconds(model, backend: str, length: int, page_size: int) -> float:
    """Wall seconds of one prompt's prefill (+ its first token) through the engine; best of 2 after a warm-up."""
    from flashdecode.engine import LLM
    from flashdecode.engine.kv_cache import bytes_per_page
    from flashdecode.engine.sampling import SamplingParams

    cfg = model.config
    budget = (-(-(length + 2) // page_size)) * bytes_per_page(cfg.num_hidden_layers, page_size,
                                                              cfg.num_key_value_heads, cfg.head_dim, model.lm_head_weight.dtype)
    llm = LLM(model, attn_backend=backend, page_size=page_size, kv_cache_memory=budget, max_num_seqs=1,
              max_model_len=length + 2, enforce_eager=True, enable_prefix_caching=False)  # the prompt repeats
    try:
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(0, cfg.vocab_size, (length,), generator=gen).tolist()
        llm.generate([ids[:1024]], SamplingParams(max_new_tokens=1))  # compile / warm up
        times = []
        for _ in range(2):
            llm.add_request(ids, SamplingParams(max_new_tokens=1))
            sync(llm.device)
            t0 = time.perf_counter()
            llm.step()
            sync(llm.device)
            times.append(time.perf_counter() - t0)
        return min(times)
    finally:
        del llm
        release()


def roofline_shares(rate: float | None, cfg, context: int, batch: int, bandwidths: dict[str, float],
                    kv_cache_dtype: str = "auto") -> dict:
    """A decode row's rooflines and shares: for each bandwidth ``name`` in ``bandwidths`` ("copy", "read"),
    ``<name>_roofline_tokens_per_s`` and ``pct_<name>_roofline`` (None without a rate); the copy ones also under
    the older keys ``roofline_tokens_per_s`` / ``pct_roofline``."""
    out = {}
    for name, bandwidth in bandwidths.items():
        roof = roofline_tokens_per_s(cfg, context, batch, bandwidth, kv_cache_dtype)
        out[f"{name}_roofline_tokens_per_s"] = roof
        out[f"pct_{name}_roofline"] = None if rate is None else 100 * rate / roof
    if "copy" in bandwidths:
        out["roofline_tokens_per_s"], out["pct_roofline"] = out["copy_roofline_tokens_per_s"], out["pct_copy_roofline"]
    return out


def run(args) -> int:
    if not torch.cuda.is_available():
        print("bench e2e needs a CUDA GPU")
        return 2
    from tqdm import tqdm

    if args.quick:
        args.contexts = "512,4096,16384,65536"
        args.steps = min(args.steps, 32)
        args.repeats = min(args.repeats, 2)
        args.prefill = min(args.prefill, 65536)
    contexts, batches = _ints(args.contexts), _ints(args.batch)
    backends, fi_note = flashinfer_plan([b.strip() for b in args.backends.split(",") if b.strip()])
    print(fi_note)
    args.flashinfer_note = fi_note
    batched = _ints(args.batched) if args.batched else []
    env = timing.env_info()
    bandwidth = timing.copy_bandwidth_bytes_per_s()
    readers = timing.read_stream_rates()
    bandwidths = {"copy": bandwidth, "read": max(readers.values())}
    max_ctx = max(contexts + [args.batched_context if batched else 0, args.prefill])
    model = _build_model(args, max_positions=max_ctx + 4 * args.steps + 64)
    cfg = model.config
    name = args.model or (args.random_weights or "llama3-8b")
    what = (f"{name}: {cfg.num_hidden_layers} layers, {cfg.num_parameters() / 1e9:.2f}B params, bf16, random "
            f"weights" if not args.model else f"{name}, bf16")
    what += (f"; engine: whole decode step CUDA-graphed, fused qkv/gate_up, "
             f"{'fused Triton norm/rope/silu kernels' if model.use_fused else 'PyTorch elementwise ops'}")
    print(f"bench e2e on {env['device']} (torch {env['torch']}, triton {env['triton']}): {what}; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s, read stream {_readers_text(readers)}; KV caches filled with random values "
          f"instead of a prefill; "
          f"{args.steps} timed decode steps x {args.repeats} (median), page size {args.page_size}")

    if args.profile or args.profile_only:
        from flashdecode.bench import step_profile

        step_profile.profile(model, args, bandwidth)
        if args.profile_only:
            return 0
    kv_dtypes = [k.strip() for k in args.kv_cache_dtype.split(",") if k.strip()]
    # (backend, kv cache dtype, its column label): 8-bit pages only for the flashdecode backends
    columns = [(b, kv, b if kv == "auto" else f"{b}+{kv}") for kv in kv_dtypes for b in backends
               if kv == "auto" or b.startswith("flashdecode")]
    points = [(col, c, bs) for bs in batches for c in contexts for col in columns]
    points += [(col, args.batched_context, bs) for bs in batched for col in columns
               if col[0] in BATCHED_BACKENDS]
    if args.cublas_column and batched and "flashdecode" in backends:
        cublas_col = ("flashdecode", "auto", "flashdecode+cublas")
        points += [(cublas_col, args.batched_context, bs) for bs in batched]
        columns.append(cublas_col)
    points, columns = with_pdl_twins(points, columns, args.pdl)
    rows = []
    for (backend, kv, label), ctx, bs in tqdm(points, desc="e2e decode"):
        try:
            rate = decode_tokens_per_s(model, backend, ctx, bs, args.steps, args.repeats, args.page_size, kv,
                                       False if "+cublas" in label else "auto", point_pdl(label, args.pdl),
                                       ON_OFF[args.async_scheduling])
            err = None
        except torch.cuda.OutOfMemoryError as e:
            rate, err = None, f"OOM: {str(e)[:80]}"
            release()
        rows.append(dict(kind="decode", backend=label, kv_cache_dtype=kv, context=ctx, batch=bs, tokens_per_s=rate,
                         **roofline_shares(rate, cfg, ctx, bs, bandwidths, kv), error=err))
    backends = list(dict.fromkeys(backends + [label for _, _, label in columns]))
    if args.prefill:
        for backend in [b for b in BATCHED_BACKENDS if b in backends]:
            secs = prefill_seconds(model, backend, args.prefill, args.page_size)
            rows.append(dict(kind="prefill", backend=backend, context=args.prefill, batch=1, seconds=secs,
                             tokens_per_s=args.prefill / secs))
            print(f"prefill {args.prefill} tokens, {backend}: {secs:.2f} s")
    impls, hf_note = _hf_plan(args, cfg.model_type)
    print(hf_note)
    if impls:  # weights shared with our model: no second copy; each point frees its cache
        hf_rows = hf_peer_rows(model, impls, contexts, args.steps, args.repeats, args.prefill)
        for r in hf_rows:
            if r["kind"] == "decode":
                r.update(roofline_shares(r["tokens_per_s"], cfg, r["context"], 1, bandwidths))
        rows += hf_rows
        backends = backends + [f"hf-{i}" for i in impls]
    args.hf_note = hf_note
    status = _write(args, env, rows, cfg, name, what, bandwidth, backends, read_bandwidth=bandwidths["read"],
                    readers=readers)
    if args.step_breakdown:  # after the benchmark's record is written
        from flashdecode.bench import step_profile

        args.step_context = args.batched_context
        step_profile.step_breakdown(model, args, bandwidths, readers, env)
    return status


ROOFLINE_NOTE = ("roofline: the bytes a decode step must read (every weight matrix once, the lm_head, one "
                 "embedding row per sequence, each sequence's K/V and 8-bit scales; flashdecode.bench.roofline) over "
                 "the copy bandwidth ('% roofline') or the read-stream bandwidth ('% read roofline') measured in "
                 "the run")


def _readers_text(readers: dict[str, float]) -> str:
    """'3.10 TB/s (best of torch_sum 2.95, triton_block_sum 3.10)'."""
    return (f"{max(readers.values()) / 1e12:.2f} TB/s (best of "
            + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in readers.items()) + ")")


PDL_SUFFIX = "+pdl"


def with_pdl_twins(points: list, columns: list, pdl: str) -> tuple[list, list]:
    """--pdl both: each point of a flashdecode column followed by its twin in the '<label>+pdl' column (PDL on; the
    original runs with it off), so the two arms of a pair run back to back in one process. Other settings: as
    given. points: ((backend, kv dtype, label), context, batch); columns: (backend, kv dtype, label)."""
    if pdl != "both":
        return points, columns
    twin = lambda col: (col[0], col[1], col[2] + PDL_SUFFIX)  # noqa: E731
    paired = []
    for col, ctx, bs in points:
        paired.append((col, ctx, bs))
        if col[0].startswith("flashdecode"):
            paired.append((twin(col), ctx, bs))
    return paired, columns + [twin(c) for c in columns if c[0].startswith("flashdecode")]


def point_pdl(label: str, pdl: str):
    """LLM(pdl=) of a point of column ``label`` under --pdl ``pdl`` (both: on for the '+pdl' twins, off else)."""
    if label.endswith(PDL_SUFFIX):
        return True
    return {"auto": "auto", "on": True, "off": False, "both": False}[pdl]


def flashinfer_plan(backends: list[str]) -> tuple[list[str], str]:
    """(the backends to run: without flashinfer where its package cannot be imported, a line saying what)."""
    if "flashinfer" not in backends:
        return backends, "flashinfer peer: not run (--backends has no flashinfer)"
    from flashdecode.engine.flashinfer_backend import import_flashinfer

    try:
        fi = import_flashinfer()
    except ImportError as e:
        return [b for b in backends if b != "flashinfer"], f"flashinfer peer: skipped, {e}"
    return backends, (f"flashinfer peer: FlashInfer {getattr(fi, '__version__', '?')} as the engine's attention "
                      f"backend (same weights, pages and CUDA graphs; its decode planned once per step)")


def vs_flashinfer(rows: list) -> tuple[dict, str | None]:
    """flashdecode's decode tokens/s over the flashinfer backend's at every point both ran: ({"b<batch> ctx<context>":
    ratio}, a summary line; None without such points). The target: >= 1.0x at every point."""
    ratios = {}
    for r in rows:
        if r["kind"] == "decode" and r["backend"] == "flashdecode" and r["tokens_per_s"]:
            other = _rate(rows, "flashinfer", r["context"], r["batch"])
            if other:
                ratios[f"b{r['batch']} ctx{r['context']}"] = r["tokens_per_s"] / other
    if not ratios:
        return ratios, None
    low = min(ratios, key=ratios.get)
    verdict = "yes" if ratios[low] >= 1.0 else f"no (lowest {low})"
    return ratios, (f"flashdecode vs the flashinfer backend: {min(ratios.values()):.3f}x-{max(ratios.values()):.3f}x "
                    f"tokens/s over {len(ratios)} points; >= 1.0x at every point: {verdict}")


def _hf_plan(args, model_type: str = "llama") -> tuple[list[str], str]:
    """(attn_implementations of the transformers peer to run, a line saying what is run or why not)."""
    text = (args.hf or "none").strip()
    if text == "auto":
        text = "sdpa" if args.quick else ",".join(HF_IMPLEMENTATIONS)
    impls = [] if text == "none" else [i.strip() for i in text.split(",") if i.strip()]
    bad = [i for i in impls if i not in HF_IMPLEMENTATIONS]
    if bad:
        raise ValueError(f"--hf must list {', '.join(HF_IMPLEMENTATIONS)} (or 'auto' / 'none'), got {bad}")
    if not impls:
        return [], "hf peer: not run (--hf none)"
    reason = hf_unavailable_reason()
    if reason:
        return [], f"hf peer: skipped, {reason}"
    if 1 not in _ints(args.batch):
        return [], "hf peer: skipped, it runs at batch 1 only (--batch has no 1)"
    if model_type not in HF_PEER_TYPES:
        return [], f"hf peer: skipped, built for {' / '.join(HF_PEER_TYPES)} only (not {model_type})"
    import transformers

    return impls, (f"hf peer: transformers {transformers.__version__} {', '.join('hf-' + i for i in impls)} "
                   f"sharing our weights; {HF_KV_NOTE}; hf-sdpa prefill of --prefill tokens (use_cache=False, "
                   f"last-position logits)")


def _rate(rows, backend, ctx, bs):
    for r in rows:
        if r["kind"] == "decode" and r["backend"] == backend and r["context"] == ctx and r["batch"] == bs:
            return r["tokens_per_s"]
    return None


def _pct(rows, backend, ctx, bs, key="pct_roofline"):
    for r in rows:
        if r["kind"] == "decode" and r["backend"] == backend and r["context"] == ctx and r["batch"] == bs:
            return r.get(key)
    return None


def _pdl_columns(row: dict, rows: list, pdl_labels: list, ctx: int, bs: int) -> list[str]:
    """The '+pdl' twins' % of the roofline (their own row's, for their KV dtype) and speed-up over the same column
    without PDL, added to the table ``row``; returns summary notes."""
    notes = []
    for b in pdl_labels:
        on, off = _rate(rows, b, ctx, bs), _rate(rows, b[:-len(PDL_SUFFIX)], ctx, bs)
        pct = _pct(rows, b, ctx, bs)
        if pct is not None:
            row[f"{b} % roofline"] = pct
        if on and off:
            row[f"{b} speed-up"] = on / off
            notes.append(f"{b} {on:.0f} tok/s ({pct:.1f}% roofline, {on / off:.3f}x without PDL)")
    return notes


def _quant_columns(row: dict, rows: list, quant_labels: list, ctx: int, bs: int, ours: float | None) -> list[str]:
    """The 8-bit-page columns' % of their own roofline (fewer KV bytes) and tokens/s over the same engine's
    model-dtype pages (``ours``), added to the table ``row``; returns summary notes."""
    notes = []
    for b in quant_labels:
        rate, pct, read = _rate(rows, b, ctx, bs), _pct(rows, b, ctx, bs), _pct(rows, b, ctx, bs, "pct_read_roofline")
        if pct is not None:
            row[f"{b} % roofline"] = pct
        if read is not None:
            row[f"{b} % read roofline"] = read
        if rate and ours:
            row[f"{b} vs model-dtype pages"] = rate / ours
            notes.append(f"{b} {rate:.0f} tok/s ({pct:.1f}% of its roofline{_read_text(read)}, {rate / ours:.2f}x "
                         f"the model-dtype pages)")
    return notes


def _read_text(pct: float | None) -> str:
    return "" if pct is None else f", {pct:.1f}% of its read-stream roofline"


def _write(args, env, rows, cfg, name, what, bandwidth, backends, read_bandwidth: float | None = None,
           readers: dict[str, float] | None = None) -> int:
    """Print and record the run. ``bandwidth``: the copy bandwidth (bytes/s) the roofline divides by;
    ``read_bandwidth``: the read stream's, whose roofline share is given beside it (``readers``: each reader's)."""
    table_rows, summary = [], []
    quant = {r["backend"] for r in rows if r["kind"] == "decode" and r.get("kv_cache_dtype", "auto") != "auto"}
    for bs, ctx in dict.fromkeys((r["batch"], r["context"]) for r in rows if r["kind"] == "decode"):
        ours = _rate(rows, "flashdecode", ctx, bs)
        roof = roofline_tokens_per_s(cfg, ctx, bs, bandwidth)
        row = {"batch": bs, "context": ctx, "roofline tok/s": roof}
        for b in backends:
            row[f"{b} tok/s"] = _rate(rows, b, ctx, bs)
        row["flashdecode % roofline"] = None if ours is None else 100 * ours / roof
        read = None
        if read_bandwidth:
            read_roof = roofline_tokens_per_s(cfg, ctx, bs, read_bandwidth)
            row["read roofline tok/s"] = read_roof
            read = row["flashdecode % read roofline"] = None if ours is None else 100 * ours / read_roof
        peers = [b for b in backends if b != "flashdecode" and not b.endswith(PDL_SUFFIX) and b not in quant]
        for b in peers:
            other = _rate(rows, b, ctx, bs)
            if ours and other:
                row[f"x vs {b}"] = ours / other
        notes = _quant_columns(row, rows, [b for b in backends if b in quant and not b.endswith(PDL_SUFFIX)], ctx,
                               bs, ours)
        notes += _pdl_columns(row, rows, [b for b in backends if b.endswith(PDL_SUFFIX)], ctx, bs)
        table_rows.append(row)
        if ours:
            vs = ", ".join(f"{ours / row[f'{b} tok/s']:.2f}x {b}" for b in peers if row.get(f"{b} tok/s"))
            summary.append(f"b{bs} ctx{ctx}: {ours:.0f} tok/s ({row['flashdecode % roofline']:.1f}% roofline"
                           f"{_read_text(read)})" + (f", {vs}" if vs else "") + "".join(f"; {n}" for n in notes))
    fi_ratios, fi_line = vs_flashinfer(rows)
    if fi_line:
        summary.append(fi_line)
    prefill_s = {r["backend"]: r["seconds"] for r in rows if r["kind"] == "prefill"}
    for r in rows:
        if r["kind"] == "prefill":
            ratio = ""
            if r["backend"] == "flashdecode":
                ratio = "".join(f" ({prefill_s[p] / r['seconds']:.2f}x {p})" for p in ("flashinfer", "hf-sdpa")
                                if p in prefill_s)
            summary.append(f"prefill {r['context']}: {r['backend']} {r['seconds']:.2f} s{ratio}")
    columns = list(dict.fromkeys(k for r in table_rows for k in r))
    md = report.markdown_table(table_rows, columns, {c: ".1f" for c in columns if c not in
                                                                ("batch", "context")})
    prefill_rows = [r for r in rows if r["kind"] == "prefill"]
    if prefill_rows:
        md += "\n\n" + report.markdown_table(prefill_rows, ["backend", "context", "seconds", "tokens_per_s"],
                                             {"seconds": ".2f", "tokens_per_s": ".0f"})
    header = (f"# e2e decode, {what}\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
              f"copy bandwidth {bandwidth / 1e12:.2f} TB/s"
              + (f", read stream {_readers_text(readers)}" if readers else "")
              + f"; KV caches filled with random values (no prefill) for "
              f"the decode points; command: flashdecode bench e2e {'--quick ' if args.quick else ''}"
              f"--contexts {args.contexts} --backends {','.join(b for b in backends if not b.startswith('hf-'))} "
              f"--batch {args.batch} --page-size {args.page_size} --hf {getattr(args, 'hf', 'none')} "
              f"--pdl {getattr(args, 'pdl', 'auto')} --async-scheduling {getattr(args, 'async_scheduling', 'auto')}\n"
              f"{getattr(args, 'hf_note', 'hf peer: not run')}\n"
              f"{getattr(args, 'flashinfer_note', 'flashinfer peer: not run')}\n")
    print(header)
    print(md)
    print("\n".join(summary))
    out = report.results_dir(args.out)
    stem = report.result_stem("e2e", env)
    path = report.write_json(out / f"{stem}.json", "e2e", env, rows,
                             {"summary": summary, "model": what, "copy_bandwidth_bytes_per_s": bandwidth,
                              "vs_flashinfer": fi_ratios,
                              "read_bandwidth_bytes_per_s": read_bandwidth, "read_stream_rates": readers,
                              "table": table_rows, "notes": f"decode KV filled with random values instead of a "
                                                            f"prefill; {ROOFLINE_NOTE}; "
                                                            + getattr(args, "hf_note", "hf peer: not run") + "; "
                                                            + getattr(args, "flashinfer_note",
                                                                      "flashinfer peer: not run")})
    print(f"wrote {path}")
    return 0
