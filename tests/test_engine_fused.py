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


def _rope_case(gen, dtype, nheads, nheads_kv, d, tokens):
    rope = RotaryEmbedding(d, RopeConfig(rope_type="llama3", theta=10000.0, factor=8.0,
                                         original_max_position_embeddings=16), 64, 64, DEVICE)
    qkv = _rand(tokens, (nheads + 2 * nheads_kv) * d, dtype=dtype, gen=gen, scale=3.0)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    return rope, qkv, positions


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_store_into_8bit_pages_gives_append_kvs_codes_and_scales(dtype, cache_dtype):
    """8-bit pages (QUANT_ROPE_STORE): the fused kernel's codes and per-token-head scales equal the unfused path's
    (rotary, then write_quantized = append_kv's quantising write) bit for bit, for kv heads padded to a power of two
    (3 -> 4), an all-zero token-head (scale 0, codes 0) and a V row holding a NaN (its scale NaN, no other token's
    data or scale touched); slots not written keep their bytes; q / k / v out as with float pages."""
    from flashdecode.engine.kv_quant import QuantPages, write_quantized

    gen = torch.Generator().manual_seed(11)
    nheads, nheads_kv, d, tokens, pages, page_size = 6, 3, 32, 6, 4, 4
    rope, qkv, positions = _rope_case(gen, dtype, nheads, nheads_kv, d, tokens)
    kv_cols = slice(nheads * d, (nheads + 2 * nheads_kv) * d)
    qkv[1, nheads * d + d:nheads * d + 2 * d] = 0  # token 1, k head 1: all zero (rope keeps it zero)
    qkv[1, (nheads + nheads_kv) * d + d:(nheads + nheads_kv) * d + 2 * d] = 0  # ... and its v head 1
    qkv[4, (nheads + nheads_kv + 2) * d + 5] = float("nan")  # token 4, v head 2: one NaN
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].to(DEVICE)
    codes = torch.randint(-100, 100, (2, pages, page_size, nheads_kv, d), generator=gen).to(torch.int8)
    fill = (codes.view(cache_dtype) if cache_dtype != torch.int8 else codes).to(DEVICE)
    scales = torch.rand(2, pages, page_size, nheads_kv, generator=gen).to(DEVICE)
    got = [QuantPages(fill[i].clone(), scales[i].clone()) for i in range(2)]
    want = [QuantPages(fill[i].clone(), scales[i].clone()) for i in range(2)]
    q, k, v = fused.rope_and_store(qkv, positions, rope.cos_table, rope.sin_table, slots, got[0].data, got[1].data,
                                   nheads, nheads_kv, d, k_scale=got[0].scale, v_scale=got[1].scale)
    q0, k0, v0 = qkv.split([nheads * d, nheads_kv * d, nheads_kv * d], dim=-1)
    q_ref, k_ref = rope(q0.reshape(tokens, nheads, d), k0.reshape(tokens, nheads_kv, d), positions, None)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(q, q_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(k, k_ref, rtol=tol, atol=tol)
    assert torch.equal(v.nan_to_num(), v0.reshape(tokens, nheads_kv, d).nan_to_num())
    write_quantized(want[0], want[1], k, v, slots)  # the unfused path's write of the same rotated k / v
    for g, w in zip(got, want):
        assert torch.equal(g.data.view(torch.int8), w.data.view(torch.int8))
        assert torch.equal(g.scale.nan_to_num(nan=-1.0), w.scale.nan_to_num(nan=-1.0))
    flat = [x.scale.view(-1, nheads_kv) for x in got]
    assert flat[0][slots[1], 1] == 0 and flat[1][slots[1], 1] == 0
    assert not (got[0].data.view(torch.int8).view(-1, nheads_kv, d)[slots[1], 1] != 0).any()
    assert torch.isnan(flat[1][slots[4], 2]) and int(torch.isnan(torch.stack(flat)).sum()) == 1
    untouched = torch.ones(pages * page_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    for g, i in zip(got, range(2)):
        assert torch.equal(g.data.view(torch.int8).view(-1, nheads_kv, d)[untouched],
                           fill[i].view(torch.int8).view(-1, nheads_kv, d)[untouched])
        assert torch.equal(g.scale.view(-1, nheads_kv)[untouched], scales[i].view(-1, nheads_kv)[untouched])


def test_rope_and_store_rejects_missing_or_misshapen_scales():
    gen = torch.Generator().manual_seed(12)
    rope, qkv, positions = _rope_case(gen, DTYPES[0], 4, 2, 16, 3)
    slots = torch.arange(3, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE).to(torch.float8_e4m3fn)
    scale = torch.zeros(2, 4, 2, device=DEVICE)
    args = (qkv, positions, rope.cos_table, rope.sin_table, slots, cache, cache.clone(), 4, 2, 16)
    with pytest.raises(ValueError, match="k_scale"):
        fused.rope_and_store(*args)
    with pytest.raises(ValueError, match="v_scale"):
        fused.rope_and_store(*args, k_scale=scale, v_scale=scale[..., :1])
    with pytest.raises(ValueError, match="k_scale"):
        fused.rope_and_store(*args, k_scale=scale.double(), v_scale=scale)
    floats = torch.zeros(2, 4, 2, 16, device=DEVICE, dtype=DTYPES[0])
    with pytest.raises(ValueError, match="8-bit"):
        fused.rope_and_store(qkv, positions, rope.cos_table, rope.sin_table, slots, floats, floats.clone(), 4, 2,
                             16, k_scale=scale, v_scale=scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"] if HAS_CUDA else ["float32"])
def test_engine_on_8bit_pages_gives_the_same_logits_with_the_quantising_rope_store(tmp_path, monkeypatch, dtype):
    """A tiny Llama on fp8 pages with the fused kernels on: every step's logits and the greedy tokens are bitwise
    the same whether the pages are written by rope_and_store (QUANT_ROPE_STORE) or by rotary + append_kv."""
    path = save_tiny(tmp_path / "m", "llama", rope_scaling=LLAMA3_ROPE)
    prompts = random_prompts((5, 11), seed=8)

    def run(quant_store: bool):
        monkeypatch.setattr(fused, "QUANT_ROPE_STORE", quant_store)
        llm = LLM(path, device=DEVICE, dtype=dtype, attn_backend="flashdecode", max_model_len=64, page_size=4,
                  kv_cache_dtype="fp8", enforce_eager=True, use_tqdm=False)
        llm.model.use_fused = True
        calls, rope_store = [], fused.rope_and_store

        def counting(*args, **kw):
            calls.append("k_scale" in kw)
            return rope_store(*args, **kw)
        monkeypatch.setattr(fused, "rope_and_store", counting)
        logits = []
        decode = llm.runner.decode

        def recording(*args, **kw):
            out, tokens = decode(*args, **kw)
            logits.append(out.clone())
            return out, tokens
        llm.runner.decode = recording
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=4))
        monkeypatch.setattr(fused, "rope_and_store", rope_store)
        return [o.token_ids for o in outs], logits, calls

    tokens_off, logits_off, calls_off = run(False)
    tokens_on, logits_on, calls_on = run(True)
    assert not calls_off and calls_on and all(calls_on)  # the switch decides which path writes the pages
    assert tokens_on == tokens_off and len(logits_on) == len(logits_off) >= 3
    for a, b in zip(logits_off, logits_on):
        assert torch.equal(a, b)


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
