"""flash_decode(batch_invariant=True) / DecodePlan(batch_invariant=True) / LLM(batch_invariant=True): a sequence's
out and lse are bitwise identical alone and inside batches of other sizes with other neighbour lengths (contiguous
and paged caches, one and two new tokens, 8-bit caches), and still match the float64 reference (FlashAttention
rule, 3x). The batch-invariant config splits every sequence at fixed key offsets (FIXED_SPLIT,
heuristics.DECODE_BATCH_INVARIANT_SPLIT_KEYS): the CPU tests that need several splits per sequence run its config
with a small split size (dataclasses.replace of the resolved config, which stays batch-invariant)."""

import dataclasses

import pytest
import torch

import flashdecode
from flashdecode import DecodePath, heuristics
from flashdecode import reference as ref
from flashdecode.ops.decode import decode_config
from flashdecode.ops.decode_launch import plan_launch
from flashdecode.ops.decode_policy import _DecodeShape, decode_device
from helpers import DEVICE, KERNEL_DTYPES, assert_fa_close, grid, randn, run_sm90_compile_script

NHEADS, NHEADS_KV, HEADDIM = 4, 2, 32
TARGET_LEN = 45  # crosses several 16-key blocks (the interpreter's tile)
# (neighbour lengths, where the target sits, cache capacity): batches of other sizes, lengths and capacities. The
# long neighbours make the default policy split the target differently (its bits then differ by ~1 ulp in fp32).
BATCHES = [((), 0, 48), ((3, 300), 1, 320), ((400, 0, 1, 64, 7), 4, 400)]


def _target(gen, dtype, seqlen_q, nheads=NHEADS, nheads_kv=NHEADS_KV, headdim=HEADDIM, length=TARGET_LEN):
    """q (1, [seqlen_q,] nheads, headdim) and k, v (1, length, nheads_kv, headdim) of the sequence followed."""
    q_shape = (1, nheads, headdim) if seqlen_q == 1 else (1, seqlen_q, nheads, headdim)
    q = randn(*q_shape, gen=gen, dtype=dtype)
    k = randn(1, length, nheads_kv, headdim, gen=gen, dtype=dtype)
    v = randn(1, length, nheads_kv, headdim, gen=gen, dtype=dtype)
    return q, k, v


def _batch_around(gen, target, neighbours, slot, capacity):
    """q, k, v, lens of a batch with the target sequence at ``slot`` among random neighbours."""
    q_t, k_t, v_t = target
    _, length, hk, d = k_t.shape
    lens = list(neighbours[:slot]) + [length] + list(neighbours[slot:])
    b = len(lens)
    q = randn(b, *q_t.shape[1:], gen=gen, dtype=q_t.dtype)
    k = randn(b, capacity, hk, d, gen=gen, dtype=k_t.dtype)
    v = randn(b, capacity, hk, d, gen=gen, dtype=k_t.dtype)
    q[slot], k[slot, :length], v[slot, :length] = q_t[0], k_t[0], v_t[0]
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _run(q, k, v, lens, page_size, gen, plan=None, config=None, **kw):
    """flash_decode(batch_invariant=True) (or with ``config``, a FIXED_SPLIT config, or ``plan``.run) with lse;
    page_size > 0 pages the cache with a random page permutation (3 extra pages)."""
    if page_size:
        k, v, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=3, generator=gen)
    else:
        table = None
    if plan is not None:
        return plan.run(q, k, v, lens, block_table=table, return_lse=True, **kw)
    flag = dict(config=config) if config is not None else dict(batch_invariant=True)
    return flashdecode.flash_decode(q, k, v, lens, block_table=table, return_lse=True, **flag, **kw)


