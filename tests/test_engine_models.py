"""Qwen3 and Gemma 3 (text) in the engine against transformers on tiny random checkpoints (save_pretrained), models
by hub id from a local HF cache, and the one-line refusals of unsupported / quantized checkpoints.

The Qwen3 checkpoint has head_dim 32 != hidden / heads and tied embeddings; the Gemma 3 one 5 layers (sliding,
sliding, global, sliding, sliding) with a window of 8, query_pre_attn_scalar 24 (a softmax scale unlike
head_dim's), linear rope scaling on the global layers, its own local rope base and final logit softcapping. Prompts
of 21 tokens are longer than the window. The Triton path ("flashdecode" backend, the fused kernels) runs in the
interpreter on the CPU, in fp32 and fp16 (the interpreter's bf16 dots are wrong)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import HAS_CUDA
from engine_helpers import (hf_greedy, hf_model, hf_prompt_logits, random_prompts, rewrite_config, save_tiny,
                            tiny_config)
from flashdecode.engine import LLM, SamplingParams, load_config
from flashdecode.engine.config import config_from_dict
from flashdecode.engine.layers import fused
from flashdecode.engine.models.qwen3 import QKNormAttention

KINDS = ("qwen3", "gemma3")
PROMPTS = (21, 5, 13)  # the first and the last longer than Gemma's window
NEW_TOKENS = 10
TRITON_RUNS = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="Triton kernels need a GPU or TRITON_INTERPRET=1")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {}
    for kind in KINDS:
        path = save_tiny(root / kind, kind)
        hf = hf_model(path)
        prompts = random_prompts(PROMPTS, seed=3)
        out[kind] = dict(path=path, hf=hf, prompts=prompts, greedy=[hf_greedy(hf, p, NEW_TOKENS) for p in prompts],
                         logits=hf_prompt_logits(hf, prompts[0]))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_config_reads_the_architecture(ckpts, kind):
    cfg = load_config(ckpts[kind]["path"])
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.tie_word_embeddings
    if kind == "gemma3":
        assert cfg.layer_types == ("sliding_attention",) * 2 + ("full_attention",) + ("sliding_attention",) * 2
        assert [cfg.layer_window_left(i) for i in range(5)] == [7, 7, -1, 7, 7]
        assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.final_logit_softcapping) == (8, 24.0, 5.0)
        assert (cfg.rope.rope_type, cfg.rope.factor, cfg.local_rope.theta) == ("linear", 2.0, 100.0)


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logits_and_greedy_batch_match_transformers(ckpts, kind):
    c = ckpts[kind]
    llm = LLM(c["path"], device="cpu", dtype="float32", attn_backend="torch", max_model_len=64, max_num_seqs=2,
              use_tqdm=False)
    assert rel_err(llm.prompt_logits(c["prompts"][0]), c["logits"]) < 1e-5
    outs = llm.generate(c["prompts"], SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)  # one joins late
    assert [o.token_ids for o in outs] == c["greedy"]


def test_backend_window_twins_are_made_once_and_share_the_decode_plans():
    from flashdecode.engine.backends import make_backend

    base = make_backend("torch", "cpu")
    twin = base.with_window(7)
    assert twin.window_size == (7, 0) and base.window_size == (-1, 0)
    assert base.with_window(7) is twin and twin.with_window(-1) is base and base.with_window(-1) is base
    if TRITON_RUNS:
        fd = make_backend("flashdecode", "cuda" if HAS_CUDA else "cpu")
        assert fd.with_window(3).plans is fd.plans


def test_gemma3_sliding_window_changes_the_answer(ckpts, tmp_path):
    """The 21-token prompt reaches past the window: a copy whose window covers it gives other logits (so the
    match above depends on the window being applied), and those too equal transformers'."""
    c = ckpts["gemma3"]
    wide = tmp_path / "wide"
    shutil.copytree(c["path"], wide)
    rewrite_config(wide, sliding_window=64)
    ids = c["prompts"][0]
    ours = LLM(wide, device="cpu", dtype="float32", max_model_len=64, use_tqdm=False).prompt_logits(ids)
    assert rel_err(ours, hf_prompt_logits(hf_model(wide), ids)) < 1e-5
    assert rel_err(ours, c["logits"]) > 1e-3


