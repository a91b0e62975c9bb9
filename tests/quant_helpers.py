"""Helpers of the 8-bit tests (test_decode_quant.py, test_fp8_prefill.py, test_fuzz.py): quantise a float cache as
append_kv writes it, page it, and check a decode against the float64 reference on the dequantised cache; quantise
FP8 prefill inputs with FA3's descales and check flash_attn's e4m3 forward (test_fp8_prefill's module doc gives
its tolerance)."""

import dataclasses

import torch

import flashdecode
from flashdecode import reference as ref
from flashdecode.ops import attention as attn_ops
from flashdecode.ops.kv_quant import QMAX, dequantize_cache
from helpers import DEVICE, assert_fa_close, max_err

INT8 = torch.int8
FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


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


def quantise(x: torch.Tensor, groups: int):
    """x (batch, seqlen, nheads, headdim) float -> (x_fp8, descale float32 (batch, groups)): one absmax / 448
    descale per (batch, group of nheads // groups consecutive heads); an all-zero group gets descale 0."""
    b, s, h, d = x.shape
    amax = x.float().abs().view(b, s, groups, h // groups, d).transpose(1, 2).reshape(b, groups, -1)
    amax = amax.amax(dim=-1) if amax.shape[-1] else amax.new_zeros(b, groups)
    descale = amax / E4M3_MAX
    per_head = descale.repeat_interleave(h // groups, dim=1)[:, None, :, None]
    safe = torch.where(per_head > 0, per_head, torch.ones_like(per_head))
    return (x.float() / safe).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), descale.float()


def dequantise(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """float64 x8 (batch, seqlen, nheads, headdim) * descale (batch, groups), each descale over its group's heads."""
    rep = x8.shape[2] // descale.shape[1]
    return x8.double() * descale.double().repeat_interleave(rep, dim=1)[:, None, :, None]


def fp8_emulation(q8, k8, v8, qd, kd, vd, **opts):
    """reference.attention_fp8_ref (the kernel's rounding rule in PyTorch) on the dequantised inputs."""
    return ref.attention_fp8_ref(dequantise(q8, qd).float(), dequantise(k8, kd).float(),
                                 dequantise(v8, vd).float(), **opts)[0]


def fp8_inputs(gen, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, q_per_head=False, scale=1.0):
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=gen) * scale
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, generator=gen) * scale
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, generator=gen)
    q8, qd = quantise(q, nheads if q_per_head else nheads_kv)
    k8, kd = quantise(k, nheads_kv)
    v8, vd = quantise(v, nheads_kv)
    return [t.to(DEVICE) for t in (q8, k8, v8, qd, kd, vd)]


def check_fp8(q8, k8, v8, qd, kd, vd, config_changes=None, **opts):
    """flash_attn on e4m3 inputs with descales (config_changes: DecodeConfig fields over the resolved config) against
    the float64 reference on the dequantised inputs, under the rule of test_fp8_prefill's module doc. Returns (out,
    lse)."""
    config = None
    if config_changes:
        config = dataclasses.replace(attn_ops.resolve_config(q8, k8, v8), fwd_autotune=False, backend="triton",
                                     **config_changes)
    out, lse = flashdecode.flash_attn(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True,
                                      config=config, **opts)
    assert out.dtype == torch.bfloat16 and out.shape == q8.shape and lse.dtype == torch.float32
    want, want_lse = ref.attention_ref(dequantise(q8, qd), dequantise(k8, kd), dequantise(v8, vd), **opts)
    emulated = fp8_emulation(q8.cpu(), k8.cpu(), v8.cpu(), qd.cpu(), kd.cpu(), vd.cpu(), **opts)
    atol = 2e-3
    if out.device.type == "cpu":
        # the interpreter casts fp32 to bf16 toward zero (a GPU rounds to nearest): up to a whole ulp of the output
        # where the same-precision baseline, rounded to nearest, is within half of one
        atol += 2.0 ** (torch.frexp(want.abs().max().float()).exponent.item() - 8)
    assert_fa_close(out, want, emulated, factor=2.0, atol=atol, name="fp8 out")
    # lse comes from fp32 logits of exact fp8 products: in the interpreter only fp32 rounding separates it from the
    # reference; Hopper's e4m3 wgmma adds its products with ~14 mantissa bits (the limit DeepSeek-V3's report
    # measured), so on the GPU a logit may be off by ~2**-13 of its size (seen: 1.6e-4)
    rel = 1e-4 if q8.device.type == "cpu" else 1e-3
    assert max_err(lse, want_lse) <= rel * (1 + want_lse[torch.isfinite(want_lse)].abs().max().item())
    return out, lse