# Several splits per sequence on the CPU: 32-key splits (two interpreter blocks) folded 2 per merge step, so a
# 100-key target has 4 splits in 2 steps, and a 400-key cache gives its launch 13 splits (7 steps, the last ones
# all empty).
SMALL_SPLIT_KEYS, SMALL_MERGE_BLOCK_S = 32, 2
FIXED_TARGET_LEN = 100
# neighbours shorter and longer than the target, capacities from its own length (no trailing empty split) to 200
# (7 splits in 4 merge steps: the target's last 2 steps all empty). The interpreter runs every (sequence, split)
# program, empty or not, so the capacities are no larger than that needs.
FIXED_BATCHES = [((), 0, FIXED_TARGET_LEN), ((3, 150), 1, 160), ((200, 0, 1, 7), 3, 200)]


def _small_split_config(q, k, lens, **kw):
    """The batch-invariant config resolved for these tensors, with SMALL_SPLIT_KEYS-key splits of 16-key blocks."""
    kw = {n: kw[n] for n in ("k_scale", "v_scale", "window_size") if n in kw}
    config = decode_config(q, k, k, lens, batch_invariant=True, **kw)
    assert config.path is DecodePath.FIXED_SPLIT
    # (16-key blocks on the GPU too, whose tile for these small heads would be 128 keys, more than a split)
    return dataclasses.replace(config, block_n=16, split_keys=SMALL_SPLIT_KEYS, merge_block_s=SMALL_MERGE_BLOCK_S)


def _check_fixed_splits_in_batches(gen, target, page_size, config=None, **kw):
    """The target's (out, lse) in FIXED_BATCHES: bitwise equal to its result alone, which matches the float64
    reference (``kw``: scales of an 8-bit cache given per kv head, the same in every batch)."""
    results = []
    for neighbours, slot, capacity in FIXED_BATCHES:
        q, k, v, lens = _batch_around(gen, target, neighbours, slot, capacity)
        if config is None:
            config = _small_split_config(q, k, lens, **kw)
        out, lse = _run(q, k, v, lens, page_size, gen, config=config, **kw)
        results.append((out[slot], lse[slot]))
        if len(neighbours) == 0:
            qk = {n: t for n, t in kw.items() if n not in ("k_scale", "v_scale")}
            kd, vd = (k, v) if "k_scale" not in kw else (k.float() * kw["k_scale"][:, None],
                                                          v.float() * kw["v_scale"][:, None])
            o64, lse64 = ref.decode_ref(q.double(), kd.double(), vd.double(), lens, **qk)
            o_same, lse_same = ref.decode_ref(q, kd.to(q.dtype), vd.to(q.dtype), lens, **qk)
            assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)
            assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-4, name="lse")
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    return config


# every dtype x new tokens x layout on a GPU; on the CPU every pair of them (6 of the 12 interpreter cases)
@pytest.mark.parametrize("dtype, seqlen_q, page_size", grid(KERNEL_DTYPES, [1, 2], [0, 16, 5]))
def test_sequence_bitwise_equal_in_any_batch(gen, dtype, seqlen_q, page_size):
    target = _target(gen, dtype, seqlen_q)
    results = []
    for neighbours, slot, capacity in BATCHES:
        q, k, v, lens = _batch_around(gen, target, neighbours, slot, capacity)
        out, lse = _run(q, k, v, lens, page_size, gen)
        results.append((out[slot], lse[slot]))
        if len(neighbours) == 0:  # alone: also the float64 reference
            o64, lse64 = ref.decode_ref(q.double(), k.double(), v.double(), lens)
            o_same, lse_same = ref.decode_ref(q, k, v, lens)
            assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)
            assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-4, name="lse")
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@pytest.mark.parametrize("dtype, seqlen_q, page_size", [
    (torch.float16, 1, 0), (torch.float32, 2, 0), (torch.float16, 2, 16), (torch.float32, 1, 5),
    (torch.float16, 1, 64)])
def test_fixed_splits_bitwise_equal_in_any_batch(gen, dtype, seqlen_q, page_size):
    """A target of 4 fixed splits alone (no trailing empty split) and among shorter and longer neighbours (up to 3
    trailing empty splits, whole empty merge steps among them): the same bits, contiguous and paged (pages of 5
    straddle the splits, pages of 64 span two)."""
    _check_fixed_splits_in_batches(gen, _target(gen, dtype, seqlen_q, length=FIXED_TARGET_LEN), page_size)


