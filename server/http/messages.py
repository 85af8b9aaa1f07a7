"""Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) on the chat path.

A Messages request is validated here (every number bounded: out of range is a 400; unknown
fields accepted and logged once), mapped onto the engine's ChatRequest and run by
`prepare_chat`, so it is refused, if at all, before the response starts, exactly like a chat
request. The mapping:
  system (string or text blocks)      -> a system message
  user text blocks                    -> a user message, after that turn's tool results
  user tool_result blocks             -> tool messages (tool_call_id = tool_use_id; is_error
                                         prefixes the text with "Error: ")
  assistant text / tool_use blocks    -> an assistant message with content and tool calls
  assistant thinking blocks           -> its reasoning (redacted_thinking is dropped)
  image / document blocks             -> 400 unsupported_content (the models take text only)
  tool_choice auto / any / tool / none -> auto / required / named / none
  stop_sequences, max_tokens, temperature, top_p, top_k -> their sampling equivalents
  output_config.format (a JSON schema)  -> the json_schema output format; its effort (low,
                                         medium, high) -> the template's reasoning_effort
`thinking` and `metadata` are accepted and ignored, and so is `cache_control` wherever Anthropic
allows it (system and content blocks, tool definitions): the KV cache reuses prefixes unasked.
count_tokens renders its request through this same mapping, template and tokenizer, so its
count is the prompt a Messages request with those fields is served.

Output: the chat pieces become content blocks in order of arrival (thinking, text, tool_use);
consecutive pieces of one kind share a block, another kind closes it. Whole and streamed
answers are built by the same `ContentBlocks`, so they agree; a whole answer leaves out a tool call
whose input is not a complete JSON object (cut by max_tokens), a stream cannot take back what
it sent (stop_reason "max_tokens" says so). Usage follows Anthropic's accounting: input_tokens
are the prompt tokens not read from the KV cache, cache_read_input_tokens those that were;
message_start (sent before the prefill) counts the whole prompt as input, message_delta carries
the final totals (the SDKs overwrite with them).

Errors on these routes carry Anthropic's envelope and error types (server/http/errors.py);
after the stream started, one `error` event in that envelope ends it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.engine.chat import (
    ChatMessage,
    ChatRequest,
    ChatTool,
    NamedTool,
    OutputFormat,
    ToolCall,
    ToolChoice,
)
from server.engine.token_loop import GenerationStats, SamplingParams
from server.engine.tool_calls import OutPiece, ToolCallArgs, ToolCallStart, json_text, strict_json
from server.errors import InvalidRequest
from server.http.errors import describe
from server.http.protocol import MaxTokens, OutModel, Temperature, TopK, TopP
from server.http.serving import (
    Pieces,
    Plan,
    ServeContext,
    check_model,
    collect,
    prepare_chat,
    render_chat,
    streamed,
)
from server.http.sse import named_event, sse_response

logger = logging.getLogger(__name__)

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class _Block(BaseModel):
    # cache_control, citations and other annotations of a block are ignored
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------- request


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class MediaBlock(_Block):
    """An image or document: accepted by validation so that the request is refused in plain words
    (the models served take text only), not with the validator's internals."""

    type: Literal["image", "document"]


ResultPart = Annotated[TextBlock | MediaBlock, Field(discriminator="type")]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[ResultPart] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


