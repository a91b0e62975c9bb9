"""Context-parallel decode over gloo: 2 spawned CPU processes (Triton interpreter) vs flash_decode on the whole cache
and the float64 reference. One spawn runs every case (process start-up dominates the time)."""

from __future__ import annotations

import zlib

import pytest
import torch

import flashdecode
from flashdecode import reference as ref
from flashdecode.distributed import context_parallel_decode
from flashdecode.distributed.launch import spawn
from helpers import SUBPROCESS_TIMEOUT_S

WORLD = 2
CPU_RANKS = dict(backend="gloo", env={"TRITON_INTERPRET": "1"})  # CPU tensors, Triton's interpreter, GPU or not


def _full_cache(gen, lengths, nheads, nheads_kv, headdim, dtype):
    """q (b, h, d) and a contiguous cache (b, max_len, hk, d) whose first lengths[i] keys are live."""
    b, cap = len(lengths), max(max(lengths), 1)
    q = torch.randn(b, nheads, headdim, generator=gen).to(dtype)
    k = torch.randn(b, cap, nheads_kv, headdim, generator=gen).to(dtype)
    v = torch.randn(b, cap, nheads_kv, headdim, generator=gen).to(dtype)
    return q, k, v


def _contiguous_shard(k, v, lengths, cuts, rank):
    """Rank 0 holds keys [0, cuts[i]) of sequence i, rank 1 keys [cuts[i], lengths[i])."""
    spans = [(0, c) if rank == 0 else (c, n) for c, n in zip(cuts, lengths)]
    cap = max(max(e - s for s, e in spans), 1)
    ks = torch.zeros(k.shape[0], cap, *k.shape[2:], dtype=k.dtype)
    vs = torch.zeros_like(ks)
    for i, (s, e) in enumerate(spans):
        ks[i, :e - s], vs[i, :e - s] = k[i, s:e], v[i, s:e]
    return ks, vs, torch.tensor([e - s for s, e in spans], dtype=torch.int32), None


