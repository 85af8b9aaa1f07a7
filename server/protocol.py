"""OpenAI protocol models: requests (validated, bounded) and responses.

Fields are ordered like the OpenAI API reference; moeflash extensions sit in a fenced block
at the end of each model. Every numeric field has bounds: a value out of range is a 400.
Unknown request fields are accepted (extra="allow") and logged once by the app.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.decode import SamplingParams

# Bounds shared by chat and legacy completions
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
MaxTokens = Annotated[int, Field(ge=1, le=2**31 - 1)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
StopField = Annotated[str | Annotated[list[str], Field(max_length=4)], Field()]
ChoiceCount = Annotated[int, Field(ge=1, le=128)]
TopK = Annotated[int, Field(ge=0, le=1_000_000)]
RepeatPenalty = Annotated[float, Field(ge=0.0, le=10.0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------- messages


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class MediaPart(_Strict):
    """An image, audio or file part: accepted by validation so that the request is refused in plain
    words (the models served take text only), not with the validator's internals."""

    type: Literal["image_url", "input_audio", "file", "image", "audio", "input_image", "input_file"]


ContentPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]
Content = str | list[ContentPart]


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Strict):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperMessage(_Strict):
    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Content | None = None
    refusal: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    # --- moeflash extension: earlier reasoning, passed back to templates that use it
    reasoning_content: str | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


def content_text(content: Content | None) -> str:
    """A message's content as one string (text parts concatenated)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content if isinstance(part, TextPart))


def media_parts(messages: list[Any]) -> Iterator[tuple[str, str]]:
    """(param, part type) of every non-text content part of `messages`."""
    for i, message in enumerate(messages):
        content = getattr(message, "content", None)
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, MediaPart):
                    yield f"messages.{i}.content.{j}", part.type


# ---------------------------------------------------------------------- tools, formats


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" shadows a BaseModel attribute: stored as json_schema, serialised as "schema"
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]


class StreamOptions(_Strict):
    include_usage: bool | None = None


# ---------------------------------------------------------------------- requests


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    model: str = Field(max_length=256)
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    logprobs: bool | None = None
    max_completion_tokens: MaxTokens | None = None
    max_tokens: MaxTokens | None = None
    metadata: dict[str, str] | None = None
    n: ChoiceCount | None = None
    parallel_tool_calls: bool | None = None
    presence_penalty: Penalty | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    response_format: ResponseFormat | None = None
    seed: Seed | None = None
    stop: StopField | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    top_p: TopP | None = None
    user: str | None = None
    # --- moeflash extensions -------------------------------------------------------
    top_k: TopK | None = None
    min_p: TopP | None = None
    repeat_penalty: RepeatPenalty | None = None
    timings: bool | None = Field(None, description="add per-response timings (moeflash extension)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='extra variables for the chat template, e.g. {"enable_thinking": false}'
    )

    def to_sampling_params(
        self, *, max_tokens: int, logit_bias: tuple[tuple[int, float], ...], grammar: str | None
    ) -> SamplingParams:
        """The engine's parameters; `max_tokens` and `logit_bias` already checked against the model."""
        return _sampling(self, max_tokens, logit_bias, grammar, bool(self.logprobs), self.top_logprobs or 0)


def _sampling(
    request: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    logit_bias: tuple[tuple[int, float], ...],
    grammar: str | None,
    logprobs: bool,
    top_logprobs: int,
) -> SamplingParams:
    # OpenAI's defaults: temperature 1, top_p 1, no penalties; extensions off unless given
    stop = request.stop
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        repeat_penalty=1.0 if request.repeat_penalty is None else request.repeat_penalty,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        # OpenAI seeds are any 64-bit integer; llama.cpp's are 32-bit
        seed=None if request.seed is None else request.seed & 0xFFFFFFFF,
        stop=() if stop is None else (stop,) if isinstance(stop, str) else tuple(stop),
        logit_bias=logit_bias,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        grammar=grammar,
    )


class CompletionRequest(_Request):
    """POST /v1/completions (legacy)."""

    model: str = Field(max_length=256)
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: bool | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    max_tokens: MaxTokens | None = 16
    n: ChoiceCount | None = None
    presence_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: StopField | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    user: str | None = None
    # --- moeflash extensions -------------------------------------------------------
    top_k: TopK | None = None
    min_p: TopP | None = None
    repeat_penalty: RepeatPenalty | None = None
    timings: bool | None = Field(None, description="add per-response timings (moeflash extension)")

    def to_sampling_params(
        self, *, max_tokens: int, logit_bias: tuple[tuple[int, float], ...]
    ) -> SamplingParams:
        """The engine's parameters; `max_tokens` and `logit_bias` already checked against the model."""
        return _sampling(self, max_tokens, logit_bias, None, self.logprobs is not None, self.logprobs or 0)


# ---------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class Timings(BaseModel):
    """moeflash extension: where the time of one response went."""

    prompt_ms: float
    decode_ms: float
    tok_per_s: float | None
    flash_wait_ms: float | None
    compute_ms: float | None
    cache_ms: float | None
    hit_rate: float | None
    bytes_read: int | None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    # --- moeflash extension (the de-facto field of local servers)
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moeflash"
    # --- moeflash extensions
    context_length: int
    architecture: str
    file_size: int
    mode: str
    budget_bytes: int | None = None  # the expert cache's budget (streaming mode)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail
