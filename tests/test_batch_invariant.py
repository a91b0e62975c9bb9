"""flash_decode(batch_invariant=True) / DecodePlan(batch_invariant=True) / LLM(batch_invariant=True): a sequence's
out and lse are bitwise identical alone and inside batches of other sizes with other neighbour lengths (contiguous
and paged caches, one and two new tokens), and still match the float64 reference (FlashAttention rule, 3x)."""

import pytest
import torch

import flashdecode
from flashdecode import DecodePath
from flashdecode import reference as ref
from flashdecode.ops.decode import decode_config
from helpers import DEVICE, KERNEL_DTYPES, assert_fa_close, randn

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
    k = randn(b, capacity, hk, d, gen=gen, dtype=q_t.dtype)
    v = randn(b, capacity, hk, d, gen=gen, dtype=q_t.dtype)
    q[slot], k[slot, :length], v[slot, :length] = q_t[0], k_t[0], v_t[0]
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _run(q, k, v, lens, page_size, gen, plan=None):
    if page_size:
        k, v, table = ref.paged_from_contiguous(k, v, page_size, extra_pages=3, generator=gen)
    else:
        table = None
    if plan is not None:
        return plan.run(q, k, v, lens, block_table=table, return_lse=True)
    return flashdecode.flash_decode(q, k, v, lens, block_table=table, return_lse=True, batch_invariant=True)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("seqlen_q", [1, 2])
@pytest.mark.parametrize("page_size", [0, 16, 5])
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
        assert plan.config_for(q, k, v, lens).path is DecodePath.UNSPLIT
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
    assert len(configs) == 1 and next(iter(configs)).path is DecodePath.UNSPLIT


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


def test_engine_greedy_tokens_alone_equal_batched(tmp_path):
    from engine_helpers import save_tiny
    from flashdecode.engine import LLM, SamplingParams

    path = save_tiny(tmp_path / "llama", "llama")
    prompts = [[5, 17, 33, 2, 9, 101, 64], [7, 7, 1], list(range(20, 41)), [150, 3, 88, 12]]
    params = SamplingParams(max_new_tokens=5)
    llm = LLM(path, device=DEVICE, dtype="float32", attn_backend="flashdecode", batch_invariant=True,
              max_num_seqs=4, use_tqdm=False)
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
