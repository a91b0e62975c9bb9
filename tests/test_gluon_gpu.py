"""The Gluon (warp-specialised, sm_90) attention forward on the GPU: every feature it takes against the float64
reference with the FlashAttention rule, and the cases it must refuse (gluon_supported False, ValueError)."""

import dataclasses

import pytest
import torch

from flashdecode.ops.gluon_attention import gluon_attention_forward, gluon_supported, resolve_gluon_config
from flashdecode.reference import attention_ref
from helpers import HAS_CUDA, assert_fa_close, max_err, randn

pytestmark = pytest.mark.gpu

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(HAS_CUDA and not HOPPER, reason="the Gluon kernel is built for sm_90 only")


def _qkv(b, sq, sk, h, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (randn(b, sq, h, d, gen=gen, dtype=dtype), randn(b, sk, hkv, d, gen=gen, dtype=dtype),
            randn(b, sk, hkv, d, gen=gen, dtype=dtype))


def _check(q, k, v, causal, config=None):
    out, lse = gluon_attention_forward(q, k, v, causal=causal, config=config)
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    same, _ = attention_ref(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert_fa_close(out, ref, same, name="out")
    assert not torch.isnan(lse).any(), "lse has NaN"
    assert max_err(lse, ref_lse) < 1e-3, "lse"


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,sq,sk,h,hkv", [(2, 128, 128, 4, 4), (1, 333, 517, 4, 2), (2, 517, 333, 8, 2),
                                          (3, 1, 300, 4, 1), (1, 1000, 999, 2, 2)])
def test_gluon_forward_matches_reference(b, sq, sk, h, hkv, d, causal, dtype):
    _check(*_qkv(b, sq, sk, h, hkv, d, dtype, seed=sq * 7 + sk + d), causal)


ABLATIONS = [dict(num_consumers=1), dict(num_consumers=1, overlap=True), dict(overlap=True, pingpong=True),
             dict(pingpong=True), dict(persistent=True), dict(persistent=True, pingpong=True),
             dict(block_n=64, num_stages=3)]


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("overrides", ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_gluon_forward_every_config(overrides, causal):
    """The configs the probe times are correct too (GQA, ragged lengths; 144 tiles > 132 SMs, so persistent CTAs
    take several tiles and the K/V ring runs across tiles)."""
    cfg = dataclasses.replace(resolve_gluon_config(128), **overrides)
    _check(*_qkv(2, 1100, 700, 8, 4, 128, torch.bfloat16, seed=5), causal, cfg)


@needs_hopper
def test_gluon_forward_rows_without_keys():
    """Causal with seqlen_q > seqlen_k (bottom-right): the first rows see no key -> out 0, lse -inf, no NaN."""
    q, k, v = _qkv(1, 300, 100, 2, 2, 128, torch.bfloat16, seed=3)
    out, lse = gluon_attention_forward(q, k, v, causal=True)
    assert torch.all(out[:, :200] == 0) and torch.all(torch.isinf(lse[:, :, :200]))
    _check(q, k, v, True)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_forward_packed_qkv_views(causal):
    """q, k, v as views of one packed (batch, seqlen, 3, heads, headdim) tensor: rows strided by 3 * heads *
    headdim, read in place through the TMA descriptors (no copy), output still (batch, seqlen, heads, headdim)."""
    gen = torch.Generator().manual_seed(11)
    qkv = randn(2, 300, 3, 4, 128, gen=gen, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert gluon_supported(q, k, v, causal)
    _check(q, k, v, causal)


@needs_hopper
def test_gluon_supported_refuses_what_it_cannot_take():
    q, k, v = _qkv(1, 64, 64, 2, 2, 128, torch.bfloat16, seed=1)
    assert gluon_supported(q, k, v, False)
    assert not gluon_supported(q.float(), k.float(), v.float(), False)
    assert not gluon_supported(q[..., :96], k[..., :96], v[..., :96], False)
    assert not gluon_supported(q, k, v, False, window_size=(8, 0))
    assert not gluon_supported(q, k, v, False, softcap=30.0)
    assert not gluon_supported(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False)
    with pytest.raises(ValueError, match="q, k, v"):
        gluon_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    with pytest.raises(TypeError, match="q"):
        gluon_attention_forward(q.float(), k, v)
