"""attn_backend="flashinfer" on the GPU against the flashdecode backend, same engine and weights (random, bf16):
prefill logits and decode logprobs within twice flashdecode's own error against the torch backend (float64
attention over the same bf16 model), greedy tokens, CUDA graphs vs eager, a prefix-cache hit and chunked prefill,
and Gemma 3's sliding windows (head_dim 256, a GQA group of 2: FlashInfer's CUDA-core decode; the Llama shape's
group of 4 takes its tensor-core decode). Skipped where flashinfer cannot be imported (`make gpu-check` installs
the wheels carried in .whl/). The first run JIT-compiles FlashInfer's kernels (minutes; cached after)."""

from __future__ import annotations

import pytest
import torch

from flashdecode.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
flashinfer = pytest.importorskip("flashinfer", reason="flashinfer is not installed (pip install --no-deps .whl/*)")

RULE = 2.0  # FlashAttention's rule: error <= 2x the same-dtype implementation's


@pytest.fixture(scope="module")
def llama():
    """A 2-layer Llama-3-8B-shaped engine model (random weights, bf16) shared by every engine below."""
    from flashdecode.engine.config import named_config

    base = LLM(named_config("llama3-8b", num_layers=2), device="cuda", max_model_len=2048, max_num_seqs=1,
               enforce_eager=True, use_tqdm=False)
    return base.model


def _prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _engine(model, backend, **kw):
    kw.setdefault("max_model_len", 2048)
    kw.setdefault("max_num_seqs", 8)
    if backend == "torch":  # the reference: float64 attention, host loops, no graphs
        kw["enforce_eager"] = True
    return LLM(model, attn_backend=backend, use_tqdm=False, **kw)


