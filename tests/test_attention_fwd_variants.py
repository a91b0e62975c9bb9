"""Forward launch variants against the float64 reference. (1) Long sequences on the descriptor path take a fixed,
untimed tile ("fwd_long", heuristics.use_fwd_long_config). (2) The forward with its unmasked loop pipelined by one
QK^T (PIPELINE_QK, fwd.attn_fwd_inner_pipelined, opt-in): causal / non-causal / sliding window, ragged tails (the
look-ahead dot reads past the last unmasked block), padded head dims, GQA, varlen with empty sequences. The interpreter emulates tensor descriptors, so
the path runs on the CPU (fp16); the GPU adds bf16 at the engine's head shape. An sm_90 compile on the CPU checks
that the pipelined tile keeps both score tiles in registers (no spills) on wgmma + TMA.
"""

from __future__ import annotations

import pytest
import torch

from flashdecode import heuristics
from flashdecode.ops import attention as attn_ops
from helpers import HAS_CUDA, KERNEL_DTYPES, run_sm90_compile_script
from test_attention import check_dense, check_varlen


@pytest.fixture(autouse=True)
def _pipelined(monkeypatch):
    """Descriptor path and PIPELINE_QK forced on, one fixed config (no autotuning); records launched kernels."""
    monkeypatch.setattr(attn_ops, "AUTOTUNE", False)
    monkeypatch.setattr(attn_ops, "TMA_MODE", "1")
    monkeypatch.setattr(attn_ops, "FWD_PIPELINE_QK", True)
    launched = []
    launch = attn_ops._launch
    monkeypatch.setattr(attn_ops, "_launch", lambda name, *a, **kw: (launched.append(name), launch(name, *a, **kw)))
    return launched


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, options)
CASES = [
    (1, 97, 97, 4, 2, 64, dict(causal=True)),
    (2, 33, 70, 2, 1, 64, {}),
    (1, 70, 97, 2, 2, 32, dict(causal=True, window_size=(40, 3))),
    (1, 129, 129, 2, 1, 80, dict(causal=True)),
    (1, 17, 130, 2, 2, 64, dict(causal=True)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[:6]}{c[6]}")
def test_pipelined_forward_matches_reference(gen, _pipelined, case):
    check_dense(gen, KERNEL_DTYPES[0], *case[:6], **case[6])
    assert _pipelined == ["fwd_pipelined"]


def test_pipelined_forward_varlen(gen, _pipelined):
    check_varlen(gen, KERNEL_DTYPES[0], [5, 0, 70, 33], [5, 3, 70, 40], 4, 1, 64, causal=True)
    assert _pipelined == ["fwd_pipelined"]


@pytest.mark.parametrize("dtype, softcap", [(torch.float32, 0.0), (torch.float16, 5.0)], ids=str)
def test_pipeline_skipped_where_it_does_not_apply(gen, _pipelined, dtype, softcap):
    """fp32 (tiles twice the size) and softcap keep the plain loop, and stay correct."""
    check_dense(gen, dtype, 1, 40, 70, 2, 1, 64, causal=True, softcap=softcap)
    assert _pipelined == ["fwd"]


@pytest.mark.parametrize("seqlen, launched", [(300, "fwd_long"), (100, "fwd")], ids=str)
def test_long_sequences_take_the_fixed_tile(gen, monkeypatch, _pipelined, seqlen, launched):
    """From PREFILL_FWD_LONG_MIN_KEYS keys (lowered here to 128) the descriptor forward skips autotuning."""
    monkeypatch.setattr(attn_ops, "FWD_PIPELINE_QK", False)
    monkeypatch.setattr(heuristics, "PREFILL_FWD_LONG_MIN_KEYS", 128)
    check_dense(gen, KERNEL_DTYPES[0], 1, seqlen, seqlen, 4, 2, 128, causal=True)
    assert _pipelined == [launched]


def test_fixed_tile_policy():
    assert heuristics.use_fwd_long_config(65536, 128, 2, True)
    assert not heuristics.use_fwd_long_config(65536, 256, 2, True)  # hd256 has its own tiles
    assert not heuristics.use_fwd_long_config(65536, 64, 2, True)  # not measured at hd64: autotuned
    assert not heuristics.use_fwd_long_config(65536, 128, 4, True)  # fp32
    assert not heuristics.use_fwd_long_config(65536, 128, 2, False)  # pointer path (pre-Hopper): autotuned
    assert not heuristics.use_fwd_long_config(heuristics.PREFILL_FWD_LONG_MIN_KEYS - 1, 128, 2, True)
    assert heuristics.PREFILL_FWD_LONG_CANDIDATES[0] == (128, 128, 8, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("case", [(1, 1057, 1057, 32, 8, 128, dict(causal=True)), (2, 777, 1500, 4, 4, 128, {}),
                                  (1, 1000, 1000, 4, 2, 64, dict(causal=True, window_size=(300, 0)))],
                         ids=lambda c: f"{c[:6]}{c[6]}")
def test_gpu_pipelined_forward_bf16(gen, _pipelined, case):
    check_dense(gen, torch.bfloat16, *case[:6], **case[6])
    assert _pipelined == ["fwd_pipelined"]


_COMPILE_SCRIPT = r'''
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashdecode.heuristics import PREFILL_FWD_PIPELINED_CANDIDATES
from flashdecode.kernels.fwd import attn_fwd_kernel
sys.path.insert(0, "tests")
from helpers import spilled_bytes

bm, bn, warps, stages = PREFILL_FWD_PIPELINED_CANDIDATES[0]
consts = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, IS_VARLEN=True, HAS_LEFT=False, HAS_RIGHT=True, SOFTCAP=False,
              DOT_PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn, USE_TMA=True, WARP_SPECIALIZE=False, RAW_MAX=False,
              PIPELINE_QK=True)
consts.update({n: 1 for n in attn_fwd_kernel.arg_names if n.startswith("stride_") and n.endswith("d")})
pointers = dict.fromkeys(["Q", "K", "V", "Out"], "*bf16") | {"Lse": "*fp32"} | dict.fromkeys(
    ["cu_seqlens_q", "cu_seqlens_k"], "*i32")
scalars = dict(qk_scale="fp32", softcap_log2="fp32")
sig = {n: "constexpr" if n in consts else pointers.get(n, scalars.get(n, "i32")) for n in attn_fwd_kernel.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(attn_fwd_kernel.arg_names)
         if n not in consts and (sig[n].startswith("*") or "stride" in n)}
kernel = triton.compile(ASTSource(attn_fwd_kernel, sig, constexprs=consts, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
ptx = kernel.asm["ptx"]
assert "wgmma" in ptx and "cp.async.bulk.tensor" in ptx, "pipelined forward not on TMA + wgmma"
assert spilled_bytes(kernel) == 0, "pipelined forward spills"
assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
print("compiled")
'''


def test_pipelined_forward_compiles_for_hopper_without_spills():
    run_sm90_compile_script(_COMPILE_SCRIPT)
