"""OpenAI request bodies (pydantic, strict types) and their translation into SamplingParams.

Field names and defaults follow the OpenAI API (temperature defaults to 1, max_tokens to 16 for completions and
to the room left in the context for chat); vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens) are accepted too.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

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
    # strict: "5" is not an int and 1 is not a bool (wrong types are 400s, never silently converted)
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


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
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """ValueError/TypeError (naming the field) when a value is out of range."""
        if self.logit_bias:
            raise OpenAIError("logit_bias is not supported", param="logit_bias")
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
    echo: bool = False
    suffix: Optional[str] = None


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
    add_generation_prompt: bool = True