@pytest.mark.parametrize("page_size", [0, 16])
def test_fixed_splits_on_an_8bit_cache(gen, page_size):
    """An e4m3 cache (scales per kv head) with two new tokens, in fixed splits: bitwise equal in any batch, and the
    float64 reference on the dequantised cache."""
    q_t, k_t, v_t = _target(gen, torch.float16, 2, length=FIXED_TARGET_LEN)
    scales = [torch.tensor([0.02, 0.05], device=DEVICE) for _ in range(2)]
    fp8 = torch.float8_e4m3fn
    target = (q_t, (k_t.float() / scales[0][:, None]).to(fp8), (v_t.float() / scales[1][:, None]).to(fp8))
    _check_fixed_splits_in_batches(gen, target, page_size, k_scale=scales[0], v_scale=scales[1])


def test_fixed_splits_with_options_in_any_batch(gen):
    """ALiBi, softcap and a window that starts mid-split, in fixed splits: bitwise equal in any batch, and the
    reference."""
    target = _target(gen, torch.float32, 2, length=FIXED_TARGET_LEN)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    _check_fixed_splits_in_batches(gen, target, 0, alibi_slopes=slopes, softcap=5.0, window_size=(70, 0))


def test_batch_invariant_config_splits_a_long_sequence(gen):
    """The resolved batch-invariant config is FIXED_SPLIT with DECODE_BATCH_INVARIANT_SPLIT_KEYS-key splits: a
    128k-key cache gives its launch 128k / 2048 = 64 splits (one for a cache of at most 2048 keys; with a window,
    as many as the window's keys need); and the kernels do split: a plan's partial buffer holds a finite lse for
    each of a 100-key sequence's 4 small splits and -inf for the launch's trailing ones."""
    q = randn(1, NHEADS, HEADDIM, gen=gen)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    config = decode_config(q, randn(1, 8, NHEADS_KV, HEADDIM, gen=gen), randn(1, 8, NHEADS_KV, HEADDIM, gen=gen),
                           lens, batch_invariant=True)
    assert config.path is DecodePath.FIXED_SPLIT and config.split_keys == heuristics.DECODE_BATCH_INVARIANT_SPLIT_KEYS
    assert decode_config(q, *[randn(1, 8, NHEADS_KV, HEADDIM, gen=gen)] * 2, lens, batch_invariant=True,
                         num_splits=1).path is DecodePath.UNSPLIT

    def grid_splits(capacity, window=(-1, -1)):
        k = torch.empty(1, capacity, NHEADS_KV, HEADDIM, device=DEVICE)
        shape = _DecodeShape(q, k, k, lens, None, None, 0.0, window)
        return plan_launch(config, shape.problem(capacity, batch_invariant=True)).grid_splits
    assert (grid_splits(131072), grid_splits(2048), grid_splits(2049)) == (64, 1, 2)
    assert grid_splits(131072, window=(4096, 0)) == 3

    dtype = KERNEL_DTYPES[0]
    q, k, v, lens = _batch_around(gen, _target(gen, dtype, 1, length=FIXED_TARGET_LEN), (7,), 0, 400)
    small = _small_split_config(q, k, lens)
    plan = flashdecode.DecodePlan(2, NHEADS, NHEADS_KV, HEADDIM, max_seqlen_k=400, dtype=dtype, device=DEVICE,
                                  config=small)
    assert plan.batch_invariant and plan.num_splits == 13
    out, lse = _run(q, k, v, lens, 0, gen, plan=plan)
    partial_lse = plan._partial_lse[: 2 * NHEADS * 13].view(2, NHEADS, 13)
    assert torch.isfinite(partial_lse[0, :, :4]).all() and torch.isneginf(partial_lse[0, :, 4:]).all()
    assert torch.isfinite(partial_lse[1, :, :1]).all() and torch.isneginf(partial_lse[1, :, 1:]).all()
    alone = _run(q[:1], k[:1, :FIXED_TARGET_LEN], v[:1, :FIXED_TARGET_LEN], lens[:1], 0, gen, config=small)
    assert torch.equal(out[0], alone[0][0]) and torch.equal(lse[0], alone[1][0])


