"""Qwen3 (dense): the Llama block with an RMSNorm over each head of q and of k (weights ``self_attn.q_norm`` /
``k_norm``, (head_dim,)) applied after the projection and before the rotary. No qkv bias unless the config's
attention_bias says so; head_dim comes from the config (it may differ from hidden / heads); small models tie their
embeddings. ``QKNormAttention`` is shared with Gemma 3, whose norms are Gemma's (1 + weight) form."""

from __future__ import annotations

import torch

from flashdecode.engine.config import ModelConfig
from flashdecode.engine.layers import fused
from flashdecode.engine.layers.norm import RMSNorm
from flashdecode.engine.models.llama import Attention, DecoderLayer, LlamaForCausalLM


class QKNormAttention(Attention):
    """Llama's attention with q and k normalised per head before the rotary (HF Qwen3Attention's order).
    ``norm_cls`` is the RMSNorm flavour; ``q_scale`` multiplies q inside its norm (Gemma 3's softmax scale, see
    Gemma3Attention)."""

    norm_cls = RMSNorm

    def __init__(self, cfg: ModelConfig, dtype, device, parallel, q_scale: float = 1.0):
        super().__init__(cfg, dtype, device, parallel)
        self.q_norm = self.norm_cls(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.k_norm = self.norm_cls(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.q_scale = q_scale

    def norm_qk(self, qkv: torch.Tensor, use_fused: bool) -> torch.Tensor:
        """qkv (tokens, q_size + 2 kv_size) -> a new tensor of that shape with every head of q and of k
        normalised by q_norm / k_norm (q also times q_scale), v unchanged. One Triton launch when fused."""
        if use_fused and not self.head_dim & (self.head_dim - 1):
            return fused.qk_rms_norm(qkv, self.q_norm.weight, self.k_norm.weight, self.nheads, self.nheads_kv,
                                     self.head_dim, self.q_norm.eps, q_scale=self.q_scale,
                                     round_normed=self.norm_cls.ROUND_NORMED, pdl=self.use_pdl)
        tokens, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split(self.splits, dim=-1)
        q = self.q_norm(q.reshape(tokens, self.nheads, d), scale=self.q_scale)
        k = self.k_norm(k.reshape(tokens, self.nheads_kv, d))
        return torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1), v), dim=-1)

    def _rotate_and_store(self, qkv, positions, rotary, meta, kv_cache, backend, use_fused):
        return super()._rotate_and_store(self.norm_qk(qkv, use_fused), positions, rotary, meta, kv_cache, backend,
                                         use_fused)


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = QKNormAttention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer

    def __init__(self, cfg, dtype, device, max_positions: int, parallel=None):
        if not cfg.qk_norm:
            raise ValueError("qwen3 needs q/k norms (config.qk_norm=True)")
        super().__init__(cfg, dtype, device, max_positions, parallel)
