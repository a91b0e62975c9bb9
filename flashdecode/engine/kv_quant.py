"""8-bit KV pages for the engine (``LLM(kv_cache_dtype="fp8" | "int8")``).

The pool then holds float8_e4m3fn (or int8) K/V plus one float32 scale per token and kv head
(pool_scales (2, num_layers, num_pages + 1, page_size, nheads_kv)): 132 bytes per token-head at head dim 128
instead of 256, so the same memory holds ~1.94x the tokens. Each layer's cache is a pair of ``QuantPages``;
writes go through flashdecode.append_kv's quantising path (each new token's scale is absmax / 448 or / 127),
decode through flash_decode with the scales. Prefill attention uses the step's K/V before quantisation (as it is
computed), so only the tokens decoded later read the 8-bit values.
"""

from __future__ import annotations

import dataclasses

import torch

KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
# backends that read QuantPages: the Triton kernels, and the reference (which dequantises: CPU tests)
QUANT_BACKENDS = ("flashdecode", "flashdecode-nosplit", "torch")


def resolve_kv_cache_dtype(kv_cache_dtype) -> torch.dtype | None:
    """"auto" (the model's dtype) -> None; "fp8" -> torch.float8_e4m3fn; "int8" -> torch.int8."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def scale_bytes_per_page(num_layers: int, page_size: int, nheads_kv: int) -> int:
    """Bytes of the float32 K and V scales of one page across all layers."""
    return 2 * num_layers * page_size * nheads_kv * 4


@dataclasses.dataclass(frozen=True)
class QuantPages:
    """One layer's K (or V) pages in 8 bits: data (num_pages + 1, page_size, nheads_kv, head_dim) float8_e4m3fn /
    int8 and scale (num_pages + 1, page_size, nheads_kv) float32; the value is data.float() * scale[..., None]."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self):
        return self.data.shape

    def dequantize(self, dtype) -> torch.Tensor:
        return (self.data.float() * self.scale[..., None]).to(dtype)


def allocate_scales(num_layers: int, num_pages: int, page_size: int, nheads_kv: int, device) -> torch.Tensor:
    """(2, num_layers, num_pages + 1, page_size, nheads_kv) float32 zeros (the +1: the scratch page)."""
    return torch.zeros((2, num_layers, num_pages + 1, page_size, nheads_kv), dtype=torch.float32, device=device)


def write_quantized(k_pages: QuantPages, v_pages: QuantPages, k, v, slot_mapping) -> None:
    """k / v (tokens, nheads_kv, head_dim) into their flat page slots (slot = page * page_size + offset), quantised
    by append_kv with per-token scales written beside them: one launch, each token its own one-token sequence
    (length slot % page_size, block table [slot // page_size]); no host sync, so it fits in a CUDA graph."""
    from flashdecode import append_kv
    from flashdecode.ops.checks import kernels_run_on

    page_size = k_pages.data.shape[1]
    if not kernels_run_on(k.device):
        # CPU engine without the Triton interpreter (the "torch" backend): the same quantisation in PyTorch
        for pages, x in ((k_pages, k), (v_pages, v)):
            data, scale = quantize_tokens(x, pages.data.dtype)
            pages.data.view(-1, *pages.data.shape[2:])[slot_mapping] = data
            pages.scale.view(-1, pages.scale.shape[-1])[slot_mapping] = scale
        return
    slots = slot_mapping.to(torch.int32)
    lens = slots % page_size
    table = (slots // page_size)[:, None]
    append_kv(k_pages.data, v_pages.data, k[:, None], v[:, None], lens, table, k_scale=k_pages.scale,
              v_scale=v_pages.scale)


def quantize_tokens(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of append_kv's quantising write, for CPU engines without the Triton interpreter.
    x (tokens, nheads_kv, head_dim) float -> (data (tokens, nheads_kv, head_dim) ``dtype``, scale (tokens, nheads_kv)
    float32): scale absmax / 448 (e4m3) or / 127 (int8, rounded half up), 0 for an all-zero row; a non-finite row
    keeps a non-finite scale and writes zeros, so it stays local to its own token-head."""
    qmax = 127.0 if dtype == torch.int8 else 448.0
    xf = x.float()
    scale = xf.abs().amax(-1) / qmax
    scale = torch.where(torch.isnan(xf).any(-1), torch.full_like(scale, float("nan")), scale)
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    y = torch.nan_to_num(xf * inv[..., None], nan=0.0).clamp(-qmax, qmax)
    y = torch.floor(y + 0.5) if dtype == torch.int8 else y + 0.0  # + 0.0: -0 -> +0, the kernel's zero code
    return y.to(dtype), scale