def _paged_shard(k, v, lengths, page_size, rank, gen):
    """Logical page j of every sequence lives on rank j % WORLD (round robin), in a shuffled local pool."""
    own = [[j for j in range(-(-n // page_size)) if j % WORLD == rank] for n in lengths]
    num_pages = max(sum(len(o) for o in own), 1)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    width = max(max(len(o) for o in own), 1)
    pool_k = torch.full((num_pages, page_size, *k.shape[2:]), float("nan"), dtype=k.dtype)  # unused slots: NaN
    pool_v = pool_k.clone()
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    seqlens = []
    nxt = 0
    for i, (pages, n) in enumerate(zip(own, lengths)):
        live = 0
        for slot, j in enumerate(pages):
            page = perm[nxt]
            nxt += 1
            table[i, slot] = page
            s, e = j * page_size, min((j + 1) * page_size, n)
            pool_k[page, :e - s], pool_v[page, :e - s] = k[i, s:e], v[i, s:e]
            live += e - s
        seqlens.append(live)
    # a page only partly filled is the shard's last one: the kernels stop at the live length
    return pool_k, pool_v, torch.tensor(seqlens, dtype=torch.int32), table


def _check_case(rank, name, dtype, layout, lengths, nheads, nheads_kv, headdim, mode="all_gather", plan=False):
    from helpers import assert_fa_close

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # same on both ranks: the "global" cache
    q, k, v = _full_cache(gen, lengths, nheads, nheads_kv, headdim, dtype)
    if layout == "contiguous":
        cuts = [n if i % 3 == 0 else (0 if i % 3 == 1 else n // 2) for i, n in enumerate(lengths)]  # empty shards
        ks, vs, sl, bt = _contiguous_shard(k, v, lengths, cuts, rank)
    else:
        ks, vs, sl, bt = _paged_shard(k, v, lengths, page_size=3, rank=rank, gen=torch.Generator().manual_seed(rank))
    if plan:
        cp = flashdecode.distributed.ContextParallelDecodePlan(len(lengths), nheads, nheads_kv, headdim,
                                                                max_seqlen_k=64, dtype=dtype, device="cpu",
                                                                mode=mode, num_splits=2)
        out, lse = cp.run(q, ks, vs, sl, block_table=bt, return_lse=True)
        out, lse = out.clone(), lse.clone()
        out2 = cp.run(q, ks, vs, sl, block_table=bt)  # a second run through the same buffers: same result
        assert torch.equal(out2, out), f"{name}: plan rerun differs"
    else:
        out, lse = context_parallel_decode(q, ks, vs, sl, block_table=bt, return_lse=True, mode=mode)
    full_sl = torch.tensor(lengths, dtype=torch.int32)
    single, single_lse = flashdecode.flash_decode(q, k, v, full_sl, return_lse=True)
    o64, lse64 = ref.decode_ref(q.double(), k.double(), v.double(), full_sl)
    o_same, _ = ref.decode_ref(q, k, v, full_sl)
    heads = slice(None)
    if mode == "head_scatter":
        hs = nheads // WORLD
        heads = slice(rank * hs, (rank + 1) * hs)
    assert out.shape == q[:, heads].shape and out.dtype == dtype, f"{name}: shape {tuple(out.shape)}"
    assert_fa_close(out, o64[:, heads], o_same[:, heads], factor=3.0, atol=1e-5, name=f"{name} out")
    assert_fa_close(lse, lse64[:, heads], lse64[:, heads].float(), factor=1.0, atol=1e-4, name=f"{name} lse")
    # the single-device kernel on the whole cache: the same answer within rounding of the partials
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out, single[:, heads], atol=tol, rtol=tol, msg=f"{name}: vs flash_decode")
    torch.testing.assert_close(lse, single_lse[:, heads], atol=1e-4, rtol=1e-5, msg=f"{name}: lse vs flash_decode")
    empty = torch.tensor(lengths) == 0
    assert torch.all(out[empty] == 0) and torch.all(lse[empty] == float("-inf")), f"{name}: empty sequence"
    return name


CASES = [
    # name, dtype, layout, lengths (ragged, with an empty sequence), nheads, nheads_kv, headdim
    ("contig-fp32-gqa", torch.float32, "contiguous", [37, 5, 0, 70, 16], 4, 2, 64),
    ("contig-fp16-mha", torch.float16, "contiguous", [1, 33, 20], 2, 2, 32),
    ("paged-fp16-gqa", torch.float16, "paged", [37, 2, 0, 70], 4, 1, 64),
    ("paged-fp32-mha", torch.float32, "paged", [4, 9, 31], 2, 2, 32),
]


def _state(rank, rows, nheads, headdim):
    """Rank ``rank``'s made-up partial state (any rank can rebuild any rank's); one row empty on rank 0."""
    gen = torch.Generator().manual_seed(100 + rank)
    o = torch.randn(rows, nheads, headdim, generator=gen).half()
    lse = torch.randn(rows, nheads, generator=gen) * 3
    if rank == 0:
        lse[1] = float("-inf")
    return o, lse


def _check_exchange(rank, mode):
    """StateExchange.exchange on given states vs the float64 merge of every rank's state."""
    from flashdecode.distributed import StateExchange

    rows, nheads, headdim = 3, 4, 32
    ex = StateExchange(4, nheads, headdim, torch.float16, "cpu", mode=mode)
    out, lse = ex.exchange(*_state(rank, rows, nheads, headdim))
    states = [_state(r, rows, nheads, headdim) for r in range(WORLD)]
    o64, lse64 = ref.merge_states_many_ref(torch.stack([s[0] for s in states]).double(),
                                           torch.stack([s[1] for s in states]).double())
    heads = slice(None) if mode == "all_gather" else slice(rank * nheads // WORLD, (rank + 1) * nheads // WORLD)
    torch.testing.assert_close(out.double(), o64[:, heads], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), lse64[:, heads], atol=1e-5, rtol=1e-5)
    assert ex.bytes_received(rows) == (WORLD - 1) * rows * ex.seg_heads * (headdim * 2 + 4)
    return f"exchange-{mode}"


def _worker(rank):
    done = [_check_exchange(rank, "all_gather"), _check_exchange(rank, "head_scatter")]
    for case in CASES:
        done.append(_check_case(rank, *case))
    done.append(_check_case(rank, "head-scatter-fp16", torch.float16, "paged", [29, 0, 8], 4, 2, 64,
                            mode="head_scatter"))
    done.append(_check_case(rank, "plan-paged-fp16", torch.float16, "paged", [40, 3, 0], 4, 2, 64, plan=True))
    done.append(_check_case(rank, "plan-head-scatter-fp32", torch.float32, "contiguous", [21, 6], 4, 2, 32,
                            mode="head_scatter", plan=True))
    return done


def test_context_parallel_decode_matches_single_device():
    results = spawn(_worker, WORLD, timeout_s=SUBPROCESS_TIMEOUT_S, **CPU_RANKS)
    expected = (["exchange-all_gather", "exchange-head_scatter"] + [c[0] for c in CASES]
                + ["head-scatter-fp16", "plan-paged-fp16", "plan-head-scatter-fp32"])
    assert results == [expected] * WORLD


def test_context_parallel_decode_rejects_several_query_tokens():
    q = torch.zeros(1, 2, 4, 64)
    k = torch.zeros(1, 8, 4, 64)
    with pytest.raises(ValueError, match="seqlen_q"):
        context_parallel_decode(q, k, k, torch.ones(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="q must be"):
        context_parallel_decode([1.0], k, k, torch.ones(1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="process group"):  # this process has none
        context_parallel_decode(q[:, 0], k, k, torch.ones(1, dtype=torch.int32))


def _graph_worker(rank):
    """One NCCL rank: the plan's run (local decode + all_gather + merge) captured in a CUDA graph and replayed with
    new cache contents equals flash_decode."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (x.cuda() for x in _full_cache(gen, [300, 7], 8, 2, 128, torch.bfloat16))
    lens = torch.tensor([300, 7], dtype=torch.int32, device="cuda")
    plan = flashdecode.distributed.ContextParallelDecodePlan(2, 8, 2, 128, max_seqlen_k=512, dtype=torch.bfloat16,
                                                            device="cuda")
    plan.run(q, k, v, lens)  # warm-up: compiles, creates the NCCL communicator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan.run(q, k, v, lens)
    k.normal_()
    v.normal_()
    graph.replay()
    torch.cuda.synchronize()
    want = flashdecode.flash_decode(q, k, v, lens)
    return (out.float() - want.float()).abs().max().item()


@pytest.mark.gpu
def test_plan_captures_in_a_cuda_graph():
    err = spawn(_graph_worker, 1, backend="nccl", timeout_s=SUBPROCESS_TIMEOUT_S)[0]
    assert err < 2e-2, err
