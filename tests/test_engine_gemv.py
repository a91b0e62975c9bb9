"""The engine's one-token Triton GEMV (flashdecode.engine.layers.gemv) and its fused prologues against the PyTorch
ops they replace, and the batch-1 decode path built on it against transformers. On the CPU the kernel runs in the
Triton interpreter (fp16/fp32, small shapes); the GPU adds bf16 at the Llama-3-8B shapes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, HAS_CUDA
from engine_helpers import LLAMA3_ROPE, hf_greedy, hf_model, hf_prompt_logits, random_prompts, save_tiny
from flashdecode.engine import LLM, SamplingParams
from flashdecode.engine.layers import gemv
from flashdecode.engine.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float16, torch.float32]


def _rand(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _assert_linear_close(got, x_ref, w, bias=None):
    """got (1, N) vs the float64 product: error within 2x F.linear's own error (same inputs, same dtype) + 1 ulp."""
    ref = x_ref.double() @ w.double().T + (0 if bias is None else bias.double())
    theirs = F.linear(x_ref, w, bias)
    ulp = ref.abs().max().item() * (2.0 ** -7 if w.dtype == torch.bfloat16 else 2.0 ** -10)
    if w.dtype == torch.float32:
        ulp = ref.abs().max().item() * 1e-6
    err, base = (got.double() - ref).abs().max().item(), (theirs.double() - ref).abs().max().item()
    assert err <= 2 * base + ulp, f"gemv error {err:.3e} vs F.linear {base:.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,config", [(40, 96, (16, 32, 4)), (37, 80, (8, 64, 4)), (64, 128, (16, 64, 4))])
def test_gemv_plain_and_bias(dtype, n, k, config):
    gen = torch.Generator().manual_seed(n + k)
    x, w, b = _rand(1, k, dtype=dtype, gen=gen), _rand(n, k, dtype=dtype, gen=gen), _rand(n, dtype=dtype, gen=gen)
    _assert_linear_close(gemv.gemv(x, w, config=config), x, w)
    _assert_linear_close(gemv.gemv(x, w, b, config=config), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_prologues_match_the_ops_they_replace(dtype):
    gen = torch.Generator().manual_seed(3)
    n, k, cfg = 24, 80, (8, 32, 4)  # K not a multiple of BLOCK_K: the masked path
    w = _rand(n, k, dtype=dtype, gen=gen)
    gate_up = _rand(1, 2 * k, dtype=dtype, gen=gen, scale=2.0)
    act = F.silu(gate_up[:, :k]) * gate_up[:, k:]
    _assert_linear_close(gemv.gemv(gate_up, w, prologue=gemv.SILU_MUL, config=cfg), act, w)

    norm = RMSNorm(k, 1e-5, dtype, DEVICE)
    norm.weight.data.copy_(_rand(k, dtype=dtype, gen=gen))
    x, res = _rand(1, k, dtype=dtype, gen=gen), _rand(1, k, dtype=dtype, gen=gen, scale=3.0)
    _assert_linear_close(gemv.gemv(x, w, prologue=gemv.RMSNORM, norm_weight=norm.weight, eps=1e-5, config=cfg),
                         norm(x), w)
    h, s = norm(x, res)
    res_before = res.clone()
    y, s_out = gemv.gemv(x, w, prologue=gemv.ADD_NORM, residual=res, norm_weight=norm.weight, eps=1e-5, config=cfg)
    assert torch.equal(s_out, s) and torch.equal(res, res_before)  # new residual, input untouched
    _assert_linear_close(y, h, w)


def test_gemv_rejects_bad_inputs():
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="x must be"):
        gemv.gemv(torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv.gemv(torch.zeros(1, 16, device=DEVICE), w, prologue=gemv.RMSNORM)
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv(torch.zeros(1, 16, device=DEVICE), w, prologue=gemv.ADD_NORM, norm_weight=torch.ones(16))


def test_one_token_path_matches_transformers(tmp_path):
    """Batch-1 decode steps (and 1-token prompts) go through the GEMV path: same greedy tokens as transformers,
    logits to fp32 rounding."""
    path = save_tiny(tmp_path / "m", "llama", rope_scaling=LLAMA3_ROPE)
    hf = hf_model(path)
    llm = LLM(path, device=DEVICE, dtype="float32", attn_backend="torch" if not HAS_CUDA else "sdpa",
              max_model_len=64, max_num_seqs=1, enforce_eager=True)
    llm.model.use_fused = llm.model.use_gemv = True
    ids = random_prompts([1], seed=6)[0]
    ref = hf_prompt_logits(hf, ids)
    assert ((llm.prompt_logits(ids) - ref).abs().max() / ref.abs().max()).item() < 1e-5
    for prompt in random_prompts((5, 1), seed=8):  # max_num_seqs=1: every decode step has one token
        out = llm.generate([prompt], SamplingParams(max_new_tokens=6))[0]
        assert out.token_ids == hf_greedy(hf, prompt, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                                      ("down", 4096, 14336), ("lm_head", 128256, 4096)])
def test_gemv_llama8b_shapes_bf16(name, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randn(n, k, device="cuda", generator=gen).mul_(0.02).bfloat16()
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    for cfg in (None, (8, 512, 4), (32, 512, 8), (16, 1024, 8)):
        _assert_linear_close(gemv.gemv(x, w, config=cfg), x, w)