def test_plan_cache_beyond_max_seqlen_k_raises(gen):
    """A batch-invariant plan holds partials for max_seqlen_k keys' splits: a cache that needs more raises
    ValueError naming max_seqlen_k (no silent loss of keys)."""
    q, k, v, lens = _batch_around(gen, _target(gen, KERNEL_DTYPES[0], 1, length=40), (), 0, 200)
    plan = flashdecode.DecodePlan(1, NHEADS, NHEADS_KV, HEADDIM, max_seqlen_k=64, dtype=q.dtype, device=DEVICE,
                                  config=_small_split_config(q, k, lens))
    with pytest.raises(ValueError, match="max_seqlen_k"):
        plan.run(q, k, v, lens)


def test_split_counts_move_the_default_bits(gen):
    """The property is not trivial: without the flag a sequence's bits depend on its split count, which the default
    policy derives from the batch (its size, the longest neighbour); here the counts are forced, so that the check
    does not depend on which counts the policy picks on this device's tiles."""
    q, k, v = _target(gen, torch.float32, 1, length=700)
    lens = torch.tensor([700], dtype=torch.int32, device=DEVICE)
    outs = [flashdecode.flash_decode(q, k, v, lens, num_splits=s) for s in (1, 3, 7)]
    assert not all(torch.equal(outs[0], o) for o in outs[1:])
    assert all(torch.allclose(outs[0], o, atol=1e-5) for o in outs[1:])


@pytest.mark.parametrize("page_size", [0, 16])
def test_plan_bitwise_equal_across_batches_and_with_flash_decode(gen, page_size):
    dtype = KERNEL_DTYPES[0]
    target = _target(gen, dtype, 1)
    plan = flashdecode.DecodePlan(6, NHEADS, NHEADS_KV, HEADDIM, max_seqlen_k=128, dtype=dtype, device=DEVICE,
                                  batch_invariant=True)
    results = []
    for neighbours, slot, capacity in BATCHES:
        q, k, v, lens = _batch_around(gen, target, neighbours, slot, capacity)
        out, lse = _run(q, k, v, lens, page_size, gen, plan=plan)
        results.append((out[slot].clone(), lse[slot].clone()))
        assert plan.config_for(q, k, v, lens).path is DecodePath.FIXED_SPLIT
    q, k, v, lens = _batch_around(gen, target, (), 0, 48)
    alone = _run(q, k, v, lens, page_size, gen)
    for out, lse in results:
        assert torch.equal(out, alone[0][0]) and torch.equal(lse, alone[1][0])


def test_window_and_ragged_batch_match_reference(gen):
    """Every row of a batch-invariant ragged batch (lengths 0 included) with a window vs the float64 reference."""
    dtype = KERNEL_DTYPES[0]
    q = randn(4, 2, NHEADS, HEADDIM, gen=gen, dtype=dtype)
    k = randn(4, 70, NHEADS_KV, HEADDIM, gen=gen, dtype=dtype)
    v = randn(4, 70, NHEADS_KV, HEADDIM, gen=gen, dtype=dtype)
    lens = torch.tensor([70, 0, 2, 33], dtype=torch.int32, device=DEVICE)
    out, lse = flashdecode.flash_decode(q, k, v, lens, window_size=(20, 0), return_lse=True, batch_invariant=True)
    o64, lse64 = ref.decode_ref(q.double(), k.double(), v.double(), lens, window_size=(20, 0))
    o_same, lse_same = ref.decode_ref(q, k, v, lens, window_size=(20, 0))
    assert_fa_close(out, o64, o_same, factor=3.0, atol=1e-4)
    assert_fa_close(lse, lse64, lse_same, factor=3.0, atol=1e-4, name="lse")


