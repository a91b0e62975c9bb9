"""flashdecode.integrations.transformers: tiny Llama and Qwen2 models (random weights, built here) run with
attn_implementation=register() against transformers' SDPA backend.

Logits of left- and right-padded batches follow the FlashAttention rule against the same model in float64 (error
<= 2x SDPA's in the same dtype, at the non-padded positions); greedy ``generate`` gives SDPA's tokens with
DynamicCache and StaticCache (left-padded batches, so generation runs flash_decode through the padded block table).
CPU (Triton interpreter) in float32; the GPU-marked test times the Llama-3-8B shape (2 layers) against SDPA.
"""

from __future__ import annotations

import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashdecode.integrations import transformers as fd_transformers  # noqa: E402
from helpers import DEVICE, max_err  # noqa: E402


def _config(family: str, **overrides):
    small = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=None,
                 bos_token_id=None, tie_word_embeddings=False)
    small.update(overrides)
    if family == "llama":
        return transformers.LlamaConfig(head_dim=16, **small)
    return transformers.Qwen2Config(**small)


@pytest.fixture(scope="module")
def name():
    return fd_transformers.register()


def _model(config, attn, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.to(device=DEVICE, dtype=dtype).eval()


def _padded_batch(gen, lengths, total, left: bool, vocab: int):
    ids = torch.randint(1, vocab, (len(lengths), total), generator=gen)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for i, n in enumerate(lengths):
        span = slice(total - n, total) if left else slice(0, n)
        mask[i, span] = 1
    return ids.masked_fill(mask == 0, 0).to(DEVICE), mask.to(DEVICE)


def test_register_returns_a_name_without_flash(name):
    assert "flash" not in name
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert AttentionInterface()[name] is fd_transformers.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is fd_transformers.padding_mask
    with pytest.raises(ValueError, match="flash"):
        fd_transformers.register("my_flash_backend")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("left", [True, False])
def test_padded_logits_follow_the_fa_rule_vs_sdpa(gen, name, family, left, tmp_path):
    config = _config(family)
    _model(config, "sdpa").save_pretrained(tmp_path)
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name).to(DEVICE).eval()
    sdpa = _model(config, "sdpa")
    ref64 = _model(config, "sdpa", torch.float64)
    ids, mask = _padded_batch(gen, [13, 6, 1], 13, left, config.vocab_size)
    with torch.no_grad():
        logits = ours(input_ids=ids, attention_mask=mask).logits
        logits_sdpa = sdpa(input_ids=ids, attention_mask=mask).logits
        logits64 = ref64(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert not torch.isnan(logits).any()
    err, base = max_err(logits[valid], logits64[valid]), max_err(logits_sdpa[valid], logits64[valid])
    assert err <= 2 * base + 1e-5, f"logits error {err:.3e} > 2 x SDPA's {base:.3e}"


@pytest.mark.parametrize("family, cache", [("llama", "dynamic"), ("qwen2", "dynamic"), ("llama", "static")])
def test_greedy_generate_matches_sdpa(gen, name, family, cache, monkeypatch):
    config = _config(family)
    ids, mask = _padded_batch(gen, [9, 4, 7], 9, True, config.vocab_size)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    tokens = {}
    calls = []
    for fn in ("flash_decode", "flash_attn_varlen"):  # count our kernels' calls: the backend must really run
        original = getattr(fd_transformers, fn)
        monkeypatch.setattr(fd_transformers, fn, lambda *a, _f=original, _n=fn, **k: calls.append(
            (_n, k.get("block_table") is not None)) or _f(*a, **k))
    for attn in ("sdpa", name):
        model = _model(config, attn)
        with torch.no_grad():
            tokens[attn] = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert tokens[name].shape == (3, 9 + 6)
    assert torch.equal(tokens[name], tokens["sdpa"])
    layers = config.num_hidden_layers
    assert calls.count(("flash_attn_varlen", False)) == layers  # the padded prefill, unpadded
    assert calls.count(("flash_decode", True)) == layers * (kw["max_new_tokens"] - 1)  # padded decode steps


def test_decode_step_logits_match_with_dynamic_cache(gen, name):
    """One generation step after a left-padded prefill: the decode path (block table over the padded cache)
    gives SDPA's next-token logits within the FlashAttention rule."""
    config = _config("llama")
    ids, mask = _padded_batch(gen, [8, 3], 8, True, config.vocab_size)
    nxt = torch.randint(1, config.vocab_size, (2, 1), generator=gen).to(DEVICE)
    mask2 = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    logits = {}
    for attn, dtype in (("ours", torch.float32), ("sdpa", torch.float32), ("ref", torch.float64)):
        model = _model(config, name if attn == "ours" else "sdpa", dtype)
        with torch.no_grad():
            past = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
            logits[attn] = model(input_ids=nxt, attention_mask=mask2, cache=past).logits[:, -1]
    err, base = max_err(logits["ours"], logits["ref"]), max_err(logits["sdpa"], logits["ref"])
    assert err <= 3 * base + 1e-5, f"decode logits error {err:.3e} > 3 x SDPA's {base:.3e}"


def test_unsupported_inputs_raise(name):
    module = torch.nn.Module()
    q = torch.zeros(1, 2, 3, 16)
    with pytest.raises(ValueError, match="dropout"):
        fd_transformers.attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="attention_mask"):
        fd_transformers.attention_forward(module, q, q, q, torch.zeros(1, 1, 3, 3))


@pytest.mark.gpu
def test_llama3_8b_shape_tokens_per_second_vs_sdpa(name):
    """Llama-3-8B's attention shape (32 q / 8 kv heads, head dim 128, hidden 4096), 2 layers, random weights, bf16:
    greedy tokens equal SDPA's for the first steps (bf16 ties may diverge later) and decode tokens/s is reported
    for both backends."""
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=8192, rope_theta=500000.0, pad_token_id=0,
                                      eos_token_id=None, bos_token_id=None)
    gen = torch.Generator().manual_seed(0)
    ids, mask = _padded_batch(gen, [512, 300, 512, 100], 512, True, config.vocab_size)
    new = 64
    results = {}
    for attn in ("sdpa", name):
        model = _model(config, attn, torch.bfloat16)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
        results[attn] = (out, ids.shape[0] * new / (time.perf_counter() - start))
        del model
        torch.cuda.empty_cache()
    print(f"\nLlama-3-8B shape, 2 layers, bf16, batch 4 (left-padded to 512), {new} new tokens: "
          f"sdpa {results['sdpa'][1]:.1f} tok/s, {name} {results[name][1]:.1f} tok/s")
    assert torch.equal(results[name][0][:, : 512 + 4], results["sdpa"][0][:, : 512 + 4])
    assert results[name][1] > 0


def test_core_imports_neither_the_integration_nor_transformers():
    import subprocess
    import sys

    code = ("import sys, flashdecode, flashdecode.flash_attn_interface; "
            "print(any(m.startswith('flashdecode.integrations') or m == 'transformers' for m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
