"""Tiny HF checkpoints for the engine tests (written by transformers' save_pretrained) and HF greedy decoding."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 160
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def tiny_config(kind: str, rope_scaling=None, **overrides):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rope_theta=10000.0,
                  eos_token_id=None, bos_token_id=None)
    common.update(overrides)
    if kind == "llama":
        return LlamaConfig(rope_scaling=rope_scaling, **common)
    if kind == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)
    if kind == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**common)
    raise ValueError(kind)


def save_tiny(path: Path, kind: str, seed: int = 0, shard: str | None = None, **kw) -> Path:
    """Random tiny model saved with save_pretrained (safetensors); biases made non-zero so they are tested."""
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM}[kind]
    model = cls(tiny_config(kind, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # HF inits these to constants; random catches mix-ups
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return path


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


@torch.no_grad()
def hf_prompt_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens with HF's KV cache (its own decode path)."""
    x = torch.tensor([ids])
    out = model(x, use_cache=True)
    cache, new = out.past_key_values, []
    for _ in range(n):
        tok = out.logits[0, -1].argmax().item()
        new.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    return new


def rewrite_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def random_prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
