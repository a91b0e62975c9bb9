"""OpenAI request bodies (pydantic, strict types) and their translation into SamplingParams.

Field names and defaults follow the OpenAI API (temperature defaults to 1, max_tokens to 16 for completions and
to the room left in the context for chat); vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens, add_generation_prompt) are
accepted too. Nothing is silently dropped: a field OpenAI does not define is refused as OpenAI refuses it
("Unrecognized request argument supplied"), an OpenAI field this server cannot honour (tools, response_format,
logit_bias, echo, ...) is refused with 400 naming it unless its value asks for nothing, and only the fields that do
not change the answer (user, metadata, store, service_tier, ...) are accepted and ignored, as OpenAI ignores them
for a model they do not apply to.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from flashdecode.engine.sampling import MAX_LOGPROBS, SamplingParams


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with HTTP ``status``."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: "5" is not an int and 1 is not a bool (wrong types are 400s, never silently converted); a field the
    # model does not declare is a 400 too ("Unrecognized request argument supplied", OpenAI's answer)
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None  # OpenAI's padding of stream events: nothing to pad here, ignored


def _asks_nothing(value, _request) -> bool:
    """None or an empty list / dict / string: the field is present but asks for nothing."""
    return value is None or (isinstance(value, (list, dict, str)) and not value)


def _is(*allowed) -> Callable[[Any, Any], bool]:
    """Only None or one of ``allowed`` (the values that ask for nothing beyond plain text generation; an empty
    object may still ask for something: web_search_options={} turns web search on)."""
    return lambda value, _request: value is None or value in allowed


class _Sampling(_Strict):
    model: str
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # accepted and ignored (an end-user id for OpenAI's abuse monitoring)
    logit_bias: Any = None  # unsupported (see UNSUPPORTED)
    # vLLM's extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    # OpenAI fields this server cannot honour: name -> (whether the value asks for nothing unsupported, what is
    # supported). Any other value is a 400 naming the field.
    UNSUPPORTED: ClassVar = {"logit_bias": (_asks_nothing, "no logit bias")}

    def check_supported(self) -> None:
        """OpenAIError (400, naming the field) for the first field given a value this server cannot honour."""
        for name, (harmless, supported) in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if not harmless(value, self):
                raise OpenAIError(f"{name}={value!r} is not supported by this server (supported: {supported})",
                                  param=name, code="unsupported_parameter")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """ValueError/TypeError (naming the field) when a value is out of range."""
        given = {k: v for k, v in dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                        min_p=self.min_p, presence_penalty=self.presence_penalty,
                                        frequency_penalty=self.frequency_penalty,
                                        repetition_penalty=self.repetition_penalty).items() if v is not None}
        given.setdefault("temperature", 1.0)
        return SamplingParams(n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
                              stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, **given)


class CompletionRequest(_Sampling):
    # a string or token ids, or a list of either: a batch, whose choice p * n + i is prompt p's completion i
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    UNSUPPORTED: ClassVar = {**_Sampling.UNSUPPORTED, "echo": (_is(False), "false: the prompt is not echoed"),
                             "suffix": (_asks_nothing, "no suffix (no fill-in-the-middle)"),
                             "best_of": (lambda v, r: v is None or v == r.n, "best_of = n: no server-side ranking")}


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: Union[str, list[ContentPart], None] = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's
    # accepted and ignored: they do not change the answer (OpenAI's storage, billing, caching and abuse hints;
    # parallel_tool_calls means nothing without tools)
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    safety_identifier: Optional[str] = None
    parallel_tool_calls: Optional[bool] = None
    # unsupported (see UNSUPPORTED)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    UNSUPPORTED: ClassVar = {
        **_Sampling.UNSUPPORTED,
        "tools": (_asks_nothing, "no tool calling"),
        "tool_choice": (_is("none"), "'none': no tool calling"),
        "functions": (_asks_nothing, "no function calling"),
        "function_call": (_is("none"), "'none': no function calling"),
        "response_format": (_is({"type": "text"}), "{'type': 'text'}: no JSON mode or structured outputs"),
        "audio": (_is(), "text output only"),
        "modalities": (_is(["text"]), "['text']"),
        "prediction": (_is(), "no predicted outputs"),
        "reasoning_effort": (_is(), "none: not a reasoning model"),
        "verbosity": (_is(), "none"),
        "web_search_options": (_is(), "no web search"),
    }
