"""The engine's fused Triton elementwise kernels (norm + residual, rope + K/V page write, silu * mul) against the
unfused PyTorch path they replace, and the whole model with them switched on (the CUDA default) against
transformers. On the CPU they run in the Triton interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import DEVICE, HAS_CUDA
from engine_helpers import LLAMA3_ROPE, hf_greedy, hf_model, hf_prompt_logits, random_prompts, save_tiny
from flashdecode.engine import LLM, SamplingParams
from flashdecode.engine.config import RopeConfig
from flashdecode.engine.layers import fused
from flashdecode.engine.layers.norm import RMSNorm
from flashdecode.engine.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float16, torch.float32]


def _rand(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5, dtype, DEVICE)
    norm.weight.data.copy_(_rand(96, dtype=dtype, gen=gen))
    x, res = _rand(5, 96, dtype=dtype, gen=gen), _rand(5, 96, dtype=dtype, gen=gen, scale=3.0)
    ref_out, ref_res = norm(x, res.clone())
    res_fused = res.clone()
    out, new_res = norm(x, res_fused, use_fused=True)
    assert new_res is res_fused and torch.equal(res_fused, ref_res)  # updated in place, same rounding
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(norm(x, use_fused=True), norm(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_store_matches_torch(dtype):
    gen = torch.Generator().manual_seed(1)
    nheads, nheads_kv, d, tokens, pages, page_size = 6, 2, 32, 7, 5, 4
    rope = RotaryEmbedding(d, RopeConfig(rope_type="llama3", theta=10000.0, factor=8.0,
                                         original_max_position_embeddings=16), 64, 64, DEVICE)
    qkv = _rand(tokens, (nheads + 2 * nheads_kv) * d, dtype=dtype, gen=gen)
    positions = torch.tensor([0, 3, 17, 40, 63, 5, 9], device=DEVICE)
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].to(DEVICE)
    k_cache = _rand(pages, page_size, nheads_kv, d, dtype=dtype, gen=gen)
    v_cache = _rand(pages, page_size, nheads_kv, d, dtype=dtype, gen=gen)
    k_ref_cache, v_ref_cache = k_cache.clone(), v_cache.clone()
    q, k, v = fused.rope_and_store(qkv, positions, rope.cos_table, rope.sin_table, slots, k_cache, v_cache,
                                   nheads, nheads_kv, d)
    q0, k0, v0 = qkv.split([nheads * d, nheads_kv * d, nheads_kv * d], dim=-1)
    q_ref, k_ref = rope(q0.reshape(tokens, nheads, d), k0.reshape(tokens, nheads_kv, d), positions, None)
    # same roundings as the torch ops, so equal in practice; allow one ulp of the dtype
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(q, q_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(k, k_ref, rtol=tol, atol=tol)
    assert torch.equal(v, v0.reshape(tokens, nheads_kv, d))
    k_ref_cache.view(-1, nheads_kv, d)[slots] = k
    v_ref_cache.view(-1, nheads_kv, d)[slots] = v
    assert torch.equal(k_cache, k_ref_cache) and torch.equal(v_cache, v_ref_cache)  # other slots untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    gen = torch.Generator().manual_seed(2)
    gu = _rand(3, 2 * 1100, dtype=dtype, gen=gen, scale=2.0)  # not a multiple of the 1024 block
    gate, up = gu.split(1100, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fused.silu_and_mul(gu), ref, rtol=tol, atol=tol)


def test_fused_model_matches_transformers(tmp_path):
    path = save_tiny(tmp_path / "m", "llama", rope_scaling=LLAMA3_ROPE)
    hf = hf_model(path)
    llm = LLM(path, device=DEVICE, dtype="float32", attn_backend="torch" if not HAS_CUDA else "sdpa",
              max_model_len=64, enforce_eager=True)
    llm.model.use_fused = True
    ids = random_prompts([37], seed=6)[0]
    ref = hf_prompt_logits(hf, ids)
    assert ((llm.prompt_logits(ids) - ref).abs().max() / ref.abs().max()).item() < 1e-4
    prompts = random_prompts((4, 9), seed=7)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
