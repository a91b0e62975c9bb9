"""flashdecode.integrations.transformers: tiny Llama and Qwen2 models (random weights, built here) run with
attn_implementation=register() against transformers' SDPA backend.

Logits of left- and right-padded batches follow the FlashAttention rule against the same model in float64 (error
<= 2x SDPA's in the same dtype, at the non-padded positions); greedy ``generate`` gives SDPA's tokens with
DynamicCache and StaticCache (left-padded batches, so generation runs flash_decode through the padded block table).
CPU (Triton interpreter) in float32; the GPU-marked test times the Llama-3-8B shape (2 layers) against SDPA.
"""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashdecode.integrations import transformers as fd_transformers  # noqa: E402
from flashdecode.bench.hf_peer import hf_cache_kwarg  # noqa: E402
from helpers import DEVICE, SUBPROCESS_TIMEOUT_S, max_err  # noqa: E402


def _config(family: str, **overrides):
    small = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=None,
                 bos_token_id=None, tie_word_embeddings=False)
    small.update(overrides)
    if family == "llama":
        return transformers.LlamaConfig(head_dim=16, **small)
    return transformers.Qwen2Config(**small)


@pytest.fixture(scope="module")
def name():
    return fd_transformers.register()


def _model(config, attn, dtype=torch.float32, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32,
                                                          **kwargs)
    return model.to(device=DEVICE, dtype=dtype).eval()


def _padded_batch(gen, lengths, total, left: bool, vocab: int):
    ids = torch.randint(1, vocab, (len(lengths), total), generator=gen)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for i, n in enumerate(lengths):
        span = slice(total - n, total) if left else slice(0, n)
        mask[i, span] = 1
    return ids.masked_fill(mask == 0, 0).to(DEVICE), mask.to(DEVICE)


def test_register_returns_a_name_without_flash(name):
    assert "flash" not in name
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert AttentionInterface()[name] is fd_transformers.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is fd_transformers.padding_mask
    with pytest.raises(ValueError, match="flash"):
        fd_transformers.register("my_flash_backend")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("left", [True, False])
