"""The OpenAI-compatible HTTP app (FastAPI): /v1/models[/{id}], /v1/completions, /v1/chat/completions, /health,
/metrics (Prometheus, server/metrics.py).

Every request is validated here (types and unknown or unsupported fields by pydantic and protocol.py, values by
SamplingParams, prompt + max_tokens against the context and the page pool by the engine's own admission check) and
answered 400 with an OpenAI error body naming the field when bad; 404 model_not_found for another model's name;
429 when the engine's queue is full. Streams
are server-sent events of OpenAI chunks ending in ``data: [DONE]``. A client that disconnects (mid-stream, or
while waiting for a non-streamed answer) has its sequences aborted: their pages return to the pool at once.
Choices carry the generated ``token_ids`` too (as vLLM's return_token_ids does), so a model without a tokenizer can
still be served with token-id prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashdecode.engine.scheduler import RequestError
from flashdecode.engine.server.async_engine import AsyncEngine, Delta, QueueFull, RequestStream
from flashdecode.engine.server.metrics import ServerMetrics
from flashdecode.engine.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError

DISCONNECT_POLL_S = 0.1


def _error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}",
                           code="invalid_json")
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:  # OpenAI's answer to a field it does not define
        name = ".".join(str(p) for p in unknown[0]["loc"] if p != "body")
        return OpenAIError(f"Unrecognized request argument supplied: {name}", param=name)
    message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in errors[:4])
    return OpenAIError(message or "invalid request", param=loc[0] if loc else None)


def _prompt_list(prompt) -> list:
    """OpenAI's prompt forms as a list of prompts: a string or a list of token ids is one prompt, a list of strings
    or of token-id lists a batch (an empty list is one empty prompt, refused by the prompt check)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


