"""The engine with 8-bit KV pages (LLM(kv_cache_dtype="fp8" | "int8")) on the tiny checkpoints, CPU: greedy tokens
equal the fp32-cache engine's for the first tokens, decode logits within a bound of them, and the pool holds
more tokens in the same memory."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import random_prompts, save_tiny
from helpers import DEVICE
from flashdecode.engine import LLM, SamplingParams
from flashdecode.engine.kv_quant import QuantPages

NEW_TOKENS = 10
# The decode plan's capacity (block-table width x page size): above 128 keys the interpreter's policy splits it in
# 16-key splits, one program each per (sequence, kv head) however short the sequences; 144 keeps the split path (9
# splits and their merge) at about half the programs of the default 256.
MAX_MODEL_LEN = 144


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("kvq") / "llama", "llama")


def _run(path, kv_cache_dtype, backend, prompts, new_tokens):
    """Greedy outputs and every decode step's logits (float32 (batch, vocab) per step). The flashdecode backend
    runs where the kernels do (the GPU, with CUDA graphs, or the CPU interpreter)."""
    device = DEVICE if backend == "flashdecode" else torch.device("cpu")
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    llm = LLM(path, device=device, dtype=dtype, attn_backend=backend, max_num_seqs=4, page_size=4,
              kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
    steps = []
    decode = llm.runner.decode

    def recording(*args, **kw):
        logits, greedy = decode(*args, **kw)
        steps.append(logits.float().cpu().clone())
        return logits, greedy

    llm.runner.decode = recording
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    return llm, [o.token_ids for o in outs], steps


@pytest.mark.parametrize("kv_cache_dtype,backend,lengths,new_tokens", [
    ("fp8", "torch", (7, 13, 3, 9), NEW_TOKENS), ("int8", "torch", (7, 13, 3, 9), NEW_TOKENS),
    ("fp8", "flashdecode", (6, 3), 4)])  # the Triton kernels in the interpreter: a short run
def test_greedy_tokens_and_logits_close_to_the_float_cache(ckpt, kv_cache_dtype, backend, lengths, new_tokens):
    """Decode logits stay within a bound of the same engine's with float pages (fp32 on the CPU, bf16 on the GPU)
    while the tokens so far agree, and greedy tokens agree except where the float run's top two logits are closer
    than twice that bound (the random tiny model has such near-ties: the quantised cache may then pick the other
    one, and the sequences part)."""
    prompts = random_prompts(lengths, seed=2)
    _, want, want_logits = _run(ckpt, "auto", backend, prompts, new_tokens)  # the same engine, float pages
    llm, got, got_logits = _run(ckpt, kv_cache_dtype, backend, prompts, new_tokens)
    assert isinstance(llm.runner.kv_caches[0][0], QuantPages)
    assert llm.runner.pool.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache_dtype]
    scale = max(x.abs().max().item() for x in want_logits)
    bound = (0.02 if kv_cache_dtype == "fp8" else 0.01) * scale
    agreed = 0
    for r, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0]  # the prefill attends the unquantised K/V
        for step in range(new_tokens - 1):  # token step + 1 comes from decode step ``step``
            ref_row, row = want_logits[step][r], got_logits[step][r]
            assert ref_row.argmax().item() == w[step + 1]  # rows are the prompts, in order
            assert (row - ref_row).abs().max().item() <= bound, (r, step)
            if g[step + 1] != w[step + 1]:
                top2 = ref_row.topk(2).values
                assert (top2[0] - top2[1]).item() <= 2 * bound, ("parted without a near-tie", r, step)
                break
            agreed += 1
    assert agreed >= 2 * len(prompts), (got, want)


def test_pool_holds_about_twice_the_tokens(ckpt):
    """The same kv_cache_memory holds more pages with 8-bit K/V (head dim 16 here: 2 x (16 + 4) bytes per token-head
    instead of 2 x 64 for fp32)."""
    f32 = LLM(ckpt, device="cpu", dtype="float32", page_size=4, kv_cache_memory=1 << 20)
    fp8 = LLM(ckpt, device="cpu", dtype="float32", page_size=4, kv_cache_memory=1 << 20, kv_cache_dtype="fp8")
    d = f32.config.head_dim
    expect = (2 * d * 4) / (2 * (d + 4))
    ratio = fp8.block_manager.num_pages / f32.block_manager.num_pages
    assert abs(ratio - expect) < 0.05 * expect, (ratio, expect)


def test_bad_kv_cache_dtype(ckpt):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(ckpt, device="cpu", kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs attn_backend"):
        LLM(ckpt, device="cpu", attn_backend="sdpa", kv_cache_dtype="fp8")


def test_generate_cli_kv_cache_dtype(ckpt, capsys):
    """`flashdecode generate --kv-cache-dtype int8` runs the 8-bit pool and prints the same greedy tokens as auto for
    a prompt without near-ties (the first generated tokens)."""
    from flashdecode.cli import main

    outs = {}
    for kv in ("auto", "int8"):
        code = main(["generate", "--model", str(ckpt), "--device", "cpu", "--dtype", "float32", "--prompt",
                     "5,17,42,99,3,8", "--max-tokens", "3", "--page-size", "4", "--kv-cache-dtype", kv])
        out = capsys.readouterr().out
        assert code in (0, None), out
        outs[kv] = [line for line in out.splitlines() if line.startswith("token ids:")]
    assert outs["int8"] and outs["int8"] == outs["auto"]


def test_batch_invariant_engine_on_8bit_pages(ckpt):
    """LLM(batch_invariant=True, kv_cache_dtype="fp8"): its decode plans are batch-invariant on the e4m3 pages, and
    a sequence's greedy tokens alone equal those it gets in a batch."""
    llm = LLM(ckpt, device=DEVICE, dtype="float32", attn_backend="flashdecode", batch_invariant=True,
              kv_cache_dtype="fp8", max_num_seqs=4, page_size=4, kv_cache_memory=1 << 20, use_tqdm=False)
    prompts = random_prompts((7, 3, 12), seed=5)
    params = SamplingParams(max_new_tokens=4)
    alone = llm.generate([prompts[0]], params)[0].token_ids
    batched = llm.generate(prompts, params)
    assert batched[0].token_ids == alone and len(alone) == 4
    plans = list(llm.backend.plans.values())
    assert plans and all(p.batch_invariant and p.kv_dtype == torch.float8_e4m3fn for p in plans)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_torch_quantised_write_matches_append_kv(dtype):
    """A CPU engine without the Triton interpreter quantises its new tokens in PyTorch (quantize_tokens): the same
    codes and scales as append_kv's quantising write (incl. an all-zero and a NaN token, which stays local)."""
    from flashdecode import append_kv
    from flashdecode.engine.kv_quant import quantize_tokens

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, 32, generator=gen) * 3
    x[2, 1] = 0.0
    x[4, 0, 5] = float("nan")
    data, scale = quantize_tokens(x, dtype)
    cache = torch.zeros(1, 8, 2, 32, dtype=dtype, device=DEVICE)
    scales = torch.zeros(1, 8, 2, device=DEVICE)
    xd = x.to(DEVICE)
    append_kv(cache, cache.clone(), xd[None], xd[None].clone(), torch.zeros(1, dtype=torch.int32, device=DEVICE),
              k_scale=scales, v_scale=scales.clone())
    assert torch.equal(scale[2, 1], torch.tensor(0.0)) and torch.isnan(scale[4, 0]) and torch.isfinite(scale[4, 1])
    torch.testing.assert_close(scale, scales[0, :6].cpu(), equal_nan=True)
    assert torch.equal(data.view(torch.uint8), cache[0, :6].cpu().view(torch.uint8))
