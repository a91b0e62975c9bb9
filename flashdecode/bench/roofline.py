"""The bytes a decode step must read, and the tokens/s that reading them at a measured bandwidth allows (the roofline
of `flashdecode bench e2e`).

A decode step of ``batch`` sequences reads every weight matrix, norm and bias of every layer once, the final norm and
the lm_head, one row of the input-embedding table per sequence (the table itself is never streamed; with tied
embeddings the lm_head's read of the table covers those rows) and each sequence's K/V: its live tokens x layers x kv
heads x head dim x 2 tensors x the element size, plus on 8-bit pages a float32 scale per token, layer, kv head and
tensor. What it writes (one token's K/V, activations) and re-reads from L2 is left out: a few MB against ~15 GB at
the Llama-3-8B shape.
"""

from __future__ import annotations

import torch

from flashdecode.engine.kv_cache import bytes_per_page
from flashdecode.engine.kv_quant import resolve_kv_cache_dtype, scale_bytes_per_page


def weight_bytes_per_step(cfg, batch: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Weight bytes one decode step of ``batch`` sequences reads (cfg: a ModelConfig)."""
    elements = cfg.num_parameters()
    if not cfg.tie_word_embeddings:  # the input table is gathered, not streamed: one row per sequence
        elements += batch * cfg.hidden_size - cfg.vocab_size * cfg.hidden_size
    return elements * torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_layer_token(cfg, dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = "auto") -> int:
    """K/V bytes of one cached token in one layer (8-bit pages: + their float32 scales)."""
    kv = resolve_kv_cache_dtype(kv_cache_dtype)
    page = bytes_per_page(1, 1, cfg.num_key_value_heads, cfg.head_dim, kv or dtype)
    return page + (scale_bytes_per_page(1, 1, cfg.num_key_value_heads) if kv else 0)


def kv_tokens_read(cfg, context: int) -> int:
    """Cached tokens one decode step of one sequence reads over all layers (a sliding-window layer - Gemma 3 - its
    window only; ModelConfig.kv_tokens_read)."""
    return cfg.kv_tokens_read(context)


def kv_bytes_per_step(cfg, context: int, batch: int, dtype: torch.dtype = torch.bfloat16,
                      kv_cache_dtype: str = "auto") -> int:
    """K/V bytes one decode step of ``batch`` sequences of ``context`` live tokens each reads."""
    return batch * kv_tokens_read(cfg, context) * kv_bytes_per_layer_token(cfg, dtype, kv_cache_dtype)


def decode_step_bytes(cfg, context: int, batch: int, dtype: torch.dtype = torch.bfloat16,
                      kv_cache_dtype: str = "auto") -> int:
    """Bytes one decode step of ``batch`` sequences of ``context`` live tokens each must read."""
    return weight_bytes_per_step(cfg, batch, dtype) + kv_bytes_per_step(cfg, context, batch, dtype, kv_cache_dtype)


def roofline_tokens_per_s(cfg, context: int, batch: int, bandwidth: float, kv_cache_dtype: str = "auto",
                          dtype: torch.dtype = torch.bfloat16) -> float:
    """Sequence tokens/s (all ``batch`` sequences together) if a step took exactly its bytes over ``bandwidth``
    (bytes/s)."""
    return batch * bandwidth / decode_step_bytes(cfg, context, batch, dtype, kv_cache_dtype)
