"""Tiny HF checkpoints for the engine tests (written by transformers' save_pretrained) and HF greedy decoding."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flashdecode.bench.hf_peer import hf_cache_kwarg

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
    if kind == "qwen3":  # head_dim unlike hidden / heads, tied embeddings
        from transformers import Qwen3Config

        return Qwen3Config(**{"head_dim": 32, "tie_word_embeddings": True, **common})
    if kind == "gemma3":  # 5 layers: sliding, sliding, global, sliding, sliding; window 8; every knob off default
        from transformers import Gemma3TextConfig

        gemma = dict(num_hidden_layers=5, head_dim=32, sliding_window=8, sliding_window_pattern=3,
                     query_pre_attn_scalar=24, rope_local_base_freq=100.0, final_logit_softcapping=5.0,
                     rope_scaling={"rope_type": "linear", "factor": 2.0}, pad_token_id=None)
        gemma.update(overrides)
        return Gemma3TextConfig(**{**common, **gemma})
    raise ValueError(kind)


def save_tiny(path: Path, kind: str, seed: int = 0, shard: str | None = None, **kw) -> Path:
    """Random tiny model saved with save_pretrained (safetensors); biases made non-zero so they are tested."""
    from transformers import (Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                              Qwen3ForCausalLM)

    torch.manual_seed(seed)
    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM,
           "qwen3": Qwen3ForCausalLM, "gemma3": Gemma3ForCausalLM}[kind]
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
        out = model(torch.tensor([[tok]]), use_cache=True, **{hf_cache_kwarg(model): cache})
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


# A word-level tokenizer over the tiny vocabulary: token i is the word "w<i>", except four special tokens.
SPECIAL_TOKENS = {"<|system|>": 150, "<|user|>": 151, "<|assistant|>": 152, "</s>": 153}
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def word(i: int) -> str:
    return f"w{i}"


def add_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE, eos: bool = False) -> Path:
    """Write tokenizer.json (+ tokenizer_config.json with the chat template) into a tiny checkpoint directory.
    Words "w0".."w159" are single tokens (ids 150..153 are the special tokens instead), split on whitespace;
    decode joins tokens with spaces. ``eos``: "</s>" is the tokenizer's EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word(i): i for i in range(VOCAB) if i not in SPECIAL_TOKENS.values()}
    vocab.update(SPECIAL_TOKENS)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eos:
        config["eos_token"] = "</s>"
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def words(ids) -> str:
    return " ".join(word(i) for i in ids if i not in SPECIAL_TOKENS.values())


def start_serve(argv: list[str], timeout_s: float = 90):
    """`python -m flashdecode serve ARGV --port P` as a user starts it, in its own process group (so that a test can
    end every process it spawned with os.killpg), on a free loopback port; returns (process, base url) once /health
    answers 200. AssertionError with the server's output if it exits or does not come up within ``timeout_s``."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "flashdecode", "--log-level", "WARNING", "serve", *argv, "--port",
                             str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, 9)
            raise AssertionError(f"the server did not come up in {timeout_s} s")
        time.sleep(0.2)
