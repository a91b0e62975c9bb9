"""The engine checks a request whole before anything runs: a bad prompt or sampling parameter raises ValueError /
TypeError from LLM.add_request / LLM.generate with the KV page pool bit for bit as it was and nothing queued, so a
caller that fixes the request and retries starts from the same state. (flash_attn_with_kvcache and append_kv: every
bad argument leaves the cache untouched, tests/test_bad_inputs.py and tests/test_flash_attn_interface.py.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from engine_helpers import VOCAB, random_prompts, save_tiny  # noqa: E402
from flashdecode.engine import LLM, SamplingParams  # noqa: E402

BAD_REQUESTS = [
    ("token id", lambda p: [p[0], VOCAB], SamplingParams(max_tokens=2)),
    ("negative token id", lambda p: [-1] + p, SamplingParams(max_tokens=2)),
    ("empty prompt", lambda p: [], SamplingParams(max_tokens=2)),
    ("too long", lambda p: p * 20, SamplingParams(max_tokens=2)),
    ("stop_token_ids", lambda p: p, SamplingParams(max_tokens=2, stop_token_ids=[VOCAB + 3])),
    ("not a prompt", lambda p: 3.5, SamplingParams(max_tokens=2)),
    ("second of two", lambda p: [p, [VOCAB + 1]], SamplingParams(max_tokens=2, prompt_logprobs=1)),
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("ckpt") / "llama", "llama")
    engine = LLM(str(path), device="cpu", dtype="float32", max_model_len=64)
    engine.generate(random_prompts([9]), SamplingParams(max_tokens=3), use_tqdm=False)  # pages hold real K/V
    return engine


def _bits(pool: torch.Tensor) -> torch.Tensor:
    return pool.detach().clone().view(torch.uint8)  # NaN-safe bitwise snapshot


@pytest.mark.parametrize("label, make, params", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_a_bad_request_raises_and_changes_nothing(llm, label, make, params):
    before = _bits(llm.runner.pool)
    prompt = make(random_prompts([5])[0])
    with pytest.raises((ValueError, TypeError)):
        if label == "second of two":
            llm.generate(prompt, params, use_tqdm=False)
        else:
            llm.add_request(prompt, params)
    assert torch.equal(_bits(llm.runner.pool), before), "the KV pool changed"
    assert not llm.scheduler.has_work(), "a sequence was left queued"
    out = llm.generate(random_prompts([4]), SamplingParams(max_tokens=2), use_tqdm=False)  # still serves
    assert len(out[0].outputs[0].token_ids) == 2
