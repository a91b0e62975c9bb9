"""SamplingParams in vLLM's names and meanings, the batched sampler, stop strings and incremental detokenisation.

Engine tests run a tiny random Llama (fp32, CPU) with a word-level tokenizer (token i = "w<i>").
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from engine_helpers import SPECIAL_TOKENS, add_tokenizer, random_prompts, save_tiny, words
from flashdecode.engine import LLM, SamplingParams
from flashdecode.engine.sampling import apply_penalties, filter_logits, sample
from flashdecode.engine.tokenizer import IncrementalDetokenizer

N = 12


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = add_tokenizer(save_tiny(tmp_path_factory.mktemp("sampling") / "m", "llama"))
    return LLM(path, device="cpu", max_num_seqs=8, use_tqdm=False)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts((5, 9, 3), seed=21)


@pytest.fixture(scope="module")
def greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(max_tokens=N), use_tqdm=False)
    return [o.token_ids for o in outs]


def test_params_validation_names_the_argument():
    for name, bad in (("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -1.0),
                      ("top_p", 0.0), ("top_p", float("nan")), ("min_p", 1.5), ("top_k", -2),
                      ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", float("-inf")),
                      ("max_tokens", 0), ("max_tokens", -3), ("n", 0), ("logprobs", 21), ("prompt_logprobs", -1),
                      ("min_tokens", -1)):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: bad})
    for name, bad in (("temperature", "1"), ("max_tokens", 2.5), ("seed", "7"), ("stop", 5), ("stop", [""]),
                      ("ignore_eos", 1)):
        with pytest.raises((TypeError, ValueError), match=name):
            SamplingParams(**{name: bad})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_tokens=4, max_new_tokens=5)


def test_max_tokens_alias_and_defaults():
    assert SamplingParams().max_tokens == 16
    assert SamplingParams(max_new_tokens=7).max_tokens == 7 == SamplingParams(max_tokens=7).max_new_tokens
    sp = SamplingParams(stop="ab")
    assert sp.stop == ("ab",) and sp.stop_holdback == 1
    assert SamplingParams(temperature=1e-45).greedy and not SamplingParams(temperature=1e-3).greedy


def test_tiny_temperature_is_greedy_not_token_zero(llm, prompts, greedy):
    outs = llm.generate(prompts, SamplingParams(max_tokens=N, temperature=1e-45, seed=3), use_tqdm=False)
    assert [o.token_ids for o in outs] == greedy
    # a small but non-greedy temperature concentrates the draw on the argmax (no overflow, no token 0 spam)
    outs = llm.generate(prompts, SamplingParams(max_tokens=N, temperature=1e-4, seed=3), use_tqdm=False)
    assert [o.token_ids for o in outs] == greedy


def _draws(logits: torch.Tensor, params: SamplingParams, rows: int) -> torch.Tensor:
    """Picks of ``rows`` rows of the same float32 ``logits`` (vocab,), each row drawing with its own generator."""
    seqs = [types.SimpleNamespace(params=params, generator=torch.Generator().manual_seed(i), token_ids=[0],
                                  num_prompt_tokens=1, num_generated=0, min_tokens_stop_ids=frozenset())
            for i in range(rows)]
    return torch.as_tensor(sample(logits.expand(rows, -1).clone(), seqs).tokens)


def test_sampler_draws_from_the_filtered_distribution():
    """Many rows of one distribution: frequencies of the picks match softmax(logits / T) restricted by top-k."""
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    rows = 4000
    picks = _draws(logits, SamplingParams(temperature=0.5, top_k=3), rows)
    want = torch.softmax(logits[:3] / 0.5, -1)
    freq = torch.bincount(picks, minlength=4).double() / rows
    assert freq[3] == 0
    assert (freq[:3] - want).abs().max() < 4 * math.sqrt(0.25 / rows)


@pytest.mark.parametrize("temperature,min_p,kept", [(1.0, 0.3, 3), (0.5, 0.3, 2), (1.0, 0.0, 5)])
def test_min_p_drops_tokens_below_its_share_of_the_top_probability(temperature, min_p, kept):
    """vLLM's min_p: after the temperature, a token is dropped when its probability is below min_p x the top one's;
    the rest keep their renormalised probabilities. p = [0.4, 0.25, 0.15, 0.1, 0.1]: min_p 0.3 keeps the three
    >= 0.12 at T = 1, and at T = 0.5 (p^2 renormalised: 0.60, 0.24, 0.08, 0.04, 0.04; floor 0.18) the first two;
    min_p 0 keeps all five."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.1])
    logits = torch.log(probs)
    rows = 3000
    picks = _draws(logits, SamplingParams(temperature=temperature, min_p=min_p), rows)
    freq = torch.bincount(picks, minlength=5).double() / rows
    want = torch.softmax(logits / temperature, -1).double()
    want = torch.where(want >= min_p * want.max(), want, torch.zeros_like(want))
    want /= want.sum()
    assert int((want > 0).sum()) == kept
    assert (freq[want == 0] == 0).all()  # never a dropped token
    assert (freq - want).abs().max() < 4 * math.sqrt(0.25 / rows)


