"""Continuous batching and preemption: the scheduler alone, then the whole engine under page pressure."""

from __future__ import annotations

import pytest

from engine_helpers import LLAMA3_ROPE, hf_greedy, hf_model, random_prompts, save_tiny
from flashdecode.engine import LLM, SamplingParams
from flashdecode.engine.kv_cache import BlockManager, bytes_per_page
from flashdecode.engine.scheduler import Scheduler, Sequence, Status


def make(num_pages=8, page_size=4, max_num_seqs=4, max_tokens=64, max_len=64):
    return Scheduler(BlockManager(num_pages, page_size), max_num_seqs, max_tokens, max_len)


def seq(n, new=4):
    return Sequence(list(range(1, n + 1)), SamplingParams(max_new_tokens=new))


def test_requests_join_between_decode_steps_and_leave_when_done():
    s = make(max_num_seqs=2)
    a, b, c = seq(3, new=2), seq(5, new=3), seq(2, new=2)
    for x in (a, b, c):
        s.add(x)
    batch, prefill = s.schedule()
    assert prefill and batch == [a, b] and c.status is Status.WAITING  # two seats
    s.postprocess(batch, [9, 9])
    batch, prefill = s.schedule()
    assert not prefill and batch == [a, b]
    done = s.postprocess(batch, [9, 9])
    assert done == [a] and a.finish_reason == "length" and a.seq_id not in s.blocks.tables
    batch, prefill = s.schedule()  # a's seat is free: c joins before b's next decode step
    assert prefill and batch == [c]
    s.postprocess(batch, [9])
    batch, prefill = s.schedule()
    assert not prefill and batch == [b, c]


def test_prefill_token_budget_splits_batches():
    s = make(max_tokens=8)
    a, b = seq(6), seq(6)
    s.add(a)
    s.add(b)
    assert s.schedule() == ([a], True)
    assert s.schedule() == ([b], True)


def test_decode_preempts_latest_when_pages_run_out_and_recomputes():
    s = make(num_pages=4, page_size=4)
    a, b = seq(8, new=8), seq(8, new=8)
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()  # 2 pages each: the pool is full
    s.postprocess(batch, [1, 1])  # both now need a 3rd page for position 8
    batch, prefill = s.schedule()
    assert not prefill and batch == [a]
    assert b.status is Status.WAITING and s.waiting[0] is b and b.num_preemptions == 1
    assert b.seq_id not in s.blocks.tables and len(s.blocks.table(a.seq_id)) == 3
    s.postprocess(batch, [2])
    # b comes back only when it fits again: a holds 3 of 4 pages, b needs 3 for its 9 tokens
    assert s.schedule() == ([a], False)
    for _ in range(6):
        s.postprocess([a], [3])
        if a.status is Status.FINISHED:
            break
        s.schedule()
    assert a.status is Status.FINISHED and s.blocks.num_free == 4
    batch, prefill = s.schedule()
    assert prefill and batch == [b] and len(b) == 9  # recomputed: prompt + its generated token


def test_refuses_requests_that_can_never_fit():
    s = make(num_pages=2, page_size=4, max_len=64)
    with pytest.raises(ValueError, match="KV pages"):
        s.add(seq(6, new=4))  # needs 3 pages in the end
    with pytest.raises(ValueError, match="max_model_len"):
        make(max_len=8).add(seq(8))


def test_engine_under_page_pressure_matches_transformers(tmp_path):
    """A pool far smaller than the batch needs: requests wait, running ones are preempted and recomputed, and
    every greedy generation still equals HF's."""
    path = save_tiny(tmp_path / "m", "llama", rope_scaling=LLAMA3_ROPE)
    prompts = random_prompts((9, 14, 6, 11, 3, 16), seed=11)
    n_new = 12
    page_size = 4
    page_bytes = bytes_per_page(2, page_size, 2, 16, __import__("torch").float32)
    llm = LLM(path, device="cpu", page_size=page_size, kv_cache_memory=9 * page_bytes, max_num_seqs=4)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n_new))
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_free == 9
    hf = hf_model(path)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, n_new) for p in prompts]