class PromptBatch:
    """Several prompts' RequestStreams (n choices each) as one request: choice p * n + i is prompt p's completion
    i (OpenAI's order for a list of prompts). Iterating yields each stream's deltas, re-indexed, as they arrive;
    close() releases every stream (a client that left aborts them all)."""

    def __init__(self, streams: list[RequestStream]):
        self.streams = streams
        self.n = streams[0].params.n

    async def __aiter__(self):
        pending = {asyncio.ensure_future(s.__anext__()): p for p, s in enumerate(self.streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    p = pending.pop(task)
                    try:
                        deltas = task.result()
                    except StopAsyncIteration:
                        continue
                    pending[asyncio.ensure_future(self.streams[p].__anext__())] = p
                    yield [dataclasses.replace(d, index=p * self.n + d.index) for d in deltas]
        finally:
            for task in pending:
                task.cancel()

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


class Server:
    """Routes bound to one engine and model name."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine, self.llm, self.model_name = engine, engine.llm, model_name
        self.created = int(time.time())

    # -------------------------------------------------------------------------------------------- helpers
    def _model_not_found(self, name: str) -> OpenAIError:
        return OpenAIError(f"The model {name!r} does not exist; this server serves {self.model_name!r}",
                           status=404, param="model", code="model_not_found")

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise self._model_not_found(name)

    def _max_tokens(self, given: int | None, prompt_len: int, field: str = "max_tokens") -> int:
        """The request's max_tokens; when not given (chat), the room the prompt leaves in the context."""
        if given is None:
            return max(self.llm.max_model_len - prompt_len, 1)
        if given < 1:
            raise OpenAIError(f"{field} must be >= 1, got {given}", param=field)
        return given

    def _check_requests(self, prompts: list[list[int]], params, names: dict[str, str]) -> None:
        """The engine's admission rules for every prompt before any is queued (a batch is refused whole): a
        prompt + max_tokens beyond the context is 400 context_length_exceeded, never cut short. ``names`` maps the
        engine's field names to this endpoint's (chat: "prompt" -> "messages")."""
        for ids in prompts:
            try:
                self.llm.check_request(ids, params)
            except RequestError as e:
                raise OpenAIError(str(e), param=names.get(e.param, e.param), code=e.code) from None

    def _submit(self, ids: list[int], params) -> RequestStream:
        try:
            return self.engine.submit(ids, params)
        except QueueFull as e:
            raise OpenAIError(str(e), status=429, type="rate_limit_error", code="queue_full") from None

    def _submit_all(self, prompts: list[list[int]], params):
        """One prompt's RequestStream, or a PromptBatch of several; a batch that does not fit the queue is
        withdrawn whole (429)."""
        streams = []
        try:
            for ids in prompts:
                streams.append(self._submit(ids, params))
        except OpenAIError:
            for stream in streams:
                stream.close()
            raise
        return streams[0] if len(streams) == 1 else PromptBatch(streams)

    def _token_text(self, tok: int) -> str:
        if self.llm.tokenizer is None:
            return f"token_id:{tok}"
        return self.llm.tokenizer.decode([tok], skip_special_tokens=False)

    def _usage(self, prompt_len: int, completion: int) -> dict:
        return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion}

    # -------------------------------------------------------------------------------------------- log-probs
    def _completion_logprobs(self, delta_tokens: list[int], lps, offset: int) -> dict:
        texts = [self._token_text(t) for t in delta_tokens]
        offsets, pos = [], offset
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": texts, "token_logprobs": [lp[t] for t, lp in zip(delta_tokens, lps)],
                "top_logprobs": [{self._token_text(k): v for k, v in lp.items()} for lp in lps],
                "text_offset": offsets}

    def _chat_logprobs(self, delta_tokens: list[int], lps, top: int) -> dict:
        def entry(tok, value):
            text = self._token_text(tok)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        def best(lp):  # the top ``top`` by log-probability (the sampled token is in lp even when not among them)
            return sorted(lp.items(), key=lambda kv: -kv[1])[:top]

        return {"content": [{**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in best(lp)]}
                            for t, lp in zip(delta_tokens, lps)]}

    # -------------------------------------------------------------------------------------------- running
    async def _collect(self, stream, request: Request, n: int) -> list[dict]:
        """Run a non-streamed request (a RequestStream or a PromptBatch of n choices) to the end; abort it if the
        client disconnects meanwhile."""
        choices = [{"token_ids": [], "text": "", "logprobs": [], "finish_reason": None, "stop_reason": None}
                   for _ in range(n)]

        async def consume():
            async for deltas in stream:
                for d in deltas:
                    c = choices[d.index]
                    c["token_ids"] += d.token_ids
                    c["text"] += d.text
                    c["logprobs"] += d.logprobs or []
                    if d.finish_reason is not None:
                        c["finish_reason"], c["stop_reason"] = d.finish_reason, d.stop_reason

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    break
            await task
        finally:
            stream.close()
        return choices

    async def _sse(self, stream, chunk_of, final_usage: bool, prompt_len: int):
        """Server-sent events of a RequestStream or a PromptBatch: one chunk per delta, then the usage chunk (if
        asked), then [DONE]. A cancelled generator (the client left) closes the stream, which aborts its
        sequences."""
        completion = 0
        try:
            async for deltas in stream:
                for d in deltas:
                    completion += len(d.token_ids)
                    yield f"data: {json.dumps(chunk_of(d))}\n\n"
            if final_usage:
                yield f"data: {json.dumps(chunk_of(None, self._usage(prompt_len, completion)))}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as e:  # an engine failure mid-stream: an error event, then the end
            err = OpenAIError(str(e), status=500, type="internal_error")
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            stream.close()

    # -------------------------------------------------------------------------------------------- endpoints
    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "flashdecode",
                "max_model_len": self.llm.max_model_len}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model(self, model_id: str) -> dict:
        self._check_model(model_id)
        return self.model_card()

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        body.check_supported()
        prompts = [self._encode(p) for p in _prompt_list(body.prompt)]
        longest = max(prompts, key=len)
        params = self._params(body, self._max_tokens(body.max_tokens, len(longest)), body.logprobs)
        self._check_requests(prompts, params, {})
        stream = self._submit_all(prompts, params)
        prompt_len, n = sum(len(ids) for ids in prompts), params.n * len(prompts)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        offsets = [0] * n

        def choice(d: Delta) -> dict:
            lp = None
            if d.logprobs is not None:
                lp = self._completion_logprobs(d.token_ids, d.logprobs, offsets[d.index])
                offsets[d.index] += sum(len(t) for t in lp["tokens"])
            return {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason, "token_ids": d.token_ids}

        if body.stream:
            def chunk(d, usage=None):
                return {**base, "choices": [] if d is None else [choice(d)], **({"usage": usage} if usage else {})}

            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(stream, chunk, include_usage, prompt_len),
                                     media_type="text/event-stream")
        choices = await self._collect(stream, request, n)
        out = [choice(Delta(i, c["token_ids"], c["text"], c["logprobs"] if params.logprobs is not None else None,
                            c["finish_reason"], c["stop_reason"])) for i, c in enumerate(choices)]
        return {**base, "choices": out,
                "usage": self._usage(prompt_len, sum(len(c["token_ids"]) for c in choices))}

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        body.check_supported()
        if self.llm.tokenizer is None or not self.llm.tokenizer.has_chat_template:
            raise OpenAIError("this model has no chat template; use /v1/completions", param="messages")
        try:
            ids = self.llm.render_chat([m.as_template_input() for m in body.messages], body.add_generation_prompt)
        except Exception as e:  # a template that fails on these messages (e.g. an unknown role it rejects)
            raise OpenAIError(f"the chat template failed on these messages: {e}", param="messages") from None
        top = body.top_logprobs or 0
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params = self._params(body, self._max_tokens(getattr(body, field), len(ids), field),
                              top if body.logprobs else None)
        self._check_requests([ids], params, {"prompt": "messages", "max_tokens": field})
        stream = self._submit(ids, params)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": self.model_name}

        def logprobs(d: Delta):
            return None if d.logprobs is None else self._chat_logprobs(d.token_ids, d.logprobs, top)

        if body.stream:
            started = [False] * params.n

            def chunk(d, usage=None):
                if d is None:
                    return {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                delta = {"content": d.text}
                if not started[d.index]:
                    started[d.index] = True
                    delta["role"] = "assistant"
                return {**base, "object": "chat.completion.chunk",
                        "choices": [{"index": d.index, "delta": delta, "logprobs": logprobs(d),
                                     "finish_reason": d.finish_reason, "stop_reason": d.stop_reason,
                                     "token_ids": d.token_ids}]}

            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(stream, chunk, include_usage, len(ids)),
                                     media_type="text/event-stream")
        choices = await self._collect(stream, request, params.n)
        out = []
        for i, c in enumerate(choices):
            d = Delta(i, c["token_ids"], c["text"], c["logprobs"] if params.logprobs is not None else None)
            out.append({"index": i, "message": {"role": "assistant", "content": c["text"]},
                        "logprobs": logprobs(d), "finish_reason": c["finish_reason"],
                        "stop_reason": c["stop_reason"], "token_ids": c["token_ids"]})
        return {**base, "object": "chat.completion", "choices": out,
                "usage": self._usage(len(ids), sum(len(c["token_ids"]) for c in choices))}

    def _encode(self, prompt) -> list[int]:
        try:
            return self.llm.encode(prompt)
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e), param="prompt") from None

    @staticmethod
    def _params(body, max_tokens: int, logprobs: int | None):
        try:
            return body.sampling_params(max_tokens, logprobs)
        except (ValueError, TypeError) as e:
            if isinstance(e, OpenAIError):
                raise
            param = next((f for f in type(body).model_fields if re.match(rf"{f}\b", str(e))), None)
            raise OpenAIError(str(e), param=param) from None


def build_app(engine: AsyncEngine, model_name: str) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name``. The engine thread starts with the app."""
    server = Server(engine, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="flashdecode", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server = server
    metrics = ServerMetrics(engine, model_name)
    engine.request_observer = metrics.observe

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request, exc: OpenAIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        return _error_response(OpenAIError(str(exc.detail), status=exc.status_code,
                                           type="invalid_request_error" if exc.status_code < 500 else "internal_error"))

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):  # an engine failure: the request fails, the server stays up
        return _error_response(OpenAIError(f"{type(exc).__name__}: {exc}", status=500, type="internal_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return server.model(model_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    return app