def test_config_ignores_batch_and_lengths(gen):
    """The resolved config is the same for any batch, lengths and capacity (the default's is not)."""
    dtype = KERNEL_DTYPES[0]
    configs = set()
    for b, cap, lens in ((1, 48, [45]), (7, 2048, [2000] * 7), (3, 300, [1, 300, 0])):
        q = randn(b, NHEADS, HEADDIM, gen=gen, dtype=dtype)
        k = randn(b, cap, NHEADS_KV, HEADDIM, gen=gen, dtype=dtype)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        configs.add(decode_config(q, k, k, lens_t, batch_invariant=True))
    assert len(configs) == 1 and next(iter(configs)).path is DecodePath.FIXED_SPLIT


@pytest.mark.parametrize("kw, word", [(dict(num_splits=3), "num_splits"), (dict(batch_invariant=1), "batch_invariant")])
def test_bad_input_names_the_argument(gen, kw, word):
    q = randn(1, NHEADS, HEADDIM, gen=gen)
    k = randn(1, 16, NHEADS_KV, HEADDIM, gen=gen)
    lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    kw = dict(dict(batch_invariant=True), **kw)
    with pytest.raises((ValueError, TypeError), match=word):
        flashdecode.flash_decode(q, k, k, lens, **kw)
    plan = flashdecode.DecodePlan(1, NHEADS, NHEADS_KV, HEADDIM, max_seqlen_k=16, dtype=q.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="batch_invariant"):
        flashdecode.flash_decode(q, k, k, lens, plan=plan, batch_invariant=True)
    with pytest.raises(ValueError, match="config"):
        flashdecode.flash_decode(q, k, k, lens, batch_invariant=True, config=decode_config(q, k, k, lens))


@pytest.mark.parametrize("async_scheduling", ["auto", True])  # auto: on for CUDA; True: also on the CPU
def test_engine_greedy_tokens_alone_equal_batched(tmp_path, async_scheduling):
    from engine_helpers import save_tiny
    from flashdecode.engine import LLM, SamplingParams

    path = save_tiny(tmp_path / "llama", "llama")
    prompts = [[5, 17, 33, 2, 9, 101, 64], [7, 7, 1], list(range(20, 41)), [150, 3, 88, 12]]
    params = SamplingParams(max_new_tokens=5)
    llm = LLM(path, device=DEVICE, dtype="float32", attn_backend="flashdecode", batch_invariant=True,
              max_num_seqs=4, use_tqdm=False, async_scheduling=async_scheduling)
    alone = llm.generate([prompts[0]], params)[0].token_ids
    batched = llm.generate(prompts, params)
    assert batched[0].token_ids == alone and len(alone) == 5
    with pytest.raises(ValueError, match="batch_invariant"):
        LLM(path, device="cpu", dtype="float32", attn_backend="torch", batch_invariant=True, use_tqdm=False)


def test_bench_decode_rows_for_batch_invariant_and_kvcache():
    """bench decode's new columns (CPU: argument parsing and the summary; the timings need the GPU)."""
    import argparse

    from flashdecode.bench import decode as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args([]).batch_invariant and parser.parse_args([]).kvcache
    assert not parser.parse_args(["--no-batch-invariant"]).batch_invariant
    assert {"ours-bi", "fai-kvcache"} <= set(bench.BUILDERS) and {"ours-bi", "fai-kvcache"} <= set(bench.OURS)
    row = dict(sweep="ctx", batch=1, context=4096, layout="contig", ours=10.0, **{"ours_%floor": 80.0},
               **{"ours-bi": 25.0, "fai-kvcache": 11.0, "FA2": 22.0})
    line = bench.summary_line(row)
    assert "batch-invariant 25.0us (2.50x)" in line and "flash_attn_with_kvcache 11.0us vs FA2 22.0us (2.00x)" in line
    assert bench._best_peer(row, ["ours", "ours-bi", "fai-kvcache", "FA2"]) == ("FA2", 22.0)
    # --bi-split-keys: columns of the batch-invariant plan with other split sizes, never "the best peer"
    assert parser.parse_args(["--bi-split-keys", "512,4096"]).bi_split_keys == "512,4096"
    row.update({"ours-bi@4096": 40.0, "ours-bi@512": 9.0, "FA2": 50.0})
    assert "batch-invariant 25.0us (2.50x), bi@512 keys 9.0us, bi@4096 keys 40.0us" in bench.summary_line(row)
    assert bench._best_peer(row, ["ours", "ours-bi@512", "FA2"]) == ("FA2", 50.0)
    assert callable(bench._builder("ours-bi@512")) and bench._builder("ours") is bench.BUILDERS["ours"]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [0, 16, 128])