def test_filter_logits_min_p_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15]))
    assert torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [True, False, True, False]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.85)).tolist() == [True, False, True, True]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.5)).tolist() == [True, False, False, False]


def test_penalties_follow_vllm_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    seq = types.SimpleNamespace(token_ids=[0, 1, 3, 3, 2], num_prompt_tokens=2,
                                params=SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                                                      presence_penalty=0.25))
    out = logits.clone()
    apply_penalties(out, [0], [seq])
    # every seen token (0, 1, 2, 3) is divided (positive) / multiplied (negative) by 2; outputs 3 (x2) and 2 (x1)
    # pay frequency 0.5 per occurrence and presence 0.25 once
    want = torch.tensor([[1.0, -2.0, 0.25 - 0.5 - 0.25, 1.5 - 1.0 - 0.25, -2.0]])
    assert torch.allclose(out, want)


def test_repetition_penalty_changes_generation(llm, prompts, greedy):
    out = llm.generate(prompts[0], SamplingParams(max_tokens=N, repetition_penalty=100.0), use_tqdm=False)[0]
    assert len(set(out.token_ids)) == len(out.token_ids)  # a huge penalty forbids any repeat of the output
    assert set(out.token_ids).isdisjoint(prompts[0])  # and of the prompt


def test_stop_strings_across_token_boundaries(llm, prompts, greedy):
    ref = greedy[1]
    full = words(ref)
    assert llm.generate(prompts[1], SamplingParams(max_tokens=N), use_tqdm=False)[0].text == full
    # the stop string spans the end of token 3 and the start of token 4 ("3 w4" of "... w13 w42 ...")
    cut = len(words(ref[:4]))
    stop = full[cut - 1:cut + 3]
    out = llm.generate(prompts[1], SamplingParams(max_tokens=N, stop=[stop, "zzz"]), use_tqdm=False)[0]
    first = full.find(stop)
    assert out.text == full[:first] and out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.token_ids == ref[:len(out.token_ids)] and len(out.token_ids) < N
    out = llm.generate(prompts[1], SamplingParams(max_tokens=N, stop=stop, include_stop_str_in_output=True),
                       use_tqdm=False)[0]
    assert out.text == full[:first + len(stop)]


