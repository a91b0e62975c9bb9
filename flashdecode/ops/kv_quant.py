"""8-bit KV caches (float8_e4m3fn, symmetric int8): checks of the caches' scales and the kernels' scale arguments.

A cache of dtype float8_e4m3fn or int8 goes with float32 ``k_scale`` / ``v_scale`` broadcastable to the cache's
shape without its head dim: a scalar (), one per kv head (nheads_kv,), or one per token and kv head (the cache's
shape[:-1]: (batch, max_seqlen, nheads_kv) contiguous, (num_pages, page_size, nheads_kv) paged). The dequantised
key is ``k_cache.float() * k_scale[..., None]`` (kernels/kv_quant.py says how the kernels apply it).
"""

from __future__ import annotations

import dataclasses

import torch

from flashdecode.kernels.decode_args import QUANT_TILES_OFF, QuantTiles
from flashdecode.ops import checks

__all__ = ["QUANT_DTYPES", "QMAX", "KVQuant", "resolve_kv_quant", "kv_quant_kernel_args", "dequantize_cache"]

QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8)
# the largest finite magnitude of each format: the scale of a token is its absmax / QMAX
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """An 8-bit cache's scales, checked: k_scale / v_scale expanded (views, no copy) to the cache's shape[:-1]."""

    dtype: torch.dtype
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    per_token: bool  # the scales vary along the cache's first two dims (else one per kv head)

    @property
    def strides(self) -> tuple[int, int, int]:
        """(sequence or page, token, kv head) element strides of the scales, 0 along broadcast dims."""
        return tuple(self.k_scale.stride())

    def offsets_fit_int32(self) -> bool:
        last = sum((n - 1) * st for n, st in zip(self.k_scale.shape, self.k_scale.stride()) if n > 0)
        return last < 2**31


def _is_quant(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in QUANT_DTYPES


def _expand_scale(name: str, scale, cache: torch.Tensor, device) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a float32 torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scale.dtype}")
    checks.check_device(name, scale, device)
    target = tuple(cache.shape[:-1])
    try:
        expanded = scale.expand(target) if scale.dim() <= len(target) else None
    except RuntimeError:
        expanded = None
    if expanded is None:
        raise ValueError(f"{name} of shape {tuple(scale.shape)} must broadcast to the cache's shape without its head "
                         f"dim {target}: () , (nheads_kv,) or {target}")
    return expanded


def resolve_kv_quant(q_dtype, k_cache, v_cache, k_scale, v_scale, *, kv_name: str = "k_cache") -> KVQuant | None:
    """The checked scales of an 8-bit cache pair, or None for a fp16/bf16/fp32 cache without scales.
    ValueError / TypeError naming the argument: an 8-bit cache without scales, scales for a float cache, scales of
    the wrong dtype / shape / device, K and V of different 8-bit dtypes, an 8-bit ``q`` (q_dtype: q's or the new
    tokens' dtype, which must be fp16/bf16/fp32)."""
    for name, x in ((kv_name, k_cache), (kv_name.replace("k_", "v_"), v_cache)):
        checks.check_tensor(name, x, (4,))
    if q_dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"q must be one of {checks.FLOAT_DTYPES} (the cache may be 8-bit, not q), got {q_dtype}")
    if not _is_quant(k_cache) and not _is_quant(v_cache):
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise ValueError(f"{name} is only for an 8-bit ({', '.join(map(str, QUANT_DTYPES))}) cache; "
                                 f"this cache is {k_cache.dtype}")
        return None
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must have the same dtype")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"{name} is required with an 8-bit ({k_cache.dtype}) cache: float32 (), (nheads_kv,) "
                             f"or {tuple(k_cache.shape[:-1])}")
    ks = _expand_scale("k_scale", k_scale, k_cache, k_cache.device)
    vs = _expand_scale("v_scale", v_scale, k_cache, k_cache.device)
    if ks.stride() != vs.stride():
        raise ValueError(f"k_scale and v_scale must have the same shape and strides, got {tuple(k_scale.shape)} / "
                         f"{k_scale.stride()} and {tuple(v_scale.shape)} / {v_scale.stride()}")
    per_token = any(n > 1 and st != 0 for n, st in zip(ks.shape[:2], ks.stride()[:2]))
    return KVQuant(k_cache.dtype, ks, vs, per_token)


def kv_quant_kernel_args(quant: KVQuant | None, k_cache: torch.Tensor,
                         tiles: QuantTiles = QUANT_TILES_OFF) -> dict:
    """The decode kernels' kv_scales = (K_SCALE, V_SCALE, (sequence or page, token, kv head) strides), KV_QUANT and
    QUANT_TILES (``tiles``: how its tiles are converted, from the DecodeConfig's quant_* fields) arguments ({}
    for a float cache: the kernels' defaults compile the float path unchanged). Per-token scales whose (sequence or
    page, token) strides are the cache's divided by the head dim take KV_QUANT 3 (a key's scale offset = its K offset
    // head dim)."""
    if quant is None:
        return {}
    sb, st, sh = quant.strides
    mode = 1
    if quant.per_token:
        d = k_cache.shape[-1]
        mode = 3 if (k_cache.stride(0), k_cache.stride(1)) == (d * sb, d * st) else 2
    return dict(kv_scales=(quant.k_scale, quant.v_scale, (sb, st, sh)), KV_QUANT=mode, QUANT_TILES=tiles)


def dequantize_cache(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """cache.float() * scale[..., None] (float32, the cache's shape): the values an 8-bit cache stands for."""
    return cache.float() * scale.float().expand(cache.shape[:-1])[..., None]
