"""Qwen3 and Gemma 3 on the GPU in bf16 through the engine's CUDA defaults (flashdecode backend, fused norms / q-k
norm / rope kernels, the one-token GEMV path, CUDA graphs): logits against transformers (error within twice
transformers' own bf16 error), and CUDA graphs vs eager giving identical tokens. Gemma's window (64) is shorter
than the prompts, so its sliding layers' window is exercised in the prefill (the dense / Gluon call for one
prompt, varlen for several) and in paged decode; head_dim 256 as in the published Gemma 3 shapes."""

from __future__ import annotations

import copy

import pytest
import torch

from flashdecode.engine import LLM, SamplingParams
from flashdecode.engine.config import config_from_dict
from flashdecode.engine.loader import load_weights
from flashdecode.engine.models import model_class

pytestmark = pytest.mark.gpu
VOCAB = 4096


def _hf_config(kind: str):
    from transformers import Gemma3TextConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_key_value_heads=4,
                  max_position_embeddings=4096, eos_token_id=None, bos_token_id=None)
    if kind == "qwen3":
        return Qwen3Config(num_hidden_layers=2, num_attention_heads=16, head_dim=128, rope_theta=1e6, **common)
    return Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=8, head_dim=256, sliding_window=64,
                            query_pre_attn_scalar=256, rope_scaling={"rope_type": "linear", "factor": 8.0},
                            pad_token_id=None, **common)


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def models(request):
    """(our bf16 model, HF bf16 (sdpa), HF fp32 (eager)) with the same random weights (rounded to bf16)."""
    from transformers import AutoModelForCausalLM

    cfg = _hf_config(request.param)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf32 = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in hf32.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            p.copy_(p.bfloat16().float())
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    hf16.config._attn_implementation = "sdpa"
    ours_cfg = config_from_dict(cfg.to_dict())
    ours = model_class(ours_cfg)(ours_cfg, torch.bfloat16, torch.device("cuda"), max_positions=1024)
    load_weights(ours, hf16.state_dict().items())
    return ours, hf16, hf32


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_bf16_logits_match_transformers(models):
    ours, hf16, hf32 = models
    ids = _prompts([333])[0]
    with torch.no_grad():
        ref = hf32(torch.tensor([ids], device="cuda")).logits[0].double()
        hf_bf16 = hf16(torch.tensor([ids], device="cuda")).logits[0].double()
    llm = LLM(ours, max_model_len=512, max_num_seqs=1, use_tqdm=False)
    got = llm.prompt_logits(ids).double().cuda()
    err, base = (got - ref).abs().max().item(), (hf_bf16 - ref).abs().max().item()
    assert err <= 2 * base + 1e-3, f"engine bf16 error {err:.3e} vs transformers bf16 {base:.3e}"


def test_cuda_graphs_and_eager_give_the_same_tokens(models):
    ours = models[0]
    prompts = _prompts((7, 300, 45, 129), seed=1)
    sp = SamplingParams(max_new_tokens=40)  # the 45-token prompt decodes across the window

    def tokens(**kw):
        llm = LLM(ours, max_model_len=512, max_num_seqs=4, page_size=16, async_scheduling=False, use_tqdm=False,
                  **kw)
        assert bool(llm.runner.graphs) != kw.get("enforce_eager", False)
        return [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    assert tokens() == tokens(enforce_eager=True)
