"""Qwen2 / Qwen2.5: the Llama block with a bias on the q/k/v projections (not on o_proj) and, on the small
models, tied input/output embeddings. Both come from the config (ModelConfig.qkv_bias, tie_word_embeddings), so the
module is Llama's; this class exists to name the architecture and its defaults in one place."""

from __future__ import annotations

from flashdecode.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, dtype, device, max_positions: int, parallel=None):
        if not cfg.qkv_bias or cfg.o_bias:
            raise ValueError("qwen2 needs qkv bias and no o_proj bias (config.qkv_bias=True, o_bias=False)")
        super().__init__(cfg, dtype, device, max_positions, parallel)
