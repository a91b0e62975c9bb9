"""Serving load test: N concurrent streaming requests against the OpenAI-compatible server on loopback.

    flashdecode bench serve --random-weights llama3-8b --num-requests 32 --prompt-len 1024 --output-len 256
    flashdecode bench serve --url http://127.0.0.1:8000 --model-name NAME --num-requests 64

The requests come from a separate (spawned) client process, as a real server's clients would: in the server's
process the client's own HTTP work would compete for the GIL with the engine thread. Without --url the server is
started in this process (loopback, a free port) from the engine options; after the
load test the same engine runs ``LLM.generate`` on the same batch (same prompts and lengths), the offline number
the server is compared with. Each request asks for exactly --output-len tokens (ignore_eos) and streams them;
TTFT is the time to the first streamed token, TPOT the mean time per later token of a request. Requests go to
/v1/chat/completions when the model has a chat template (prompt text made of random token ids), else to
/v1/completions with token-id prompts of exactly --prompt-len tokens. The run is bounded by --num-requests and
--timeout; failed or timed-out requests are counted, never dropped silently.

Workloads (--workload; token-id prompts to /v1/completions, greedy, ignore_eos):
  random          --num-requests prompts of --prompt-len random tokens (the default, described above)
  shared-prefix   one --prefix-len-token system prompt (default 4096) + --prompt-len new tokens per request: what
                  prefix caching serves (compare --enable-prefix-caching / --no-enable-prefix-caching)
  multi-turn      --num-requests conversations of --turns turns; each turn resends the history (earlier prompts
                  and replies) + --prompt-len new tokens, after the previous reply arrived
  chunked-prefill --num-requests streams of --prompt-len tokens decode --output-len tokens; once each has
                  --long-after tokens, one --long-prompt-len prompt arrives: the streams' inter-token latency
                  (ITL) p50/p99, over the run and while the long prompt prefills, and the long prompt's TTFT
                  (compare --enable-chunked-prefill --max-num-batched-tokens N with the default)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

import torch

from flashdecode.bench import report
from flashdecode.engine.cli import add_engine_arguments, build_llm

logger = logging.getLogger(__name__)
PERCENTILES = (50, 90, 99)
WORKLOADS = ("random", "shared-prefix", "multi-turn", "chunked-prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, default_max_num_seqs=32, required=False)
    parser.add_argument("--url", default=None, help="a running server (else one is started here, on loopback)")
    parser.add_argument("--model-name", default=None, help="with --url: the served model name (default: the "
                                                           "server's first model)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=None, help="open requests at once (default: all)")
    parser.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=256, help="generated tokens per request")
    parser.add_argument("--endpoint", choices=("auto", "chat", "completions"), default="auto",
                        help="auto: chat when the model has a chat template")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole load test")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--skip-generate", action="store_true", help="no LLM.generate comparison")
    parser.add_argument("--out", default=None, help="output folder (default: $OUT, else benchmarks/results/latest)")
    parser.add_argument("--workload", choices=WORKLOADS, default="random", help="see the module docstring")
    parser.add_argument("--prefix-len", type=int, default=4096, help="shared-prefix: system prompt tokens")
    parser.add_argument("--turns", type=int, default=8, help="multi-turn: turns per conversation")
    parser.add_argument("--long-prompt-len", type=int, default=32768, help="chunked-prefill: the long prompt")
    parser.add_argument("--long-after", type=int, default=32,
                        help="chunked-prefill: tokens every stream has before the long prompt is sent")


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99 (nearest rank) of ``values``; None when empty."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    s = sorted(values)
    return {f"p{p}": s[min(len(s) - 1, max(0, -(-p * len(s) // 100) - 1))] for p in PERCENTILES}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


async def _one(client, url: str, body: dict, t_start: float, rec: dict | None = None) -> dict:
    """One streaming request: its latency record (ttft, tpot, tokens, error; token_ids and each one's arrival
    time, seconds after t_start), filled in as tokens arrive when ``rec`` is given."""
    t0 = time.perf_counter()
    rec = rec if rec is not None else {}
    rec |= {"start_s": t0 - t_start, "ttft_s": None, "tpot_s": None, "tokens": 0, "error": None, "token_ids": [],
           "times": []}
    first = last = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = chunk["error"]["message"]
                    break
                ids = [t for c in chunk.get("choices", []) for t in c.get("token_ids") or []]
                n = len(ids)
                if n:
                    now = time.perf_counter()
                    rec["token_ids"] += ids
                    rec["times"] += [now - t_start] * n
                    first = now if first is None else first
                    last = now
                    rec["tokens"] += n
    except Exception as e:  # a dropped connection counts as a failed request
        rec["error"] = f"{type(e).__name__}: {e}"
    if first is not None:
        rec["ttft_s"] = first - t0
        if rec["tokens"] > 1:
            rec["tpot_s"] = (last - first) / (rec["tokens"] - 1)
    if rec["error"] is None and rec["tokens"] != body["max_tokens"]:
        rec["error"] = f"got {rec['tokens']} tokens, asked for {body['max_tokens']}"
    return rec


async def load_test(base_url: str, bodies: list[tuple[str, dict]], concurrency: int, timeout: float) -> dict:
    """Send every (path, body) request, ``concurrency`` at a time, within ``timeout`` seconds."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    t_start = time.perf_counter()

    async def bounded(client, path, body):
        async with sem:
            return await _one(client, base_url + path, body, t_start)

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as client:
        tasks = [asyncio.ensure_future(bounded(client, p, b)) for p, b in bodies]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        records = [t.result() for t in tasks if t in done]
        records += [{"error": "timed out", "tokens": 0, "ttft_s": None, "tpot_s": None}] * len(pending)
    return summarize(records, time.perf_counter() - t_start)


