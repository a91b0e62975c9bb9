"""benchmarks/probes/fp8_mma_design.py: the facts docs/decisions.md quotes - an e4m3 Gluon mma_v2 is a tensor-core
e4m3 MMA on sm_89 but conversions + f16 MMAs on sm_90 (Triton's ptxas, no GPU); the all-e4m3 decode needs q and
P * v_scale in two e4m3 parts each to stay within the FlashAttention rule."""

from helpers import run_sm90_compile_script

from benchmarks.probes.fp8_mma_design import error_ratios

_MMA_SCRIPT = r'''
from benchmarks.probes.fp8_mma_design import mma_ops
ada, hopper = mma_ops(89), mma_ops(90)
assert ada["ptx"] == hopper["ptx"] == ["mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"], (ada, hopper)
assert set(ada["sass"]) == {"QMMA.16832.F32.E4M3.E4M3"}, ada
assert "HMMA.16816.F32" in hopper["sass"] and hopper["sass"].get("F2FP.F16.E4M3.UNPACK_B", 0) > 0, hopper
assert not any(op.startswith("QMMA") for op in hopper["sass"]), hopper
print("compiled")
'''


def test_e4m3_mma_v2_is_emulated_on_hopper():
    run_sm90_compile_script(_MMA_SCRIPT)


def test_two_e4m3_parts_of_q_and_p_meet_the_rule():
    ratios = error_ratios(512, seed=1)
    assert ratios[(1, 1)] > 3.0  # one part each: outside the rule's 3x
    assert ratios[(2, 2)] < 1.0 and ratios[(3, 3)] < ratios[(2, 2)]