def test_padded_logits_follow_the_fa_rule_vs_sdpa(gen, name, family, left, tmp_path):
    config = _config(family)
    _model(config, "sdpa").save_pretrained(tmp_path)
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name).to(DEVICE).eval()
    sdpa = _model(config, "sdpa")
    ref64 = _model(config, "sdpa", torch.float64)
    ids, mask = _padded_batch(gen, [13, 6, 1], 13, left, config.vocab_size)
    with torch.no_grad():
        logits = ours(input_ids=ids, attention_mask=mask).logits
        logits_sdpa = sdpa(input_ids=ids, attention_mask=mask).logits
        logits64 = ref64(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert not torch.isnan(logits).any()
    err, base = max_err(logits[valid], logits64[valid]), max_err(logits_sdpa[valid], logits64[valid])
    assert err <= 2 * base + 1e-5, f"logits error {err:.3e} > 2 x SDPA's {base:.3e}"


def test_training_gradients_follow_the_fa_rule_vs_sdpa(gen, name):
    """Backward through the padded (unpadded varlen) prefill: parameter gradients of a left-padded batch's loss
    within 3x SDPA's error against the float64 model."""
    config = _config("llama")
    ids, mask = _padded_batch(gen, [11, 5], 11, True, config.vocab_size)
    labels = ids.masked_fill(mask == 0, -100)
    grads = {}
    for key, attn, dtype in (("ours", name, torch.float32), ("peer", "sdpa", torch.float32),
                             ("ref", "sdpa", torch.float64)):
        model = _model(config, attn, dtype)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        layer = model.model.layers[0].self_attn
        grads[key] = torch.cat([layer.q_proj.weight.grad.flatten(), layer.k_proj.weight.grad.flatten(),
                                layer.v_proj.weight.grad.flatten()])
    err, base = max_err(grads["ours"], grads["ref"]), max_err(grads["peer"], grads["ref"])
    assert err <= 3 * base + 1e-6, f"gradient error {err:.3e} > 3 x SDPA's {base:.3e}"


@pytest.mark.parametrize("family, cache", [("llama", "dynamic"), ("qwen2", "dynamic"), ("llama", "static")])
def test_greedy_generate_matches_sdpa(gen, name, family, cache, monkeypatch):
    config = _config(family)
    ids, mask = _padded_batch(gen, [9, 4, 7], 9, True, config.vocab_size)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    tokens = {}
    calls = []
    for fn in ("flash_decode", "flash_attn_varlen"):  # count our kernels' calls: the backend must really run
        original = getattr(fd_transformers, fn)
        monkeypatch.setattr(fd_transformers, fn, lambda *a, _f=original, _n=fn, **k: calls.append(
            (_n, k.get("block_table") is not None)) or _f(*a, **k))
    for attn in ("sdpa", name):
        model = _model(config, attn)
        with torch.no_grad():
            tokens[attn] = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert tokens[name].shape == (3, 9 + 6)
    assert torch.equal(tokens[name], tokens["sdpa"])
    layers = config.num_hidden_layers
    assert calls.count(("flash_attn_varlen", False)) == layers  # the padded prefill, unpadded
    assert calls.count(("flash_decode", True)) == layers * (kw["max_new_tokens"] - 1)  # padded decode steps


def test_decode_step_logits_match_with_dynamic_cache(gen, name):
    """One generation step after a left-padded prefill: the decode path (block table over the padded cache)
    gives SDPA's next-token logits within the FlashAttention rule."""
    config = _config("llama")
    models = {key: _model(config, name if key == "ours" else "sdpa", dtype)
              for key, dtype in (("ours", torch.float32), ("peer", torch.float32), ("ref", torch.float64))}
    _assert_decode_step_close(gen, models, config.vocab_size)


# the keyword this transformers version's forward takes the cache under ("cache" from 5.2x, "past_key_values"
# before: the GPU machine has 5.17); an unknown keyword would be swallowed by **kwargs silently
_CACHE_KWARG = hf_cache_kwarg(transformers.LlamaForCausalLM)


def _assert_decode_step_close(gen, models, vocab):
    """Prefill a left-padded batch, then one decode step: our next-token logits vs the float64 model's within 3x
    the peer backend's error (models: "ours", "peer" (same dtype), "ref" (float64), same weights)."""
    ids, mask = _padded_batch(gen, [8, 3], 8, True, vocab)
    nxt = torch.randint(1, vocab, (2, 1), generator=gen).to(DEVICE)
    mask2 = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    logits = {}
    for key, model in models.items():
        with torch.no_grad():
            past = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
            logits[key] = model(input_ids=nxt, attention_mask=mask2, **{_CACHE_KWARG: past}).logits[:, -1]
    err, base = max_err(logits["ours"], logits["ref"]), max_err(logits["peer"], logits["ref"])
    assert err <= 3 * base + 1e-5, f"decode logits error {err:.3e} > 3 x the peer's {base:.3e}"


def test_static_cache_without_attention_mask_reads_only_the_tokens_seen(gen, name):
    """A StaticCache is longer than the tokens seen; without an attention_mask the keys past them must not be read
    (prefill and one decode step vs the float64 model, FlashAttention rule against SDPA)."""
    config = _config("llama")
    ids = torch.randint(1, config.vocab_size, (2, 7), generator=gen).to(DEVICE)
    nxt = torch.randint(1, config.vocab_size, (2, 1), generator=gen).to(DEVICE)
    logits = {}
    for key, attn, dtype in (("ours", name, torch.float32), ("peer", "sdpa", torch.float32),
                             ("ref", "sdpa", torch.float64)):
        model = _model(config, attn, dtype)
        cache = transformers.StaticCache(config=config, max_cache_len=16)
        with torch.no_grad():
            first = model(input_ids=ids, use_cache=True, **{_CACHE_KWARG: cache}).logits
            second = model(input_ids=nxt, use_cache=True, **{_CACHE_KWARG: cache}).logits
            logits[key] = torch.cat([first, second], dim=1)
    err, base = max_err(logits["ours"], logits["ref"]), max_err(logits["peer"], logits["ref"])
    assert err <= 3 * base + 1e-5, f"logits error {err:.3e} > 3 x SDPA's {base:.3e}"


def test_static_cache_decode_step_compiles_without_graph_breaks(gen, name):
    """A decode step with a StaticCache under torch.compile(fullgraph=True) (any graph break raises) gives the
    eager step's logits: the attention is one opaque torch.library op while tracing."""
    config = _config("llama")
    model = _model(config, name)
    ids, mask = _padded_batch(gen, [9, 4], 9, True, config.vocab_size)
    nxt = torch.randint(1, config.vocab_size, (2, 1), generator=gen).to(DEVICE)
    mask2 = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    caches = [transformers.StaticCache(config=config, max_cache_len=16) for _ in range(2)]
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    logits = []
    with torch.no_grad():
        for cache, forward in zip(caches, (model.forward, compiled)):
            model(input_ids=ids, attention_mask=mask, use_cache=True, **{_CACHE_KWARG: cache})
            logits.append(forward(input_ids=nxt, attention_mask=mask2, use_cache=True,
                                  **{_CACHE_KWARG: cache}).logits)
            # and a step without attention_mask (the mask of the positions in use is built on the device)
            logits.append(forward(input_ids=nxt, use_cache=True, **{_CACHE_KWARG: cache}).logits)
    torch.testing.assert_close(logits[2], logits[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logits[3], logits[1], atol=1e-6, rtol=1e-6)


def _count_calls(monkeypatch, module, fn: str, record=lambda *a, **k: True) -> list:
    """Patch ``module.fn`` to append record(*args, **kwargs) to the returned list on each call."""
    calls, original = [], getattr(module, fn)

    def counted(*args, **kwargs):
        calls.append(record(*args, **kwargs))
        return original(*args, **kwargs)
    monkeypatch.setattr(module, fn, counted)
    return calls


@pytest.mark.parametrize("padding", ["none", "left"])
def test_static_cache_generate_compiles_one_fullgraph_for_every_step(gen, name, padding, monkeypatch):
    """generate with a StaticCache and a compiled decode step (CompileConfig fullgraph=True; AOTAutograd with a
    counting compiler that runs the traced graph eagerly - inductor's CUDA graphs are the GPU test's): one graph for
    all steps (the step table's shape does not grow), unpadded steps read the cache contiguously (no block table),
    and the greedy tokens and every step's logits follow the float64 SDPA model (FlashAttention rule against fp32
    SDPA)."""
    config = _config("llama")
    lengths = [7, 7] if padding == "none" else [7, 3]
    ids, mask = _padded_batch(gen, lengths, 7, True, config.vocab_size)
    from torch._dynamo.backends.common import aot_autograd

    graphs = []  # AOTAutograd's forward graphs (the op's fake implementation traced), run eagerly
    backend = aot_autograd(fw_compiler=lambda gm, example_inputs: graphs.append(gm) or gm.forward)
    compile_config = transformers.CompileConfig(fullgraph=True, backend=backend, mode=None)
    compile_config._compile_all_devices = True  # transformers compiles generate's decode step on GPUs only
    new = 4
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
              cache_implementation="static", output_logits=True, return_dict_in_generate=True)
    contiguous = _count_calls(monkeypatch, fd_transformers, "flash_decode",
                              lambda *a, **k: k.get("block_table") is None)
    with torch.no_grad():
        ours = _model(config, name).generate(compile_config=compile_config, **kw)
        peer = _model(config, "sdpa").generate(disable_compile=True, **kw)
        ref = _model(config, "sdpa", torch.float64).generate(disable_compile=True, **kw)
    assert len(graphs) == 1
    assert len(contiguous) == config.num_hidden_layers * (new - 1)
    assert all(contiguous) == (padding == "none") and any(contiguous) == (padding == "none")
    assert torch.equal(ours.sequences, peer.sequences) and torch.equal(ours.sequences, ref.sequences)
    for step, (a, b, r) in enumerate(zip(ours.logits, peer.logits, ref.logits)):
        err, base = max_err(a, r), max_err(b, r)
        assert err <= 2 * base + 1e-5, f"step {step}: logits error {err:.3e} > 2 x SDPA's {base:.3e}"


@pytest.mark.parametrize("padding", ["none", "left"])
def test_metadata_is_built_once_per_step_not_per_layer(gen, name, padding, monkeypatch):
    """Eager generate (DynamicCache), 3 layers: a left-padded prefill reads its mask's host facts once (not per
    layer) and each decode step builds one positions table for all layers; without padding nothing is built (the
    mask function returns None, the decode reads the cache contiguously). The tokens are SDPA's."""
    config = _config("llama", num_hidden_layers=3)
    ids, mask = _padded_batch(gen, [8, 3, 6] if padding == "left" else [8, 8, 8], 8, True, config.vocab_size)
    new = 4
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    rows = _count_calls(monkeypatch, fd_transformers, "_PrefillRows")
    tables = _count_calls(monkeypatch, fd_transformers, "_positions_table")
    contiguous = _count_calls(monkeypatch, fd_transformers, "flash_decode",
                              lambda *a, **k: k.get("block_table") is None)
    with torch.no_grad():
        tokens = _model(config, name).generate(**kw)
    steps = new - 1
    assert len(contiguous) == config.num_hidden_layers * steps
    if padding == "left":
        assert (len(rows), len(tables), any(contiguous)) == (1, steps, False)
    else:
        assert (len(rows), len(tables), all(contiguous)) == (0, 0, True)
    with torch.no_grad():
        assert torch.equal(tokens, _model(config, "sdpa").generate(**kw))


def test_metadata_of_a_growing_dynamic_cache_is_resolved_once(gen, name, device_resident, monkeypatch):
    """Eager generate (DynamicCache, a longer cache tensor every step), lengths on the device as on the GPU: every
    decode call of every step and layer shares one resolved config and one remembered call (the cache's lengths
    stay in one capacity bucket, ops/decode_host.py). The tokens are SDPA's."""
    from flashdecode import heuristics
    from flashdecode.ops import decode_host

    config = _config("llama", num_hidden_layers=3)
    ids, mask = _padded_batch(gen, [8, 8], 8, True, config.vocab_size)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    decodes = _count_calls(monkeypatch, fd_transformers, "flash_decode")
    resolved = _count_calls(monkeypatch, heuristics, "resolve_decode_config")
    decode_host.clear()
    with torch.no_grad():
        tokens = _model(config, name).generate(**kw)
    assert len(decodes) == config.num_hidden_layers * 5 and len(resolved) == 1
    assert len(decode_host._CALLS) == 1
    with torch.no_grad():
        assert torch.equal(tokens, _model(config, "sdpa").generate(**kw))


def test_step_tables_stand_for_their_masks():
    """padding_mask's decode step tables against the masks they come from: lengths for prefix rows (None when all
    valid), positions otherwise, and each converts back to its mask (the prefill path's reading)."""
    config = _config("llama")
    prefix = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1]], dtype=torch.bool)
    table = fd_transformers.padding_mask(2, 1, 4, attention_mask=prefix, config=config)
    assert table.dtype == torch.int32 and table.shape == (1, 1, 1, 2) and table.flatten().tolist() == [3, 1]
    assert fd_transformers.padding_mask(2, 1, 4, attention_mask=torch.ones(2, 4, dtype=torch.bool)) is None
    for mask in (prefix, left):
        table = fd_transformers.padding_mask(2, 1, 4, attention_mask=mask, config=config)
        hk = 1 if table.shape[-1] == 2 else config.num_key_value_heads
        assert torch.equal(fd_transformers._step_table_as_mask(table, 2, hk, 4), mask)
    # a StaticCache (q_offset a tensor) without a mask: the tokens seen, on the device, no host read
    table = fd_transformers.padding_mask(3, 1, 16, q_offset=torch.tensor(5), attention_mask=None)
    assert table.flatten().tolist() == [6, 6, 6]
    # a short mask (a StaticCache's tokens seen) is padded to the cache length
    table = fd_transformers.padding_mask(1, 1, 6, attention_mask=torch.ones(1, 4, dtype=torch.bool), config=config)
    assert table.flatten().tolist() == [4]
    with pytest.raises(ValueError, match="step table"):
        fd_transformers._read_step_table(torch.zeros(1, 1, 1, 5, dtype=torch.int32), 2, 2, 4)


