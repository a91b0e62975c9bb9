"""Engine vs transformers on tiny random checkpoints (fp32, CPU): prompt logits and greedy generations.

Checkpoints are written by save_pretrained (Llama with llama3 rope scaling; Qwen2 with qkv bias and tied
embeddings); HF runs in fp32 with eager attention. The default CPU backend is the reference ("torch").
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine_helpers import (LLAMA3_ROPE, VOCAB, hf_greedy, hf_model, hf_prompt_logits, random_prompts,
                            rewrite_config, save_tiny)
from flashdecode.engine import LLM, SamplingParams, load_config
from flashdecode.engine.config import config_from_dict, named_config

RAGGED = (5, 11, 17, 3, 9)
NEW_TOKENS = 12


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints and the HF results every test compares against (computed once)."""
    root = tmp_path_factory.mktemp("engine")
    out = {}
    for kind, kw in (("llama", {"rope_scaling": LLAMA3_ROPE}), ("qwen2", {})):
        path = save_tiny(root / kind, kind, **kw)
        hf = hf_model(path)
        prompts = random_prompts(RAGGED, seed=1)
        out[kind] = dict(path=path, hf=hf, prompts=prompts,
                         greedy=[hf_greedy(hf, p, NEW_TOKENS) for p in prompts])
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prompt_logits_match_transformers(ckpts, kind):
    c = ckpts[kind]
    llm = LLM(c["path"], device="cpu", dtype="float32")
    ids = random_prompts([45], seed=2)[0]  # longer than the llama3 original_max_position_embeddings (32)
    assert rel_err(llm.prompt_logits(ids), hf_prompt_logits(c["hf"], ids)) < 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_ragged_batch_matches_transformers(ckpts, kind):
    c = ckpts[kind]
    llm = LLM(c["path"], device="cpu", dtype="float32", max_num_seqs=4)  # 5 prompts, 4 seats: one joins later
    outs = llm.generate(c["prompts"], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == c["greedy"]
    assert all(o.finish_reason == "length" for o in outs)


def test_qwen2_has_bias_and_tied_embeddings(ckpts):
    cfg = load_config(ckpts["qwen2"]["path"])
    assert cfg.qkv_bias and not cfg.o_bias and cfg.tie_word_embeddings
    llm = LLM(ckpts["qwen2"]["path"], device="cpu")
    assert llm.model.lm_head is None
    assert llm.model.model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_torch_backends_agree(ckpts, backend):
    c = ckpts["llama"]
    llm = LLM(c["path"], device="cpu", attn_backend=backend, max_num_seqs=8)
    outs = llm.generate(c["prompts"][:3], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == c["greedy"][:3]
    ids = c["prompts"][2]
    assert rel_err(llm.prompt_logits(ids), hf_prompt_logits(c["hf"], ids)) < 1e-4


def test_transformers_4x_config_json(ckpts, tmp_path):
    """config.json as transformers 4.x writes it: rope_theta + rope_scaling ("type" or "rope_type")."""
    path = tmp_path / "v4"
    shutil.copytree(ckpts["llama"]["path"], path)
    rewrite_config(path, rope_parameters=None, rope_theta=10000.0,
                   rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}},
                   transformers_version="4.46.0")
    cfg = load_config(path)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.factor == 8.0 and cfg.rope.theta == 10000.0
    ids = random_prompts([40], seed=3)[0]
    llm = LLM(path, device="cpu")
    assert rel_err(llm.prompt_logits(ids), hf_prompt_logits(ckpts["llama"]["hf"], ids)) < 1e-4


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}])
def test_rope_scaling_linear_dynamic(tmp_path, rope):
    """max_position_embeddings 24 < prompt 40: dynamic NTK grows its base for the whole prompt, as HF does."""
    path = save_tiny(tmp_path / "m", "llama", rope_scaling=rope, max_position_embeddings=24)
    ids = random_prompts([40], seed=4)[0]
    llm = LLM(path, device="cpu", max_model_len=64)
    assert rel_err(llm.prompt_logits(ids), hf_prompt_logits(hf_model(path), ids)) < 1e-4


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_mistral_sliding_window(tmp_path, backend):
    """Mistral with a sliding window of 8 keys: prompts and generations longer than the window."""
    path = save_tiny(tmp_path / "mistral", "mistral", sliding_window=8)
    assert load_config(path).sliding_window == 8
    hf = hf_model(path)
    llm = LLM(path, device="cpu", attn_backend=backend, max_model_len=64)
    ids = random_prompts([21], seed=8)[0]
    assert rel_err(llm.prompt_logits(ids), hf_prompt_logits(hf, ids)) < 1e-4
    out = llm.generate([ids], SamplingParams(max_new_tokens=6))[0]
    assert out.token_ids == hf_greedy(hf, ids, 6)