def summarize(records: list[dict], wall: float) -> dict:
    """Requests, failures, rates and TTFT / TPOT percentiles of a load test's records."""
    ok = [r for r in records if r["error"] is None]
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "ok": len(ok), "failed": len(records) - len(ok),
            "errors": sorted({str(r["error"]) for r in records if r["error"]})[:5],
            "duration_s": wall, "requests_per_s": len(ok) / wall, "output_tokens_per_s": tokens / wall,
            "ttft_ms": _ms(percentiles([r["ttft_s"] for r in ok])),
            "tpot_ms": _ms(percentiles([r["tpot_s"] for r in ok if r["tpot_s"] is not None])),
            "ttft_s_all": [r["ttft_s"] for r in ok], "tpot_s_all": [r["tpot_s"] for r in ok]}


def _ms(pcts: dict) -> dict:
    return {k: v and v * 1e3 for k, v in pcts.items()}


def inter_token_gaps(records: list[dict], start: float = float("-inf"), end: float = float("inf")) -> list[float]:
    """Seconds between consecutive tokens of each record, for gaps ending within [start, end] (seconds after the
    test's start)."""
    return [b - a for r in records for a, b in zip(r["times"], r["times"][1:]) if start <= b <= end]


async def multi_turn_test(base_url: str, conversations: list[list[list[int]]], common: dict, timeout: float) -> dict:
    """Each conversation's turns in order, all conversations at once: turn t sends the history (the earlier
    turns' new tokens and replies) + its new tokens once the reply to turn t - 1 is in."""
    import httpx

    t_start = time.perf_counter()

    async def converse(client, turns):
        history, records = [], []
        for new in turns:
            history = history + new
            rec = await _one(client, base_url + "/v1/completions", {**common, "prompt": history}, t_start)
            records.append(rec)
            if rec["error"] is not None:
                break
            history = history + rec["token_ids"]
        return records

    limits = httpx.Limits(max_connections=len(conversations), max_keepalive_connections=len(conversations))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as client:
        results = await asyncio.wait_for(asyncio.gather(*(converse(client, c) for c in conversations)), timeout)
    return summarize([r for recs in results for r in recs], time.perf_counter() - t_start)