def test_a_static_cache_step_keeps_its_table_when_the_cache_fills():
    """A StaticCache's decode step (q_offset, the tokens seen, a tensor) whose mask has every cache position valid -
    the step that fills the cache, where transformers 5.17 hands generate's 2-D mask of the tokens seen - still gets
    the lengths table: a None would drop attention_mask from the compiled forward's inputs and compile it again. A
    DynamicCache's (q_offset an int) gets None (no table to build)."""
    full = torch.ones(2, 4, dtype=torch.bool)
    table = fd_transformers.padding_mask(2, 1, 4, q_offset=torch.tensor(3), attention_mask=full)
    assert table.dtype == torch.int32 and table.shape == (1, 1, 1, 2) and table.flatten().tolist() == [4, 4]
    assert fd_transformers.padding_mask(2, 1, 4, q_offset=3, attention_mask=full) is None


def _new_tensors(before: dict) -> list:
    """The tensors alive now (after a collection) that were not in ``before`` (id -> weakref of the tensors alive
    then, as _live_tensors returns)."""
    gc.collect()
    return [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)
            and not (id(t) in before and before[id(t)]() is t)]


def _live_tensors() -> dict:
    gc.collect()
    return {id(t): weakref.ref(t) for t in gc.get_objects() if issubclass(type(t), torch.Tensor)}


