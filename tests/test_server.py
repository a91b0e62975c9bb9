"""The OpenAI-compatible server on a loopback port, driven by the official openai client and raw httpx (SSE).

A tiny random Llama (fp32, CPU) with a word-level tokenizer and a chat template; a second engine on the same
checkpoint computes what LLM.generate / LLM.chat return, which the server must reproduce.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import openai
import pytest

from engine_helpers import SPECIAL_TOKENS, add_tokenizer, random_prompts, save_tiny, start_serve, word, words
from flashdecode.engine import LLM, SamplingParams
from flashdecode.engine.server.launch import ServerThread

MODEL = "tiny-llama"
MAX_LEN = 256


def make_llm(path, **kw):
    return LLM(path, device="cpu", max_num_seqs=8, max_model_len=MAX_LEN, page_size=4, use_tqdm=False, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return add_tokenizer(save_tiny(tmp_path_factory.mktemp("server") / "m", "llama"))


@pytest.fixture(scope="module")
def ref(ckpt):
    return make_llm(ckpt)


@pytest.fixture(scope="module")
def server(ckpt):
    # async scheduling as on a GPU (its default there; "auto" leaves it off on the CPU): every test below also
    # checks that greedy streams equal the synchronous `ref` and that aborts free their pages with it on
    with ServerThread(make_llm(ckpt, async_scheduling=True), MODEL, max_queue=64) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def sse_events(response: httpx.Response) -> list:
    """The data payloads of a server-sent event stream, [DONE] as the string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def pool_is_full(server) -> bool:
    llm = server.engine.llm
    return llm.block_manager.num_free == llm.block_manager.num_pages and server.engine.num_open == 0


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200


def test_chat_and_completion_greedy_equal_generate(server, client, ref):
    msgs = [{"role": "system", "content": "w4 w5"}, {"role": "user", "content": "w1 w2 w3"}]
    want = ref.chat(msgs, SamplingParams(max_tokens=10), use_tqdm=False)[0]
    got = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    choice = got.choices[0]
    assert choice.message.content == want.text == words(want.token_ids) and choice.finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"

    prompt = "w7 w8 w9 w10"
    want = ref.generate(prompt, SamplingParams(max_tokens=9), use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].model_extra["token_ids"] == want.token_ids
    ids = random_prompts([7], seed=31)[0]
    want = ref.generate(ids, SamplingParams(max_tokens=6), use_tqdm=False)[0]
    stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want.text


def test_a_list_of_prompts_is_a_batch(server, client, ref):
    """OpenAI's batched prompt forms (strings, token-id lists): choice p * n + i is prompt p's completion i, the
    same greedy text as one request per prompt, streamed or not; usage sums the prompts."""
    texts = ["w7 w8 w9", "w1 w2"]
    want = [o.text for o in ref.generate(texts, SamplingParams(max_tokens=5), use_tqdm=False)]
    got = client.completions.create(model=MODEL, prompt=texts, max_tokens=5, temperature=0, n=2)
    by_index = {c.index: c.text for c in got.choices}
    assert [by_index[i] for i in range(4)] == [want[0], want[0], want[1], want[1]]
    assert got.usage.prompt_tokens == sum(len(ref.encode(t)) for t in texts) and got.usage.completion_tokens == 20
    ids = random_prompts([5, 8], seed=33)
    want = [o.text for o in ref.generate(ids, SamplingParams(max_tokens=4), use_tqdm=False)]
    stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, stream=True)
    streamed = {}
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[0], streamed[1]] == want
    assert wait_until(lambda: pool_is_full(server))


def test_raw_sse_ends_with_done_and_reports_usage(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w3"}], "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    tokens = [t for e in events[:-2] for t in e["choices"][0]["token_ids"]]
    assert len(tokens) == 5 and all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_stop_string_spanning_tokens_streamed(server, client, ref):
    ids = random_prompts([6], seed=32)[0]
    full_ids = ref.generate(ids, SamplingParams(max_tokens=12), use_tqdm=False)[0].token_ids
    full = words(full_ids)
    cut = len(words(full_ids[:5]))
    stop = full[cut - 2:cut + 3]  # the end of token 5, the space, the start of token 6
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stop=[stop],
                                        stream=stream)
        chunks = list(got) if stream else [got]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == full[:full.find(stop)] and stop not in text
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_match_seeded_generate(client, ref):
    msgs = [{"role": "user", "content": "w11 w12"}]
    want = ref.chat(msgs, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=9), use_tqdm=False)[0]
    got = client.chat.completions.create(model=MODEL, messages=msgs, n=3, max_tokens=6, temperature=1.0, seed=9)
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    by_index = {c.index: c.message.content for c in got.choices}
    assert [by_index[i] for i in range(3)] == [c.text for c in want.outputs]
    assert len(set(by_index.values())) > 1


