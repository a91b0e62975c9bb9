"""Gemma 3 for the engine: HF Gemma3ForCausalLM (model_type gemma3_text), and the language model of the image+text
Gemma3ForConditionalGeneration checkpoints (model_type gemma3; text prompts only, the vision tower is not loaded).

What differs from Llama (each as transformers computes it):
- layers interleave sliding-window and global attention (ModelConfig.layer_types); a sliding layer attends its
  ``sliding_window`` newest keys (itself included) in prefill and decode, through the engine backend's windowed
  twin (AttentionBackend.with_window), and takes its own rotary (ModelConfig.local_rope: rope_local_base_freq,
  unscaled) while global layers take rope_theta + rope_scaling;
- q and k are RMS-normalised per head before the rotary; every norm is Gemma's (float32, times 1 + weight:
  GemmaRMSNorm); each block also normalises the attention and MLP outputs (post_attention_layernorm,
  post_feedforward_layernorm) and the MLP input (pre_feedforward_layernorm);
- the softmax scale is query_pre_attn_scalar ** -0.5: the backends scale by head_dim ** -0.5, so q is multiplied
  by sqrt(head_dim / query_pre_attn_scalar) inside its norm (1 for the published 1B/4B/12B shapes);
- embeddings are multiplied by sqrt(hidden_size) (rounded to the weight dtype, as HF does), the MLP is
  gelu_pytorch_tanh(gate) * up, and final_logit_softcapping (when set) caps the logits: cap * tanh(logits / cap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashdecode.engine.config import ModelConfig
from flashdecode.engine.layers import gemv
from flashdecode.engine.layers.norm import GemmaRMSNorm
from flashdecode.engine.layers.rotary import RotaryEmbedding
from flashdecode.engine.models.llama import MLP, LlamaForCausalLM
from flashdecode.engine.models.qwen3 import QKNormAttention


class Gemma3Attention(QKNormAttention):
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, dtype, device, parallel):
        super().__init__(cfg, dtype, device, parallel, q_scale=(cfg.head_dim / cfg.query_pre_attn_scalar) ** 0.5)


class Gemma3MLP(MLP):
    def forward(self, x, use_fused: bool = False):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device, parallel):
        super().__init__()
        def norm():
            return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma3Attention(cfg, dtype, device, parallel)
        self.mlp = Gemma3MLP(cfg, dtype, device, parallel)

    def forward(self, x, residual, positions, rotary, meta, kv_cache, backend, use_fused: bool,
                last_rows: torch.Tensor | None = None):
        """Residual-stream form of HF's block (see llama.DecoderLayer.forward): returns (post-feed-forward-normed
        MLP output, residual). last_rows (int64 (n,)): only those rows past the K/V write (the last layer of a
        prefill that needs last-token logits); the results are then (n, hidden)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x, use_fused=use_fused)
        else:
            h, residual = self.input_layernorm(x, residual, use_fused=use_fused)
        if last_rows is None:
            h = self.self_attn(h, positions, rotary, meta, kv_cache, backend, use_fused)
        else:
            h = self.self_attn.forward_last_rows(h, positions, rotary, meta, kv_cache, backend, use_fused, last_rows)
            residual = residual[last_rows]
        h = self.post_attention_layernorm(h, use_fused=use_fused)
        h, residual = self.pre_feedforward_layernorm(h, residual, use_fused=use_fused)
        return self.post_feedforward_layernorm(self.mlp(h, use_fused), use_fused=use_fused), residual

    use_pdl = False  # forward_one_token's GEMVs launched as programmatic dependents

    def forward_one_token(self, x, residual, positions, rotary, meta, kv_cache, backend):
        """forward() for a single token with every projection a Triton GEMV (as llama.DecoderLayer's; without its
        fused prologues, which compute Llama's norm and silu: Gemma's norms stay the fused norm kernels).
        x, residual (1, hidden)."""
        attn, mlp, pdl = self.self_attn, self.mlp, self.use_pdl
        if residual is None:
            residual, h = x, self.input_layernorm(x, use_fused=True)
        else:
            h, residual = self.input_layernorm(x, residual, use_fused=True)
        qkv = gemv.gemv(h, attn.qkv_proj.weight, attn.qkv_proj.bias, pdl=pdl)
        h = attn.attend(qkv, positions, rotary, meta, kv_cache, backend, use_fused=True, use_gemv=True)
        h = self.post_attention_layernorm(h, use_fused=True)
        h, residual = self.pre_feedforward_layernorm(h, residual, use_fused=True)
        gate, up = gemv.gemv(h, mlp.gate_up_proj.weight, pdl=pdl).split(mlp.intermediate_size, dim=-1)
        act = F.gelu(gate, approximate="tanh") * up
        h = mlp.down_proj.finish(gemv.gemv(act, mlp.down_proj.weight, mlp.down_proj.local_bias, pdl=pdl))
        return self.post_feedforward_layernorm(h, use_fused=True), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls, norm_cls = Gemma3DecoderLayer, GemmaRMSNorm
    # image+text checkpoints (Gemma3ForConditionalGeneration): the language model's tensors under language_model.*
    # (model.language_model.* in transformers' in-memory names); the vision tower and projector are not loaded
    WEIGHT_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                      ("model.language_model.", "model."), ("vision_tower.", None), ("multi_modal_projector.", None),
                      ("model.vision_tower.", None), ("model.multi_modal_projector.", None))

    def __init__(self, cfg: ModelConfig, dtype, device, max_positions: int, parallel=None):
        if cfg.layer_types is None or cfg.local_rope is None or cfg.query_pre_attn_scalar is None:
            raise ValueError("gemma3_text needs layer_types, local_rope and query_pre_attn_scalar in its ModelConfig")
        if cfg.local_rope.rope_type == "dynamic":
            raise ValueError("gemma3_text: dynamic rope scaling of the sliding layers is not supported")
        super().__init__(cfg, dtype, device, max_positions, parallel)
        self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.local_rope, cfg.max_position_embeddings, max_positions,
                                            device)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype).item()  # HF's rounding of sqrt(h)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_caches: list, backend,
                last_rows: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward: input_ids, positions int64 (tokens,) -> hidden (tokens, hidden), or
        (len(last_rows), hidden) with last_rows. Each layer gets its rotary and its window's backend."""
        cfg = self.config
        x, residual = self.model.embed_tokens(input_ids) * self.embed_scale, None
        one_token = self.use_gemv and input_ids.shape[0] == 1 and self.use_fused
        last_layer = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            rotary = self.local_rotary if cfg.layer_types[i] == "sliding_attention" else self.rotary
            layer_backend = backend.with_window(cfg.layer_window_left(i))
            if one_token:
                x, residual = layer.forward_one_token(x, residual, positions, rotary, meta, kv_cache, layer_backend)
            else:
                x, residual = layer(x, residual, positions, rotary, meta, kv_cache, layer_backend, self.use_fused,
                                    last_rows if i == last_layer else None)
        if one_token and last_rows is not None:
            x, residual = x[last_rows], residual[last_rows]
        return self.model.norm(x, residual, use_fused=self.use_fused)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (rows, hidden) -> float32 logits (rows, vocab), soft-capped where the config says so."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
