"""benchmarks/probes/decode_warp_split.py's prototype stage 1 (keys split across warps, each with its own softmax
state): right on the CPU interpreter against the float64 reference on the dequantised cache (fp16 q: the
interpreter's 3-D bf16 dots are not exact), and compiled for sm_90 with the loop the probe is for - 2 CTA barriers
per block, no spills (the GPU times it)."""

import pytest
import torch

from benchmarks.probes.decode_warp_split import warp_split_decode
from flashdecode import reference as ref
from helpers import DEVICE, assert_fa_close, randn, run_sm90_compile_script

pytestmark = pytest.mark.probes
FP8 = torch.float8_e4m3fn


def _cache(gen, batch, seqlen, nheads_kv, headdim):
    """An e4m3 cache (batch, seqlen, nheads_kv, headdim) with per-token-head scales, and its dequantised float64
    copy."""
    out = []
    for _ in range(2):
        x = randn(batch, seqlen, nheads_kv, headdim, gen=gen) * 3
        scale = (x.abs().amax(-1) / 448.0).clamp_min(1e-12)
        x8 = (x / scale[..., None]).to(FP8)
        out += [x8, scale, x8.double() * scale.double()[..., None]]
    return out


@pytest.mark.parametrize("batch,seqlen,group,splits,warps,keys_per_warp,sum_tile", [
    (1, 300, 8, 3, 4, 32, False),   # ragged last block and split
    (2, 300, 8, 3, 4, 32, True),
    (3, 77, 5, 4, 4, 16, True),     # a group padded to 16 rows, the last split empty
    (1, 50, 2, 2, 4, 16, False),    # splits shorter than a block: masked blocks only, warps without keys
    (1, 256, 1, 1, 2, 16, False),   # one split, whole blocks
])
def test_warp_split_stage1_matches_the_reference(gen, batch, seqlen, group, splits, warps, keys_per_warp, sum_tile):
    nheads_kv, headdim = 2, 32
    k8, ks, k64, v8, vs, v64 = _cache(gen, batch, seqlen, nheads_kv, headdim)
    q = randn(batch, nheads_kv * group, headdim, gen=gen, dtype=torch.float16)
    scale = headdim ** -0.5
    out = warp_split_decode(q, k8, v8, ks, vs, scale, splits, warps, keys_per_warp, 1, sum_tile=sum_tile)
    lens = torch.tensor([seqlen] * q.shape[0], dtype=torch.int32, device=DEVICE)
    o64, _ = ref.decode_ref(q.double(), k64, v64, lens, softmax_scale=scale)
    o16, _ = ref.decode_ref(q, k64.half(), v64.half(), lens, softmax_scale=scale)
    assert_fa_close(out, o64, o16, factor=3.0, atol=2e-3)


_COMPILE_SCRIPT = r'''
import re
import sys
from benchmarks.probes.decode_warp_split import warp_split_stage1
sys.path.insert(0, "tests")
from helpers import _cuobjdump, compile_for_sm90, spilled_bytes

types = dict(Q="*bf16", K="*fp8e4nv", V="*fp8e4nv", KS="*fp32", VS="*fp32", O="*fp32", LSE="*fp32", score_scale="fp32")
for sum_tile in (False, True):
    consts = dict(GROUP=8, BLOCK_M=16, HEADDIM=128, W=4, KW=32, QUANT_CONVERT=2, V_FIRST=True, SUM_TILE=sum_tile)
    kernel = compile_for_sm90(warp_split_stage1, types, consts, 3, 4)
    sass = _cuobjdump(kernel, "-sass")
    code = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), a) for a, t in code for m in [re.search(r"BRA (0x[0-9a-f]+)", t)]
             if m and int(m.group(1), 16) < a]
    assert len(loops) == 1, loops  # the unmasked loop over whole blocks (the masked block follows it)
    barriers = sum("BAR.SYNC" in t for a, t in code if loops[0][0] <= a <= loops[0][1])
    assert barriers <= 2, barriers
    assert spilled_bytes(kernel) == 0, spilled_bytes(kernel)
    assert "mma.sync" in kernel.asm["ptx"]
print("compiled")
'''


def test_warp_split_stage1_compiles_for_hopper_with_two_barriers_per_block():
    run_sm90_compile_script(_COMPILE_SCRIPT)


def test_time_point_rows(gen, monkeypatch):
    """The probe's GPU loop on the CPU (the CUDA trace replaced by one call per function): a row for the resolved
    call naming its stage-1 kernel and one per variant, whose output matches the resolved call's."""
    import benchmarks.probes.decode_warp_split as probe

    def one_call(fn, calls):
        fn()
        return {"decode_split_kernel": 2.0, "merge_many_kernel": 1.0, "warp_split_stage1": 1.5}
    monkeypatch.setattr(probe, "kernel_times_us", one_call)
    cpu = torch.Generator(device=DEVICE).manual_seed(1)
    # 160 keys: the resolved call still splits (10 splits of 16 keys in the interpreter), at half the programs of 300
    rows = probe.time_point(160, ["4x16x1s*2", "2x16x1@3"], cpu, batch=1, nheads=8, nheads_kv=1, headdim=32,
                            calls=1, dtype=torch.float16, quant_convert=1, v_first=False)
    assert [r["variant"] for r in rows] == ["resolved", "4x16x1s*2", "2x16x1@3"]
    assert rows[0]["stage1_us"] == 2.0 and rows[0]["all_kernels_us"] == 4.5
    assert all(r["stage1_us"] == 1.5 and r["max_diff_vs_resolved"] < 2e-3 for r in rows[1:])
    assert rows[1]["splits"] == 2 * rows[0]["splits"] and rows[2]["splits"] == 3
