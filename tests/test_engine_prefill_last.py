"""The prefill's last layer on the last token only (runner.prefill -> model(..., last_rows=...),
backend.prefill_last): logits equal the full forward's (prompt_logits) at each prompt's last position, for every
attention backend, ragged batches and a sliding window; the K/V of every token still reach the cache (the
following decode matches transformers)."""

from __future__ import annotations

import os

import pytest
import torch

from engine_helpers import hf_greedy, hf_model, random_prompts, save_tiny
from flashdecode.engine import LLM, SamplingParams

BACKENDS = ["torch", "sdpa", "eager"] + (["flashdecode"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


def _prefill_logits(llm, prompts):
    """Schedule the prompts as one prefill step and return its (len(prompts), vocab) logits."""
    for p in prompts:
        llm.add_request(p, SamplingParams(max_new_tokens=1))
    seqs, is_prefill = llm.scheduler.schedule()
    assert is_prefill and len(seqs) == len(prompts)
    return llm.runner.prefill(seqs, [llm.block_manager.table(s.seq_id) for s in seqs])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, window", [("llama", None), ("mistral", 8)], ids=str)
def test_last_rows_prefill_matches_full_forward(tmp_path, backend, kind, window):
    path = save_tiny(tmp_path / kind, kind, **({"sliding_window": window} if window else {}))
    llm = LLM(path, device="cpu", dtype="float32", attn_backend=backend, max_model_len=64, max_num_seqs=4)
    prompts = random_prompts([21, 1, 9, 14], seed=3)
    got = _prefill_logits(llm, prompts)
    want = torch.stack([llm.prompt_logits(p)[-1] for p in prompts])
    assert got.shape == want.shape
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_last_rows_prefill_keeps_every_key_for_decode(tmp_path):
    """Generations after a last-rows prefill match transformers (the skipped rows' K/V were still written)."""
    path = save_tiny(tmp_path / "llama", "llama", num_hidden_layers=1)  # one layer: it is the pruned one
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=64)
    ids = random_prompts([19], seed=4)[0]
    out = llm.generate([ids], SamplingParams(max_new_tokens=5))[0]
    assert out.token_ids == hf_greedy(hf_model(path), ids, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flashdecode", "sdpa"])
def test_gpu_last_rows_prefill_matches_full_forward(backend):
    """bf16 on the GPU, Llama-3-8B shape cut to 2 layers (random weights): the pruned last layer (fused kernels,
    flash_attn_varlen with one query row per sequence) against the full forward's last rows."""
    from flashdecode.engine.config import named_config

    llm = LLM(named_config("llama3-8b", num_layers=2), attn_backend=backend, max_model_len=1024, max_num_seqs=4)
    prompts = random_prompts([333, 1, 129], seed=5)
    got = _prefill_logits(llm, prompts).float()
    want = torch.stack([llm.prompt_logits(p)[-1] for p in prompts]).to(got.device)
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