@pytest.mark.parametrize("form", ["lengths", "none", "positions"])
def test_the_compiled_op_keeps_no_tensor_it_makes(gen, form, device_resident, monkeypatch):
    """The attention op torch.compile runs (flashdecode_transformers::attention) keeps no tensor it makes beyond the
    call: in a cudagraph tree's warmup its allocations come from the graph's memory pool, and a block still held
    afterwards that the graph did not return raises ("tensor(s) in the cudagraph pool not tracked as outputs"). A
    decode step of each step-table form (lengths: the contiguous read; none: every position valid; positions: the
    one-token pages), with empty module caches: the op's call leaves no new tensor alive but its output, where the
    same call made eagerly keeps its workspace pools and the shared lengths (the control: those caches are what
    the op must not fill)."""
    from flashdecode.ops import decode_host, decode_workspace

    b, h, hk, s, d = 2, 4, 2, 12, 16
    q = torch.randn(b, h, 1, d, generator=gen).to(DEVICE)
    key, value = (torch.randn(b, hk, s, d, generator=gen).to(DEVICE) for _ in range(2))
    valid = torch.arange(s).view(1, s) < torch.tensor([[9], [s]])
    if form == "positions":
        valid = valid.flip(1)  # left padding: not a prefix
    mask = None if form == "none" else fd_transformers.padding_mask(
        b, 1, s, attention_mask=valid.to(DEVICE), config=_config("llama"))
    assert (mask is None) == (form == "none") and (form != "lengths" or mask.shape[-1] == b)
    args = (q, key, value, mask, True, None, -1, 0.0, None)
    monkeypatch.setattr(decode_workspace, "_POOLS", {})
    monkeypatch.setattr(fd_transformers, "_LENGTHS", {})
    decode_host.clear()
    before = _live_tensors()
    out = torch.ops.flashdecode_transformers.attention(*args)
    results = [out.untyped_storage().data_ptr()]  # (and the tensors the results are views of)
    kept = [t for t in _new_tensors(before) if t.untyped_storage().data_ptr() not in results]
    assert kept == [], f"the op kept {len(kept)} tensor(s) it made: {[tuple(t.shape) for t in kept]}"
    eager = fd_transformers._attention(*args)
    results.append(eager.untyped_storage().data_ptr())
    assert [t for t in _new_tensors(before) if t.untyped_storage().data_ptr() not in results]  # the pools
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


