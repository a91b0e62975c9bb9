"""Programmatic dependent launch of the engine's decode-step kernels (flashdecode.engine.layers.pdl): the setting,
its wiring into every launch of a step, the PDL variants compiled for sm_90 (waits before the first access to
memory, weight prefetch before the wait), and on a Hopper GPU: results bitwise equal with PDL on and off, kernel
by kernel and for whole CUDA-graphed decode steps."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import DEVICE, HAS_CUDA
from helpers import run_sm90_compile_script
from flashdecode.engine.config import config_from_dict
from flashdecode.engine.layers import flat_gemm as fg
from flashdecode.engine.layers import fused, gemv
from flashdecode.engine.layers import pdl as pdl_setting

RUNS_KERNELS = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"
HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] >= 9
SMALL = fg.FlatGemmConfig(block_n=32, block_k=32, num_warps=4, num_stages=2)


def tiny_config(vocab: int = 160, hidden: int = 64, inter: int = 128, head_dim: int = 16):
    return config_from_dict(dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=head_dim, rms_norm_eps=1e-5, max_position_embeddings=256))


def test_resolve_pdl_is_one_checked_decision(monkeypatch):
    assert pdl_setting.resolve_pdl("auto", "cpu") is False
    assert pdl_setting.resolve_pdl(False, "cpu") is False
    with pytest.raises(ValueError, match="pdl=True needs a CUDA GPU"):
        pdl_setting.resolve_pdl(True, "cpu")
    with pytest.raises(ValueError, match="pdl must be"):
        pdl_setting.resolve_pdl("on", "cpu")
    with pytest.raises(TypeError, match="pdl must be"):
        pdl_setting.resolve_pdl(1, "cpu")
    monkeypatch.setattr(pdl_setting, "pdl_supported", lambda device: True)
    assert pdl_setting.resolve_pdl(True, "cuda") is True
    assert pdl_setting.resolve_pdl("auto", "cuda") is pdl_setting.AUTO_ON
    monkeypatch.setattr(pdl_setting, "AUTO_ON", True)
    assert pdl_setting.resolve_pdl("auto", "cuda") is True
    assert pdl_setting.launch_options(True) == {"launch_pdl": True} and pdl_setting.launch_options(False) == {}


def test_prefetch_columns_are_whole_lines_within_the_budget():
    budget = pdl_setting.PREFETCH_BYTES
    # Llama-3-8B's decode linears (bf16): qkv, o_proj, gate_up, down_proj
    for rows, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        cols = pdl_setting.prefetch_columns(rows, k, 2)
        assert cols >= 64 and cols % 64 == 0 and cols & (cols - 1) == 0  # whole 128-byte lines, a power of two
        # the most whole lines within the budget, or the per-row cap
        assert rows * cols * 2 <= budget
        assert 2 * cols * rows * 2 > budget or cols == pdl_setting.PREFETCH_MAX_COLUMNS
    assert pdl_setting.prefetch_columns(128256, 4096, 2) == 0  # the lm_head: not one line per row in the budget
    assert pdl_setting.prefetch_columns(64, 16, 4) == 0  # a row shorter than a line
    # short rows: the row rounded up to a power of two (the kernel clamps the columns into the row)
    assert pdl_setting.prefetch_columns(64, 100, 2) == 128
    args = pdl_setting.linear_launch_args(True, 4096, 4096, torch.empty(1, dtype=torch.bfloat16))
    assert args == dict(USE_PDL=True, PREFETCH_K=1024, LINE_ELEMS=64, launch_pdl=True)
    assert pdl_setting.linear_launch_args(False, 4096, 4096, torch.empty(1)) == {}


def test_llm_rejects_bad_pdl_before_building_anything():
    from flashdecode.engine import LLM

    with pytest.raises(ValueError, match="pdl"):
        LLM(tiny_config(), device="cpu", use_tqdm=False, pdl="yes")
    with pytest.raises(TypeError, match="pdl"):
        LLM(tiny_config(), device="cpu", use_tqdm=False, pdl=None)
    if not HOPPER:
        with pytest.raises(ValueError, match="pdl=True"):
            LLM(tiny_config(), device=DEVICE, use_tqdm=False, pdl=True)


@pytest.mark.skipif(not RUNS_KERNELS, reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
def test_every_kernel_launch_of_a_step_carries_the_engines_setting(monkeypatch):
    """With the setting installed on the model, every launch of the fused kernels, the GEMV (batch 1) and the flat
    GEMM (batch 2) gets pdl=True; installed off, every one gets False. (The launches themselves run without PDL
    here: the interpreter cannot run it.)"""
    from flashdecode.engine import LLM, SamplingParams

    seen: dict[str, list[bool]] = {}

    def recording(module, name):
        real = getattr(module, name)

        def launch(*args, pdl=False, **kw):
            seen.setdefault(name, []).append(pdl)
            return real(*args, pdl=False, **kw)

        monkeypatch.setattr(module, name, launch)

    for module, name in ((fused, "add_rms_norm"), (fused, "rope_and_store"), (fused, "silu_and_mul"),
                         (gemv, "gemv"), (fg, "flat_gemm")):
        recording(module, name)
    dtype = torch.float16 if HAS_CUDA else torch.float32
    llm = LLM(tiny_config(), device=DEVICE, dtype=dtype, max_num_seqs=2, use_tqdm=False, enforce_eager=True,
              flat_gemm=False, pdl=False)
    llm.model.use_fused = llm.model.use_gemv = True  # the CUDA defaults, also on the CPU
    table = fg.ChoiceTable()
    for n, k in fg.linear_shapes(llm.model):
        for m in fg.M_BUCKETS:
            table.choices[(m, n, k)] = fg.Choice("flat", SMALL, 1.0, 2.0)
    fg.install(llm.model, table)
    params = SamplingParams(max_tokens=2, ignore_eos=True)  # a prefill and one decode step
    for enabled in (True, False):
        pdl_setting.install(llm.model, enabled)
        seen.clear()
        llm.generate([[1, 2, 3, 4, 5]], params, use_tqdm=False)  # batch 1: GEMVs
        llm.generate([[6, 7, 8], [9, 10, 11, 12]], params, use_tqdm=False)  # batch 2: flat GEMMs
        assert set(seen) == {"add_rms_norm", "rope_and_store", "silu_and_mul", "gemv", "flat_gemm"}
        assert all(flag is enabled for flags in seen.values() for flag in flags), seen


_SM90_SCRIPT = r'''
import re
import sys
from flashdecode.engine.layers import flat_gemm, fused, gemv
sys.path.insert(0, "tests")
from helpers import compile_for_sm90

MEMORY = re.compile(r"\b(ld|st|atom|red)\.global|cp\.async")
bf = "*bf16"
pointers = dict(X=bf, RES=bf, W=bf, OUT=bf, NORM_W=bf, BIAS=bf, RES_OUT=bf, GU=bf, QKV=bf, Q_OUT=bf, K_OUT=bf,
                V_OUT=bf, K_CACHE=bf, V_CACHE=bf, POS="*i64", SLOTS="*i64", COS="*fp32", SIN="*fp32", eps="fp32",
                stride_o="i32", stride_q="i32", stride_k="i32")
linear = dict(HAS_BIAS=False, LINE_ELEMS=64)
kernels = [
    ("add_rms_norm", fused._add_rms_norm_kernel, dict(HAS_RES=True, BLOCK=4096), {}),
    ("rope_and_store", fused._rope_store_kernel, dict(NHEADS=32, NHEADS_KV=8, HALF=64, BLOCK_H=32, BLOCK_HK=8,
                                                      QUANT=False), {}),
    ("silu_and_mul", fused._silu_mul_kernel, dict(BLOCK=1024), {}),
] + [
    (f"gemv {p}", gemv._gemv_kernel, dict(linear, PROLOGUE=p, STORE_RES=p == 3, EVEN_N=True, EVEN_K=True,
                                          BLOCK_N=16, BLOCK_K=1024, NORM_BLOCK=4096, PREFETCH_K=1024),
     dict(num_warps=8)) for p in (0, 1, 3)
] + [
    (f"flat_gemm {p}", flat_gemm._flat_gemm_kernel, dict(linear, PROLOGUE=p, EPILOGUE=0, STORE_RES=p == 3, BLOCK_M=16,
                                                         BLOCK_N=64, BLOCK_K=128, NORM_BLOCK=1024,
                                                         PRECISION="tf32", PREFETCH_K=512),
     dict(num_warps=4, num_stages=3)) for p in (0, 1)
] + [
    ("flat_gemm silu*mul epilogue", flat_gemm._flat_gemm_kernel,
     dict(linear, PROLOGUE=3, EPILOGUE=1, STORE_RES=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, NORM_BLOCK=1024,
          PRECISION="tf32", PREFETCH_K=512), dict(num_warps=4, num_stages=3)),
]
# 8-bit pages written by the rope kernel (fused.QUANT_ROPE_STORE): e4m3 and int8 codes, float32 scales
quant_pages = {"*fp8e4nv": 448.0, "*i8": 127.0}
kernels += [(f"rope_and_store into {t[1:]} pages", fused._rope_store_kernel,
             dict(NHEADS=32, NHEADS_KV=8, HALF=64, BLOCK_H=32, BLOCK_HK=8, QUANT=True, QMAX=qmax),
             dict(types=dict(K_CACHE=t, V_CACHE=t, K_SCALE="*fp32", V_SCALE="*fp32")))
            for t, qmax in quant_pages.items()]
for name, fn, consts, opts in kernels:
    types = {n: t for n, t in pointers.items() if n in fn.arg_names}
    opts = dict(opts)
    types.update(opts.pop("types", {}))
    off = compile_for_sm90(fn, types, dict(consts, USE_PDL=False), **opts).asm["ptx"]
    assert "griddepcontrol" not in off and "prefetch.global.L2" not in off, name
    ptx = compile_for_sm90(fn, types, dict(consts, USE_PDL=True), **opts).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    release = ptx.find("griddepcontrol.launch_dependents")
    first_access = MEMORY.search(ptx).start()
    # the wait precedes every memory access (read or write) and the release follows it
    assert 0 <= wait < release < first_access, (name, wait, release, first_access)
    if "pages" in name:  # the hardware's e4m3 conversion / int8 codes from the floored value (quantize_rows)
        assert ("cvt.rn.satfinite.e4m3x2.f32" if "fp8" in name else "cvt.rzi.s16.f32") in ptx, name
    if name.startswith(("gemv", "flat_gemm")):  # weight rows hinted into L2 before the wait
        assert 0 <= ptx.find("prefetch.global.L2") < wait, name
    else:
        assert "prefetch.global.L2" not in ptx, name
print("compiled")
'''


def test_pdl_variants_compile_for_sm90_and_wait_before_touching_memory():
    run_sm90_compile_script(_SM90_SCRIPT)


# ------------------------------------------------------------------------------------------------------ GPU
hopper_only = pytest.mark.skipif(not HOPPER, reason="PDL needs a GPU of compute capability >= 9.0")


@pytest.mark.gpu
@hopper_only
def test_kernels_give_the_same_bits_with_and_without_pdl():
    """Each launcher with pdl=True (right behind the same launch without it, on one stream) writes exactly what it
    writes without PDL: Llama-3-8B widths, bf16, the flat GEMM at 2 / 16 / 40 rows and the GEMV, every prologue."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16) * scale

    def same_bits(launch):
        off, on = launch(False), launch(True)
        torch.cuda.synchronize()
        off, on = (off, on) if isinstance(off, tuple) else ((off,), (on,))
        assert all(torch.equal(a, b) for a, b in zip(off, on))

    hidden, inter, nheads, nheads_kv, d = 4096, 2048, 32, 8, 128
    norm_w = rand(hidden)
    x, res = rand(16, hidden), rand(16, hidden)

    def norm(pdl):
        residual = res.clone()  # updated in place
        return fused.add_rms_norm(x, norm_w, 1e-5, residual, pdl=pdl), residual

    same_bits(norm)
    gate_up = rand(16, 2 * inter)
    same_bits(lambda pdl: fused.silu_and_mul(gate_up, pdl=pdl))
    qkv = rand(16, (nheads + 2 * nheads_kv) * d)
    positions = torch.randint(0, 512, (16,), generator=gen, device="cuda")
    tables = torch.rand(512, d, generator=gen, device="cuda"), torch.rand(512, d, generator=gen, device="cuda")
    slots = torch.randperm(64 * 16, generator=gen, device="cuda")[:16]
    pages = torch.zeros(64, 16, nheads_kv, d, device="cuda", dtype=torch.bfloat16)

    def rope(pdl):
        k_cache, v_cache = pages.clone(), pages.clone()
        q, k, v = fused.rope_and_store(qkv, positions, *tables, slots, k_cache, v_cache, nheads, nheads_kv, d,
                                       pdl=pdl)
        return q, k, v, k_cache, v_cache

    same_bits(rope)
    w_qkv, w_down = rand(6144, hidden, scale=0.02), rand(hidden, inter, scale=0.02)
    for m in (2, 16, 40):
        xs, rs, gu = rand(m, hidden), rand(m, hidden), rand(m, 2 * inter)
        same_bits(lambda pdl: fg.flat_gemm(xs, w_qkv, pdl=pdl))
        same_bits(lambda pdl: fg.flat_gemm(xs, w_qkv, prologue=fg.ADD_NORM, residual=rs, norm_weight=norm_w,
                                           eps=1e-5, pdl=pdl))
        same_bits(lambda pdl: fg.flat_gemm(gu, w_down, prologue=fg.SILU_MUL, pdl=pdl))
        same_bits(lambda pdl: fg.flat_gemm(xs, w_qkv, epilogue=fg.EPILOGUE_SILU_MUL, pdl=pdl))  # as a gate_up
    one, r1, gu1 = rand(1, hidden), rand(1, hidden), rand(1, 2 * inter)
    for prologue in (gemv.PLAIN, gemv.RMSNORM, gemv.ADD_NORM):
        same_bits(lambda pdl: gemv.gemv(one, w_qkv, prologue=prologue, residual=r1, norm_weight=norm_w, eps=1e-5,
                                        pdl=pdl))
    same_bits(lambda pdl: gemv.gemv(gu1, w_down, prologue=gemv.SILU_MUL, pdl=pdl))


