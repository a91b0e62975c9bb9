"""The Gluon forward's exp2 on the FMA pipe (kernels/gluon/attn_fwd.py _exp2_fma), replayed on the CPU in float32
with the kernel's exact sequence of operations: its error bound over a dense grid of the exponents a softmax
block produces (x = scaled score - row max, in [-130, 0], and -inf for masked keys), so that the GPU kernel's
emulated columns stay within float32 rounding of the MUFU's ex2.approx."""

import pytest
import torch

from flashdecode.kernels.gluon.attn_fwd import EXP2_CLAMP, EXP2_POLY, ROUND_MAGIC
from flashdecode.config import EXP2_EMU_DEGREES, GluonFwdConfig

# Max relative error on x >= -126 per degree: the polynomial's fit (1.0e-4, 2.8e-6, 9e-8) plus float32 rounding.
REL_BOUND = {3: 1.05e-4, 4: 3.5e-6, 5: 3.5e-7}


def _fma(a: torch.Tensor, b, c) -> torch.Tensor:
    """float32 fused multiply-add: the product of two float32 values is exact in float64; the sum is rounded once
    there and once to float32 (a double rounding that differs from the GPU's single one in rare last-bit ties)."""
    return (a.double() * b + c).float()


def exp2_emulated(x: torch.Tensor, degree: int) -> torch.Tensor:
    """_exp2_fma of float32 x, operation by operation: clamp, round by the magic constant, Horner's FMAs, the
    integer part added to the exponent bits (int32 wraparound)."""
    x = torch.clamp_min(x, EXP2_CLAMP.value)
    t = x + ROUND_MAGIC.value  # float32 add, round to nearest even: rint(x) in t's low mantissa bits
    f = x - (t - ROUND_MAGIC.value)
    coeffs = (1.0, ) + EXP2_POLY[degree]
    p = _fma(f, coeffs[degree], coeffs[degree - 1])
    for i in range(degree - 2, -1, -1):
        p = _fma(p, f.double(), coeffs[i])
    shifted = (t.view(torch.int32).to(torch.int64) << 23) & 0xFFFFFFFF
    bits = (p.view(torch.int32).to(torch.int64) + shifted) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def _grid() -> torch.Tensor:
    """Every float32 in [-1, 1] at a fine step plus a dense sweep of [-130, 0] (the fraction's full range at
    every integer part), float32."""
    dense = torch.linspace(-130.0, 0.0, 2_600_001, dtype=torch.float64)
    fine = torch.linspace(-1.0, 1.0, 400_001, dtype=torch.float64)
    halves = torch.arange(-130, 1, dtype=torch.float64) + 0.5  # the rounding's ties
    return torch.cat([dense, fine, halves, halves.nextafter(halves + 1), halves.nextafter(halves - 1)]).float()


@pytest.mark.parametrize("degree", EXP2_EMU_DEGREES)
def test_exp2_emulation_error_bound(degree):
    x = _grid()
    got = exp2_emulated(x, degree).double()
    want = torch.exp2(x.double())
    normal = x >= -126.0
    rel = ((got - want).abs() / want)[normal]
    assert rel.max().item() <= REL_BOUND[degree], f"degree {degree}: max relative error {rel.max().item():.3e}"
    # below 2**-126 (a float32's normal range) the result is not 2**x, but it stays below 2**-126, where the MUFU's
    # ex2.approx.ftz flushes to 0 anyway: a probability that small never moves a row sum >= 1
    tiny = got[~normal]
    assert torch.all((tiny >= 0) & (tiny < 2.0**-126))
    assert torch.all(got >= 0) and not torch.isnan(got).any()


@pytest.mark.parametrize("degree", EXP2_EMU_DEGREES)
def test_exp2_emulation_special_values(degree):
    """-inf (a masked key) and anything at or below the clamp give exactly +0.0; 0 (the row max) exactly 1;
    integers exactly 2**j (f = 0 leaves the polynomial's constant 1)."""
    x = torch.tensor([-float("inf"), -1e30, -200.0, -127.0, 0.0], dtype=torch.float32)
    got = exp2_emulated(x, degree)
    assert got.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0] and not torch.signbit(got).any()
    ints = torch.arange(-126, 1, dtype=torch.float32)
    assert torch.equal(exp2_emulated(ints, degree), torch.exp2(ints))


def test_exp2_polynomials_match_the_config_choices():
    """Every degree GluonFwdConfig accepts has coefficients in the kernel."""
    assert sorted(EXP2_POLY) == sorted(EXP2_EMU_DEGREES)
    assert all(len(EXP2_POLY[d]) == d for d in EXP2_POLY)


def test_gluon_config_refuses_what_the_kernel_cannot_take():
    """Emulated columns off the multiple-of-8 grid or past the block, unknown degrees, register budgets beyond an
    SM's 65536 or off setmaxnreg's grid, four consumers, a tile order other than round robin without two Q buffer
    sets (zigzag: and without persistent CTAs), an unknown tile order."""
    for bad in (dict(exp2_emu_cols=12), dict(exp2_emu_cols=136), dict(exp2_emu_cols=-8)):
        with pytest.raises(ValueError, match="exp2_emu_cols"):
            GluonFwdConfig(**bad)
    with pytest.raises(ValueError, match="exp2_emu_degree"):
        GluonFwdConfig(exp2_emu_cols=32, exp2_emu_degree=2)
    with pytest.raises(ValueError, match="consumer_regs"):
        GluonFwdConfig(num_consumers=3)  # three warpgroups of 240 registers do not fit an SM
    with pytest.raises(ValueError, match="num_consumers"):
        GluonFwdConfig(num_consumers=4, consumer_regs=120)
    with pytest.raises(ValueError, match="producer_regs"):
        GluonFwdConfig(producer_regs=20)
    with pytest.raises(ValueError, match="tile_order"):
        GluonFwdConfig(tile_order="zigzag", persistent=True)
    with pytest.raises(ValueError, match="tile_order"):
        GluonFwdConfig(tile_order="zigzag", q_buffers=2)
    with pytest.raises(ValueError, match="tile_order"):
        GluonFwdConfig(tile_order="pairs")
    with pytest.raises(ValueError, match="tile_order"):
        GluonFwdConfig(tile_order="snake", q_buffers=2)
    with pytest.raises(ValueError, match="tile_order"):
        GluonFwdConfig(tile_order="lpt", q_buffers=2)  # a list per persistent CTA
    assert GluonFwdConfig(num_consumers=3, consumer_regs=160).block_m == 192
    assert GluonFwdConfig(tile_order="zigzag", persistent=True, q_buffers=2).tile_order == "zigzag"
    assert GluonFwdConfig(tile_order="pairs", q_buffers=2).tile_order == "pairs"
