"""An engine in the middle of decoding without its prefill, for the decode benchmarks (bench e2e, its step
profile): running sequences whose KV pages hold random values (decode speed does not depend on the cache content;
a 64k prefill per point would cost minutes), and the page size that sizes their pool."""

from __future__ import annotations

import torch

from flashdecode.engine.kv_cache import engine_page_bytes
from flashdecode.engine.kv_quant import resolve_kv_cache_dtype
from flashdecode.engine.sampling import SamplingParams
from flashdecode.engine.scheduler import Sequence, Status


def fill_running(llm, batch: int, context: int, steps: int) -> None:
    """``batch`` running sequences of ``context`` tokens whose pages already hold (random) K/V."""
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    gen = torch.Generator().manual_seed(context + batch)
    for _ in range(batch):
        ids = torch.randint(0, llm.config.vocab_size, (context,), generator=gen).tolist()
        seq = Sequence(ids, params)
        llm.scheduler.add(seq)
        llm.scheduler.waiting.remove(seq)
        llm.block_manager.allocate(seq.seq_id, context)
        seq.status = Status.RUNNING
        llm.scheduler.running.append(seq)


def page_bytes(cfg, page_size: int, dtype, kv_cache_dtype: str) -> int:
    """Bytes of one KV page (all layers) of a single-rank engine of ``cfg`` with K/V pages of ``kv_cache_dtype``
    ("auto": ``dtype``; 8-bit: + float32 scales), as the engine sizes its pool."""
    return engine_page_bytes(cfg, page_size, cfg.num_key_value_heads, dtype, resolve_kv_cache_dtype(kv_cache_dtype))


def fill_pool_randomly(runner) -> None:
    """Random K/V instead of a prefill: normal values, or for 8-bit pages codes 0..126 (never an e4m3 NaN) with
    scales 1/448."""
    if runner.pool.element_size() > 1:
        runner.pool.normal_()
        return
    runner.pool.view(torch.uint8).random_(0, 127)
    runner.pool_scales.fill_(1.0 / 448)