async def chunked_prefill_test(base_url: str, streams: list[dict], long_body: dict, long_after: int,
                               timeout: float) -> dict:
    """The streams decode; once each has ``long_after`` tokens the long prompt is sent. The streams' inter-token
    latency over the run and while the long prompt waits for its first token, and that prompt's TTFT."""
    import httpx

    url = base_url + "/v1/completions"
    t_start = time.perf_counter()
    recs = [{"tokens": 0} for _ in streams]
    long_rec = {}
    limits = httpx.Limits(max_connections=len(streams) + 1, max_keepalive_connections=len(streams) + 1)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as client:
        tasks = [asyncio.ensure_future(_one(client, url, b, t_start, r)) for b, r in zip(streams, recs)]
        while min(r["tokens"] for r in recs) < long_after and not all(t.done() for t in tasks):
            await asyncio.sleep(0.002)
        long_start = time.perf_counter() - t_start
        tasks.append(asyncio.ensure_future(_one(client, url, long_body, t_start, long_rec)))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    result = summarize(recs + [long_rec], time.perf_counter() - t_start)
    long_first = long_start + (long_rec["ttft_s"] or float("nan"))
    result.update(long_prompt_ttft_s=long_rec["ttft_s"],
                  itl_ms=_ms(percentiles(inter_token_gaps(recs))),
                  itl_during_long_prefill_ms=_ms(percentiles(inter_token_gaps(recs, long_start, long_first))),
                  itl_max_ms=max(inter_token_gaps(recs), default=0.0) * 1e3)
    return result


def client_process_run(base_url: str, warm: list[tuple[str, dict]], bodies: list[tuple[str, dict]], concurrency: int,
                       timeout: float, workload: tuple | None = None) -> dict:
    """The load test as its own process runs it: the warm-up requests (compile / first-call costs outside the
    timing), then ``bodies`` (or ``workload``: ("multi-turn", conversations, common body) or ("chunked-prefill",
    stream bodies, long body, long_after)). A separate process, as a real server's clients are: in the server's
    process the client's HTTP parsing would hold the GIL that the engine thread and the server's event loop need."""
    asyncio.run(load_test(base_url, warm, 1, timeout))
    if workload is None:
        return asyncio.run(load_test(base_url, bodies, concurrency, timeout))
    name, *args = workload
    test = {"multi-turn": multi_turn_test, "chunked-prefill": chunked_prefill_test}[name]
    return asyncio.run(test(base_url, *args, timeout=timeout))


