"""Pure pieces of the distributed layer (no processes): the context-parallel page layout and block manager, the
tensor-parallel head shards, the size checks and the cost model."""

from __future__ import annotations

import math

import pytest

from flashdecode.distributed import cost
from flashdecode.distributed.groups import ParallelConfig, ParallelState
from flashdecode.engine.kv_cache import ContextParallelBlockManager, cp_local_length, cp_owner, make_block_manager


@pytest.mark.parametrize("page_size", [1, 3, 4])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_cp_local_length_counts_each_ranks_tokens(page_size, cp):
    for n in range(0, 40):
        owners = [cp_owner(p, page_size, cp) for p in range(n)]
        for r in range(cp):
            assert cp_local_length(n, page_size, cp, r) == owners.count(r), (n, r)


def test_cp_block_manager_deals_pages_round_robin():
    bm = ContextParallelBlockManager(num_pages=3, page_size=4, cp_size=2, cp_rank=1)
    assert bm.num_pages == 6 and bm.num_free == 6
    assert bm.allocate(7, 9) == [0]  # 3 logical pages: ranks 0, 1, 0 -> rank 1 holds one
    assert bm.tables[7] == [0, 0, 1]
    assert [len(f) for f in bm.free_lists] == [1, 2]
    assert not bm.can_allocate(9)  # would need 2 more pages of rank 0, which has 1
    assert bm.can_allocate(4)
    assert bm.can_ensure(7, 16) and bm.ensure(7, 16) == [0, 1]  # logical page 3 lives on rank 1
    assert bm.can_ensure(7, 24)  # pages 4, 5 -> ranks 0, 1: one free page each
    assert not bm.can_ensure(7, 25)  # page 6 -> rank 0 again, which has no third page (rank 1 still would)
    with pytest.raises(RuntimeError, match="out of pages"):
        bm.ensure(7, 25)
    bm.free(7)
    assert bm.num_free == 6 and [sorted(f) for f in bm.free_lists] == [[0, 1, 2]] * 2
    with pytest.raises(ValueError, match="cp_rank"):
        ContextParallelBlockManager(3, 4, cp_size=2, cp_rank=2)
    assert type(make_block_manager(3, 4)).__name__ == "BlockManager"


def test_tp_head_shards():
    def state(tp, rank):
        return ParallelState(ParallelConfig(tensor_parallel_size=tp), tp_rank=rank)

    assert [state(2, r).shard(32) for r in range(2)] == [(0, 16), (16, 32)]
    assert [state(4, r).kv_head_shard(8) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # tp > nheads_kv: each rank stores the one KV head its query heads use (query head h -> kv head h // group)
    for tp, hk, h in ((4, 2, 8), (8, 1, 8), (8, 2, 16)):
        for r in range(tp):
            q0, q1 = state(tp, r).shard(h)
            k0, k1 = state(tp, r).kv_head_shard(hk)
            assert k1 - k0 == 1 and {q // (h // hk) for q in range(q0, q1)} == {k0}


def test_parallel_config_checks():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="context_parallel_size"):
        ParallelConfig(context_parallel_size=-1)
    assert ParallelConfig(2, 3).world_size == 6
    ParallelConfig(4).check_model(32, 8, 14336, None)
    ParallelConfig(8).check_model(32, 2, 14336, None)  # replicated KV heads
    with pytest.raises(ValueError, match="attention heads"):
        ParallelConfig(3).check_model(32, 8, 14336, None)
    with pytest.raises(ValueError, match="KV heads"):
        ParallelConfig(4).check_model(12, 6, 96, None)
    with pytest.raises(ValueError, match="intermediate"):
        ParallelConfig(2).check_model(4, 2, 99, None)
    with pytest.raises(ValueError, match="sliding"):
        ParallelConfig(1, 2).check_model(4, 2, 8, 4096)


def test_cost_model_bytes_by_hand():
    s = cost.LLAMA3_8B
    assert cost.kv_bytes_per_layer(s, 1, 1) == 2 * 8 * 128 * 2  # 4 KiB per token and layer
    assert cost.exchange_bytes_per_layer(s, 1, 2) == 32 * (128 * 2 + 4)  # one peer's (o, lse)
    assert cost.exchange_bytes_per_layer(s, 4, 8, "head_scatter") == pytest.approx(7 / 8 * 4 * 32 * 260)
    with pytest.raises(ValueError, match="mode"):
        cost.exchange_bytes_per_layer(s, 1, 2, "ring")
    with pytest.raises(ValueError, match="batch"):
        cost.kv_bytes_per_layer(s, 0, 10)


def test_cost_model_breakeven_and_limits():
    s, link = cost.LLAMA3_8B, cost.NVLINK4
    c_star = cost.breakeven_context(s, 1, 2, link)
    t = cost.decode_layer_time(s, 1, c_star, 2, link)
    assert t["total"] == pytest.approx(t["single"], rel=1e-9)  # the break-even is where the times meet
    assert cost.decode_layer_time(s, 1, 2 * c_star, 2, link)["speedup"] > 1 > \
        cost.decode_layer_time(s, 1, c_star / 2, 2, link)["speedup"]
    # more batch -> more KV per step -> parallelism pays at shorter contexts; PCIe's latency pushes it out
    assert cost.breakeven_context(s, 8, 2, link) < c_star < cost.breakeven_context(s, 1, 2, cost.PCIE5)
    # long contexts approach the ideal speedup W
    assert cost.decode_layer_time(s, 1, 2**24, 4, link)["speedup"] == pytest.approx(4, rel=0.02)
    assert cost.breakeven_context(s, 1, 1, link) == math.inf
    assert cost.decode_layer_time(s, 1, 1000, 1, link)["speedup"] == 1.0


def test_tp_step_model():
    w = 16e9  # Llama-3-8B bf16 weights
    one = cost.tp_decode_step_time(w, 32, 4096, 1, 1)
    assert one["total"] == one["single"] == pytest.approx(w / cost.H100_HBM_BW) and one["all_reduce"] == 0
    two = cost.tp_decode_step_time(w, 32, 4096, 1, 2)
    assert two["weights"] == pytest.approx(one["single"] / 2)
    # 64 all-reduces of 8 KB: latency-bound, 2 x 32 x (10 us + 8 KB / 450 GB/s)
    assert two["all_reduce"] == pytest.approx(64 * (10e-6 + 4096 * 2 / 450e9))
    assert cost.tp_decode_step_time(w, 32, 4096, 1, 2, cost.PCIE5)["total"] > two["total"]


def test_distributed_layer_sits_below_the_engine():
    """flashdecode.distributed is used by the engine (and is public API beside flash_decode): it imports the ops
    and the reference, never the engine, the benchmarks or the CLI (docs/distributed.md, "Layer")."""
    import ast
    from pathlib import Path

    import flashdecode.distributed as pkg

    bad = []
    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            bad += [f"{path.name}: {n}" for n in names if n.startswith(("flashdecode.engine", "flashdecode.bench",
                                                                           "flashdecode.cli"))]
    assert not bad, bad
