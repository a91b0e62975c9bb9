"""GluonFwdConfig (flashdecode/config.py) refuses what the Gluon forward kernels cannot take, with a ValueError
naming the field."""

import pytest

from flashdecode.config import GluonFwdConfig


def test_gluon_config_refuses_what_the_kernel_cannot_take():
    """Register budgets beyond an SM's 65536 or off setmaxnreg's grid, four consumers, a tile order other than
    round robin without two Q buffer sets (lpt: and without persistent CTAs), an unknown or removed tile order
    (zigzag), a removed option (ping-pong, exp2 emulation: no such field)."""
    for removed in (dict(pingpong=True), dict(exp2_emu_cols=32)):
        with pytest.raises(TypeError):
            GluonFwdConfig(**removed)
    with pytest.raises(ValueError, match="consumer_regs"):
        GluonFwdConfig(num_consumers=3)  # three warpgroups of 240 registers do not fit an SM
    with pytest.raises(ValueError, match="num_consumers"):
        GluonFwdConfig(num_consumers=4, consumer_regs=120)
    with pytest.raises(ValueError, match="producer_regs"):
        GluonFwdConfig(producer_regs=20)
    with pytest.raises(ValueError, match="tile_order"):
        GluonFwdConfig(tile_order="zigzag", persistent=True, q_buffers=2)
    with pytest.raises(ValueError, match="tile_order"):
        GluonFwdConfig(tile_order="pairs")
    with pytest.raises(ValueError, match="tile_order"):
        GluonFwdConfig(tile_order="snake", q_buffers=2)
    with pytest.raises(ValueError, match="tile_order"):
        GluonFwdConfig(tile_order="lpt", q_buffers=2)  # a list per persistent CTA
    assert GluonFwdConfig(num_consumers=3, consumer_regs=160).block_m == 192
    assert GluonFwdConfig(tile_order="pairs", q_buffers=2).tile_order == "pairs"



def test_v_tail_is_a_checked_bool():
    """GluonFwdConfig.v_tail (the ragged forward's V-tail zeroing; False is a timing ablation) is on by default and
    takes a bool only, named in the error."""
    assert GluonFwdConfig().v_tail is True
    with pytest.raises(TypeError, match="v_tail"):
        GluonFwdConfig(v_tail=1)