def run_client(base_url: str, warm, bodies, concurrency: int, timeout: float, workload: tuple | None = None) -> dict:
    """``client_process_run`` in a spawned child process (fork would copy a CUDA context); its result dict."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(client_process_run, base_url, warm, bodies, concurrency, timeout, workload).result()


def build_requests(prompts: list[list[int]], output_len: int, model: str, chat_text=None) -> list[tuple[str, dict]]:
    """(path, body) per prompt: chat with the prompt's text when ``chat_text`` (ids -> str) is given, else a
    token-id completion."""
    common = {"model": model, "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0, "stream": True}
    if chat_text is None:
        return [("/v1/completions", {**common, "prompt": ids}) for ids in prompts]
    return [("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": chat_text(ids)}]})
            for ids in prompts]


def workload_plan(args, vocab: int, model: str) -> tuple[list[list[int]], tuple | None, list[list[int]]]:
    """The prompts of a --workload (for the load test and the generate baseline), the workload tuple that
    client_process_run takes (None: a plain load test of the prompts) and the warm-up prompts: unrelated to the
    workload's tokens (nothing of it is cached beforehand), two sharing a prefix (a paged prefill compiles)."""
    n, plen, seed = args.num_requests, args.prompt_len, args.seed
    warm_len = plen + (args.prefix_len if args.workload == "shared-prefix" else 0)
    base = random_prompts(1, warm_len, vocab, seed + 7)[0]
    warm = [base, base[:-8] + random_prompts(1, 8, vocab, seed + 8)[0]]
    common = {"model": model, "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0, "stream": True}
    if args.workload == "shared-prefix":
        prefix = random_prompts(1, args.prefix_len, vocab, seed + 1)[0]
        return [prefix + p for p in random_prompts(n, plen, vocab, seed)], None, warm
    if args.workload == "multi-turn":
        turns = [random_prompts(args.turns, plen, vocab, seed + 100 * c) for c in range(n)]
        return [t[0] for t in turns], ("multi-turn", turns, common), warm
    if args.workload == "chunked-prefill":
        prompts = random_prompts(n, plen, vocab, seed)
        long = {**common, "prompt": random_prompts(1, args.long_prompt_len, vocab, seed + 1)[0], "max_tokens": 16}
        streams = [{**common, "prompt": p} for p in prompts]
        return prompts, ("chunked-prefill", streams, long, args.long_after), warm
    return random_prompts(n, plen, vocab, seed), None, warm


def workload_max_model_len(args) -> int:
    """The context the --workload needs (its longest prompt + output, + 8)."""
    longest = {"shared-prefix": args.prefix_len + args.prompt_len,
               "multi-turn": args.turns * (args.prompt_len + args.output_len),
               "chunked-prefill": max(args.prompt_len, args.long_prompt_len)}.get(args.workload, args.prompt_len)
    return longest + args.output_len + 8


def warm_up_engine(llm, prompts: list[list[int]]) -> None:
    """Compile outside the timing what the load test will run: the prefill of one prompt, of several at once
    (another kernel: varlen) and the decode step. The HTTP warm-up request covers the server's path."""
    from flashdecode.engine import SamplingParams

    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)
    llm.generate(prompts, params, use_tqdm=False)


def generate_baseline(llm, prompts: list[list[int]], output_len: int) -> dict:
    """LLM.generate on the same batch (warm: after the server ran): output tokens/s."""
    from flashdecode.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"duration_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall}


def _workload_settings(args, llm) -> dict:
    """What a --workload record needs to be read: its sizes and the engine's prefix-cache / chunking options."""
    out = {"prefix_len": args.prefix_len} if args.workload == "shared-prefix" else {}
    if args.workload == "multi-turn":
        out["turns"] = args.turns
    if args.workload == "chunked-prefill":
        out.update(long_prompt_len=args.long_prompt_len, long_after=args.long_after)
    if llm is not None:
        out.update(prefix_caching=llm.enable_prefix_caching, chunked_prefill=llm.enable_chunked_prefill,
                   max_num_batched_tokens=llm.scheduler_tokens, prefix_cache_hits=llm.stats.prefix_cache_hits,
                   prefix_cache_queries=llm.stats.prefix_cache_queries)
    return out


def _plot(path, result: dict) -> None:
    series = {}
    for key, label in (("ttft_s_all", "TTFT"), ("tpot_s_all", "TPOT")):
        vals = sorted(v * 1e3 for v in result[key] if v is not None)
        if vals:
            series[label] = [(100.0 * (i + 1) / len(vals), v) for i, v in enumerate(vals)]
    if series:
        report.line_plot(path, series, title="serving latency (cumulative)", xlabel="requests (%)",
                         ylabel="ms", logx=False, logy=True)


