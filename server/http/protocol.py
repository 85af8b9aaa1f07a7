"""OpenAI protocol models: requests (validated, bounded) and the responses built from them.

Fields are ordered like the OpenAI API reference; moeflash extensions sit in a fenced block
at the end of each model. Every numeric field has bounds: a value out of range is a 400.
Unknown request fields are accepted (extra="allow") and logged once by the app. A request
converts itself into the engine's types (`to_chat_request`, `to_sampling_params`).

Responses and stream chunks are built as these models and sent as `to_json()`: a field that
is None is sent as null, except the optional ones declared with `absent()`, which are left out
(OpenAI's wire leaves them out too: `tool_calls` of a message without calls, `usage` of a chunk).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from server.engine.chat import ChatMessage, ChatRequest, ChatTool, NamedTool, OutputFormat
from server.engine.chat import ToolCall as ChatToolCall
from server.engine.chat import ToolChoice as ChatToolChoice
from server.engine.generation import SamplingParams

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
        self, *, max_tokens: int, logit_bias: tuple[tuple[int, float], ...]
    ) -> SamplingParams:
        """The engine's parameters; `logit_bias` already checked against the model (the grammar
        comes from tools and response_format, when the chat path prepares the request)."""
        return _sampling(self, max_tokens, logit_bias, bool(self.logprobs), self.top_logprobs or 0)

    def to_chat_request(
        self, *, max_tokens_cap: int, logit_bias: tuple[tuple[int, float], ...]
    ) -> ChatRequest:
        """The engine's chat request; `logit_bias` already checked against the model, and
        `max_tokens_cap` (the server's) what the client allows when it names no limit."""
        extra = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            extra["reasoning_effort"] = self.reasoning_effort  # gpt-oss templates read it
        max_tokens = self.max_completion_tokens or self.max_tokens or max_tokens_cap
        return ChatRequest(
            messages=tuple(_chat_message(m) for m in self.messages),
            sampling=self.to_sampling_params(max_tokens=max_tokens, logit_bias=logit_bias),
            tools=tuple(_chat_tool(t) for t in self.tools or ()),
            tool_choice=_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls is not False,
            output_format=_output_format(self.response_format),
            template_kwargs=extra,
        )


def _chat_message(message: Message) -> ChatMessage:
    content = content_text(message.content)
    if isinstance(message, AssistantMessage):
        calls = tuple(
            ChatToolCall(call.id, call.function.name, call.function.arguments)
            for call in message.tool_calls or ()
        )
        return ChatMessage("assistant", content, tool_calls=calls, reasoning=message.reasoning_content)
    if isinstance(message, ToolMessage):
        return ChatMessage("tool", content, tool_call_id=message.tool_call_id)
    return ChatMessage(message.role, content)


def _chat_tool(tool: Tool) -> ChatTool:
    f = tool.function
    return ChatTool(f.name, f.description, f.parameters, f.strict)


def _tool_choice(choice: ToolChoice | None) -> ChatToolChoice | None:
    return NamedTool(choice.function.name) if isinstance(choice, NamedToolChoice) else choice


def _output_format(fmt: ResponseFormat | None) -> OutputFormat | None:
    if isinstance(fmt, ResponseFormatJsonSchema):
        return OutputFormat("json_schema", fmt.json_schema.json_schema)
    return None if fmt is None else OutputFormat(fmt.type)


def _sampling(
    request: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    logit_bias: tuple[tuple[int, float], ...],
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
        return _sampling(self, max_tokens, logit_bias, self.logprobs is not None, self.logprobs or 0)


# ---------------------------------------------------------------------- responses


def _is_none(value: object) -> bool:
    return value is None


def absent() -> Any:
    """An optional response field that is left out of the wire form while None."""
    return Field(None, exclude_if=_is_none)


class OutModel(BaseModel):
    """A response body, chunk or event built by a route."""

    def to_json(self) -> dict[str, Any]:
        """The wire form: nulls kept, `absent()` fields left out while None."""
        return self.model_dump()


FinishReason = Literal["stop", "length", "tool_calls"]
TextFinishReason = Literal["stop", "length"]  # legacy completions: no tools


class PromptTokensDetails(OutModel):
    cached_tokens: int


class Usage(OutModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprobOut(OutModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(OutModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(OutModel):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class Timings(BaseModel):
    """moeflash extension: where the time of a response went, at the scope it names: "request"
    (the final response or chunk: every decode call of the request) or "token" (a streamed chunk:
    the decode step of the token(s) it carries; prompt_ms null). Streamer figures are null for a
    resident model; gauges (expert_memory_bytes, budget_bytes) are as at the scope's end."""

    scope: Literal["token", "request"]
    prompt_ms: float | None
    decode_ms: float
    tok_per_s: float | None
    flash_wait_ms: float | None
    compute_ms: float | None
    cache_ms: float | None
    # waiting on RPC helpers (the link and their layers' compute); null without helpers
    helper_wait_ms: float | None = None
    # routed experts found resident, cached or read ahead (null when routing was not watched)
    hit_rate: float | None
    bytes_read: int | None
    # routed experts that a read-ahead had brought in
    prefetch_hits: int | None
    # the expert cache's memory with pages, and its budget (which follows memory pressure)
    expert_memory_bytes: int | None
    budget_bytes: int | None


# the timings as server/http/timings.py makes them, passed through (documented as Timings)
TimingsJson = Annotated[dict[str, Any], WithJsonSchema(Timings.model_json_schema())]


class ResponseMessage(OutModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = absent()
    # --- moeflash extension (the de-facto field of local servers)
    reasoning_content: str | None = absent()


class ChatChoice(OutModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(OutModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    timings: TimingsJson | None = absent()


class FunctionDelta(OutModel):
    name: str | None = absent()
    arguments: str | None = absent()


class ToolCallDelta(OutModel):
    """A streamed tool call: its first delta has id, type and name, the next ones arguments."""

    index: int
    id: str | None = absent()
    type: Literal["function"] | None = absent()
    function: FunctionDelta


class ChoiceDelta(OutModel):
    role: Literal["assistant"] | None = absent()
    content: str | None = absent()
    tool_calls: list[ToolCallDelta] | None = absent()
    # --- moeflash extension
    reasoning_content: str | None = absent()


class ChunkChoice(OutModel):
    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(OutModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Usage | None = absent()
    timings: TimingsJson | None = absent()


class CompletionLogprobs(OutModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(OutModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: TextFinishReason | None


class Completion(OutModel):
    """A legacy completion, and each chunk of a streamed one (usage: the last chunk's only)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = absent()
    timings: TimingsJson | None = absent()


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