def test_stop_token_ids_min_tokens_and_ignore_eos(llm, prompts, greedy):
    ref = greedy[0]
    k = next(i for i in range(1, N) if ref[i] not in ref[:i])
    out = llm.generate(prompts[0], SamplingParams(max_tokens=N, stop_token_ids=[ref[k]]), use_tqdm=False)[0]
    assert out.token_ids == ref[:k + 1] and out.finish_reason == "stop" and out.outputs[0].stop_reason == ref[k]
    # min_tokens: the stop token is masked until k + 3 tokens exist, so generation goes on past it
    out = llm.generate(prompts[0], SamplingParams(max_tokens=N, stop_token_ids=[ref[k]], min_tokens=k + 3),
                       use_tqdm=False)[0]
    assert len(out.token_ids) >= k + 3 and ref[k] not in out.token_ids[:k + 2]
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(prompts[0], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    # an EOS id past the vocabulary (configs have them) is ignored by the min_tokens mask, not indexed
    seq = llm.add_request(prompts[0], SamplingParams(max_tokens=3, min_tokens=2))[0]
    seq.min_tokens_stop_ids = frozenset({10**6, ref[0]})
    llm._run([seq], use_tqdm=False, desc="")
    assert seq.num_generated == 3 and seq.token_ids[len(prompts[0])] != ref[0]


def test_logprobs_are_log_softmax_of_the_raw_logits(llm, prompts, greedy):
    out = llm.generate(prompts[2], SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 6
    total = 0.0
    for j, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        ref = torch.log_softmax(llm.prompt_logits(prompts[2] + comp.token_ids[:j])[-1], -1)
        top = torch.topk(ref, 3).indices.tolist()
        assert list(entry)[0] == tok and top[0] == tok  # greedy: the sampled token is the top-1
        assert set(entry) == set(top) and all(v <= 0 for v in entry.values())
        assert all(abs(entry[t] - ref[t].item()) < 1e-4 for t in entry)
        total += entry[tok]
    assert abs(comp.cumulative_logprob - total) < 1e-5
    plp = out.prompt_logprobs
    ref = torch.log_softmax(llm.prompt_logits(prompts[2]), -1)
    assert plp[0] is None and len(plp) == len(prompts[2])
    for pos in range(1, len(prompts[2])):
        tok = prompts[2][pos]
        assert list(plp[pos])[0] == tok and abs(plp[pos][tok] - ref[pos - 1, tok].item()) < 1e-4
        assert len(plp[pos]) <= 3


def test_n_completions_seeded(llm, prompts, greedy):
    sp = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5)
    a = llm.generate(prompts[0], sp, use_tqdm=False)[0]
    b = llm.generate(prompts[0], sp, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # seeded: reproducible
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # choice i uses seed + i
    g = llm.generate(prompts[0], SamplingParams(n=2, max_tokens=N), use_tqdm=False)[0]
    assert [c.token_ids for c in g.outputs] == [greedy[0]] * 2


def test_detokenizer_never_splits_utf8():
    """A byte-level tokenizer (one token per byte): every delta is valid text and they add up to the string."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    wrapper = types.SimpleNamespace(decode=lambda ids, skip_special_tokens=True: tok.decode(ids))
    text = "héllo 日本語 ok ✓"
    ids = tok.encode(text).ids
    assert len(ids) == len(text.encode())
    det = IncrementalDetokenizer(wrapper)
    deltas = [det.step([t]) for t in ids] + [det.flush()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert sum(d == "" for d in deltas) >= 6  # the pieces of multi-byte characters wait for their last byte


def test_chat_applies_the_template(llm, tmp_path):
    msgs = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4 w5"}]
    ids = llm.render_chat(msgs)
    s, u, a = (SPECIAL_TOKENS[t] for t in ("<|system|>", "<|user|>", "<|assistant|>"))
    assert ids == [s, 1, 2, u, 3, 4, 5, a]
    out = llm.chat(msgs, SamplingParams(max_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids == llm.generate(ids, SamplingParams(max_tokens=5), use_tqdm=False)[0].token_ids
    both = llm.chat([msgs, msgs[1:]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(both) == 2 and both[1].prompt_token_ids == [u, 3, 4, 5, a]
    with pytest.raises(ValueError, match="chat template"):
        path = add_tokenizer(save_tiny(tmp_path / "nochat", "llama"), chat_template=None)
        LLM(path, device="cpu", use_tqdm=False).chat(msgs)