def _gpt_oss(attn, dtype=torch.float32):
    """A tiny GPT-OSS (random weights, seeded): attention sinks (s_aux) on every layer, a sliding-window layer
    (window 4) and a full one, GQA; sinks drawn large enough to matter."""
    config = transformers.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                       layer_types=["sliding_attention", "full_attention"],
                                       max_position_embeddings=64, pad_token_id=0,
                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    model = _model(config, attn, dtype, experts_implementation="eager")  # grouped_mm has no float64
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4, generator=g) * 2)
    return config, model


def test_gpt_oss_sinks_and_sliding_window_vs_eager(gen, name):
    """GPT-OSS (no SDPA backend in transformers) against its eager attention: left-padded prefill logits within
    the FlashAttention rule of the float64 model, and equal greedy tokens (decode with sinks and a window)."""
    config, ours = _gpt_oss(name)
    _, eager = _gpt_oss("eager")
    _, ref64 = _gpt_oss("eager", torch.float64)
    ids, mask = _padded_batch(gen, [10, 5], 10, True, config.vocab_size)
    with torch.no_grad():
        logits = {key: model(input_ids=ids, attention_mask=mask).logits
                  for key, model in (("ours", ours), ("eager", eager), ("ref", ref64))}
        kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
        tokens = [model.generate(input_ids=ids, attention_mask=mask, **kw) for model in (ours, eager)]
    valid = mask.bool()
    err, base = max_err(logits["ours"][valid], logits["ref"][valid]), max_err(logits["eager"][valid],
                                                                              logits["ref"][valid])
    assert err <= 2 * base + 1e-5, f"logits error {err:.3e} > 2 x eager's {base:.3e}"
    assert torch.equal(tokens[0], tokens[1])
    _assert_decode_step_close(gen, dict(ours=ours, peer=eager, ref=ref64), config.vocab_size)