def test_gemma3_image_text_checkpoint_serves_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration (model_type gemma3, the published 4B/12B/27B form): its text_config and the
    language_model.* tensors load; the vision tower is skipped; text prompts give transformers' logits. (Without
    final_logit_softcapping, null in the published configs: transformers' image+text class does not apply it.)"""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=tiny_config("gemma3", final_logit_softcapping=None).to_dict(),
                          vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, boi_token_index=157, eoi_token_index=158, image_token_index=159)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "mm")
    assert load_config(tmp_path / "mm").model_type == "gemma3_text"
    ids = random_prompts([13], seed=5)[0]
    llm = LLM(tmp_path / "mm", device="cpu", dtype="float32", max_model_len=32, use_tqdm=False)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].float()
    assert rel_err(llm.prompt_logits(ids), ref) < 1e-5


def test_gemma3_transformers_4x_config_spelling(ckpts, tmp_path):
    """Hub configs of Gemma 3 spell the rotary as rope_theta + rope_scaling + rope_local_base_freq and the layer
    pattern as sliding_window_pattern, and leave out what equals the class default."""
    c = ckpts["gemma3"]
    old = tmp_path / "old"
    shutil.copytree(c["path"], old)
    raw = json.loads((old / "config.json").read_text())
    full, local = raw["rope_parameters"]["full_attention"], raw["rope_parameters"]["sliding_attention"]
    rewrite_config(old, rope_parameters=None, layer_types=None, rms_norm_eps=None, sliding_window_pattern=3,
                   rope_theta=full["rope_theta"], rope_local_base_freq=local["rope_theta"],
                   rope_scaling={"rope_type": "linear", "factor": full["factor"]})
    assert load_config(old) == load_config(c["path"])


@needs_triton
@pytest.mark.parametrize("kind, dtype", [("gemma3", torch.float32), ("gemma3", torch.float16),
                                         ("qwen3", torch.float16)])
def test_flashdecode_backend_matches_transformers(ckpts, kind, dtype):
    """Prefill (flash_attn_varlen / dense) and paged decode (flash_decode) with a window on Gemma's sliding layers;
    fp16 logits against transformers' fp32 within fp16 rounding, greedy tokens equal."""
    c = ckpts[kind]
    device = "cuda" if HAS_CUDA else "cpu"
    llm = LLM(c["path"], device=device, dtype=dtype, attn_backend="flashdecode", max_model_len=48, max_num_seqs=4,
              page_size=4, enforce_eager=True, use_tqdm=False)
    assert rel_err(llm.prompt_logits(c["prompts"][0]), c["logits"]) < (1e-5 if dtype == torch.float32 else 5e-3)
    outs = llm.generate(c["prompts"][1:], SamplingParams(max_new_tokens=6), use_tqdm=False)
    assert [o.token_ids for o in outs] == [g[:6] for g in c["greedy"][1:]]


