"""quantize_fp8 / dequantize_fp8 / hadamard_rotate: round trips, the rotation's invariance, bad input."""

import pytest
import torch

from flashdecode.ops.quant import FP8_E4M3_MAX, dequantize_fp8, hadamard_rotate, quantize_fp8

# e4m3 keeps 3 mantissa bits: a round-to-nearest step is at most 2**-4 of the value's magnitude, so any element's
# error is at most 2**-4 of its group's absmax (the largest power-of-two bucket holds the absmax).
E4M3_REL_STEP = 2.0 ** -4


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_block"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_within_one_step(granularity, dtype):
    torch.manual_seed(0)
    x = (torch.randn(2, 37, 3, 64) * torch.rand(1, 37, 3, 1) * 10).to(dtype)
    xq, descale = quantize_fp8(x, granularity=granularity, block_size=16)
    assert xq.dtype == torch.float8_e4m3fn and descale.dtype == torch.float32
    expected_shape = {"per_tensor": (), "per_head": (2, 3), "per_block": (2, 3, 3)}[granularity]
    assert tuple(descale.shape) == expected_shape
    back = dequantize_fp8(xq, descale, block_size=16)
    amax = descale * FP8_E4M3_MAX
    err = (back - x.float()).abs()
    if granularity == "per_tensor":
        bound = amax
    elif granularity == "per_head":
        bound = amax[:, None, :, None]
    else:
        bound = amax.repeat_interleave(16, 2)[:, :, :37].transpose(1, 2)[..., None]
    assert torch.all(err <= bound * E4M3_REL_STEP + 1e-12)


def test_zero_groups_get_zero_descale_and_no_nan():
    x = torch.randn(1, 8, 2, 32)
    x[:, :, 1] = 0
    xq, descale = quantize_fp8(x)
    assert descale[0, 1] == 0 and descale[0, 0] > 0
    back = dequantize_fp8(xq, descale)
    assert torch.isfinite(back).all() and torch.all(back[:, :, 1] == 0)


def test_saturation_at_448():
    x = torch.zeros(1, 2, 1, 16)
    x[0, 0, 0, 0] = 1e4
    x[0, 1, 0, 0] = -1e4
    xq, descale = quantize_fp8(x)
    assert xq.float().abs().max() == FP8_E4M3_MAX
    assert torch.allclose(dequantize_fp8(xq, descale)[0, :, 0, 0], torch.tensor([1e4, -1e4]))


def test_hadamard_keeps_qk_and_is_orthogonal():
    torch.manual_seed(1)
    q, k = torch.randn(2, 5, 4, 128, dtype=torch.float64), torch.randn(2, 7, 4, 128, dtype=torch.float64)
    qr, kr = hadamard_rotate(q, seed=3), hadamard_rotate(k, seed=3)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    sr = torch.einsum("bqhd,bkhd->bhqk", qr, kr)
    assert torch.allclose(s, sr, atol=1e-10)
    assert torch.allclose(hadamard_rotate(qr, seed=3, inverse=True), q, atol=1e-12)
    assert not torch.allclose(hadamard_rotate(q, seed=4), qr)


def test_hadamard_spreads_outliers():
    """FA3's setup (N(0, 1) plus N(0, 100) on 0.1% of entries): the rotation lowers each head's peak-to-RMS ratio,
    i.e. the absmax that sets the quantisation scale, while keeping the RMS (R is orthogonal)."""
    gen = torch.Generator().manual_seed(2)
    shape = (1, 512, 4, 128)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    hot = torch.rand(shape, generator=gen, dtype=torch.float64) < 1e-3
    x = x + hot * torch.randn(shape, generator=gen, dtype=torch.float64) * 10
    xr = hadamard_rotate(x, seed=7)

    def peak_to_rms(t):
        return t.abs().amax(dim=(1, 3)) / t.pow(2).mean(dim=(1, 3)).sqrt()

    assert torch.allclose(x.pow(2).mean(), xr.pow(2).mean())
    assert torch.all(peak_to_rms(xr) < 0.5 * peak_to_rms(x))


def test_bad_inputs_name_the_argument():
    x = torch.randn(1, 4, 2, 48)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        quantize_fp8(x, hadamard=True)
    with pytest.raises(ValueError, match="granularity"):
        quantize_fp8(torch.randn(1, 4, 2, 32), granularity="per_row")
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_fp8(torch.randn(1, 4, 2, 32).to(torch.float64))
    with pytest.raises(ValueError, match="x must have 4 dimensions"):
        quantize_fp8(torch.randn(4, 2, 32))
    with pytest.raises(TypeError, match="hadamard must be a bool"):
        quantize_fp8(torch.randn(1, 4, 2, 32), hadamard=1)
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_fp8(torch.full((1, 4, 2, 32), float("nan")))
    with pytest.raises(TypeError, match="x_fp8 must have dtype"):
        dequantize_fp8(torch.randn(1, 4, 2, 32), torch.ones(()))