def test_unsupported_inputs_raise(name):
    module = torch.nn.Module()
    q = torch.zeros(1, 2, 3, 16)
    with pytest.raises(ValueError, match="dropout"):
        fd_transformers.attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="attention_mask"):
        fd_transformers.attention_forward(module, q, q, q, torch.zeros(1, 1, 3, 3))


def compare_with_sdpa(config, name, lengths, new_tokens, dtype):
    """One model (random weights) run with SDPA and with ``name`` (set_attn_implementation, same weights) on a
    left-padded batch: last-position prefill logits vs the float32 SDPA model's ({backend: error}), and greedy
    decode throughput ({backend: tokens/s}, wall clock of generate after a warm-up)."""
    gen = torch.Generator().manual_seed(0)
    ids, mask = _padded_batch(gen, lengths, max(lengths), True, config.vocab_size)
    model = _model(config, "sdpa")
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else (lambda: None)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits.float()
        model.to(dtype)
        errors, speed = {}, {}
        for attn in ("sdpa", name):
            model.set_attn_implementation(attn)
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
            errors[attn] = max_err(logits, ref)
            kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0)
            model.generate(max_new_tokens=2, **kw)
            sync()
            start = time.perf_counter()
            model.generate(max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
            sync()
            speed[attn] = len(lengths) * new_tokens / (time.perf_counter() - start)
    return errors, speed


@pytest.mark.gpu
@pytest.mark.xdist_group("gpu_bigmem")  # ~10-15 GB (bf16, bf16 SDPA and float32 copies of a 128k-vocab model)
def test_llama3_8b_shape_tokens_per_second_vs_sdpa(name):
    """Llama-3-8B's shapes (32 q / 8 kv heads, head dim 128, hidden 4096, vocab 128256), 2 layers, random weights,
    bf16, batch 4 left-padded to 512: our last-position logits within 2x SDPA's error against the float32 model,
    and decode tokens/s of both backends (printed; generate's wall clock, eager, no CUDA graphs)."""
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=8192, rope_theta=500000.0, pad_token_id=0,
                                      eos_token_id=None, bos_token_id=None)
    errors, speed = compare_with_sdpa(config, name, [512, 300, 512, 100], 64, torch.bfloat16)
    print(f"\nLlama-3-8B shape, 2 layers, bf16, batch 4 (left-padded to 512), 64 new tokens: "
          f"sdpa {speed['sdpa']:.1f} tok/s, {name} {speed[name]:.1f} tok/s; last-logit error vs fp32: "
          f"sdpa {errors['sdpa']:.3e}, {name} {errors[name]:.3e}")
    assert errors[name] <= 2 * errors["sdpa"] + 1e-3