@pytest.mark.parametrize("seqlen_q", [1, 2])
def test_gpu_bitwise_equal_in_any_batch_at_production_tiles(gen, page_size, seqlen_q):
    """bf16, Llama-3-8B heads (32 / 8, hd128), a 5000-key sequence alone and among 1, 7 and 63 neighbours of other
    lengths (long ones too, so the default policy would split differently), through flash_decode and a plan."""
    target = _target(gen, torch.bfloat16, seqlen_q, nheads=32, nheads_kv=8, headdim=128, length=5000)
    plan = flashdecode.DecodePlan(64, 32, 8, 128, max_seqlen_k=20000, dtype=torch.bfloat16, device=DEVICE,
                                  max_seqlen_q=seqlen_q, batch_invariant=True)
    results = []
    for neighbours, slot in (((), 0), ((20000,), 1), ((3, 17000, 0, 900, 4999, 12, 8000), 3),
                             (tuple(int(x) for x in torch.randint(0, 20000, (63,), generator=gen)), 40)):
        q, k, v, lens = _batch_around(gen, target, neighbours, slot, 20000)
        out, lse = _run(q, k, v, lens, page_size, gen)
        results.append((out[slot].clone(), lse[slot].clone()))
        out, lse = _run(q, k, v, lens, page_size, gen, plan=plan)
        results.append((out[slot].clone(), lse[slot].clone()))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    q, k, v, lens = _batch_around(gen, target, (), 0, 5000)
    o64, _ = ref.decode_ref(q.double(), k.double(), v.double(), lens)
    o_same, _ = ref.decode_ref(q, k, v, lens)
    assert_fa_close(results[0][0][None], o64, o_same, factor=3.0, atol=1e-4)


