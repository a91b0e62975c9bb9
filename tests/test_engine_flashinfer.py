"""attn_backend="flashinfer" on the CPU: the host side (paged-KV metadata from block tables, option checks, the
import error) and the engine end to end on a stand-in flashinfer module (tests/flashinfer_fake.py: FlashInfer's
documented plan / run semantics computed by the reference), whose greedy tokens and logprobs must equal the torch
backend's - prefill, decode, a prefix-cache hit, chunked prefill, Gemma 3's sliding windows. The real kernels are
compared with the flashdecode backend on the GPU (test_engine_flashinfer_gpu.py)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from engine_helpers import random_prompts, save_tiny
from flashdecode import reference
from flashdecode.engine import LLM, EngineConfig, SamplingParams
from flashdecode.engine import flashinfer_backend as fib
from flashdecode.engine.backends import make_backend
from flashinfer_fake import fake_module

PAGE = 4


# ---------------------------------------------------------------------------------------------- host metadata
def test_paged_kv_metadata_from_block_tables():
    tables = np.array([[5, 6, 7, 8], [9, 1, 1, 1], [3, 4, 2, 2], [0, 0, 0, 0]], dtype=np.int32)
    indptr, indices, last = fib.paged_kv_metadata(tables, [9, 1, 8, 0], PAGE)
    # 9 keys = 3 pages (last holds 1), 1 key = 1 page, 8 keys = 2 full pages, 0 keys = no page
    assert indptr.tolist() == [0, 3, 4, 6, 6]
    assert indices.tolist() == [5, 6, 7, 9, 3, 4]
    assert last.tolist() == [1, 1, 4, 0]
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    lens = (np.diff(indptr) - 1).clip(min=0) * PAGE + last
    assert lens.tolist() == [9, 1, 8, 0]  # FlashInfer's kv length formula gives the lengths back


def test_page_gather_index_matches_the_host_indices():
    tables = np.array([[5, 6, 7], [9, 2, 2], [3, 4, 2]], dtype=np.int32)
    lens = [12, 3, 5]
    _, indices, _ = fib.paged_kv_metadata(tables, lens, PAGE)
    assert tables.reshape(-1)[fib.page_gather_index(lens, 3, PAGE)].tolist() == indices.tolist()


@pytest.mark.parametrize("lens, match", [([1, -1], "kv_lens must be >= 0"), ([13, 1], "needs 4 pages"),
                                         ([1], "one entry per block-table row")])
def test_paged_kv_metadata_refuses_bad_lengths(lens, match):
    with pytest.raises(ValueError, match=match):
        fib.paged_kv_metadata(np.zeros((2, 3), dtype=np.int32), lens, PAGE)


# ---------------------------------------------------------------------------------------------- options
def test_missing_flashinfer_is_one_line_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    with pytest.raises(ImportError, match="attn_backend='flashinfer' needs the flashinfer package") as info:
        make_backend("flashinfer", "cpu")
    assert "\n" not in str(info.value)


def test_engine_options_name_what_flashinfer_cannot_do():
    assert EngineConfig("m", attn_backend="flashinfer").attn_backend == "flashinfer"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        fib.check_engine(torch.device("cpu"), torch.bfloat16, 128)
    with pytest.raises(ValueError, match="dtype"):
        fib.check_engine(torch.device("cuda"), torch.float32, 128)
    with pytest.raises(ValueError, match="head_dim"):
        fib.check_engine(torch.device("cuda"), torch.bfloat16, 96)
    fib.check_engine(torch.device("cuda"), torch.float16, 256)  # supported: no error


def test_cli_takes_the_backend():
    import argparse

    from flashdecode.engine.cli import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, 4)
    assert parser.parse_args(["--model", "m", "--attn-backend", "flashinfer"]).attn_backend == "flashinfer"


# ---------------------------------------------------------------------------------------------- engine on the fake
@pytest.fixture()
def fake(monkeypatch):
    """The fake flashinfer installed; the CPU / dtype / head-dim check off (the fake computes any of them)."""
    mod = fake_module()
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(fib.FlashInferBackend, "check_engine", staticmethod(lambda device, dtype, cfg: None))
    return mod


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("fi") / "llama", "llama")


def make(ckpt, **kw):
    kw.setdefault("page_size", PAGE)
    kw.setdefault("max_model_len", 96)
    kw.setdefault("max_num_seqs", 4)
    return LLM(ckpt, device="cpu", dtype="float32", use_tqdm=False, **kw)


def run(llm, prompts, n=6):
    params = SamplingParams(max_new_tokens=n, logprobs=1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def assert_same(got, want, tol=1e-4):
    for (g_ids, g_lp), (w_ids, w_lp) in zip(got, want, strict=True):
        assert g_ids == w_ids
        for tok, g, w in zip(g_ids, g_lp, w_lp, strict=True):
            assert abs(g[tok] - w[tok]) <= tol


def _events(mod, event, kind):
    return [args for e, k, args in mod.calls if e == event and k == kind]


def test_prefill_and_decode_match_torch_one_plan_per_step(fake, ckpt):
    prompts = random_prompts([5, 11, 3], seed=1)
    want = run(make(ckpt, attn_backend="torch"), prompts)
    llm = make(ckpt, attn_backend="flashinfer", enable_prefix_caching=False)
    assert_same(run(llm, prompts), want)
    layers = llm.config.num_hidden_layers
    decode_plans, decode_runs = _events(fake, "plan", "decode"), _events(fake, "run", "decode")
    # one plan per decode step (every layer reuses it), one run per layer and step; 5 steps after the prefill
    assert len(decode_runs) == layers * len(decode_plans) == layers * 5
    ragged_plans = _events(fake, "plan", "ragged")
    assert len(ragged_plans) == 2  # one prefill forward: the layers' plan, then the last layer's last-row plan
    assert ragged_plans[0]["kv_indptr"].tolist() == [0, 5, 16, 19] and ragged_plans[0]["causal"]
    assert ragged_plans[1]["qo_indptr"].tolist() == [0, 1, 2, 3]
    assert ragged_plans[0]["wrapper"] is not ragged_plans[1]["wrapper"]  # never planned twice in one forward
    # the first decode step: 3 rows padded to the bucket of 4 (a row of one key on the scratch page)
    step = decode_plans[0]
    scratch = llm.runner.scratch_page
    assert step["last_page_len"].tolist() == [2, 4, 4, 1] and step["indptr"].tolist() == [0, 2, 5, 6, 7]
    assert step["indices"].tolist()[-1] == scratch
    assert (step["num_qo_heads"], step["num_kv_heads"], step["head_dim"], step["page_size"]) == (4, 2, 16, PAGE)
    inits = _events(fake, "init", "decode")
    assert all(i["use_cuda_graph"] for i in inits)  # fixed buffers, as in the captured graphs on the GPU
    assert not any(i["use_tensor_cores"] for i in inits)  # GQA group 2 < TENSOR_CORE_MIN_GROUP


def test_async_scheduling_plans_the_step_launched_ahead(fake, ckpt):
    prompts = random_prompts([6, 9], seed=2)
    want = run(make(ckpt, attn_backend="torch"), prompts)
    assert_same(run(make(ckpt, attn_backend="flashinfer", async_scheduling=True), prompts), want)


def test_prefix_cache_hit_and_chunked_prefill_match_torch(fake, ckpt):
    system = random_prompts([13], seed=3)[0]
    prompts = [system + t for t in random_prompts([3, 7], seed=4)] + random_prompts([29], seed=5)
    want = run(make(ckpt, attn_backend="torch", enable_prefix_caching=False), prompts)
    llm = make(ckpt, attn_backend="flashinfer", enable_prefix_caching=True, enable_chunked_prefill=True,
               max_num_batched_tokens=8)
    first = run(llm, prompts[:1])
    assert_same(first + run(llm, prompts[1:]), want)
    assert llm.stats.prefix_cache_hits == 12  # the 3 full pages of the system prompt, once
    paged = _events(fake, "plan", "paged")
    assert paged and all(p["causal"] and p["page_size"] == PAGE for p in paged)
    # the chunks' queries and the last layer's last rows plan two wrappers (never one twice in a forward)
    wrappers = llm.backend._shared.prefill
    assert wrappers[("paged", False, -1)][0] is not wrappers[("paged", True, -1)][0]
    for p in paged:  # every paged plan describes whole pages of its rows
        lens = (np.diff(p["indptr"].numpy()) - 1).clip(min=0) * PAGE + p["last_page_len"].numpy()
        assert (lens > 0).all() and len(p["indices"]) == int(p["indptr"][-1])


def test_single_forward_chunks_match_torch(fake, ckpt):
    prompts = random_prompts([4, 21, 6], seed=6)
    want = run(make(ckpt, attn_backend="torch"), prompts)
    llm = make(ckpt, attn_backend="flashinfer", enable_chunked_prefill=True, max_num_batched_tokens=7,
               chunked_prefill_single_forward=True)
    assert_same(run(llm, prompts), want)


def test_gemma3_sliding_windows_plan_each_window(fake, tmp_path):
    """Gemma 3 (window 8, prompts longer): a decode wrapper and plan per window, windows passed to every plan."""
    path = save_tiny(tmp_path / "gemma3", "gemma3")
    prompts = random_prompts([14, 19], seed=7)
    want = run(make(path, attn_backend="torch"), prompts, n=5)
    llm = make(path, attn_backend="flashinfer", enable_chunked_prefill=True, max_num_batched_tokens=10)
    assert_same(run(llm, prompts, n=5), want)
    windows = {p["window_left"] for p in _events(fake, "plan", "decode")}
    assert windows == {-1, llm.config.sliding_window - 1}
    assert {p["window_left"] for p in _events(fake, "plan", "paged")} == windows


def test_8bit_pages_and_batch_invariant_are_refused(fake, ckpt):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make(ckpt, attn_backend="flashinfer", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="batch_invariant"):
        make(ckpt, attn_backend="flashinfer", batch_invariant=True)


def test_decode_wrapper_buffers_tensor_cores_and_plan_order(fake):
    """A GQA group of 4 decodes on tensor cores (SGLang's rule); the CUDA-graph buffers hold the batch's whole
    block table; a decode before the step's plan is refused."""
    from flashdecode.engine.attention import AttentionMetadata

    backend = make_backend("flashinfer", "cpu")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, generator=gen)
    k_cache, v_cache = (torch.randn(6, PAGE, 2, 16, generator=gen) for _ in range(2))
    tables = np.array([[3, 1, 5], [0, 5, 5]], dtype=np.int32)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(2, dtype=torch.int64),
                             block_tables=torch.from_numpy(tables),
                             context_lens=torch.tensor([9, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="before plan_decode"):
        backend.decode(q, k_cache, v_cache, meta)
    backend.plan_decode(2, np.array([9, 2]), tables, PAGE)
    out = backend.decode(q, k_cache, v_cache, meta)
    init, = _events(fake, "init", "decode")
    assert init["use_cuda_graph"] and init["use_tensor_cores"]
    wrapper = backend._shared.decode[2][-1][0]
    assert [len(b) for b in wrapper.buffers] == [3, 2 * 3, 2]
    want, _ = reference.decode_ref(
        q.double(), k_cache.double(), v_cache.double(), torch.tensor([9, 2]), block_table=torch.from_numpy(tables))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