def _generate(llm, prompts, n=16):
    """Greedy tokens and, per step, the log-probabilities of the sampled token and the top 2 (a parting's runner-up)."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, logprobs=2, ignore_eos=True), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _logprob_error(got, ref) -> tuple[float, int]:
    """(max |logprob - the reference's| of the chosen token, steps compared) over each request's steps up to the
    first token where the two runs part (a near tie of a random model may flip in bf16)."""
    err, steps = 0.0, 0
    for (g_ids, g_lp), (r_ids, r_lp) in zip(got, ref, strict=True):
        for tok, r_tok, g, r in zip(g_ids, r_ids, g_lp, r_lp):
            if tok != r_tok:
                break
            err, steps = max(err, abs(g[tok] - r[tok])), steps + 1
    return err, steps


@pytest.mark.parametrize("window_left", [-1, 20])
def _partings(got, ref) -> list[float]:
    """Where a run's greedy tokens part from the reference's: per parting request, the reference's margin for its
    own token over the run's pick at the first differing step (log-probabilities; inf where the run's pick is not
    among the reference's top 2 - a real disagreement, not a near tie)."""
    margins = []
    for (g_ids, _), (r_ids, r_lp) in zip(got, ref, strict=True):
        for tok, r_tok, r in zip(g_ids, r_ids, r_lp):
            if tok != r_tok:
                margins.append(r[r_tok] - r.get(tok, -float("inf")))
                break
    return margins


def _assert_parts_only_at_near_ties(name, got, ref, err):
    """A random bf16 model's logits hold near ties, where rounding alone picks either token: a run may part from
    the float64 reference only where the reference's margin is within twice the run's measured logprob error (the
    two tokens' errors in opposite directions) - never at a clear choice."""
    margins = _partings(got, ref)
    assert all(m <= 2 * err + 1e-3 for m in margins), f"{name} parts from the reference at margins {margins} > 2 x " \
                                                      f"its logprob error {err:.3e}"


def test_backend_calls_match_the_reference(window_left):
    """The backend alone in fp16 (head_dim 128, pages of 16 in shuffled order, a GQA group of 4): paged prefill
    (chunks after cached keys, and their last rows), ragged prefill and decode against the float64 reference."""
    from flashdecode import reference
    from flashdecode.engine.attention import AttentionMetadata
    from flashdecode.engine.backends import make_backend
    from test_engine_prefix_cache import expected_paged, paged_case

    gen = torch.Generator().manual_seed(0)
    tol = dict(atol=2e-3, rtol=2e-3)
    backend = make_backend("flashinfer", "cuda", window_left)
    q, k_cache, v_cache, meta, tables = paged_case(gen, "cuda", torch.float16, page_size=16, hk=2, h=8, d=128,
                                                   chunks=((0, 37), (40, 93), (100, 101)))
    args = (q.double(), k_cache.double(), v_cache.double(), meta, tables, window_left)
    torch.testing.assert_close(backend.prefill_paged(q, k_cache, v_cache, meta).double(), expected_paged(*args),
                               **tol)
    last = (meta.cu_seqlens[1:] - 1).long()
    torch.testing.assert_close(backend.prefill_paged(q[last], k_cache, v_cache, meta, last_only=True).double(),
                               expected_paged(*args, last_only=True), **tol)
    # ragged: the chunks' queries against their own keys only
    k, v = (torch.randn(q.shape[0], 2, 128, generator=gen).to("cuda", torch.float16) for _ in range(2))
    want, _ = reference.attention_varlen_ref(q.double(), k.double(), v.double(), meta.cu_seqlens, meta.cu_seqlens,
                                             causal=True, window_size=(window_left, 0))
    torch.testing.assert_close(backend.prefill(q, k, v, meta).double(), want, **tol)
    # decode: one query per sequence against its first seqlens_k keys in the pages
    lens = torch.tensor(meta.seqlens_k, dtype=torch.int32)
    dq = torch.randn(len(lens), 8, 128, generator=gen).to("cuda", torch.float16)
    dmeta = AttentionMetadata(is_prefill=False, slot_mapping=meta.slot_mapping[:len(lens)],
                              block_tables=meta.block_tables, context_lens=lens.cuda())
    backend.plan_decode(len(lens), lens.numpy(), meta.block_tables.cpu().numpy(), 16)
    want, _ = reference.decode_ref(dq.double(), k_cache.double(), v_cache.double(), lens.cuda(),
                                   block_table=meta.block_tables, window_size=(window_left, 0))
    torch.testing.assert_close(backend.decode(dq, k_cache, v_cache, dmeta).double(), want.double(), **tol)


def test_prefill_logits_within_the_rule_of_flashdecode(llama):
    ids = _prompts([333], llama.config.vocab_size)[0]
    ref, fd, fi = (_engine(llama, b, max_num_seqs=1).prompt_logits(ids).double()
                   for b in ("torch", "flashdecode", "flashinfer"))
    err, base = (fi - ref).abs().max().item(), (fd - ref).abs().max().item()
    assert err <= RULE * base + 1e-3, f"flashinfer prefill error {err:.3e} vs flashdecode {base:.3e}"


@pytest.mark.parametrize("page_size", [16, 128])
def test_decode_tokens_and_logprobs_match_flashdecode(llama, page_size):
    """A batch of 5 (padded to the graph of 8) with contexts 1..300 (across several pages): the decode logprobs
    meet the rule against the float64 reference over the steps where the tokens agree, and each backend's greedy
    tokens part from the reference's only at near ties."""
    prompts = _prompts((7, 300, 45, 129, 1), llama.config.vocab_size, seed=1)
    ref = _generate(_engine(llama, "torch", page_size=page_size), prompts)
    fd = _generate(_engine(llama, "flashdecode", page_size=page_size), prompts)
    fi_llm = _engine(llama, "flashinfer", page_size=page_size)
    assert fi_llm.runner.graphs and fi_llm.async_scheduling
    fi = _generate(fi_llm, prompts)
    (err, steps), (base, base_steps) = _logprob_error(fi, ref), _logprob_error(fd, ref)
    assert err <= RULE * base + 1e-3, f"flashinfer decode logprob error {err:.3e} vs flashdecode {base:.3e}"
    _assert_parts_only_at_near_ties("flashdecode", fd, ref, base)
    _assert_parts_only_at_near_ties("flashinfer", fi, ref, err)
    assert steps >= 16 and base_steps >= 16  # at least a request's worth of steps compared


def test_cuda_graphs_give_the_eager_tokens(llama):
    """The captured decode graphs replay FlashInfer's kernels on each step's plan: the eager engine's tokens."""
    prompts = _prompts((7, 300, 45), llama.config.vocab_size, seed=2)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    graphs = _engine(llama, "flashinfer", max_num_seqs=4)
    eager = _engine(llama, "flashinfer", max_num_seqs=4, enforce_eager=True)
    assert graphs.runner.graphs and not eager.runner.graphs
    assert ([o.token_ids for o in graphs.generate(prompts, sp, use_tqdm=False)]
            == [o.token_ids for o in eager.generate(prompts, sp, use_tqdm=False)])


def test_prefix_cache_hit_and_chunked_prefill(llama):
    """A shared 300-token prefix and a 1500-token prompt chunked by 256 tokens (FlashInfer's paged prefill, CUDA
    graphs, pages of 128) give the tokens of flashinfer with both features off, as flashdecode's with them on give
    its own with them off (a near tie may part one request: 3 of 4 must be identical; across the two backends the
    tokens part at near ties, which the decode test checks against the float64 reference); the hits are counted."""
    vocab = llama.config.vocab_size
    system = _prompts([300], vocab, seed=3)[0]
    prompts = [system + p for p in _prompts((40, 7, 90), vocab, seed=4)] + _prompts([1500], vocab, seed=5)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    features = dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=256,
                    max_num_seqs=4)

    def tokens(llm):
        first = llm.generate(prompts[:1], sp, use_tqdm=False)[0].token_ids  # caches the system prompt
        return [first] + [o.token_ids for o in llm.generate(prompts[1:], sp, use_tqdm=False)]

    plain = tokens(_engine(llama, "flashinfer", enable_prefix_caching=False, max_num_seqs=4))
    fi = _engine(llama, "flashinfer", **features)
    got = tokens(fi)
    assert fi.stats.prefix_cache_hits >= 2 * 256  # the 2 full 128-token pages of the system prompt, twice
    assert ("paged", False, -1) in fi.backend._shared.prefill  # the chunks and cached prefixes read the pages
    assert sum(g == w for g, w in zip(got, plain)) >= 3, (got, plain)
    fd_plain = tokens(_engine(llama, "flashdecode", enable_prefix_caching=False, max_num_seqs=4))
    fd = tokens(_engine(llama, "flashdecode", **features))
    assert sum(g == w for g, w in zip(fd, fd_plain)) >= 3, (fd, fd_plain)