_FIXED_SPLIT_SM90_SCRIPT = r'''
import os, re, subprocess, sys, tempfile
import triton.backends.nvidia as nv
from flashdecode import heuristics as hx
from flashdecode.kernels.decode import decode_split_kernel
from flashdecode.kernels.merge import merge_many_kernel
from flashdecode.ops.decode_launch import plan_launch
sys.path.insert(0, "tests")
from helpers import compile_for_sm90


def usage(kernel):
    """(registers, spilled stack bytes) of a compiled kernel, from cuobjdump on its cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    return int(re.search(r"REG:(\d+)", out).group(1)), int(re.search(r"STACK:(\d+)", out).group(1))


dev = hx.DecodeDevice(num_sms=132, interpret=False, hopper=True, pdl=True)
print("variant                       block_n preload stages regs spill")
for page, seqlen_q, kv in [(0, 1, "bf16"), (0, 2, "bf16"), (16, 1, "bf16"), (128, 1, "bf16"), (5, 1, "bf16"),
                           (1, 1, "bf16"), (16, 1, "fp8e4nv")]:
    # bf16 hd128, 16 query / 2 kv heads (the b1 sweep's shape), a 128k-key cache: the launcher's geometry
    p = hx.DecodeProblem(batch=1, grid_batch=1, seqlen_q=seqlen_q, group=8, nheads_kv=2, headdim=128,
                         elem_bytes=1 if kv != "bf16" else 2, page_size=page, capacity=131072, window_left=-1,
                         live_keys=131072, cache_offsets_fit_int32=True, batch_invariant=True)
    config = hx.batch_invariant_config(p, dev)
    launch = plan_launch(config, p)
    assert config.path.name == "FIXED_SPLIT" and launch.grid_splits == 64
    types = dict(Q="*bf16", K="*" + kv, V="*" + kv, K_RAW="*" + kv, V_RAW="*" + kv, SEQLENS="*i32",
                 BLOCK_TABLE="*i32", O="*fp32", LSE="*fp32", score_scale="fp32", softcap_out="fp32",
                 K_SCALE="*fp32", V_SCALE="*fp32")
    consts = dict(SEQLEN_Q=seqlen_q, GROUP=8, NUM_M_BLOCKS=1, HEADDIM=128, BLOCK_M=p.block_m,
                  BLOCK_N=config.block_n, BLOCK_D=128, NUM_SPLITS=config.num_splits, MIN_CHUNK=launch.min_chunk,
                  MERGE_SPLITS=hx.next_power_of_2(config.num_splits), SPLIT_KEYS=config.split_keys, PAGE_SIZE=page, SOFTCAP=False, WINDOW=False,
                  FINAL=False, DOT_PRECISION="tf32", USE_TMA=config.use_tma, USE_PDL=config.use_pdl,
                  PDL_WAIT=config.pdl_wait, PRELOAD_PAGES=launch.preload_pages, DEVICE_SPLITS=False,
                  OFFS_32=config.offs_32, SPEC_PAGES=config.spec_pages, ALIBI=False,
                  KV_QUANT=0 if kv == "bf16" else 1)
    kernel = compile_for_sm90(decode_split_kernel, types, consts, launch.num_stages, config.num_warps)
    assert "async_copy_global_to_local" in kernel.asm["ttgir"], (page, "K/V loads not pipelined")
    assert "griddepcontrol.wait" in kernel.asm["ptx"]
    regs, spill = usage(kernel)
    name = f"stage1 page {page} sq {seqlen_q} {kv}"
    print(f"{name:30s} {config.block_n:7d} {launch.preload_pages:7d} {launch.num_stages:6d} {regs:4d} {spill:5d}")
    assert spill == 0, (name, spill)
# the merge as the launcher runs it on FIXED_SPLIT (ops/merge.py launch_merge_many): one row per program over
# head-dim quarters, merge_block_s states per step, SKIP_EMPTY
block_d = 128 // config.merge_d_chunks
kernel = compile_for_sm90(merge_many_kernel, dict(O_IN="*fp32", LSE_IN="*fp32", O_OUT="*bf16", LSE_OUT="*fp32"),
                          dict(HEADDIM=128, BLOCK_R=1, BLOCK_S=config.merge_block_s, BLOCK_D=block_d,
                               LSE_LOG2=True, USE_PDL=True, EARLY_TRIGGER=False, SKIP_EMPTY=True), 1)
regs, spill = usage(kernel)
print(f"{'merge SKIP_EMPTY':30s} {'':7s} {'':7s} {1:6d} {regs:4d} {spill:5d}")
assert spill == 0
print("compiled")
'''


def test_fixed_split_kernels_compile_for_hopper_without_a_gpu():
    """The batch-invariant variant as the launcher configures it on an H100 (bf16 hd128, 16 / 2 heads, a 128k
    cache: 64 splits of 2048 keys, 16 KiB tiles, contiguous and paged with 16-, 128-, 5- and 1-key pages, two new
    tokens, an e4m3 cache) and its SKIP_EMPTY merge compile for sm_90 with Triton's ptxas (no GPU), loads
    pipelined, PDL in, nothing spilled (``python -c`` of the script prints the registers)."""
    run_sm90_compile_script(_FIXED_SPLIT_SM90_SCRIPT)