def test_logprobs_sanity(client, ref):
    ids = random_prompts([5], seed=33)[0]
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    want = ref.generate(ids, SamplingParams(max_tokens=6), use_tqdm=False)[0].token_ids
    assert lp.tokens == [f"w{t}" for t in want]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and all(v <= 0 for v in top.values())
        assert max(top, key=top.get) == tok and abs(top[tok] - value) < 1e-6  # greedy: the top-1 is the token
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6  # part of one distribution
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2)
    for entry in got.choices[0].logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_16_concurrent_streams_complete(server, ref):
    prompts = random_prompts([3 + i % 7 for i in range(16)], seed=34)
    want = [o.token_ids for o in ref.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)]

    async def one(client, ids):
        stream = await client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, stream=True)
        tokens, reason = [], None
        async for chunk in stream:
            tokens += chunk.choices[0].model_extra["token_ids"]
            reason = chunk.choices[0].finish_reason or reason
        return tokens, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert [r[0] for r in results] == want and all(r[1] == "length" for r in results)
    assert wait_until(lambda: pool_is_full(server))


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_pages(server, monkeypatch, stream):
    llm = server.engine.llm
    seqs = []
    add = llm.add_request
    step = llm.step_sequences

    def recording_add(*a, **kw):
        seqs.extend(add(*a, **kw))
        return seqs[-1:]

    def slow_step():  # 200 tokens now take >= 4 s: the abort must land long before
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(llm, "add_request", recording_add)
    monkeypatch.setattr(llm, "step_sequences", slow_step)
    body = {"model": MODEL, "prompt": "w1 w2 w3 w4 w5 w6 w7 w8 w9", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: ")
                if got == 3:
                    assert llm.block_manager.num_free < llm.block_manager.num_pages
                    break
    else:  # the client gives up waiting for the whole answer
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        assert seqs and not seqs[-1].finished
    # the connection is closed: the server sees the disconnect and aborts the sequence
    assert wait_until(lambda: pool_is_full(server), timeout=5)
    assert seqs[-1].finish_reason == "abort" and seqs[-1].num_generated < 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": " ".join(["w1"] * MAX_LEN)}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 3}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**6]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["w1", []]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[2, 3], []]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["w1", 3]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "temperature": float("nan")}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "top_p": 5.0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "n": "2"}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "logprobs": 50}, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "stream": "yes"},
     "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]}, "model"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, client, path, body, param):
    r = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    ok = client.completions.create(model=MODEL, prompt="w1 w2", max_tokens=2, temperature=0)
    assert len(ok.choices[0].model_extra["token_ids"]) == 2


def test_malformed_json_and_unknown_route(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0).completions.create(
            model=MODEL, prompt="w1", max_tokens=0)


def test_engine_failure_fails_the_request_not_the_server(server, client, monkeypatch):
    llm = server.engine.llm
    step = llm.step_sequences
    calls = []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated device error")
        return step()

    monkeypatch.setattr(llm, "step_sequences", failing_once)
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "w1 w2", "max_tokens": 3},
                   timeout=30)
    assert r.status_code == 500 and "simulated device error" in r.json()["error"]["message"]
    assert wait_until(lambda: pool_is_full(server))
    ok = client.completions.create(model=MODEL, prompt="w1 w2", max_tokens=3, temperature=0)
    assert len(ok.choices[0].model_extra["token_ids"]) == 3