def test_sharded_checkpoint(tmp_path, ckpts):
    path = save_tiny(tmp_path / "sharded", "qwen2", shard="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    ids = random_prompts([20], seed=5)[0]
    llm = LLM(path, device="cpu")
    assert rel_err(llm.prompt_logits(ids), hf_prompt_logits(hf_model(path), ids)) < 1e-4


def test_eos_from_generation_config_stops(tmp_path, ckpts):
    c = ckpts["llama"]
    prompt, greedy = c["prompts"][1], c["greedy"][1]
    stop_at = next(i for i in range(2, NEW_TOKENS) if greedy[i] not in greedy[:i])
    path = tmp_path / "eos"
    shutil.copytree(c["path"], path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [VOCAB + 5, greedy[stop_at]]}))
    assert load_config(path).eos_token_ids == (VOCAB + 5, greedy[stop_at])
    llm = LLM(path, device="cpu")
    out = llm.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS))[0]
    assert out.token_ids == greedy[:stop_at + 1] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == greedy


def test_sampling_seeded_and_limits(ckpts):
    c = ckpts["llama"]
    llm = LLM(c["path"], device="cpu", max_num_seqs=8)
    prompts = c["prompts"][:3]
    sp = SamplingParams(max_new_tokens=8, temperature=1.3, top_k=20, top_p=0.9, seed=7)
    alone = llm.generate([prompts[0]], sp)[0].token_ids
    batched = llm.generate(prompts, sp)
    assert batched[0].token_ids == alone  # a seeded request does not depend on its batch
    other = llm.generate([prompts[0]], SamplingParams(max_new_tokens=8, temperature=1.3, seed=8))[0].token_ids
    assert other != alone
    # top_k=1 and a tiny top_p leave only the argmax: they must reproduce greedy decoding
    for sp in (SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=1, seed=1),
               SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=1e-6, seed=1)):
        assert llm.generate([prompts[0]], sp)[0].token_ids == c["greedy"][0]


def test_filter_logits_top_k_top_p():
    from flashdecode.engine.sampling import filter_logits

    logits = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15]))
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [True, False, True, False]
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.85))  # 0.5 + 0.3 < 0.85: 0.15 joins too
    assert kept.tolist() == [True, False, True, True]
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.5))
    assert kept.tolist() == [True, False, False, False]


def test_string_prompts_with_tokenizer(tmp_path, ckpts):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path / "tok"
    shutil.copytree(ckpts["llama"]["path"], path)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    llm = LLM(path, device="cpu")
    ids = ckpts["llama"]["prompts"][0]
    out = llm.generate(" ".join(f"w{i}" for i in ids), SamplingParams(max_new_tokens=NEW_TOKENS))[0]
    assert out.prompt_token_ids == ids and out.token_ids == ckpts["llama"]["greedy"][0]
    assert out.text == " ".join(f"w{i}" for i in out.token_ids)


def test_bad_inputs_raise_clear_errors(ckpts, tmp_path):
    with pytest.raises(ValueError, match="llama"):
        config_from_dict({"model_type": "gpt2", "vocab_size": 10})
    path = tmp_path / "yarn"
    shutil.copytree(ckpts["llama"]["path"], path)
    rewrite_config(path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="llama3"):
        LLM(path, device="cpu")
    llm = LLM(ckpts["llama"]["path"], device="cpu", max_model_len=32)
    with pytest.raises(ValueError, match="string prompts"):
        llm.generate("no tokenizer here")
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(40))])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[VOCAB + 1]])
    with pytest.raises(ValueError, match="attn_backend"):
        LLM(ckpts["llama"]["path"], device="cpu", attn_backend="nope")
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(ckpts["llama"]["path"], device="cpu", dtype="int8")