@pytest.mark.gpu
@hopper_only
def test_cuda_graphed_decode_steps_give_the_same_logits_with_and_without_pdl():
    """A tiny random Llama decoding 5 sequences (bucket 8: flat GEMMs) and then 1 (the GEMV path) inside CUDA graphs:
    the logits of every step are bitwise equal with PDL on and off (two engines sharing the weights)."""
    from flashdecode.engine import LLM, SamplingParams
    from flashdecode.engine.models import model_class

    cfg = tiny_config(vocab=512, hidden=256, inter=512, head_dim=64)
    model = model_class(cfg)(cfg, torch.bfloat16, torch.device("cuda"), max_positions=512)
    model.init_random_(0, std=0.05)
    table = fg.ChoiceTable()
    for n, k in fg.linear_shapes(model) + [tuple(model.lm_head_weight.shape)]:
        for m in fg.M_BUCKETS:
            table.choices[(m, n, k)] = fg.Choice("flat", fg.FlatGemmConfig(32, 64, 4, 3), 1.0, 2.0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (9, 130, 33, 257, 70)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def run(pdl: bool):
        llm = LLM(model, max_num_seqs=8, max_model_len=512, page_size=16, flat_gemm=table, pdl=pdl, use_tqdm=False)
        assert llm.runner.graphs and llm.pdl is pdl and model.use_pdl is pdl
        logits = []
        real = llm.runner.decode

        def decode(seqs, tables, **kw):  # kw: ahead=True where async scheduling launches a step early
            out, tokens = real(seqs, tables, **kw)
            logits.append(out.clone())  # stream-ordered: the copy runs right after this step's replay
            return out, tokens

        llm.runner.decode = decode
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        tokens += [o.token_ids for o in llm.generate(prompts[:1], params, use_tqdm=False)]
        del llm
        return tokens, logits

    tokens_off, logits_off = run(False)
    tokens_on, logits_on = run(True)
    assert tokens_on == tokens_off
    assert len(logits_on) == len(logits_off) >= 10
    assert {t.shape[0] for t in logits_off} >= {1, 5}
    for a, b in zip(logits_off, logits_on):
        assert torch.equal(a, b)
