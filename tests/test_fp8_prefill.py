"""FP8 (float8_e4m3fn) prefill forward: flash_attn / flash_attn_varlen with q/k/v_descale (FA3's API), against the
float64 reference on the dequantised inputs.

Tolerance (the FlashAttention rule's analogue): the kernel rounds P to e4m3 (3 mantissa bits: up to 2**-4 relative
error per probability) for the fp8 PV dot, which dominates its error. The same-precision PyTorch implementation,
reference.attention_fp8_ref, does the same (fp32 logits from the dequantised inputs, P = exp(S - rowmax) scaled by
2**8 and rounded to e4m3, fp32 PV, normalised by the fp32 row sum, output rounded to bf16); the kernel's error must
be within 2x of that implementation's, plus 2e-3 (half a bf16 ulp at |out| ~ 1). The kernel rounds P relative to
the running row max of each KV block rather than the final one: a different but equally fine rounding, hence the
factor 2. The lse comes from fp32 logits of exact fp8 products, so it is checked to fp32 accuracy.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import reference as ref
from flashdecode.ops import attention as attn_ops
from helpers import DEVICE, HAS_CUDA, assert_fa_close
from quant_helpers import E4M3_MAX, check_fp8, dequantise, fp8_emulation, fp8_inputs

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _no_autotuning(monkeypatch):
    monkeypatch.setenv(attn_ops.AUTOTUNE_ENV, "0")


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, options)
CASES = [
    (2, 40, 37, 4, 2, 64, {}),
    (1, 97, 97, 4, 1, 64, dict(causal=True)),
    (2, 33, 70, 8, 2, 128, dict(causal=True)),
    (1, 70, 33, 2, 2, 80, dict(causal=True)),  # seqlen_q > seqlen_k: empty rows (0, -inf)
    (1, 1, 65, 2, 1, 16, {}),  # head dim 16: padded to the fp8 dot's depth of 32
    (1, 40, 97, 2, 1, 64, dict(window_size=(20, 3), softcap=5.0)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[:6]}{c[6]}")
def test_fp8_forward_matches_reference(gen, case):
    out, lse = check_fp8(*fp8_inputs(gen, *case[:6]), **case[6])
    if case[1] > case[2] and case[6].get("causal"):
        assert torch.all(out[:, :case[1] - case[2]] == 0) and torch.all(lse[:, :, :case[1] - case[2]] == -torch.inf)


def test_fp8_per_query_head_q_descale_and_descriptors(gen):
    """q_descale (batch, nheads) (one per query head) and the tensor-descriptor path (V^T descriptor)."""
    check_fp8(*fp8_inputs(gen, 2, 50, 61, 4, 2, 64, q_per_head=True), causal=True)
    check_fp8(*fp8_inputs(gen, 2, 50, 61, 4, 2, 64), causal=True, config_changes=dict(fwd_tma=True))


def test_fp8_with_alibi(gen):
    """ALiBi (per-batch slopes) on the FP8 path: the bias joins the fp32 logits before P is rounded."""
    alibi = (torch.rand(2, 8, generator=gen) * 0.5).to(DEVICE)
    check_fp8(*fp8_inputs(gen, 2, 45, 60, 8, 2, 64), causal=True, alibi_slopes=alibi)


def test_fp8_zero_descales_and_zero_heads(gen):
    """An all-zero head quantises to descale 0: q/k descale 0 gives uniform attention (the mean of the visible
    values), v descale 0 gives out 0; no NaN anywhere."""
    q8, k8, v8, qd, kd, vd = fp8_inputs(gen, 2, 40, 40, 4, 2, 64)
    q8[0, :, 0:2] = 0
    qd[0, 0] = 0.0
    vd[1, 1] = 0.0
    v8[1, :, 1] = 0
    out, _ = check_fp8(q8, k8, v8, qd, kd, vd, causal=True)
    assert torch.all(out[1, :, 2:] == 0)
    mean = (dequantise(v8, vd)[0, :, 0].cumsum(0) / torch.arange(1, 41, device=DEVICE)[:, None]).float()
    torch.testing.assert_close(out[0, :, 0].float(), mean, atol=2e-2, rtol=2e-2)


def test_fp8_saturated_inputs(gen):
    """Entries at the e4m3 limits +-448 (large descales: logits far from 0) stay exact in the fp32 logits."""
    q8, k8, v8, qd, kd, vd = fp8_inputs(gen, 1, 64, 64, 2, 2, 64)
    for x in (q8, k8, v8):
        x[:, ::7, :, ::5] = torch.tensor(E4M3_MAX, dtype=FP8)
        x[:, 3::7, :, 1::5] = torch.tensor(-E4M3_MAX, dtype=FP8)
    assert q8.float().abs().max() == E4M3_MAX
    check_fp8(q8, k8, v8, qd * 4, kd * 4, vd, causal=True)


def test_fp8_varlen(gen):
    """Per-sequence descales (batch = len(cu_seqlens) - 1), each sequence against its own dense result."""
    lens_q, lens_k = [5, 0, 40, 17], [9, 3, 40, 30]
    seqs = [fp8_inputs(gen, 1, sq, sk, 4, 2, 64) for sq, sk in zip(lens_q, lens_k)]
    cat = [torch.cat([s[i][0] for s in seqs]) for i in range(3)] + [torch.cat([s[i] for s in seqs]) for i in (3, 4, 5)]
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    for changes in (None, dict(fwd_tma=True)):
        config = None
        if changes:
            config = dataclasses.replace(attn_ops.resolve_config(cat[0], cat[1], cat[2], max(lens_k)),
                                         fwd_autotune=False, backend="triton", **changes)
        out = flashdecode.flash_attn_varlen(*cat[:3], cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                            q_descale=cat[3], k_descale=cat[4], v_descale=cat[5], config=config)
        assert out.dtype == torch.bfloat16
        for i, (q8, k8, v8, qd, kd, vd) in enumerate(seqs):
            rows = out[cu_q[i]:cu_q[i + 1]][None]
            want, _ = ref.attention_ref(dequantise(q8, qd), dequantise(k8, kd), dequantise(v8, vd), causal=True)
            emulated = fp8_emulation(*(t.cpu() for t in (q8, k8, v8, qd, kd, vd)), causal=True)
            assert_fa_close(rows, want, emulated, factor=2.0, atol=2e-3, name=f"sequence {i}")


# ----------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------

def _fp8_ok():
    return fp8_inputs(torch.Generator().manual_seed(0), 2, 8, 8, 4, 2, 64)


def test_fp8_requires_descales():
    q8, k8, v8, qd, kd, vd = _fp8_ok()
    with pytest.raises(ValueError, match="q_descale is required"):
        flashdecode.flash_attn(q8, k8, v8)
    with pytest.raises(ValueError, match="v_descale is required"):
        flashdecode.flash_attn(q8, k8, v8, q_descale=qd, k_descale=kd)


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_fp8_rejects_bad_descales(name):
    q8, k8, v8, qd, kd, vd = _fp8_ok()
    good = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    for bad, error, match in ((good[name][:1], ValueError, f"{name} must have shape"),
                              (good[name].double(), TypeError, f"{name} must be float32"),
                              (0.5, TypeError, f"{name} must be a float32 torch.Tensor")):
        with pytest.raises(error, match=match):
            flashdecode.flash_attn(q8, k8, v8, **{**good, name: bad})
    if name != "q_descale":  # q_descale may also be per query head
        with pytest.raises(ValueError, match=f"{name} must have shape"):
            flashdecode.flash_attn(q8, k8, v8, **{**good, name: torch.ones(2, 4, device=DEVICE)})


@pytest.mark.skipif(not HAS_CUDA, reason="needs two devices (cpu + cuda)")
def test_fp8_rejects_descale_on_another_device():
    q8, k8, v8, qd, kd, vd = _fp8_ok()
    with pytest.raises(ValueError, match="k_descale is on"):
        flashdecode.flash_attn(q8, k8, v8, q_descale=qd, k_descale=kd.cpu(), v_descale=vd)


def test_fp8_rejects_descales_for_16_bit_inputs_and_mixed_dtypes():
    q8, k8, v8, qd, kd, vd = _fp8_ok()
    with pytest.raises(ValueError, match="q_descale is only for float8_e4m3fn"):
        flashdecode.flash_attn(q8.half(), k8.half(), v8.half(), q_descale=qd)
    with pytest.raises(ValueError, match="v_descale is only for float8_e4m3fn"):
        flashdecode.flash_attn(q8.half(), k8.half(), v8.half(), v_descale=vd)
    with pytest.raises(TypeError, match="k has dtype torch.bfloat16 but q has torch.float8_e4m3fn"):
        flashdecode.flash_attn(q8, k8.bfloat16(), v8, q_descale=qd, k_descale=kd, v_descale=vd)
    with pytest.raises(TypeError, match="v has dtype torch.float8_e4m3fn but q has torch.float16"):
        flashdecode.flash_attn(q8.half(), k8.half(), v8)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"q_descale must have shape \(batch, nheads_kv\) = \(2, 2\)"):
        flashdecode.flash_attn_varlen(q8[0], k8[0], v8[0], cu, cu, 8, 8, q_descale=qd[:1], k_descale=kd,
                                      v_descale=vd)


def test_fp8_is_forward_only():
    q8, k8, v8, qd, kd, vd = _fp8_ok()
    with pytest.raises(ValueError, match="q requires grad, but FP8 attention"):
        flashdecode.flash_attn(q8.requires_grad_(), k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    with pytest.raises(ValueError, match="v_descale requires grad"):
        flashdecode.flash_attn(q8.detach(), k8, v8, q_descale=qd, k_descale=kd, v_descale=vd.requires_grad_())
    with torch.no_grad():  # no gradient can flow: allowed
        flashdecode.flash_attn(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)


# ----------------------------------------------------------------------------------------------------------------
# GPU (the `gpu` marker): the real e4m3 cast and fp8 wgmma
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_gpu_fp8_forward(gen, causal, headdim):
    check_fp8(*fp8_inputs(gen, 2, 1000, 1100, 8, 2, headdim), causal=causal)
    check_fp8(*fp8_inputs(gen, 1, 3000, 3000, 4, 4, headdim), causal=causal)


@pytest.mark.gpu
def test_gpu_fp8_autotuned_and_pointer_paths(gen, monkeypatch):
    monkeypatch.setenv(attn_ops.AUTOTUNE_ENV, "1")
    inputs = fp8_inputs(gen, 2, 2048, 2048, 8, 2, 128)
    check_fp8(*inputs, causal=True)
    check_fp8(*inputs, causal=True, config_changes=dict(fwd_tma=False))


# ----------------------------------------------------------------------------------------------------------------
# The V transpose both FP8 forwards read (kernels/fp8_transpose.py)
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key_order", ["natural", "wgmma"])
@pytest.mark.parametrize("keys,headdim,varlen", [(37, 64, False), (128, 80, False), (1, 16, True), (70, 128, True)])
def test_fp8_v_transpose_moves_bytes_and_zero_pads(gen, keys, headdim, varlen, key_order):
    """V^T holds V's bytes with the keys contiguous (every e4m3 code, NaN ones included, moved exactly, from a
    strided view) and zeros in the padding up to a multiple of 16 keys (32 for the Gluon kernel's "wgmma" order,
    where column 32 ch + 16 jh + 4 c + 2 jl + e holds key 32 ch + 16 jh + 8 jl + 2 c + e)."""
    from flashdecode.ops.fp8_v_transpose import fp8_v_transposed

    codes = torch.randint(0, 256, (2, keys, 3, 2 * headdim), generator=gen, dtype=torch.uint8)
    v = codes.to(DEVICE).view(FP8)[..., ::2]  # a non-unit head-dim stride
    if varlen:
        v = v[0]
    phys, _ = fp8_v_transposed(v, varlen, key_order)
    pad = -(-keys // 32) * 32 if key_order == "wgmma" else -(-keys // 16) * 16
    want = v.view(torch.uint8)[None] if varlen else v.view(torch.uint8)
    want = torch.cat([want, want.new_zeros(want.shape[0], pad - keys, *want.shape[2:])], dim=1)
    if key_order == "wgmma":
        col = torch.arange(pad)
        ch, jh, c, jl, e = col // 32, col // 16 % 2, col // 4 % 4, col // 2 % 2, col % 2
        want = want[:, (ch * 32 + jh * 16 + jl * 8 + c * 2 + e).to(want.device)]
    got = phys.view(torch.uint8)[None] if varlen else phys.view(torch.uint8)
    assert got.shape == (want.shape[0], 3, headdim, pad) and got.stride(-1) == 1
    assert torch.equal(got, want.permute(0, 2, 3, 1))


def test_fp8_v_transpose_rejects_unknown_key_order():
    from flashdecode.ops.fp8_v_transpose import fp8_v_transposed

    with pytest.raises(ValueError, match="key_order"):
        fp8_v_transposed(torch.zeros(1, 4, 1, 16, device=DEVICE).to(FP8), key_order="sorted")


def test_fp8_wgmma_key_order_matches_the_gluon_kernels_p_columns(gen):
    """The Gluon e4m3 kernel renumbers P's keys with reshape (64, n/32, 2, 2, 4, 2) -> permute (0, 1, 2, 4, 3, 5)
    -> reshape (its _p_operand; reshape and permute there have torch's semantics); P renumbered that way times the
    "wgmma"-ordered V^T is P V."""
    from flashdecode.ops.fp8_v_transpose import fp8_v_transposed

    keys, d = 128, 16
    v8 = (torch.randn(1, keys, 1, d, generator=gen) * 4).to(FP8).to(DEVICE)
    p = torch.rand(64, keys, generator=gen, dtype=torch.float64)
    p_cols = p.reshape(64, keys // 32, 2, 2, 4, 2).permute(0, 1, 2, 4, 3, 5).reshape(64, keys)
    vt, _ = fp8_v_transposed(v8, key_order="wgmma")
    got = p_cols @ vt[0, 0].cpu().double().T
    torch.testing.assert_close(got, p @ v8[0, :, 0].cpu().double(), rtol=1e-12, atol=1e-12)
