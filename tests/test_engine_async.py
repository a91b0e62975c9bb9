"""Async scheduling (LLM(async_scheduling=True)): a decode step whose tokens the device draws alone is launched before the
host reads the tokens of the step in flight. On the CPU (tiny random checkpoints, fp32) it must give exactly the
tokens, finish reasons and page accounting of the synchronous engine: sequences ending by length at different
steps, stop tokens (the row launched ahead is dropped), min_tokens, seeded sampled rows, a penalised row (no
running ahead), requests joining and aborted while a step is in flight."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import random_prompts, save_tiny
from flashdecode.engine import LLM, SamplingParams

PROMPTS = random_prompts((5, 11, 17, 3, 9, 6), seed=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("async") / "llama", "llama")


def _engine(ckpt, async_scheduling: bool, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 4)
    return LLM(ckpt, device="cpu", dtype="float32", page_size=4, async_scheduling=async_scheduling, **kw)


def _count_ahead(llm: LLM) -> list[bool]:
    """Record the ahead flag of every decode launch of ``llm``."""
    flags, decode = [], llm.runner.decode

    def spy(seqs, tables, ahead=False):
        flags.append(ahead)
        return decode(seqs, tables, ahead)
    llm.runner.decode = spy
    return flags


def _outputs(outs):
    return [(o.token_ids, o.finish_reason, o.outputs[0].stop_reason) for o in outs]


def test_async_greedy_equals_sync_across_lengths_joins_and_stops(ckpt):
    """Six prompts on four seats (two join later), each with its own max_tokens (rows end by length at different
    steps); then stop tokens taken from the synchronous output so rows stop mid-batch."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (9, 3, 14, 1, 7, 11)]
    sync = _engine(ckpt, False)
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    llm = _engine(ckpt, True)
    flags = _count_ahead(llm)
    assert _outputs(llm.generate(PROMPTS, params, use_tqdm=False)) == _outputs(want)
    assert any(flags), "no decode step ran ahead"
    assert llm.block_manager.num_free == llm.block_manager.num_pages
    stops = [SamplingParams(max_tokens=14, stop_token_ids=[o.token_ids[k]])
             for o, k in zip(sync.generate(PROMPTS, SamplingParams(max_tokens=14, ignore_eos=True),
                                           use_tqdm=False), (4, 2, 7, 0, 10, 5))]
    want = sync.generate(PROMPTS, stops, use_tqdm=False)
    assert any(o.finish_reason == "stop" for o in want)
    assert _outputs(llm.generate(PROMPTS, stops, use_tqdm=False)) == _outputs(want)
    assert llm.block_manager.num_free == llm.block_manager.num_pages


def test_async_min_tokens_and_sampled_rows_match_sync(ckpt):
    """min_tokens masks stop tokens on the host: no running ahead while it is pending; seeded sampled rows run
    ahead (the device draws them from their own generators, in the synchronous order) and give the same tokens;
    a row with a repetition penalty keeps the batch synchronous while it runs."""
    sync, llm = _engine(ckpt, False), _engine(ckpt, True)
    flags = _count_ahead(llm)
    first = sync.generate(PROMPTS[:1], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    params = [SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[first.token_ids[1]]),
              SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.3, top_k=20, top_p=0.9, min_p=0.01, seed=6,
                             ignore_eos=True),
              SamplingParams(max_tokens=8, ignore_eos=True)]
    assert _outputs(llm.generate(PROMPTS[:4], params, use_tqdm=False)) == _outputs(
        sync.generate(PROMPTS[:4], params, use_tqdm=False))
    assert any(flags), "sampled rows did not run ahead"
    flags.clear()
    penalised = [SamplingParams(max_tokens=12, repetition_penalty=1.3, ignore_eos=True),  # the last to end
                 SamplingParams(max_tokens=8, ignore_eos=True)]
    assert _outputs(llm.generate(PROMPTS[:2], penalised, use_tqdm=False)) == _outputs(
        sync.generate(PROMPTS[:2], penalised, use_tqdm=False))
    assert not any(flags), "a batch with a penalised row ran ahead"


def test_async_with_fewer_free_pages_than_rows_needing_one(ckpt):
    """Two rows cross a page boundary at the same step with one page free: the step is not launched ahead (the
    rows' needs are counted together), and the synchronous fallback preempts as the synchronous engine does."""
    from flashdecode.engine.kv_cache import bytes_per_page

    sync = _engine(ckpt, False)
    cfg = sync.config
    page = bytes_per_page(cfg.num_hidden_layers, 4, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    prompts = [PROMPTS[0][:4], PROMPTS[1][:4]]  # page 4: both rows need a new page at the same steps
    params = SamplingParams(max_tokens=8, ignore_eos=True)  # 12 tokens = 3 pages each, 5 in the pool
    want = _engine(ckpt, False, kv_cache_memory=5 * page).generate(prompts, params, use_tqdm=False)
    llm = _engine(ckpt, True, kv_cache_memory=5 * page)
    assert llm.block_manager.num_pages == 5
    flags = _count_ahead(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _outputs(got) == _outputs(want) and any(flags)
    assert llm.scheduler.num_preemptions >= 1
    assert llm.block_manager.num_free == llm.block_manager.num_pages


def _drive(llm: LLM, events) -> dict[int, list[int]]:
    """Step ``llm``; after step i, apply events[i]: ("add", prompt_index, max_tokens) or ("abort", prompt_index).
    Returns each request's output tokens."""
    seqs, step = {}, 0
    while llm.scheduler.has_work() or step in events:
        for ev in events.get(step, ()):
            if ev[0] == "add":
                seqs[ev[1]], = llm.add_request(PROMPTS[ev[1]], SamplingParams(max_tokens=ev[2], ignore_eos=True))
            else:
                llm.abort([seqs[ev[1]]])
        if llm.scheduler.has_work():
            llm.step()
        step += 1
    return {i: (s.output_token_ids, s.finish_reason) for i, s in seqs.items()}


def test_async_requests_join_and_abort_while_a_step_is_in_flight(ckpt):
    """Requests added and aborted between steps (the server's pattern) give the synchronous engine's tokens for
    every request that was not aborted (an aborted one: a prefix of them, at most one token shorter), and the
    page pool comes back full."""
    events = {0: [("add", 0, 12), ("add", 1, 12)], 3: [("add", 2, 6)], 5: [("abort", 0)], 7: [("add", 3, 5)],
              9: [("abort", 2), ("add", 4, 4)]}
    want = _drive(_engine(ckpt, False), events)
    llm = _engine(ckpt, True)
    flags = _count_ahead(llm)
    got = _drive(llm, events)
    assert any(flags)
    assert want[0][1] == "abort" and want[1][1] == "length"
    for i, (tokens, reason) in want.items():
        if reason == "abort":  # the host reads a step one call later: an abort may cut one token earlier
            assert got[i][1] == "abort" and tokens[:len(got[i][0])] == got[i][0] and len(tokens) - len(got[i][0]) <= 1
        else:
            assert got[i] == (tokens, reason)
    assert llm.block_manager.num_free == llm.block_manager.num_pages


def test_async_scheduling_argument_is_checked(ckpt):
    with pytest.raises(ValueError, match="async_scheduling"):
        _engine(ckpt, "yes")
    with pytest.raises(TypeError, match="async_scheduling"):
        _engine(ckpt, 1)
    assert _engine(ckpt, "auto").async_scheduling is False  # auto: CUDA only
