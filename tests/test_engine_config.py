"""EngineConfig: every engine option checked in one place (the error names the field), ``LLM(**options)`` and
``LLM(config=EngineConfig(...))`` the same engine, and the CLI's options one EngineConfig."""

from __future__ import annotations

import dataclasses

import pytest

from flashdecode.cli import build_parser
from flashdecode.engine import LLM, EngineConfig, SamplingParams
from flashdecode.engine.cli import engine_config
from flashdecode.engine.config import config_from_dict


def tiny_config():
    return config_from_dict(dict(model_type="llama", vocab_size=160, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 rms_norm_eps=1e-5, max_position_embeddings=256))


@pytest.mark.parametrize("options, error, field", [
    (dict(page_size=0), ValueError, "page_size"),
    (dict(page_size=2.0), TypeError, "page_size"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_model_len=1), ValueError, "max_model_len"),
    (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
    (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size"),
    (dict(context_parallel_size="2"), TypeError, "context_parallel_size"),
    (dict(kv_cache_memory=1.5), ValueError, "kv_cache_memory"),
    (dict(kv_cache_memory=-3), ValueError, "kv_cache_memory"),
    (dict(kv_cache_dtype="fp4"), ValueError, "kv_cache_dtype"),
    (dict(dtype="int8"), ValueError, "dtype"),
    (dict(device=3), TypeError, "device"),
    (dict(attn_backend="nope"), ValueError, "attn_backend"),
    (dict(pdl="yes"), ValueError, "pdl"),
    (dict(pdl=None), TypeError, "pdl"),
    (dict(async_scheduling="yes"), ValueError, "async_scheduling"),
    (dict(async_scheduling=1), TypeError, "async_scheduling"),
    (dict(flat_gemm="yes"), ValueError, "flat_gemm"),
    (dict(flat_gemm=3), TypeError, "flat_gemm"),
    (dict(enable_prefix_caching=1), TypeError, "enable_prefix_caching"),
    (dict(enable_chunked_prefill="on"), TypeError, "enable_chunked_prefill"),
    (dict(chunked_prefill_single_forward=1), TypeError, "chunked_prefill_single_forward"),
    (dict(batch_invariant=1), TypeError, "batch_invariant"),
    (dict(enforce_eager="no"), TypeError, "enforce_eager"),
    (dict(enable_chunked_prefill=True, context_parallel_size=2), ValueError, "enable_chunked_prefill"),
    (dict(async_scheduling=True, tensor_parallel_size=2), ValueError, "async_scheduling"),
])
def test_a_bad_option_names_its_field_when_the_config_is_made(options, error, field):
    with pytest.raises(error, match=field):
        EngineConfig(tiny_config(), **options)
    with pytest.raises(error, match=field):  # replace checks again
        EngineConfig(tiny_config()).replace(**options)
    with pytest.raises(error, match=field):  # LLM's keyword arguments are the same check, before anything is built
        LLM(tiny_config(), **options)


def test_model_must_be_a_checkpoint_a_model_config_or_an_engine_model():
    with pytest.raises(TypeError, match="model must be"):
        EngineConfig(3)
    with pytest.raises(TypeError, match="needs a model"):
        LLM()
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        LLM(config={"model": tiny_config()})
    with pytest.raises(TypeError, match="not both"):
        LLM(tiny_config(), config=EngineConfig(tiny_config()))
    with pytest.raises(TypeError, match="not both"):
        LLM(config=EngineConfig(tiny_config()), max_num_seqs=2)


def test_config_is_frozen_and_its_defaults_are_the_keyword_defaults():
    config = EngineConfig(tiny_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 4
    assert config.max_num_seqs == 32 and config.kv_cache_dtype == "auto" and config.enable_prefix_caching is None


def test_llm_from_a_config_equals_llm_from_keywords():
    options = dict(device="cpu", dtype="float32", max_num_seqs=2, max_model_len=48, page_size=8, seed=3,
                   use_tqdm=False, enable_prefix_caching=False)
    by_keywords = LLM(tiny_config(), **options)
    by_config = LLM(config=EngineConfig(tiny_config(), **options))
    assert by_keywords.engine_config == by_config.engine_config
    for name in ("max_model_len", "scheduler_tokens", "enable_prefix_caching", "async_scheduling", "dtype"):
        assert getattr(by_keywords, name) == getattr(by_config, name), name
    assert by_keywords.block_manager.num_pages == by_config.block_manager.num_pages
    prompts, params = [[5, 17, 33, 2], [7, 7, 1, 150, 9]], SamplingParams(max_tokens=6)
    want = [o.token_ids for o in by_keywords.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in by_config.generate(prompts, params, use_tqdm=False)] == want
    assert all(len(t) == 6 for t in want)


def test_cli_options_become_one_engine_config():
    args = build_parser().parse_args(["generate", "--random-weights", "llama3.2-1b", "--layers", "1", "--device",
                                      "cpu", "--page-size", "8", "--max-num-seqs", "3", "--kv-cache-memory", "0.5",
                                      "--pdl", "off", "--no-enable-prefix-caching", "--enable-chunked-prefill",
                                      "--max-num-batched-tokens", "64", "--prompt", "1,2"])
    config = engine_config(args, max_model_len=40)
    assert (config.page_size, config.max_num_seqs, config.max_model_len) == (8, 3, 40)
    assert config.kv_cache_memory == 0.5 and config.pdl is False and config.async_scheduling == "auto"
    assert config.enable_prefix_caching is False and config.enable_chunked_prefill
    assert config.max_num_batched_tokens == 64 and config.model.num_hidden_layers == 1


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_several_ranks_check_the_options_before_any_rank_starts(command, monkeypatch):
    """--tp / --cp > 1: a bad engine option is refused by the launcher (ValueError naming the flag), before it spawns
    ranks that would each fail on their own."""
    import flashdecode.distributed.launch as launch
    from flashdecode.engine.cli import join_ranks

    spawned = []
    monkeypatch.setattr(launch, "main_on_ranks", lambda *a, **k: spawned.append(a) or 0)
    extra = ["--prompt", "1,2"] if command == "generate" else []
    bad = build_parser().parse_args([command, "--random-weights", "llama3.2-1b", "--device", "cpu", "--tp", "2",
                                     "--max-num-seqs", "0", *extra])
    with pytest.raises(ValueError, match="--max-num-seqs"):
        join_ranks(lambda a: 0, bad)
    good = build_parser().parse_args([command, "--random-weights", "llama3.2-1b", "--device", "cpu", "--tp", "2",
                                      *extra])
    assert join_ranks(lambda a: 0, good) == 0 and len(spawned) == 1