def test_named_configs_parameter_counts():
    assert abs(named_config("llama3-8b").num_parameters() - 8.03e9) < 0.01e9
    assert abs(named_config("qwen2.5-1.5b").num_parameters() - 1.54e9) < 0.01e9
    assert named_config("llama3-8b", num_layers=2).num_hidden_layers == 2
    assert abs(named_config("qwen3-8b").num_parameters() - 8.19e9) < 0.01e9
    gemma = named_config("gemma3-12b")  # the language model of Gemma-3-12B (12.19B with its vision tower)
    assert abs(gemma.num_parameters() - 11.77e9) < 0.01e9
    assert gemma.layer_types.count("full_attention") == 8 and gemma.layer_window_left(0) == 1023
    assert gemma.kv_tokens_read(4096) == 8 * 4096 + 40 * 1024


def test_flashdecode_backend_prefills_one_prompt_through_the_dense_call():
    """A single-prompt prefill takes flash_attn (the Gluon kernel on sm_90) instead of the varlen call, with the
    same causal result; a batch of prompts stays on varlen."""
    from flashdecode import reference
    from flashdecode.engine.attention import AttentionMetadata, FlashDecodeBackend

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(37, 4, 16, generator=gen).half()
    k, v = (torch.randn(37, 2, 16, generator=gen).half() for _ in range(2))
    backend = FlashDecodeBackend()
    dense, varlen = [], []
    backend._dense = lambda *a, real=backend._dense, **kw: dense.append(1) or real(*a, **kw)
    backend._varlen = lambda *a, real=backend._varlen, **kw: varlen.append(1) or real(*a, **kw)
    one = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(37), cu_seqlens=torch.tensor([0, 37],
                            dtype=torch.int32), max_seqlen=37, seqlens=[37])
    out = backend.prefill(q, k, v, one)
    ref, _ = reference.attention_varlen_ref(q.double(), k.double(), v.double(), one.cu_seqlens, one.cu_seqlens,
                                            causal=True)
    assert dense == [1] and not varlen and out.shape == q.shape
    assert (out.double() - ref).abs().max() < 2e-3
    two = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(37), cu_seqlens=torch.tensor(
        [0, 20, 37], dtype=torch.int32), max_seqlen=20, seqlens=[20, 17])
    backend.prefill(q, k, v, two)
    assert dense == [1] and varlen == [1]


@pytest.mark.parametrize("nheads,nheads_kv,window_left", [(8, 2, -1), (4, 4, -1), (6, 1, 5)])
def test_sdpa_and_eager_decode_match_the_reference_on_pages(nheads, nheads_kv, window_left):
    """The sdpa backend's decode (a kv head's query heads as its query rows, no repeated K/V) and eager's against the
    spec on a shuffled paged cache with ragged lengths, GQA / MHA / MQA and a sliding window."""
    from flashdecode.engine.attention import AttentionMetadata, EagerBackend, SdpaBackend, TorchBackend

    gen = torch.Generator().manual_seed(5)
    page, d, lens = 4, 16, [13, 1, 7]
    k_cache, v_cache = (torch.randn(12, page, nheads_kv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    table = torch.randperm(12, generator=gen).view(3, 4).to(torch.int32)
    q = torch.randn(3, nheads, d, generator=gen, dtype=torch.float64)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(3, dtype=torch.int64), block_tables=table,
                             context_lens=torch.tensor(lens, dtype=torch.int32))
    want = TorchBackend(window_left).decode(q, k_cache, v_cache, meta)
    for backend in (SdpaBackend(window_left), EagerBackend(window_left)):
        torch.testing.assert_close(backend.decode(q, k_cache, v_cache, meta), want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_sdpa_decode_on_the_gpu_in_a_cuda_graph():
    """The sdpa backend's GQA-rows decode through CUDA's SDPA kernels, captured in a CUDA graph, against the spec."""
    from flashdecode.engine.attention import AttentionMetadata, SdpaBackend, TorchBackend

    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache = (torch.randn(40, 16, 8, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    table = torch.randperm(40, generator=gen).view(4, 10).to("cuda", torch.int32)
    q = torch.randn(4, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(4, dtype=torch.int64, device="cuda"),
                             block_tables=table, context_lens=torch.tensor([160, 1, 77, 129], dtype=torch.int32,
                                                                           device="cuda"))
    backend = SdpaBackend()
    backend.decode(q, k_cache, v_cache, meta)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.decode(q, k_cache, v_cache, meta)
    graph.replay()
    want = TorchBackend().decode(q.double(), k_cache.double(), v_cache.double(), meta)
    assert (out.double() - want).abs().max() < 2e-2