def run(args) -> int:
    import httpx

    for name in ("num_requests", "prompt_len", "output_len", "prefix_len", "turns", "long_prompt_len", "long_after"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    concurrency = args.concurrency or args.num_requests
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    if args.url is None and not (args.model or args.random_weights):
        raise ValueError("give --model or --random-weights (a server is started here), or --url of a running one")
    llm = server = None
    if args.url is None:
        from flashdecode.engine.server.launch import ServerThread

        llm = build_llm(args, max_model_len=args.max_model_len or workload_max_model_len(args))
        warm_up_engine(llm, random_prompts(2, args.prompt_len, llm.config.vocab_size, args.seed + 1))
        server = ServerThread(llm, "bench", max_queue=args.num_requests + 1).start()
        base_url, model = server.url, "bench"
    else:
        base_url = args.url.rstrip("/")
        model = args.model_name or httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    try:
        vocab = llm.config.vocab_size if llm is not None else 1000
        prompts, workload, warm_prompts = workload_plan(args, vocab, model)
        chat_text = None
        use_chat = args.workload == "random" and (args.endpoint == "chat" or (
            args.endpoint == "auto" and llm is not None and llm.tokenizer is not None
            and llm.tokenizer.has_chat_template))
        if use_chat:
            if llm is None or llm.tokenizer is None:
                raise ValueError("--endpoint chat needs a local engine with a tokenizer (prompts are built with it)")
            chat_text = llm.tokenizer.decode
        warm = build_requests(warm_prompts, 2, model, chat_text)
        result = run_client(base_url, warm, build_requests(prompts, args.output_len, model, chat_text), concurrency,
                            args.timeout, workload)
    finally:
        if server is not None:
            server.stop()
    baseline = None
    if llm is not None and not args.skip_generate and args.workload in ("random", "shared-prefix"):
        llm.reset_prefix_cache()  # the load test's prompts are cached now: the baseline starts as cold as it did
        baseline = generate_baseline(llm, prompts, args.output_len)
        result["generate_output_tokens_per_s"] = baseline["output_tokens_per_s"]
        result["serve_vs_generate"] = result["output_tokens_per_s"] / baseline["output_tokens_per_s"]
    from flashdecode.timing import env_info

    env = env_info()
    row = {k: v for k, v in result.items() if not k.endswith("_all")}
    row.update(workload=args.workload, **_workload_settings(args, llm))
    row.update(num_requests=args.num_requests, concurrency=concurrency, prompt_len=args.prompt_len,
               output_len=args.output_len, endpoint="chat" if chat_text else "completions",
               model=args.model or args.random_weights or model,
               layers=llm.config.num_hidden_layers if llm is not None else None)
    out = report.results_dir(args.out or (None if report.os.environ.get("OUT") else "benchmarks/results/latest"))
    stem = report.result_stem("serve", env)
    path = report.write_json(out / f"{stem}.json", "serve", env, [row],
                             {"baseline": baseline, "ttft_s_all": result["ttft_s_all"],
                              "tpot_s_all": result["tpot_s_all"]})
    _plot(out / f"{stem}.png", result)
    t, p = row["ttft_ms"], row["tpot_ms"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"serve: {row['ok']}/{row['requests']} ok ({row['failed']} failed) in {row['duration_s']:.2f} s, "
          f"{row['requests_per_s']:.2f} req/s, {row['output_tokens_per_s']:.1f} output tok/s")
    print(f"TTFT ms p50/p90/p99 {fmt(t['p50'])}/{fmt(t['p90'])}/{fmt(t['p99'])}; "
          f"TPOT ms p50/p90/p99 {fmt(p['p50'])}/{fmt(p['p90'])}/{fmt(p['p99'])}")
    if "itl_ms" in row:
        i, d = row["itl_ms"], row["itl_during_long_prefill_ms"]
        print(f"streams' ITL ms p50/p99 {fmt(i['p50'])}/{fmt(i['p99'])}, max {row['itl_max_ms']:.1f}; while the "
              f"long prompt prefilled p50/p99 {fmt(d['p50'])}/{fmt(d['p99'])}; long prompt TTFT "
              f"{fmt(row['long_prompt_ttft_s'] and row['long_prompt_ttft_s'] * 1e3)} ms")
    if baseline is not None:
        print(f"LLM.generate on the same batch: {baseline['output_tokens_per_s']:.1f} output tok/s "
              f"(server / generate = {row['serve_vs_generate']:.2f})")
    if row["errors"]:
        print("errors:", "; ".join(row["errors"]))
    print(f"wrote {path}")
    return 0 if row["failed"] == 0 else 1