def test_queue_full_gets_429(ckpt):
    """One seat and no queue: while one request streams, a second one is refused with 429."""
    llm = LLM(ckpt, device="cpu", max_num_seqs=1, max_model_len=MAX_LEN, use_tqdm=False)
    step = llm.step_sequences
    llm.step_sequences = lambda: (time.sleep(0.01), step())[1]
    with ServerThread(llm, MODEL, max_queue=0) as srv:
        body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            second = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
            assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"
        assert wait_until(lambda: srv.engine.num_open == 0)
        ok = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200


def test_bench_serve_tiny(ckpt, tmp_path, capsys):
    """`flashdecode bench serve` with 4 streaming chat requests: every request completes with its exact token count,
    the percentiles are ordered, and the LLM.generate comparison runs on the same batch."""
    from flashdecode.cli import main

    code = main(["--log-level", "WARNING", "bench", "serve", "--model", str(ckpt), "--device", "cpu",
                 "--num-requests", "4", "--prompt-len", "6", "--output-len", "5", "--max-model-len", "64",
                 "--timeout", "120", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr()
    record = json.loads(next(tmp_path.glob("serve_*.json")).read_text())
    row = record["rows"][0]
    assert row["ok"] == 4 and row["failed"] == 0 and row["endpoint"] == "chat"
    assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p90"] <= row["ttft_ms"]["p99"]
    assert 0 < row["tpot_ms"]["p50"] <= row["tpot_ms"]["p99"]
    assert row["output_tokens_per_s"] > 0 and row["requests_per_s"] > 0
    assert record["baseline"]["output_tokens"] == 4 * 5 and row["generate_output_tokens_per_s"] > 0
    assert len(record["ttft_s_all"]) == 4
    assert next(tmp_path.glob("serve_*.png")).stat().st_size > 0


# ------------------------------------------------------------------------------------------ saying no clearly

def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "w1 w2 w3"}]


@pytest.mark.parametrize("path,extra,param", [
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),
    (CHAT, {"logit_bias": {"5": 100}}, "logit_bias"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"prediction": {"type": "content", "content": "w1"}}, "prediction"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CHAT, {"verbosity": "low"}, "verbosity"),
    (CHAT, {"web_search_options": {}}, "web_search_options"),  # {} turns web search on (OpenAI's defaults)
    (CMPL, {"logit_bias": {"5": 100}}, "logit_bias"),
    (CMPL, {"echo": True}, "echo"),
    (CMPL, {"suffix": " w9"}, "suffix"),
    (CMPL, {"best_of": 3}, "best_of"),
    (CMPL, {"guided_json": {"type": "object"}}, "guided_json"),  # not an OpenAI field: unrecognized, as OpenAI says
    (CHAT, {"frobnicate": 1}, "frobnicate"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
])
def test_unsupported_or_unknown_fields_are_refused_by_name(server, path, extra, param):
    """A field the server cannot honour is a 400 naming it (never a 200 that silently ignores it); a field OpenAI does
    not define is refused with OpenAI's own message."""
    base = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    base.update({"messages": MSGS} if path == CHAT else {"prompt": "w1 w2"})
    r = post(server, path, {**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"
    if param in extra and param not in ("guided_json", "frobnicate"):
        assert err["code"] == "unsupported_parameter" and "not supported" in err["message"]
    else:
        assert err["message"] == f"Unrecognized request argument supplied: {param}"


def test_fields_that_ask_nothing_unsupported_are_served(server, client):
    """OpenAI fields at values that need nothing this server lacks, and the fields that do not change the answer
    (storage, billing, caching hints), are accepted and give the same tokens."""
    want = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, temperature=0)
    got = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=3, temperature=0, tools=[], tool_choice="none",
        response_format={"type": "text"}, modalities=["text"], logit_bias={}, user="u1", metadata={"k": "v"},
        store=False, service_tier="auto", parallel_tool_calls=False, prompt_cache_key="c", safety_identifier="s",
        reasoning_effort=None, stream_options=None)
    assert got.choices[0].model_extra["token_ids"] == want.choices[0].model_extra["token_ids"]
    got = client.completions.create(model=MODEL, prompt="w1 w2", max_tokens=3, temperature=0, echo=False,
                                    best_of=1, user="u1", logit_bias={})
    assert len(got.choices[0].model_extra["token_ids"]) == 3


