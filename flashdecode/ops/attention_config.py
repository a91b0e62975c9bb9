"""The AttentionConfig of a flash_attn / flash_attn_varlen call: resolved once per problem from the inputs and the
call's device (heuristics.resolve_attention_config over an AttentionProblem), or given with ``config=`` and
interned, so that the torch.library custom ops carry it as an int across their boundary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from flashdecode import heuristics
from flashdecode.config import AttentionConfig, AttentionProblem
from flashdecode.ops.checks import FP8_DTYPE
from flashdecode.ops.util import autotune_enabled, device_facts, interpreting_now, tma_layout_ok

__all__ = ["RESOLVE_CONFIG", "config_id_of", "attention_problem", "resolve_config", "config_for", "gluon_allowed",
           "head_dim_pad"]

_GIVEN_CONFIGS: list[AttentionConfig] = []
_GIVEN_CONFIG_IDS: dict[AttentionConfig, int] = {}
RESOLVE_CONFIG = -1  # config id meaning "resolve from the problem"

_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionConfig))


def config_id_of(config) -> int:
    """An int that stands for ``config`` across the torch.library op boundary (-1: None, resolve it). Under
    torch.compile the config reaches the interning as a tuple of its field values: an assume_constant_result
    function runs while tracing (its result is a constant of the graph, so the config is interned before the graph
    runs), and torch 2.11's Dynamo can hand it only constants such as tuples, not a dataclass instance."""
    if config is None:
        return RESOLVE_CONFIG
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be a flashdecode.AttentionConfig or None, got {type(config).__name__}")
    if torch.compiler.is_compiling():
        return _config_id_of_fields(tuple([getattr(config, name) for name in _CONFIG_FIELDS]))
    return _intern_config(config)


def _config_id_of_fields(fields: tuple) -> int:
    return _intern_config(AttentionConfig(*fields))


# torch._dynamo.assume_constant_result's whole effect (torch 2.4-2.13), without importing torch._dynamo: `import
# flashdecode` must not pay for Dynamo (about a second) where nothing is compiled
_config_id_of_fields._dynamo_marked_constant = True


def _intern_config(config: AttentionConfig) -> int:
    found = _GIVEN_CONFIG_IDS.get(config)
    if found is None:
        config.check()
        found = _GIVEN_CONFIG_IDS[config] = len(_GIVEN_CONFIGS)
        _GIVEN_CONFIGS.append(config)
    return found


def head_dim_pad(headdim: int, dtype: Optional[torch.dtype] = None) -> int:
    """Head dim padded to a power of two >= the smallest GPU dot depth (16 for 16/32-bit operands, 32 for fp8)."""
    return max(32 if dtype == FP8_DTYPE else 16, heuristics.next_power_of_2(headdim))


_resolve_cached = functools.lru_cache(maxsize=1024)(heuristics.resolve_attention_config)


def attention_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_k: int,
                      deterministic: bool = True) -> AttentionProblem:
    """The AttentionProblem of a call with these q, k, v (any layout flash_attn or flash_attn_varlen takes)."""
    interpret = interpreting_now()
    smem, major = device_facts(q.device) if q.is_cuda and not interpret else (227 * 1024, 0)
    return AttentionProblem(head_dim_pad=head_dim_pad(q.shape[-1], q.dtype), elem_bytes=q.element_size(),
                            max_seqlen_k=max_seqlen_k, deterministic=deterministic,
                            tma_layout=tma_layout_ok(q, k, v), capability_major=major, smem_limit=smem,
                            interpret=interpret, autotune=autotune_enabled())


def resolve_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_k: Optional[int] = None,
                   deterministic: bool = True) -> AttentionConfig:
    """The AttentionConfig flash_attn (max_seqlen_k None: k.shape[1]) or flash_attn_varlen would use for these
    inputs: the starting point of a ``dataclasses.replace`` override."""
    if max_seqlen_k is None:
        if k.dim() != 4:
            raise ValueError("max_seqlen_k is required for varlen (3-D) k")
        max_seqlen_k = k.shape[1]
    return _resolve_cached(attention_problem(q, k, v, max_seqlen_k, deterministic))


def config_for(config_id: int, q, k, v, max_seqlen_k: int, deterministic: bool) -> AttentionConfig:
    if config_id >= 0:
        return _GIVEN_CONFIGS[config_id]
    return resolve_config(q, k, v, max_seqlen_k, deterministic)


def gluon_allowed(config_id: int) -> bool:
    """Whether the dispatch may take the Gluon kernels: without config=, or with a config whose backend is
    "gluon" (the resolved one on sm_90); backend "triton" pins the Triton kernels."""
    return config_id == RESOLVE_CONFIG or _GIVEN_CONFIGS[config_id].backend == "gluon"