def _agreeing_steps_close(ours, peer, ref, rule: float) -> int:
    """Each generate step's logits (ours, peer: same dtype, ref: float32) while all three have generated the same
    tokens so far: ours within ``rule`` x the peer's error against ref. Returns the steps compared."""
    compared = 0
    for step, (a, b, r) in enumerate(zip(ours.logits, peer.logits, ref.logits)):
        err, base = max_err(a, r), max_err(b, r)
        assert err <= rule * base + 1e-3, f"step {step}: logits error {err:.3e} > {rule} x SDPA's {base:.3e}"
        compared += 1
        if not (torch.equal(a.argmax(-1), b.argmax(-1)) and torch.equal(a.argmax(-1), r.argmax(-1))):
            break
    return compared


@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["none", "left"])
def test_static_cache_reduce_overhead_generate_on_the_gpu(name, padding, monkeypatch):
    """GPU: generate with a StaticCache and its compiled decode step (CompileConfig fullgraph=True,
    mode="reduce-overhead": inductor and CUDA graphs) on a float16 Llama of head dim 128: every step's logits within
    the FlashAttention rule of the float32 SDPA model while the tokens agree; on sm_90 the unpadded prefill runs the
    Gluon kernel (one launch per layer)."""
    from flashdecode.ops import gluon_attention

    config = _config("llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                     max_position_embeddings=1024)
    config.head_dim = 128
    gen = torch.Generator().manual_seed(1)
    ids, mask = _padded_batch(gen, [300, 300] if padding == "none" else [300, 170], 300, True, config.vocab_size)
    gluon = _count_calls(monkeypatch, gluon_attention, "run_plan")
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    compiled = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        ref = _model(config, "sdpa").generate(cache_implementation="static", disable_compile=True, **kw)
        peer = _model(config, "sdpa", torch.float16).generate(cache_implementation="static", disable_compile=True,
                                                              **kw)
        ours = _model(config, name, torch.float16)
        ours.generate(cache_implementation="static", compile_config=compiled, **kw)  # compiles, captures
        ours = ours.generate(cache_implementation="static", compile_config=compiled, **kw)
    assert _agreeing_steps_close(ours, peer, ref, 2) >= 1
    if padding == "none" and torch.cuda.get_device_capability()[0] == 9:
        assert len(gluon) >= config.num_hidden_layers


@pytest.mark.gpu
def test_unpadded_decode_steps_never_sync_the_host(name):
    """GPU: a decode step without padding (DynamicCache, and a StaticCache without attention_mask, whose step table
    is built on the device) runs every layer without a host sync (torch.cuda.set_sync_debug_mode("error"))."""
    config = _config("llama")
    model = _model(config, name, torch.float16)
    ids = torch.randint(1, config.vocab_size, (2, 20), device=DEVICE)
    nxt = torch.randint(1, config.vocab_size, (2, 1), device=DEVICE)
    for cache in (None, transformers.StaticCache(config=config, max_cache_len=64)):
        with torch.no_grad():
            kw = {} if cache is None else {_CACHE_KWARG: cache}
            past = model(input_ids=ids, use_cache=True, **kw).past_key_values
            model(input_ids=nxt, use_cache=True, **{_CACHE_KWARG: past})  # first step: kernels compile
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                logits = model(input_ids=nxt, use_cache=True, **{_CACHE_KWARG: past}).logits
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert torch.isfinite(logits).all()


def test_core_imports_neither_the_integration_nor_transformers():
    import subprocess
    import sys

    code = ("import sys, flashdecode, flashdecode.flash_attn_interface; "
            "print(any(m.startswith('flashdecode.integrations') or m == 'transformers' for m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