@needs_triton
def test_fused_kernels_match_transformers(ckpts):
    """The CUDA default path on Gemma 3: fused norms in Gemma's (1 + w) float32 form, the one-launch q/k norm
    with the softmax scale, rope + store, and one-token decode steps through the GEMVs (Qwen3's q/k norm form:
    the kernel test below)."""
    c = ckpts["gemma3"]
    device = "cuda" if HAS_CUDA else "cpu"
    llm = LLM(c["path"], device=device, dtype="float32", attn_backend="torch" if not HAS_CUDA else "sdpa",
              max_model_len=48, enforce_eager=True, use_tqdm=False)
    llm.model.use_fused = llm.model.use_gemv = True
    assert rel_err(llm.prompt_logits(c["prompts"][0]), c["logits"]) < 1e-5
    out = llm.generate(c["prompts"][1:2], SamplingParams(max_new_tokens=4), use_tqdm=False)[0]
    assert out.token_ids == c["greedy"][1][:4]


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_rms_norm_kernel_matches_the_torch_path(ckpts, kind, dtype):
    llm = LLM(ckpts[kind]["path"], device="cpu", dtype=dtype, max_model_len=16, use_tqdm=False)
    attn = llm.model.model.layers[0].self_attn
    assert isinstance(attn, QKNormAttention)
    if kind == "gemma3":
        assert attn.q_scale != 1.0  # query_pre_attn_scalar 24 vs head_dim 32
    qkv = (torch.randn(7, sum(attn.splits), generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(attn.norm_qk(qkv, use_fused=True), attn.norm_qk(qkv, use_fused=False), rtol=tol,
                               atol=tol)
    assert fused.qk_rms_norm(qkv[:0], attn.q_norm.weight, attn.k_norm.weight, attn.nheads, attn.nheads_kv, 32,
                             1e-6).shape == (0, qkv.shape[1])


# --------------------------------------------------------------------------------------------- models by hub id
def _fake_hub_cache(cache, repo: str, checkpoint) -> None:
    """``checkpoint``'s files laid out as huggingface_hub's cache holds a downloaded repo: refs/main -> a commit,
    snapshots/<commit>/<files>."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    shutil.copytree(checkpoint, repo_dir / "snapshots" / commit)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no network in any case
    monkeypatch.chdir(tmp_path)  # "Qwen/Qwen3-8B" is no local directory here
    return cache


def test_model_by_hub_id_from_the_local_cache(ckpts, offline_cache):
    c = ckpts["qwen3"]
    _fake_hub_cache(offline_cache, "Qwen/Qwen3-8B", c["path"])
    llm = LLM("Qwen/Qwen3-8B", device="cpu", dtype="float32", max_model_len=48, use_tqdm=False)
    assert str(llm.model_dir).startswith(str(offline_cache))
    assert rel_err(llm.prompt_logits(c["prompts"][0]), c["logits"]) < 1e-5


def test_model_by_hub_id_absent_offline_is_one_clear_line(offline_cache):
    absent = r"'google/gemma-3-12b-it': neither a local directory nor in the local HF cache.*absent"
    with pytest.raises(ValueError, match=absent) as err:
        LLM("google/gemma-3-12b-it", device="cpu")
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------- refusals
def _config(kind: str, **changes) -> dict:
    raw = tiny_config(kind).to_dict()
    raw.update(changes)
    return raw


@pytest.mark.parametrize("raw, match", [
    (dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]), r"unsupported model_type 'gpt_neox'.*qwen3"),
    (dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]), r"'gemma3' needs a 'text_config'"),
    (_config("qwen3", use_sliding_window=True), r"use_sliding_window=true; supported"),
    (_config("gemma3", attn_logit_softcapping=50.0), r"attn_logit_softcapping=50.0; supported: null"),
    (_config("gemma3", hidden_activation="silu"), r"hidden_act 'silu' for gemma3_text; supported: 'gelu_pytorch"),
    (_config("llama", quantization_config={"quant_method": "awq", "bits": 4}),
     r"quantization_config, quant_method 'awq'.*supported: unquantized"),
])
def test_unsupported_configs_get_one_line_naming_what_is_supported(raw, match):
    with pytest.raises(ValueError, match=match) as err:
        config_from_dict(raw)
    assert "\n" not in str(err.value)


def test_awq_tensors_are_refused_by_name(ckpts, tmp_path):
    """An AWQ-style checkpoint whose config.json lacks its quantization_config: its packed tensors are named."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "awq"
    shutil.copytree(ckpts["qwen3"]["path"], path)
    weights = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj"
    weights.pop(f"{name}.weight")
    weights[f"{name}.qweight"] = torch.zeros(64, 16, dtype=torch.int32)
    weights[f"{name}.scales"] = torch.ones(1, 128, dtype=torch.float16)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name}\.(qweight|scales).*quantized.*supported: unquantized") as err:
        LLM(path, device="cpu", use_tqdm=False)
    assert "\n" not in str(err.value)