InputBlock = Annotated[
    TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(_Block):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class ToolDefinition(_Block):
    # the chat tools' name rule, so that every accepted tool maps onto one
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # "custom" (or absent): a client tool; Anthropic's server tools (web_search_..., bash_...) are refused
    type: str | None = None


class ToolChoiceParam(_Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(_Block):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Block):
    """Structured output (`format`, a JSON schema the answer's text follows) and `effort`."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what a Messages request's prompt is made of."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=256)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    thinking: dict[str, Any] | None = Field(None, description="accepted and ignored")
    tool_choice: ToolChoiceParam | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages (Anthropic's Messages API): the prompt's fields and how to answer it."""

    max_tokens: MaxTokens
    metadata: dict[str, Any] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool | None = None
    # Anthropic's range is 0..1; OpenAI's 0..2 is accepted, as on the chat route
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None


# ---------------------------------------------------------------------- response


class TextOut(OutModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(OutModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseOut(OutModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[TextOut | ThinkingOut | ToolUseOut, Field(discriminator="type")]


class TokenCount(OutModel):
    """The answer of count_tokens."""

    input_tokens: int


class MessageUsage(OutModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class MessageOut(OutModel):
    """The whole answer, and the message of message_start (no stop_reason yet)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


# stream events, in the order a stream sends them


class MessageStart(OutModel):
    type: Literal["message_start"] = "message_start"
    message: MessageOut


class ContentBlockStart(OutModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDeltaOut(OutModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDeltaOut(OutModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDeltaOut(OutModel):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class InputJsonDeltaOut(OutModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(OutModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDeltaOut | ThinkingDeltaOut | SignatureDeltaOut | InputJsonDeltaOut


class ContentBlockStop(OutModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDetails(OutModel):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(OutModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDetails
    usage: MessageUsage


class MessageStop(OutModel):
    type: Literal["message_stop"] = "message_stop"


class ErrorEvent(OutModel):
    type: Literal["error"] = "error"
    error: dict[str, Any]  # the error envelope's error, its type Anthropic's


Event = tuple[str, dict[str, Any]]


def _event(payload: OutModel) -> Event:
    """(event name, payload) of a stream event: the name is the payload's type."""
    data = payload.to_json()
    return str(data["type"]), data


# ---------------------------------------------------------------------- mapping


def _text_only(param: str, kind: str) -> InvalidRequest:
    return InvalidRequest(
        f"this model takes text only: the content block at {param} is {kind!r}; send text blocks "
        "(type 'text') or a string",
        param=param,
        code="unsupported_content",
    )


def _misplaced(param: str, kind: str, role: str) -> InvalidRequest:
    return InvalidRequest(f"a {kind!r} block cannot be in a {role} turn ({param})", param=param)


def _result_text(block: ToolResultBlock, param: str) -> str:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        parts: list[str] = []
        for k, part in enumerate(block.content):
            if isinstance(part, MediaBlock):
                raise _text_only(f"{param}.content.{k}", part.type)
            parts.append(part.text)
        text = "".join(parts)  # as chat content parts are joined
    return "Error: " + text if block.is_error else text


def _user_turn(blocks: list[InputBlock], i: int) -> list[ChatMessage]:
    """Tool messages for the turn's tool results, then a user message for its text (if any)."""
    results: list[ChatMessage] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        param = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            results.append(ChatMessage("tool", _result_text(block, param), tool_call_id=block.tool_use_id))
        elif isinstance(block, MediaBlock):
            raise _text_only(param, block.type)
        else:
            raise _misplaced(param, block.type, "user")
    if texts or not results:
        results.append(ChatMessage("user", "".join(texts)))
    return results


def _assistant_turn(blocks: list[InputBlock], i: int) -> ChatMessage:
    texts: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        param = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCall(block.id, block.name, _arguments(block.input, f"{param}.input")))
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, RedactedThinkingBlock):
            continue  # encrypted by Anthropic: nothing a local model can read
        elif isinstance(block, MediaBlock):
            raise _text_only(param, block.type)
        else:
            raise _misplaced(param, block.type, "assistant")
    return ChatMessage(
        "assistant", "".join(texts), tool_calls=tuple(calls), reasoning="".join(reasoning) or None
    )


def _arguments(value: dict[str, Any], param: str) -> str:
    try:
        return json_text(value)
    except ValueError as exc:
        raise InvalidRequest(f"{param} has no JSON form: {exc}", param=param) from None


def _tools(tools: list[ToolDefinition]) -> tuple[ChatTool, ...]:
    out: list[ChatTool] = []
    for k, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise InvalidRequest(
                f"tools.{k}: {tool.type!r} is one of Anthropic's server tools; this server runs client "
                "tools only (a name, a description and an input_schema)",
                param=f"tools.{k}.type",
                code="unsupported_tool",
            )
        if tool.input_schema is None:
            raise InvalidRequest(f"tools.{k}.input_schema: Field required", param=f"tools.{k}.input_schema")
        out.append(ChatTool(tool.name, tool.description, tool.input_schema))
    return tuple(out)


def _tool_choice(choice: ToolChoiceParam, has_tools: bool) -> ToolChoice:
    if choice.type in ("any", "tool") and not has_tools:
        raise InvalidRequest(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice 'tool' needs a name", param="tool_choice.name")
        return NamedTool(choice.name)
    if choice.type == "any":
        return "required"
    return choice.type


def to_chat_request(body: MessagesRequest | CountTokensRequest) -> ChatRequest:
    """The chat request that `body` means; InvalidRequest (naming the Messages field) if none.
    A count_tokens request has no sampling fields: its prompt is the same, its sampling unused."""
    messages: list[ChatMessage] = []
    if isinstance(body.system, str) and body.system:
        messages.append(ChatMessage("system", body.system))
    elif isinstance(body.system, list) and body.system:
        messages.append(ChatMessage("system", "".join(block.text for block in body.system)))
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append(ChatMessage(message.role, message.content))
        elif message.role == "user":
            messages.extend(_user_turn(message.content, i))
        else:
            messages.append(_assistant_turn(message.content, i))
    if isinstance(body, MessagesRequest):
        sampling = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            stop=tuple(body.stop_sequences or ()),
        )
    else:
        sampling = SamplingParams(max_tokens=1)
    config = body.output_config
    # the text block follows the schema: the same grammar as the chat route's json_schema
    fmt = OutputFormat("json_schema", config.format.schema_) if config and config.format else None
    effort = config.effort if config is not None else None
    choice = body.tool_choice
    return ChatRequest(
        messages=tuple(messages),
        sampling=sampling,
        tools=_tools(body.tools or []),
        tool_choice=_tool_choice(choice, bool(body.tools)) if choice is not None else None,
        parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        output_format=fmt,
        template_kwargs={"reasoning_effort": effort} if effort in ("low", "medium", "high") else {},
    )


# ---------------------------------------------------------------------- output


class ContentBlocks:
    """Chat output pieces -> Anthropic content blocks, and the stream events that build them.

    `feed` and `finish` return (event name, payload) pairs; `blocks` is the content so far. At
    most one block is open; a piece of another kind (or a new tool call) closes it. Tool-use ids
    are the chat call ids with Anthropic's prefix (toolu_ instead of call_).
    """

    def __init__(self) -> None:
        self.blocks: list[TextOut | ThinkingOut | ToolUseOut] = []
        self._open: int | None = None  # index of the open block
        self._call_blocks: dict[int, int] = {}  # tool-call index -> block index
        self._arguments: dict[int, str] = {}  # block index -> arguments text so far

    def feed(self, pieces: list[OutPiece]) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, ToolCallStart):
                call_id = "toolu_" + piece.id.removeprefix("call_")
                events += self._start(ToolUseOut(id=call_id, name=piece.name, input={}))
                self._call_blocks[piece.index] = len(self.blocks) - 1
                self._arguments[len(self.blocks) - 1] = ""
            elif isinstance(piece, ToolCallArgs):
                at = self._call_blocks[piece.index]
                self._arguments[at] += piece.text
                events.append(
                    _event(ContentBlockDelta(index=at, delta=InputJsonDeltaOut(partial_json=piece.text)))
                )
            elif piece[1]:
                kind, text = piece
                events += self._extend("thinking" if kind == "reasoning" else "text", text)
        return events

    def finish(self) -> list[Event]:
        """Close the open block; an answer with neither text nor a tool call gets an empty text
        block (what the whole answer shows as empty content)."""
        events = self._close()
        if not any(isinstance(block, TextOut | ToolUseOut) for block in self.blocks):
            events += self._start(TextOut(text="")) + self._close()
        return events

    def content(self) -> list[TextOut | ThinkingOut | ToolUseOut]:
        """The whole answer's blocks: a tool_use gets its input parsed, and is left out when its
        arguments are not a complete JSON object."""
        out: list[TextOut | ThinkingOut | ToolUseOut] = []
        for at, block in enumerate(self.blocks):
            if isinstance(block, ToolUseOut):
                value = self._input(at)
                if value is None:
                    continue
                block = block.model_copy(update={"input": value})
            out.append(block)
        return out

    def complete_calls(self) -> int:
        return sum(1 for at in self._arguments if self._input(at) is not None)

    def _input(self, at: int) -> dict[str, Any] | None:
        try:
            value = strict_json(self._arguments[at])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def _extend(self, kind: Literal["text", "thinking"], text: str) -> list[Event]:
        """Add text to the open block of `kind`, starting one if another kind is open."""
        events: list[Event] = []
        block = self.blocks[self._open] if self._open is not None else None
        if kind == "text":
            if not isinstance(block, TextOut):
                block = TextOut(text="")
                events += self._start(block)
            block.text += text
            delta: TextDeltaOut | ThinkingDeltaOut = TextDeltaOut(text=text)
        else:
            if not isinstance(block, ThinkingOut):
                block = ThinkingOut(thinking="", signature="")
                events += self._start(block)
            block.thinking += text
            delta = ThinkingDeltaOut(thinking=text)
        events.append(_event(ContentBlockDelta(index=len(self.blocks) - 1, delta=delta)))
        return events

    def _start(self, block: TextOut | ThinkingOut | ToolUseOut) -> list[Event]:
        events = self._close()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        return [*events, _event(ContentBlockStart(index=self._open, content_block=block))]

    def _close(self) -> list[Event]:
        at = self._open
        if at is None:
            return []
        self._open = None
        events: list[Event] = []
        if isinstance(self.blocks[at], ThinkingOut):
            # Anthropic's streams end a thinking block with its signature; ours is empty
            events.append(_event(ContentBlockDelta(index=at, delta=SignatureDeltaOut(signature=""))))
        events.append(_event(ContentBlockStop(index=at)))
        return events


def _stop(stats: GenerationStats, calls: int) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence)."""
    if stats.finish_reason == "length":
        return "max_tokens", None
    if stats.stop_string is not None:
        return "stop_sequence", stats.stop_string
    return ("tool_use" if calls else "end_turn"), None


def _usage(stats: GenerationStats) -> MessageUsage:
    return MessageUsage(
        input_tokens=stats.prompt_tokens - stats.cached_tokens,
        output_tokens=stats.completion_tokens,
        cache_read_input_tokens=stats.cached_tokens,
        cache_creation_input_tokens=0,
    )


# ---------------------------------------------------------------------- route


async def create_message(ctx: ServeContext, body: MessagesRequest, request: Request) -> Response:
    """POST /v1/messages."""
    ctx.warn_unknown(body.model_extra)
    plan = await prepare_chat(ctx, to_chat_request(body), model_id=body.model)
    message_id = "msg_" + plan.job.id.removeprefix("chatcmpl-")
    if body.stream:
        shutdown = anyio.Event()
        return sse_response(_stream(ctx, plan, message_id, shutdown), ctx.settings.keepalive_s, shutdown)
    pieces, _, finished = await collect(ctx, plan, request)
    blocks = ContentBlocks()
    blocks.feed(pieces)
    blocks.finish()
    stop_reason, stop_sequence = _stop(finished.stats, blocks.complete_calls())
    message = MessageOut(
        id=message_id,
        model=plan.model_id,
        content=blocks.content(),
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=_usage(finished.stats),
    )
    return JSONResponse(message.to_json())


async def count_tokens(ctx: ServeContext, body: CountTokensRequest) -> Response:
    """POST /v1/messages/count_tokens: the prompt tokens /v1/messages would render `body` to (its
    usage counts them as input_tokens plus cache_read_input_tokens)."""
    ctx.warn_unknown(body.model_extra)
    model = ctx.ready_model()
    check_model(model, body.model)
    _, tokens = await render_chat(ctx, model, to_chat_request(body))
    return JSONResponse(TokenCount(input_tokens=len(tokens)).to_json())


async def _stream(
    ctx: ServeContext, plan: Plan, message_id: str, shutdown: anyio.Event
) -> AsyncIterator[ServerSentEvent]:
    blocks = ContentBlocks()
    # sent before the prefill: the whole prompt counts as input (message_delta corrects it)
    start_usage = MessageUsage(
        input_tokens=len(plan.job.request.prompt_tokens),
        output_tokens=0,
        cache_read_input_tokens=0,
        cache_creation_input_tokens=0,
    )
    message = MessageOut(
        id=message_id,
        model=plan.model_id,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=start_usage,
    )
    try:
        yield named_event(*_event(MessageStart(message=message)))
        async for item in streamed(ctx, plan, shutdown):
            if isinstance(item, Pieces):
                for name, payload in blocks.feed(item.pieces):
                    yield named_event(name, payload)
                continue
            for name, payload in blocks.finish():
                yield named_event(name, payload)
            stop_reason, stop_sequence = _stop(item.stats, blocks.complete_calls())
            delta = StopDetails(stop_reason=stop_reason, stop_sequence=stop_sequence)
            yield named_event(*_event(MessageDelta(delta=delta, usage=_usage(item.stats))))
            yield named_event(*_event(MessageStop()))
    except Exception as exc:  # the worker's failure or the server stopping: reported in-band
        _, body, _ = describe(exc, ctx.engine.queue_full_status, anthropic=True)
        error = body["error"]
        yield named_event(*_event(ErrorEvent(error=error if isinstance(error, dict) else {})))
    finally:
        # a no-op once the job finished; stops it when the reader left before it was streamed
        plan.job.cancel()