def test_unknown_model_is_404_and_models_by_id(server, client):
    for path, body in ((CMPL, {"model": "gpt-4", "prompt": "w1"}), (CHAT, {"model": "gpt-4", "messages": MSGS})):
        r = post(server, path, body)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="w1", max_tokens=1)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == MAX_LEN
    r = httpx.get(server.url + "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    named = httpx.get(server.url + "/v1/models/org/name")  # hub-style ids (with a slash) reach the route too
    assert named.status_code == 404 and "org/name" in named.json()["error"]["message"]


def test_prompt_plus_max_tokens_beyond_the_context_is_refused(server, ref):
    """vLLM's rule: a prompt whose max_tokens do not fit the context is a 400 (context_length_exceeded), not a short
    200; LLM.generate raises ValueError for the same and leaves the engine as it was."""
    ids = random_prompts([MAX_LEN - 6], seed=40)[0]
    r = post(server, CMPL, {"model": MODEL, "prompt": ids, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert str(MAX_LEN) in err["message"] and str(MAX_LEN + 4) in err["message"]
    ok = post(server, CMPL, {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 6
    # a batch is refused whole when one prompt does not fit
    r = post(server, CMPL, {"model": MODEL, "prompt": [[1, 2], ids], "max_tokens": 10})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # chat: the field named is the one given (max_completion_tokens), the prompt is "messages"
    long_chat = [{"role": "user", "content": " ".join(["w1"] * (MAX_LEN - 8))}]
    r = post(server, CHAT, {"model": MODEL, "messages": long_chat, "max_completion_tokens": 20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    r = post(server, CHAT, {"model": MODEL, "messages": long_chat + long_chat})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert wait_until(lambda: pool_is_full(server))
    with pytest.raises(ValueError, match="max_model_len"):
        ref.generate([[1, 2, 3], ids], SamplingParams(max_tokens=10), use_tqdm=False)
    assert not ref.scheduler.has_work() and ref.block_manager.num_free == ref.block_manager.num_pages
    assert len(ref.generate(ids, SamplingParams(max_tokens=6), use_tqdm=False)[0].token_ids) == 6


# ------------------------------------------------------------------------------------------ every field has its effect

PROMPT = random_prompts([6], seed=41)[0]


def _first_new(tokens: list[int], start: int) -> int:
    """The first position >= start whose token did not occur before it (a stop token that ends exactly there)."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def _special_seed(ref) -> int:
    """A seed whose sampled completion (temperature 2) contains a special token."""
    params = [SamplingParams(max_tokens=8, temperature=2.0, seed=s) for s in range(48)]
    outs = ref.generate([PROMPT] * len(params), params, use_tqdm=False)
    return next(s for s, o in enumerate(outs) if set(o.token_ids) & set(SPECIAL_TOKENS.values()))


# name -> (endpoint, extra request fields, SamplingParams with the field, SamplingParams if it were dropped), built
# from g, the greedy completion of the base request (max_tokens 8, temperature 0). The request's answer must equal
# LLM.generate / LLM.chat with the field and differ from it without: dropping a field's translation turns it red.
def _cases(g: list[int], ref) -> dict:
    sampled = dict(temperature=1.0, seed=3)
    room = MAX_LEN - len(ref.render_chat(MSGS))  # chat's default max_tokens
    stop_at = _first_new(g, 2)
    special = _special_seed(ref)
    return {
        "max_tokens": (CMPL, {"max_tokens": 3}, dict(max_tokens=3), dict(max_tokens=16)),
        "temperature": (CMPL, {"temperature": 0.0, "seed": 5}, dict(seed=5), dict(temperature=1.0, seed=5)),
        "top_p": (CMPL, {**sampled, "top_p": 0.2}, dict(sampled, top_p=0.2), sampled),
        "top_k": (CMPL, {**sampled, "top_k": 2}, dict(sampled, top_k=2), sampled),
        "min_p": (CMPL, {**sampled, "min_p": 0.6}, dict(sampled, min_p=0.6), sampled),
        "seed": (CMPL, {"temperature": 1.0, "seed": 11}, dict(temperature=1.0, seed=11),
                 dict(temperature=1.0, seed=12)),  # dropped: an unseeded draw, as unlike seed 11 as seed 12 is
        "presence_penalty": (CMPL, {"presence_penalty": 2.0}, dict(presence_penalty=2.0), {}),
        "frequency_penalty": (CMPL, {"frequency_penalty": 2.0}, dict(frequency_penalty=2.0), {}),
        "repetition_penalty": (CMPL, {"repetition_penalty": 3.0}, dict(repetition_penalty=3.0), {}),
        "stop": (CMPL, {"stop": [word(g[stop_at])]}, dict(stop=[word(g[stop_at])]), {}),
        "include_stop_str_in_output": (CMPL, {"stop": [word(g[stop_at])], "include_stop_str_in_output": True},
                                       dict(stop=[word(g[stop_at])], include_stop_str_in_output=True),
                                       dict(stop=[word(g[stop_at])])),
        "stop_token_ids": (CMPL, {"stop_token_ids": [g[stop_at]]}, dict(stop_token_ids=[g[stop_at]]), {}),
        "min_tokens": (CMPL, {"stop_token_ids": [g[0]], "min_tokens": 4},
                       dict(stop_token_ids=[g[0]], min_tokens=4), dict(stop_token_ids=[g[0]])),
        "skip_special_tokens": (CMPL, {"temperature": 2.0, "seed": special, "skip_special_tokens": False},
                                dict(temperature=2.0, seed=special, skip_special_tokens=False),
                                dict(temperature=2.0, seed=special)),
        "n": (CMPL, {**sampled, "n": 2}, dict(sampled, n=2), sampled),
        "logprobs": (CMPL, {"logprobs": 2}, dict(logprobs=2), {}),
        "chat_max_tokens": (CHAT, {"max_tokens": 3}, dict(max_tokens=3), dict(max_tokens=room)),
        "max_completion_tokens": (CHAT, {"max_completion_tokens": 3}, dict(max_tokens=3), {}),
        "chat_logprobs": (CHAT, {"logprobs": True}, dict(logprobs=0), {}),
        "top_logprobs": (CHAT, {"logprobs": True, "top_logprobs": 2}, dict(logprobs=2), dict(logprobs=0)),
        "add_generation_prompt": (CHAT, {"add_generation_prompt": False}, dict(add_generation_prompt=False), {}),
        "chat_seed": (CHAT, {"temperature": 1.0, "seed": 11}, dict(temperature=1.0, seed=11),
                      dict(temperature=1.0, seed=12)),
    }


FIELD_CASES = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "stop", "include_stop_str_in_output", "stop_token_ids",
               "min_tokens", "skip_special_tokens", "n", "logprobs", "chat_max_tokens", "max_completion_tokens",
               "chat_logprobs", "top_logprobs", "add_generation_prompt", "chat_seed"]


@pytest.fixture(scope="module")
def field_cases(ref):
    g = ref.generate(PROMPT, SamplingParams(max_tokens=8), use_tqdm=False)[0].token_ids
    return _cases(g, ref)


def _reference(ref, path: str, kwargs: dict) -> list:
    """What LLM.generate / LLM.chat answer: per choice (token ids, text, log-probabilities by token id)."""
    kwargs = {"max_tokens": 8, **kwargs}
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    params = SamplingParams(**kwargs)
    if path == CHAT:
        out = ref.chat(MSGS, params, use_tqdm=False, add_generation_prompt=add_generation_prompt)[0]
    else:
        out = ref.generate(PROMPT, params, use_tqdm=False)[0]
    return [(c.token_ids, c.text, c.logprobs) for c in out.outputs]


def _served(server, path: str, extra: dict) -> list:
    """The server's answer in the same form (log-probabilities keyed by token text, as the API returns them)."""
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0.0, **extra}
    body.update({"messages": MSGS} if path == CHAT else {"prompt": PROMPT})
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    if path == CHAT:
        return [(c["token_ids"], c["message"]["content"],
                 None if c["logprobs"] is None else [{t["token"]: t["logprob"] for t in [e, *e["top_logprobs"]]}
                                                     for e in c["logprobs"]["content"]]) for c in choices]
    return [(c["token_ids"], c["text"], None if c["logprobs"] is None else c["logprobs"]["top_logprobs"])
            for c in choices]


def _by_text(choices: list) -> list:
    """Reference log-probabilities keyed by token text, the top ones of each position plus the sampled token."""
    out = []
    for ids, text, lps in choices:
        out.append((ids, text, None if lps is None else [{word(k): v for k, v in lp.items()} for lp in lps]))
    return out


def _same(got: list, want: list) -> bool:
    if len(got) != len(want):
        return False
    for (g_ids, g_text, g_lp), (w_ids, w_text, w_lp) in zip(got, want):
        if g_ids != w_ids or g_text != w_text or (g_lp is None) != (w_lp is None):
            return False
        if g_lp is not None and (len(g_lp) != len(w_lp) or any(
                a.keys() != b.keys() or any(abs(a[k] - b[k]) > 1e-5 for k in a) for a, b in zip(g_lp, w_lp))):
            return False
    return True


@pytest.mark.parametrize("name", FIELD_CASES)
def test_every_request_field_has_its_effect(server, ref, field_cases, name):
    path, extra, with_field, without_field = field_cases[name]
    want = _by_text(_reference(ref, path, with_field))
    dropped = _by_text(_reference(ref, path, without_field))
    assert not _same(want, dropped), f"{name}: this case cannot tell the field from its absence"
    got = _served(server, path, extra)
    assert _same(got, want), f"{name}: served {got}, LLM with the field gives {want}"


def test_ignore_eos_has_its_effect(server, ref, monkeypatch):
    """With an EOS token (the greedy completion's third new token): the request stops there unless ignore_eos."""
    g = ref.generate(PROMPT, SamplingParams(max_tokens=8), use_tqdm=False)[0].token_ids
    eos = g[_first_new(g, 2)]
    for llm in (ref, server.engine.llm):
        monkeypatch.setattr(llm, "eos_token_ids", (eos,))
    stopped = _served(server, CMPL, {})
    assert stopped[0][0] == g[:g.index(eos) + 1] == _reference(ref, CMPL, {})[0][0]
    assert _served(server, CMPL, {"ignore_eos": True})[0][0] == g == _reference(ref, CMPL, dict(ignore_eos=True))[0][0]


# ------------------------------------------------------------------------------------------ /metrics

def scrape(server) -> dict[str, float]:
    """/metrics as {sample name (+ finished_reason): value}; every vllm: series is labelled with the model."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if not s.name.startswith("vllm:") or "le" in s.labels:
                continue
            assert s.labels["model_name"] == MODEL, s
            reason = s.labels.get("finished_reason")
            values[s.name + (f"[{reason}]" if reason else "")] = s.value
    return values


def test_metrics_count_what_was_served(server, ref, monkeypatch):
    """vLLM's metric names with the exact counts of two requests (one stopped by a stop token, one by length), the
    running / KV gauges during a stream and after it, and the prefix cache counters the engine fills."""
    assert wait_until(lambda: pool_is_full(server))
    g = ref.generate(PROMPT, SamplingParams(max_tokens=8), use_tqdm=False)[0].token_ids
    stop_at = _first_new(g, 1)
    stats = server.engine.llm.scheduler.stats  # the counters the prefix cache fills (tokens looked up / found)
    before = scrape(server)
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    assert post(server, CMPL, {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}).status_code == 200
    r = post(server, CMPL, {"model": MODEL, "prompt": PROMPT, "temperature": 0, "stop_token_ids": [g[stop_at]]})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert wait_until(lambda: pool_is_full(server))
    after = scrape(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["vllm:prompt_tokens_total"] == 2 * len(PROMPT)
    assert delta["vllm:generation_tokens_total"] == 5 + stop_at + 1
    assert delta["vllm:request_success_total[length]"] == 1 and delta["vllm:request_success_total[stop]"] == 1
    assert delta["vllm:time_to_first_token_seconds_count"] == 2 and delta["vllm:time_to_first_token_seconds_sum"] > 0
    assert delta["vllm:inter_token_latency_seconds_count"] == 4 + stop_at
    assert delta["vllm:e2e_request_latency_seconds_count"] == 2
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0  # cached prefix pages are evictable: not in use
    # the second request of the same prompt found the first one's full pages (prefix caching is on by default)
    looked_up, found = stats.prefix_cache_queries - queries, stats.prefix_cache_hits - hits
    assert delta["vllm:prefix_cache_queries_total"] == looked_up and delta["vllm:prefix_cache_hits_total"] == found
    assert 0 < found < looked_up

    llm = server.engine.llm
    step = llm.step_sequences
    monkeypatch.setattr(llm, "step_sequences", lambda: (time.sleep(0.02), step())[1])
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + CMPL, json=body, timeout=60) as stream:
        events = 0
        for line in stream.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                during = scrape(server)
                break
    assert during["vllm:num_requests_running"] == 1 and 0 < during["vllm:kv_cache_usage_perc"] < 1
    assert wait_until(lambda: pool_is_full(server))
    aborted = scrape(server)  # an aborted stream is no success
    assert sum(v for k, v in aborted.items() if k.startswith("vllm:request_success_total")) == \
        sum(v for k, v in after.items() if k.startswith("vllm:request_success_total"))


# ------------------------------------------------------------------------------------------ serve --tp 2

def greedy_together(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The token ids of concurrent greedy completions, one request per prompt, from the server at ``url``."""
    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(c.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens,
                                                               temperature=0) for p in prompts))

    return [o.choices[0].model_extra["token_ids"] for o in asyncio.run(main())]


def test_serve_tp2_on_cpu_ranks_matches_one_process(ckpt, ref):
    """`flashdecode serve --tp 2` as a user starts it: two gloo ranks, rank 0 serving HTTP, rank 1 following its
    engine steps. Greedy completions, chat, seeded n = 2 sampling and concurrent streams equal the one-process
    engine; a stream the client drops is aborted on both ranks (the next requests still agree); /metrics answers;
    SIGTERM to the launcher stops every rank."""
    import os
    import signal

    proc, url = start_serve(["--model", str(ckpt), "--served-model-name", MODEL, "--tp", "2", "--device", "cpu",
                             "--dtype", "float32", "--page-size", "4", "--max-model-len", str(MAX_LEN),
                             "--max-num-seqs", "8"], timeout_s=180)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        prompts = random_prompts([5, 9, 3], seed=42)
        want = [o.token_ids for o in ref.generate(prompts, SamplingParams(max_tokens=6), use_tqdm=False)]

        def greedy(ids):
            got = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
            return got.choices[0].model_extra["token_ids"]

        assert greedy(prompts[0]) == want[0]
        # a dropped stream: rank 1 must abort it too, or the next steps' batches differ between the ranks
        body = {"model": MODEL, "prompt": prompts[1], "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + CMPL, json=body, timeout=60) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break

        assert greedy_together(url, prompts, 6) == want
        chat_want = ref.chat(MSGS, SamplingParams(max_tokens=5), use_tqdm=False)[0].token_ids
        chat = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0)
        assert chat.choices[0].model_extra["token_ids"] == chat_want
        sampled = ref.generate(prompts[2], SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=4),
                               use_tqdm=False)[0]
        got = client.completions.create(model=MODEL, prompt=prompts[2], n=2, max_tokens=5, temperature=1.0, seed=4)
        assert sorted((c.index, c.model_extra["token_ids"]) for c in got.choices) == \
            [(i, c.token_ids) for i, c in enumerate(sampled.outputs)]
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0' in metrics
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.gpu
def test_serve_tp2_on_two_gpus(ckpt):
    """`serve --tp 2` over NCCL on two GPUs (float32): concurrent greedy completions equal the one-GPU engine's,
    /metrics counts their tokens, SIGTERM stops both ranks."""
    import os
    import signal

    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    one = LLM(ckpt, dtype="float32", max_num_seqs=8, max_model_len=MAX_LEN, use_tqdm=False)
    prompts = random_prompts([5, 9, 3, 17], seed=43)
    want = [o.token_ids for o in one.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)]
    del one
    torch.cuda.empty_cache()
    proc, url = start_serve(["--model", str(ckpt), "--served-model-name", MODEL, "--tp", "2", "--dtype", "float32",
                             "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8"], timeout_s=300)
    try:
        assert greedy_together(url, prompts, 8) == want
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert f'vllm:generation_tokens_total{{model_name="{MODEL}"}} {8.0 * len(prompts)}' in metrics
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
