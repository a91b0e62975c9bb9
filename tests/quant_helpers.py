"""Helpers of the 8-bit KV cache tests (test_decode_quant.py, test_fuzz.py): quantise a float cache as append_kv
writes it, page it, and check a decode against the float64 reference on the dequantised cache."""

import torch

from flashdecode import reference as ref
from flashdecode.ops.kv_quant import QMAX, dequantize_cache
from helpers import DEVICE, assert_fa_close

INT8 = torch.int8


def to_8bit(x, scale, dtype):
    """x float (..., d) / scale (broadcast to x.shape[:-1]) -> saturated 8-bit, as append_kv writes it."""
    s = scale.expand(x.shape[:-1])[..., None]
    y = torch.where(s > 0, x.float() / s, torch.zeros_like(x.float())).clamp(-QMAX[dtype], QMAX[dtype])
    return (y.round() if dtype == INT8 else y).to(dtype)


def quantize_float_cache(x, dtype, granularity):
    """A float cache (B, S, H, D) -> (8-bit cache, float32 scale): per token and head ("token"), per kv head
    ("head") or one scale ("scalar"), each absmax / QMAX over what it covers."""
    amax = x.float().abs().amax(-1)
    if granularity == "head":
        amax = amax.amax((0, 1))
    elif granularity == "scalar":
        amax = amax.amax()
    scale = (amax / QMAX[dtype]).contiguous()
    return to_8bit(x, scale, dtype), scale


def heads_major(scale):
    """The same per-token scales stored heads-major ((nheads_kv, B, S) permuted back): strides that are not the
    cache's divided by the head dim, so the kernels take their general per-token path (KV_QUANT 2)."""
    return scale.permute(2, 0, 1).contiguous().permute(1, 2, 0)


def dequant(cache, scale):
    return torch.nan_to_num(dequantize_cache(cache, scale), nan=0.0)


def to_pages(x, table, page_size, num_pages, fill):
    """Scatter a contiguous (B, S, ...) tensor into (num_pages, page_size, ...) pages per ``table``; other slots
    hold ``fill``."""
    b, pages_per_seq = table.shape
    padded = torch.full((b, pages_per_seq * page_size, *x.shape[2:]), fill, dtype=torch.float32, device=x.device)
    padded[:, :x.shape[1]] = x.float()
    pages = torch.full((num_pages, page_size, *x.shape[2:]), fill, dtype=torch.float32, device=x.device)
    pages[table.long().flatten()] = padded.view(b * pages_per_seq, page_size, *x.shape[2:])
    return pages.to(x.dtype)


def paged_quant_cache(gen, kc, ks, vc, vs, page_size, extra_pages=2):
    """The 8-bit caches (and per-token scales) in randomly permuted pages, unused pages holding 3 (data) and NaN
    (scales)."""
    b, s = kc.shape[:2]
    pages_per_seq = -(-s // page_size)
    num_pages = b * pages_per_seq + extra_pages
    table = torch.randperm(num_pages, generator=gen)[: b * pages_per_seq].view(b, pages_per_seq)
    table = table.to(torch.int32).to(DEVICE)
    kp, vp = (to_pages(c, table, page_size, num_pages, 3.0) for c in (kc, vc))
    if ks.dim() == 3:
        strided = ks.stride(-1) != 1
        ks, vs = (to_pages(x, table, page_size, num_pages, float("nan")) for x in (ks, vs))
        if strided:
            ks, vs = heads_major(ks), heads_major(vs)
    return kp, ks, vp, vs, table


def check_on_dequantised(out, lse, q, kc, ks, vc, vs, lens, **kw):
    """out / lse vs decode_ref on the dequantised contiguous cache (float64, and q's dtype as the baseline)."""
    k, v = dequant(kc, ks), dequant(vc, vs)
    o64, lse64 = ref.decode_ref(q.double(), k.double(), v.double(), lens, **kw)
    o_same, lse_same = ref.decode_ref(q, k.to(q.dtype), v.to(q.dtype), lens, **kw)
    assert_fa_close(out, o64, o_same, factor=3.0, atol=2e-3)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=2e-3, name="lse")


def quant_step(dtype, scale):
    """The format's worst-case rounding error of a value x quantised with ``scale`` (e4m3: 3 mantissa bits, half a
    step relative, and the subnormal step (2**-9; the interpreter flushes subnormals, so 2**-6) absolute; int8:
    half a unit)."""
    if dtype == INT8:
        return lambda x: 0.5 * scale + 1e-6
    return lambda x: x.abs() * 2.0**-4 + scale * 2.0**-6 + 1e-6
