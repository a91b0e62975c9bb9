"""benchmarks/probes/fp8_decode_gluon.py: the sm_90 code docs/decisions.md quotes (Triton's ptxas, no GPU) - the
hand-laid e4m3 stage 1 reads K and V from shared memory with ldmatrix only (8 non-transposed and 8 transposed per
thread and 128-key block, no 8-bit shared loads, no shared stores in the KV loop), converts with one PRMT, one shift
and one AND per two values (no conversion-unit instruction), runs 64 HMMAs a block and spills nothing. Its numerics
and times are the GPU's (the probe itself); the Gluon kernel does not run in the CPU interpreter."""

from helpers import run_sm90_compile_script

_SCRIPT = r'''
from benchmarks.probes.fp8_decode_gluon import sass_loop_opcodes
r = sass_loop_opcodes()
loop = r["loop"]
assert r["resources"] and " STACK:0 " in r["resources"][0], r["resources"]
assert loop.get("HMMA.16816.F32") == 64, loop
assert loop.get("LDSM.16.M88.4") == 8 and loop.get("LDSM.16.MT88.4") == 8, loop
assert loop.get("PRMT") == 128 and loop.get("LOP3.LUT", 0) >= 128, loop
assert not [op for op in loop if op.startswith(("F2FP.F16.E4M3", "STS", "LDS.")) or op == "LDS"], loop
assert 0 < r["loop_instructions"] < 982, r  # the resolved Triton loop: 982 (docs/decisions.md)
print("compiled")
'''


def test_gluon_e4m3_loop_reads_pairs_by_ldmatrix_and_converts_by_bits():
    run_sm90_compile_script(_SCRIPT)
