"""Prefix caching and chunked prefill in the engine (tiny checkpoint, CPU): the same greedy tokens and logprobs as
without them, whatever was cached, shared, evicted, preempted or chunked."""

from __future__ import annotations

import dataclasses
import pytest
import torch

from engine_helpers import random_prompts, save_tiny
from flashdecode.engine import LLM, SamplingParams

PAGE = 4
LOGPROB_TOL = 1e-4  # fp32: the cached prefix's K/V attended from the pages instead of the step's own copy


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("prefix") / "llama", "llama")


def make(ckpt, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("page_size", PAGE)
    kw.setdefault("max_model_len", 96)
    kw.setdefault("max_num_seqs", 4)
    return LLM(ckpt, dtype=kw.pop("dtype", "float32"), use_tqdm=False, **kw)


def greedy(n, logprobs=True, **kw):
    return SamplingParams(max_new_tokens=n, logprobs=1 if logprobs else None, ignore_eos=True, **kw)


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def assert_same(got, want, tol=LOGPROB_TOL):
    """Tokens equal; each step's logprob of the chosen token within ``tol``."""
    for g_req, w_req in zip(got, want, strict=True):
        for (g_ids, g_lp), (w_ids, w_lp) in zip(g_req, w_req, strict=True):
            assert g_ids == w_ids
            if w_lp is not None:
                for tok, g, w in zip(g_ids, g_lp, w_lp, strict=True):
                    assert abs(g[tok] - w[tok]) <= tol, (tok, g[tok], w[tok])


def shared_prefix_prompts(system_len=13, tails=(3, 6, 1, 9), seed=0):
    system = random_prompts([system_len], seed=seed)[0]
    return [system + t for t in random_prompts(tails, seed=seed + 1)]


def test_shared_system_prompt_reuses_pages_and_matches_caching_off(ckpt):
    prompts = shared_prefix_prompts()
    want = run(make(ckpt, enable_prefix_caching=False), prompts, greedy(6))
    llm = make(ckpt, enable_prefix_caching=True, max_num_seqs=1)  # one at a time: each later one finds the prefix
    assert_same(run(llm, prompts, greedy(6)), want)
    stats = llm.stats
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert stats.prefix_cache_hits == 3 * 12  # the 3 full pages of the 13-token system prompt, for the 3 later ones
    # run again: whole prompts are cached now (up to their last token, which is always computed)
    assert_same(run(llm, prompts, greedy(6)), want)
    assert stats.prefix_cache_hits == 3 * 12 + sum((len(p) - 1) // PAGE * PAGE for p in prompts)


def test_multi_turn_resend_matches_caching_off(ckpt):
    """Each turn resends the conversation so far (prompt + reply + a new user message): the earlier turns'
    pages, decoded ones included, are found in the cache."""
    turns = random_prompts([7, 5, 6], seed=3)

    def converse(llm):
        history, replies = [], []
        for user in turns:
            history = history + user
            out = llm.generate([history], greedy(5), use_tqdm=False)[0]
            replies.append([(out.token_ids, out.outputs[0].logprobs)])
            history = history + out.token_ids
        return replies

    want = converse(make(ckpt, enable_prefix_caching=False))
    llm = make(ckpt)  # on by default here
    assert llm.enable_prefix_caching
    assert_same(converse(llm), want)
    # turn 2 finds turn 1's 2 full pages (11 tokens computed), turn 3 turn 2's 5 (21 computed, decoded ones too)
    assert llm.stats.prefix_cache_hits == 8 + 20


def test_n_completions_share_the_prompt_and_match(ckpt):
    prompts = shared_prefix_prompts(tails=(5, 2))
    params = SamplingParams(max_new_tokens=6, n=3, temperature=0.8, seed=7, logprobs=1)
    want = run(make(ckpt, enable_prefix_caching=False), prompts, params)
    assert_same(run(make(ckpt, enable_prefix_caching=True), prompts, params), want)


def test_preemption_with_a_tiny_pool_matches_caching_off(ckpt):
    """Pages run out while decoding: sequences are preempted, recomputed (partly from their own cached pages) and
    cached pages are evicted; the outputs do not change."""
    prompts = shared_prefix_prompts(system_len=9, tails=(2, 4, 3, 5, 1))
    off = make(ckpt, enable_prefix_caching=False)
    want = run(off, prompts, greedy(14))
    small = make(ckpt, enable_prefix_caching=True, kv_cache_memory=_pages_bytes(off, 12))
    outs = small.generate(prompts, greedy(14), use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0
    assert_same([[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs], want)
    bm = small.block_manager
    assert bm.num_free == bm.num_pages and not bm.tables  # every page back: free or evictable


def _pages_bytes(llm, pages: int) -> int:
    from flashdecode.engine.kv_cache import bytes_per_page

    cfg = llm.config
    return pages * bytes_per_page(cfg.num_hidden_layers, PAGE, cfg.num_key_value_heads, cfg.head_dim, llm.dtype)


def test_fp16_prefix_caching_matches(ckpt):
    prompts = shared_prefix_prompts(tails=(4, 7))
    want = run(make(ckpt, dtype="float16", enable_prefix_caching=False, max_num_seqs=1), prompts, greedy(5))
    got = run(make(ckpt, dtype="float16", enable_prefix_caching=True, max_num_seqs=1), prompts, greedy(5))
    assert_same(got, want, tol=2e-2)


def test_8bit_pages_share_pages_with_their_scales(ckpt):
    """8-bit pages: off by default; on, a hit reuses the pages and their scales (the cached prefix is then read
    8-bit, so logprobs differ a little from off)."""
    assert not make(ckpt, kv_cache_dtype="int8").enable_prefix_caching
    prompts = shared_prefix_prompts(tails=(4, 7))
    want = run(make(ckpt, kv_cache_dtype="int8", enable_prefix_caching=False, max_num_seqs=1), prompts, greedy(2))
    llm = make(ckpt, kv_cache_dtype="int8", enable_prefix_caching=True, max_num_seqs=1)
    assert_same(run(llm, prompts, greedy(2)), want, tol=5e-2)
    assert llm.stats.prefix_cache_hits == 12


def test_refusals(ckpt):
    llm = make(ckpt, enable_prefix_caching=True, kv_cache_memory=_pages_bytes(make(ckpt), 4))
    llm.generate([[1] * 9], greedy(3), use_tqdm=False)  # 3 pages: fits, and its first 2 pages stay cached
    with pytest.raises(ValueError, match="KV pages"):  # cached pages do not make room: 5 pages never fit in 4
        llm.generate([[1] * 10], greedy(10), use_tqdm=False)
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        make(ckpt, enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(ckpt, enable_chunked_prefill=True, max_num_batched_tokens=4, max_num_seqs=8)


# ---------------------------------------------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("caching, single", [(False, False), (True, False), (True, True)])
def test_chunked_prefill_long_prompt_arrives_while_others_decode(ckpt, caching, single):
    """Short requests decode; a long prompt arrives and is prefilled in chunks of at most 8 tokens less the
    decodes, while the others keep getting a token every step (single: decode rows and chunks in one forward).
    Same greedy tokens (and logprobs) as unchunked."""
    short = random_prompts([5, 3, 6], seed=11)
    long = random_prompts([45], seed=12)[0]

    def serve(llm):
        seqs = [llm.add_request(p, greedy(12))[0] for p in short]
        for _ in range(3):
            llm.step()
        seqs += llm.add_request(long, greedy(8))
        stalls = 0
        while llm.scheduler.has_work():
            before = [len(s) for s in seqs[:3] if not s.finished]
            llm.step()
            stalls += any(len(s) == n for s, n in zip([s for s in seqs[:3] if not s.finished], before))
        return [[(s.output_token_ids, s.logprobs)] for s in seqs], stalls

    want, _ = serve(make(ckpt, enable_prefix_caching=False))
    llm = make(ckpt, enable_prefix_caching=caching, enable_chunked_prefill=True, max_num_batched_tokens=8,
               max_num_seqs=4, chunked_prefill_single_forward=single)
    got, stalls = serve(llm)
    assert_same(got, want)
    assert stalls == 0  # no decode step was skipped for the long prompt


def test_chunked_prefill_many_prompts_and_preemption(ckpt):
    prompts = random_prompts([30, 3, 17, 9, 22], seed=13)
    want = run(make(ckpt, enable_prefix_caching=False), prompts, greedy(10))
    llm = make(ckpt, enable_chunked_prefill=True, max_num_batched_tokens=7, max_num_seqs=3,
               kv_cache_memory=_pages_bytes(make(ckpt), 16))
    outs = llm.generate(prompts, greedy(10), use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0
    assert_same([[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs], want)


def test_bench_serve_workload_plans():
    """The bench serve workloads' requests: a shared system prompt, conversations of turns, streams + one long
    prompt; warm-up prompts share nothing with them."""
    import argparse

    from flashdecode.bench import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    base = ["--num-requests", "3", "--prompt-len", "5", "--output-len", "4"]
    args = parser.parse_args(base + ["--workload", "shared-prefix", "--prefix-len", "11"])
    prompts, workload, warm = serve.workload_plan(args, 160, "m")
    assert workload is None and [len(p) for p in prompts] == [16] * 3 and len({tuple(p[:11]) for p in prompts}) == 1
    assert len({tuple(p[11:]) for p in prompts}) == 3 and not {tuple(w[:11]) for w in warm} & {tuple(prompts[0][:11])}
    assert serve.workload_max_model_len(args) == 11 + 5 + 4 + 8
    args = parser.parse_args(base + ["--workload", "multi-turn", "--turns", "4"])
    _, (name, turns, common), _ = serve.workload_plan(args, 160, "m")
    assert name == "multi-turn" and len(turns) == 3 and all(len(t) == 4 and len(t[0]) == 5 for t in turns)
    assert common["max_tokens"] == 4 and serve.workload_max_model_len(args) == 4 * 9 + 4 + 8
    args = parser.parse_args(base + ["--workload", "chunked-prefill", "--long-prompt-len", "50", "--long-after", "2"])
    _, (name, streams, long, after), _ = serve.workload_plan(args, 160, "m")
    assert name == "chunked-prefill" and len(streams) == 3 and len(long["prompt"]) == 50 and after == 2
    records = [{"times": [0.0, 1.0, 1.5, 4.0]}, {"times": [0.5, 2.5]}]
    assert serve.inter_token_gaps(records) == [1.0, 0.5, 2.5, 2.0]
    assert serve.inter_token_gaps(records, 1.2, 3.0) == [0.5, 2.0]


# ---------------------------------------------------------------------------------------------- paged prefill
def paged_case(gen, device, dtype, page_size=4, chunks=((0, 5), (6, 9), (3, 4)), hk=2, h=4, d=16, extra=3):
    """Sequences whose first `end` tokens sit in shuffled pages; queries = tokens [start, end) of each. Returns the
    backend inputs and the contiguous per-sequence K/V for the reference."""
    from flashdecode.engine.attention import AttentionMetadata

    ends = [e for _, e in chunks]
    npages = [-(-e // page_size) for e in ends]
    total_pages = sum(npages) + extra
    k_cache = torch.randn(total_pages + 1, page_size, hk, d, generator=gen).to(device, dtype)
    v_cache = torch.randn(total_pages + 1, page_size, hk, d, generator=gen).to(device, dtype)
    perm = torch.randperm(total_pages, generator=gen).tolist()
    tables = []
    for n in npages:
        tables.append(perm[:n])
        perm = perm[n:]
    bt = torch.full((len(chunks), max(npages)), total_pages, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    lens = [e - s for s, e in chunks]
    q = torch.randn(sum(lens), h, d, generator=gen).to(device, dtype)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(device)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.zeros(sum(lens), dtype=torch.int64, device=device),
                             cu_seqlens=cu, max_seqlen=max(lens), seqlens=lens, block_tables=bt.to(device),
                             context_lens=torch.tensor(ends, dtype=torch.int32, device=device), seqlens_k=ends,
                             max_seqlen_k=max(ends))
    return q, k_cache, v_cache, meta, tables


def expected_paged(q, k_cache, v_cache, meta, tables, window_left=-1, last_only=False):
    from flashdecode import reference

    outs, q0 = [], 0
    for (nq, nk), table in zip(zip(meta.seqlens, meta.seqlens_k), tables):
        k = k_cache[table].flatten(0, 1)[:nk][None]
        v = v_cache[table].flatten(0, 1)[:nk][None]
        qs = q[q0:q0 + nq][None]
        if last_only:
            qs = qs[:, -1:]
        o, _ = reference.attention_ref(qs, k, v, causal=True, window_size=(window_left, 0))
        outs.append(o[0])
        q0 += nq
    return torch.cat(outs)


@pytest.mark.parametrize("name", ["torch", "sdpa", "eager", "flashdecode"])
@pytest.mark.parametrize("window_left", [-1, 2])
def test_prefill_paged_backends_match_the_reference(name, window_left, gen, device):
    """Every backend's paged prefill (chunks after K/V in shuffled pages, causal bottom-right, a window) equals the
    float64 reference on the gathered keys; last_only gives each sequence's last row."""
    from flashdecode.engine.backends import make_backend

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    q, k_cache, v_cache, meta, tables = paged_case(gen, device, dtype)
    backend = make_backend(name, device, window_left)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    want = expected_paged(q.double(), k_cache.double(), v_cache.double(), meta, tables, window_left)
    torch.testing.assert_close(backend.prefill_paged(q, k_cache, v_cache, meta).double(), want, atol=tol, rtol=tol)
    last = (meta.cu_seqlens[1:] - 1).long()
    want_last = expected_paged(q.double(), k_cache.double(), v_cache.double(), meta, tables, window_left, True)
    got_last = backend.prefill_paged(q[last], k_cache, v_cache, meta, last_only=True)
    torch.testing.assert_close(got_last.double(), want_last, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["torch", "flashdecode"])
def test_prefill_paged_reads_8bit_pages_with_their_scales(name, gen, device):
    from flashdecode.engine.backends import make_backend
    from flashdecode.engine.kv_quant import QuantPages, quantize_tokens

    dtype = torch.float16 if name == "flashdecode" else torch.float32
    q, k_cache, v_cache, meta, tables = paged_case(gen, device, dtype)
    pages = []
    for x in (k_cache, v_cache):
        data, scale = quantize_tokens(x.flatten(0, 1), torch.int8)
        pages.append(QuantPages(data.view(x.shape), scale.view(x.shape[:3])))
    backend = make_backend(name, device)
    if name == "flashdecode":
        assert backend.paged_varlen_quant  # the kernel reads the 8-bit pages, no gathered copy
    want = expected_paged(q.double(), *(p.dequantize(torch.float64) for p in pages), meta, tables)
    got = backend.prefill_paged(q, *pages, meta)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_flashdecode_backend_prefills_with_resolved_untimed_tiles(gen, device):
    """The flashdecode backend's prefill calls pass config= the resolved configuration with autotuning off (one per
    length class: a new key-length bucket never times tiles inside a request), or None with prefill_autotune."""
    from flashdecode.engine.backends import make_backend
    from flashdecode.heuristics import PREFILL_LENGTH_THRESHOLDS
    from flashdecode.ops.attention_config import resolve_config

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    q, k_cache, v_cache, meta, tables = paged_case(gen, device, dtype)
    backend = make_backend("flashdecode", device)
    seen, varlen = [], backend._varlen

    def spy(*args, **kwargs):
        seen.append(kwargs["config"])
        return varlen(*args, **kwargs)
    backend._varlen = spy
    backend.prefill_paged(q, k_cache, v_cache, meta)
    backend.prefill_paged(q, k_cache, v_cache, meta)
    want = resolve_config(q, k_cache, v_cache, meta.max_seqlen_k)
    assert seen[0] is seen[1] and not seen[0].fwd_autotune
    assert seen[0] == dataclasses.replace(want, fwd_autotune=False)
    long = backend._config(q, k_cache, v_cache, max(PREFILL_LENGTH_THRESHOLDS))
    assert long is not seen[0] and long == dataclasses.replace(
        resolve_config(q, k_cache, v_cache, max(PREFILL_LENGTH_THRESHOLDS)), fwd_autotune=False)
    backend.prefill_autotune = True
    backend.prefill_paged(q, k_cache, v_cache, meta)
    assert seen[2] is None


def test_flashdecode_backend_prefix_caching_and_chunks_match_it_without(ckpt):
    """The Triton paged prefill in the engine (the interpreter on the CPU): a shared prefix, then a prompt in
    chunks; greedy tokens equal to the same backend with both features off (that one with prefill_autotune)."""
    prompts = shared_prefix_prompts(system_len=9, tails=(3, 11))
    kw = dict(attn_backend="flashdecode", max_num_seqs=1, device="cuda" if torch.cuda.is_available() else "cpu")
    off = make(ckpt, enable_prefix_caching=False, prefill_autotune=True, **kw)
    assert off.backend.prefill_autotune
    want = run(off, prompts, greedy(3, logprobs=False))
    llm = make(ckpt, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=6, **kw)
    assert llm.backend.paged_varlen and not llm.backend.prefill_autotune
    assert_same(run(llm, prompts, greedy(3, logprobs=False)), want)
    assert llm.stats.prefix_cache_hits == 8


@pytest.mark.gpu
def test_gpu_prefix_caching_and_chunked_prefill_with_cuda_graphs():
    """On the GPU (flashdecode backend, CUDA graphs, async scheduling, pages of 128), a 2-layer Llama-3-8B-shaped
    model in bf16: a shared 300-token prefix and a 1500-token prompt chunked by 256 tokens give the greedy tokens of
    the engine with both features off (bf16 rounding differs between a paged and a fresh prefill, so a near tie of
    a random model may part one request: 3 of 4 must be identical), and the hits are counted."""
    from flashdecode.engine.config import named_config

    cfg = named_config("llama3-8b", num_layers=2)
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, cfg.vocab_size, (300,), generator=gen).tolist()
    prompts = [system + torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (40, 7, 90)]
    prompts.append(torch.randint(0, cfg.vocab_size, (1500,), generator=gen).tolist())
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    base = LLM(cfg, device="cuda", max_model_len=2048, max_num_seqs=4, enable_prefix_caching=False, use_tqdm=False)
    want = [o.token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    llm = LLM(base.model, max_model_len=2048, max_num_seqs=4, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=256, use_tqdm=False)
    assert llm.backend.paged_varlen and llm.runner.graphs
    first = llm.generate(prompts[:1], params, use_tqdm=False)[0].token_ids
    got = [first] + [o.token_ids for o in llm.generate(prompts[1:], params, use_tqdm=False)]
    assert sum(g == w for g, w in zip(got, want)) >= 3, (got, want)
    assert llm.stats.prefix_cache_hits >= 2 * 256  # the 2 full 128-token pages of the system prompt, twice


def test_async_scheduling_with_chunks_and_cached_prefixes(ckpt):
    """Async scheduling (decode steps launched ahead) never runs ahead of a pending prompt chunk, and aborting a
    request mid-prompt frees its pages; tokens equal the synchronous engine without the features."""
    prompts = shared_prefix_prompts(system_len=10, tails=(2, 14, 5))
    want = run(make(ckpt, enable_prefix_caching=False), prompts, greedy(9, logprobs=False))
    llm = make(ckpt, async_scheduling=True, enable_chunked_prefill=True, max_num_batched_tokens=5)
    seqs = [llm.add_request(p, greedy(9, logprobs=False))[0] for p in prompts]
    victim = llm.add_request(random_prompts([40], seed=5)[0], greedy(9, logprobs=False))[0]
    while llm.scheduler.has_work():
        llm.step()
        if victim.prefilling and victim.num_computed_tokens >= 10:
            llm.abort([victim])  # mid-prompt
    assert victim.finish_reason == "abort" and victim.num_generated == 0
    assert [[(s.output_token_ids, None)] for s in seqs] == [[(t, None) for t, _ in r] for r in want]
    assert not llm.block_manager.tables and llm.block_manager.num_free == llm.block_manager.num_pages


def test_prefill_warmup_is_resolved_once():
    """prefill_warmup "auto": on for flashdecode backends on CUDA only; the lengths fit a step and half the
    context; a value that is neither "auto" nor a bool is refused naming the option."""
    from flashdecode.engine import engine_config as ec

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert ec.resolve_prefill_warmup("auto", cuda, "flashdecode") and ec.resolve_prefill_warmup("auto", cuda,
                                                                                                "flashdecode-nosplit")
    assert not ec.resolve_prefill_warmup("auto", cpu, "flashdecode")
    assert not ec.resolve_prefill_warmup("auto", cuda, "flashinfer")
    assert ec.resolve_prefill_warmup(True, cpu, "torch") and not ec.resolve_prefill_warmup(False, cuda, "flashdecode")
    assert ec.prefill_warmup_lengths(2048, 131072) == ec.PREFILL_WARMUP_TOKENS == (256, 2048)
    assert ec.prefill_warmup_lengths(2048, 96) == (48, )
    assert ec.prefill_warmup_lengths(6, 96) == (6, )
    assert ec.prefill_warmup_lengths(2048, 3) == ()
    with pytest.raises((TypeError, ValueError), match="prefill_warmup"):
        ec.EngineConfig("llama3-8b", prefill_warmup="yes")


def test_prefill_warmup_runs_each_prefill_kernel_on_the_scratch_page(ckpt, monkeypatch):
    """LLM(prefill_warmup=True) runs the dense, ragged and paged prefills (and the last layer's last-rows
    variants) once per warm-up length before the first request, writing only the scratch page (every other page
    of the pool stays zero) and touching no prefix-cache statistic; the greedy tokens after it are those of an
    engine without it."""
    from flashdecode.engine.attention import FlashDecodeBackend

    calls = []
    for name in ("prefill", "prefill_last", "prefill_paged"):
        original = getattr(FlashDecodeBackend, name)

        def spy(self, q, *args, _original=original, _name=name, **kwargs):
            meta = args[2]
            calls.append((_name, len(meta.seqlens), meta.max_seqlen_k, q.shape[0]))
            return _original(self, q, *args, **kwargs)
        monkeypatch.setattr(FlashDecodeBackend, name, spy)
    kw = dict(attn_backend="flashdecode", device="cuda" if torch.cuda.is_available() else "cpu",
              max_num_batched_tokens=8, enable_prefix_caching=True)
    llm = make(ckpt, prefill_warmup=True, **kw)
    inner = llm.config.num_hidden_layers - 1  # the last layer computes its sequences' last rows only
    assert calls == ([("prefill", 1, 0, 8)] * inner + [("prefill_last", 1, 0, 1)]
                     + [("prefill", 2, 0, 8)] * inner + [("prefill_last", 2, 0, 2)]
                     + [("prefill_paged", 1, 16, 8)] * inner + [("prefill_paged", 1, 16, 1)])
    pool = llm.runner.pool
    assert pool[:, :, -1].abs().sum() > 0 and pool[:, :, :-1].abs().sum() == 0
    assert llm.stats.prefix_cache_queries == 0
    prompts = shared_prefix_prompts(system_len=9, tails=(3, 5))
    got = run(llm, prompts, greedy(3, logprobs=False))
    assert_same(got, run(make(ckpt, prefill_warmup=False, **kw), prompts, greedy(3, logprobs=False)))