def test_gemma3_sliding_windows():
    """Gemma 3 (6 layers, window 64 shorter than the prompts, head_dim 256, 8 query / 4 kv heads): prefill logits
    and decode logprobs within the rule of flashdecode's error, a decode wrapper per window."""
    from flashdecode.engine.config import config_from_dict

    cfg = config_from_dict(dict(
        model_type="gemma3_text", vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=64, sliding_window_pattern=6,
        query_pre_attn_scalar=256, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=10000.0, max_position_embeddings=4096))
    model = LLM(cfg, device="cuda", max_model_len=1024, max_num_seqs=1, enforce_eager=True, use_tqdm=False).model
    ids = _prompts([200], 4096, seed=6)[0]
    kw = dict(max_model_len=1024, max_num_seqs=4)
    ref_llm, fd_llm, fi_llm = (_engine(model, b, **kw) for b in ("torch", "flashdecode", "flashinfer"))
    ref, fd, fi = (llm.prompt_logits(ids).double() for llm in (ref_llm, fd_llm, fi_llm))
    err, base = (fi - ref).abs().max().item(), (fd - ref).abs().max().item()
    assert err <= RULE * base + 1e-3, f"flashinfer prefill error {err:.3e} vs flashdecode {base:.3e}"
    prompts = _prompts((150, 70, 9), 4096, seed=7)
    ref_out, fd_out, fi_out = (_generate(llm, prompts, n=24) for llm in (ref_llm, fd_llm, fi_llm))
    (err, steps), (base, _) = _logprob_error(fi_out, ref_out), _logprob_error(fd_out, ref_out)
    assert steps >= 24
    assert err <= RULE * base + 1e-3, f"flashinfer decode logprob error {err:.3e} vs flashdecode {base:.3e}"
    assert set(fi_llm.backend._shared.decode[4]) == {-1, 63}  # the global and the sliding layers' wrappers
