"""The engine on the Triton kernels (backend "flashdecode": flash_attn_varlen prefill, flash_decode via a
DecodePlan on the paged cache). On the CPU the kernels run in the interpreter (TRITON_INTERPRET=1) on a tiny fp32
model, so CI covers the kernel path inside the engine (a ragged batch of 3, 8 new tokens each: the 11-token prompt's
last decode steps cross the interpreter's 16-key block, the 4-token pages cross each step or two)."""

from __future__ import annotations

import pytest
import torch

import flashdecode
from engine_helpers import LLAMA3_ROPE, hf_greedy, hf_model, hf_prompt_logits, random_prompts, save_tiny
from flashdecode.engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    not all(hasattr(flashdecode, f) for f in ("flash_attn_varlen", "flash_decode", "DecodePlan")),
    reason="flashdecode kernels not exported by this build")


NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("kern") / "qwen2", "qwen2")
    return path, hf_model(path)


@pytest.mark.parametrize("backend", ["flashdecode", "flashdecode-nosplit"])
def test_kernel_backend_matches_transformers(tiny, backend):
    path, hf = tiny
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = random_prompts((5, 11, 3), seed=21)
    llm = LLM(path, device=device, dtype="float32", attn_backend=backend, max_model_len=48, max_num_seqs=4,
              page_size=4)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    ids = prompts[1]
    ref = hf_prompt_logits(hf, ids)
    assert ((llm.prompt_logits(ids) - ref).abs().max() / ref.abs().max()).item() < 1e-4
