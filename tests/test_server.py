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

from engine_helpers import add_tokenizer, random_prompts, save_tiny, words
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
    ("/v1/completions", {"model": "gpt-4", "prompt": "w1"}, "model"),
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
