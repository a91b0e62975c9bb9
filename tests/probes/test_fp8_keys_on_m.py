"""benchmarks/probes/fp8_keys_on_m.py: what docs/decisions.md quotes of it - the keys-on-M e4m3 stage 1 is accurate
(both PV forms within the FlashAttention rule's 3x of a bf16 PyTorch decode, in the interpreter) and its QK^T is an
8-bit wgmma on sm_90 (Triton's ptxas, no GPU)."""

import os

import pytest
import torch
from helpers import run_sm90_compile_script

from benchmarks.probes.fp8_keys_on_m import make_inputs, merge, reference, stage1

_WGMMA_SCRIPT = r'''
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from benchmarks.probes.fp8_keys_on_m import keys_on_m_stage1 as fn
types = dict(Q="*bf16", K="*fp8e4nv", V="*fp8e4nv", KS="*fp32", VS="*fp32", O="*fp32", LSE="*fp32",
             score_scale="fp32")
for v8 in (0, 1):
    consts = dict(GROUP=8, BLOCK_M=16, BLOCK_N=128, D=128, NUM_SPLITS=128, V8=v8, INTERPRETER=False)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4, num_stages=3)).asm["ptx"]
    mmas = set(re.findall(r"wgmma\.mma_async[\w.]+", ptx))
    assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in mmas, mmas
    assert ("wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16" in mmas) == (v8 == 0), mmas
    assert "mma.sync" not in ptx
print("compiled")
'''


def test_keys_on_m_qk_is_an_e4m3_wgmma_on_hopper():
    run_sm90_compile_script(_WGMMA_SCRIPT)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter check (the GPU run is the probe)")
@pytest.mark.parametrize("v8", [0, 1])
def test_keys_on_m_stage1_meets_the_rule(v8):
    gen = torch.Generator().manual_seed(3)
    q, k, v, ks, vs = make_inputs(640, 16, 2, 128, "cpu", gen)
    ref = reference(q, k, v, ks, vs)
    bound = 3 * (reference(q, k, v, ks, vs, q.dtype).double() - ref).abs().max().item()
    err = (merge(*stage1(q, k, v, ks, vs, 5, v8)).double() - ref).abs().max().item()
    assert err <= bound, (err, bound)
