"""GluonFwdConfig (ops/gluon_attention.py) refuses what the Gluon forward kernels cannot take, with a ValueError
naming the field."""

import pytest

from flashdecode.config import GluonFwdConfig


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
