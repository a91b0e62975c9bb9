"""bfloat16 through the README's API tour, on whatever runs the kernels: small shapes, so that the CPU suite runs it
in Triton's interpreter, whose own bf16 tl.dot multiplies raw bit patterns (kernels/dot.py upcasts there). Each
call is held to the FlashAttention rule against the float64 reference (flashdecode/reference.py); the engine in
bf16 gives the torch reference backend's greedy tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import reference as ref
from flashdecode.ops.attention import resolve_config
from helpers import DEVICE, assert_fa_close, randn
from test_sinks import sink_attention_ref

BF16 = torch.bfloat16


def _leaves(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def test_flash_attn_forward_and_backward_in_bf16(gen):
    q, k, v = randn(2, 37, 4, 32, gen=gen, dtype=BF16), randn(2, 37, 2, 32, gen=gen, dtype=BF16), \
        randn(2, 37, 2, 32, gen=gen, dtype=BF16)
    do = randn(2, 37, 4, 32, gen=gen, dtype=BF16)
    leaves = _leaves(q, k, v)
    out, lse = flashdecode.flash_attn(*leaves, causal=True, return_lse=True)
    out.backward(do)
    ref64, same = _leaves(q.double(), k.double(), v.double()), _leaves(q, k, v)
    o64, lse64 = ref.attention_ref(*ref64, causal=True)
    o_same, lse_same = ref.attention_ref(*same, causal=True)
    o64.backward(do.double())
    o_same.backward(do)
    assert_fa_close(out, o64, o_same, atol=1e-3)
    assert_fa_close(lse, lse64, lse_same, atol=1e-3, name="lse")
    for name, x, x64, x_same in zip(("dq", "dk", "dv"), leaves, ref64, same):
        assert_fa_close(x.grad, x64.grad, x_same.grad, factor=3.0, atol=1e-3, name=name)


def test_flash_attn_varlen_in_bf16(gen):
    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=DEVICE)
    q, k, v = (randn(16, h, 32, gen=gen, dtype=BF16) for h in (4, 2, 2))
    out = flashdecode.flash_attn_varlen(q, k, v, cu, cu, 11, 11, causal=True)
    for a, b in ((0, 5), (5, 16)):
        o64, _ = ref.attention_ref(*(x[a:b].unsqueeze(0).double() for x in (q, k, v)), causal=True)
        o_same, _ = ref.attention_ref(*(x[a:b].unsqueeze(0) for x in (q, k, v)), causal=True)
        assert_fa_close(out[a:b].unsqueeze(0), o64, o_same, atol=1e-3)


def test_paged_decode_plan_append_and_merge_in_bf16(gen):
    k_cache, v_cache = randn(4, 23, 2, 32, gen=gen, dtype=BF16), randn(4, 23, 2, 32, gen=gen, dtype=BF16)
    k_pages, v_pages, table = ref.paged_from_contiguous(k_cache, v_cache, 4, extra_pages=3, generator=gen)
    lens = torch.tensor([21, 3, 0, 9], dtype=torch.int32, device=DEVICE)
    qd = randn(4, 4, 32, gen=gen, dtype=BF16)
    o, lse = flashdecode.flash_decode(qd, k_pages, v_pages, lens, block_table=table, return_lse=True, num_splits=3)
    o64, lse64 = ref.decode_ref(qd.double(), k_cache.double(), v_cache.double(), lens)
    o_same, lse_same = ref.decode_ref(qd, k_cache, v_cache, lens)
    assert_fa_close(o, o64, o_same, factor=3.0, atol=1e-3)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-3, name="lse")
    assert torch.all(o[2] == 0) and torch.all(lse[2] == float("-inf"))
    plan = flashdecode.DecodePlan(max_batch=4, nheads=4, nheads_kv=2, headdim=32, max_seqlen_k=23, dtype=BF16,
                                  device=DEVICE)
    assert_fa_close(plan.run(qd, k_pages, v_pages, lens, block_table=table), o64, o_same, factor=3.0, atol=1e-3)

    # append_kv copies bf16 tokens bit for bit; merging two halves of the keys equals attending to all of them
    k_new, v_new = randn(4, 2, 2, 32, gen=gen, dtype=BF16), randn(4, 2, 2, 32, gen=gen, dtype=BF16)
    flashdecode.append_kv(k_pages, v_pages, k_new, v_new, lens, block_table=table)
    k_back, v_back = ref.contiguous_from_paged(k_pages, v_pages, table, 23)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(k_back[b, n:n + 2], k_new[b]) and torch.equal(v_back[b, n:n + 2], v_new[b])
    half = torch.tensor([10, 1, 0, 4], dtype=torch.int32, device=DEVICE)
    o_a, lse_a = flashdecode.flash_decode(qd, k_cache, v_cache, half, return_lse=True, num_splits=1)
    o_b, lse_b = flashdecode.flash_decode(qd, k_cache[:, 10:], v_cache[:, 10:], lens - torch.tensor(
        [10, 3, 0, 9], dtype=torch.int32, device=DEVICE), return_lse=True, num_splits=1)
    o_ab, _ = flashdecode.flash_decode(qd, k_cache, v_cache, torch.tensor([21, 1, 0, 4], dtype=torch.int32,
                                                                         device=DEVICE), return_lse=True)
    merged, _ = flashdecode.merge_states(o_a, lse_a, o_b, lse_b)
    assert (merged[0].float() - o_ab[0].float()).abs().max() <= 2e-2


def test_sinks_and_config_override_in_bf16(gen):
    q, k, v = randn(1, 19, 4, 32, gen=gen, dtype=BF16), randn(1, 19, 2, 32, gen=gen, dtype=BF16), \
        randn(1, 19, 2, 32, gen=gen, dtype=BF16)
    sinks = torch.randn(4, generator=gen).to(DEVICE)
    leaves = _leaves(q, k, v, sinks)
    out = flashdecode.flash_attn(*leaves[:3], causal=True, sinks=leaves[3])
    out.sum().backward()
    ref64 = _leaves(q.double(), k.double(), v.double(), sinks.double())
    same = _leaves(q, k, v, sinks)
    o64, _ = sink_attention_ref(*ref64, causal=True)
    o_same, _ = sink_attention_ref(*same, causal=True)
    o64.sum().backward()
    o_same.sum().backward()
    assert_fa_close(out, o64, o_same, atol=1e-3)
    assert leaves[3].grad.abs().min() > 0, "sinks.grad is zero"
    assert_fa_close(leaves[3].grad, ref64[3].grad, same[3].grad, factor=3.0, atol=1e-3, name="dsinks")
    config = dataclasses.replace(resolve_config(q, k, v), fwd_autotune=False)
    assert_fa_close(flashdecode.flash_attn(q, k, v, causal=True, config=config), *ref.attention_ref(
        q.double(), k.double(), v.double(), causal=True)[:1], ref.attention_ref(q, k, v, causal=True)[0], atol=1e-3)


def test_engine_in_bf16_gives_the_torch_backends_greedy_tokens(tmp_path):
    """LLM(attn_backend="flashdecode", dtype="bfloat16") (prefill, paged decode) and the torch reference backend in
    the same dtype draw the same greedy tokens."""
    pytest.importorskip("transformers")
    from engine_helpers import random_prompts, save_tiny
    from flashdecode.engine import LLM, SamplingParams

    path = save_tiny(tmp_path / "llama", "llama")
    prompts = random_prompts([7, 3])
    params = SamplingParams(max_tokens=4, temperature=0.0)
    tokens = {}
    for backend in ("flashdecode", "torch"):
        llm = LLM(str(path), device=DEVICE.type, dtype="bfloat16", attn_backend=backend, max_model_len=64)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["flashdecode"] == tokens["torch"]
