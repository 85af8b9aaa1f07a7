"""Anthropic Messages API (POST /v1/messages) on the chat-completions engine path.

A Messages request is validated here (every number bounded: out of range is a 400; unknown
fields accepted and logged once), mapped onto a ChatCompletionRequest and run by
`prepare_chat`, so it is refused, if at all, before the response starts, exactly like a chat
request. The mapping:
  system (string or text blocks)      -> a system message
  user text blocks                    -> a user message, after that turn's tool results
  user tool_result blocks             -> tool messages (tool_call_id = tool_use_id; is_error
                                         prefixes the text with "Error: ")
  assistant text / tool_use blocks    -> an assistant message with content and tool_calls
  assistant thinking blocks           -> its reasoning_content (redacted_thinking is dropped)
  image / document blocks             -> 400 unsupported_content (the models take text only)
  tool_choice auto / any / tool / none -> auto / required / named / none
  stop_sequences, max_tokens, temperature, top_p, top_k -> their chat equivalents
  output_config.format (a JSON schema)  -> response_format json_schema; its effort (low, medium,
                                         high) -> reasoning_effort
`thinking` and `metadata` are accepted and ignored.

Output: the chat pieces become content blocks in order of arrival (thinking, text, tool_use);
consecutive pieces of one kind share a block, another kind closes it. Whole and streamed
answers are built by the same `ContentBlocks`, so they agree; a whole answer leaves out a tool call
whose input is not a complete JSON object (cut by max_tokens), a stream cannot take back what
it sent (stop_reason "max_tokens" says so). Usage follows Anthropic's accounting: input_tokens
are the prompt tokens not read from the KV cache, cache_read_input_tokens those that were;
message_start (sent before the prefill) counts the whole prompt as input, message_delta carries
the final totals (the SDKs overwrite with them).

Errors on this route carry Anthropic's envelope too (server/http_errors.py); after the stream
started, one `error` event ends it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.completions import ChatPlan, Pieces, ServeContext, collect, prepare_chat, streamed
from server.decode import GenerationStats
from server.errors import InvalidRequest
from server.http_errors import describe
from server.protocol import ChatCompletionRequest, MaxTokens, Temperature, TopK, TopP
from server.sse import named_event, sse_response
from server.tools import OutPiece, ToolCallArgs, ToolCallStart, json_text, strict_json

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


class ToolChoice(_Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Block):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Block):
    """Structured output (`format`, a JSON schema the answer's text follows) and `effort`."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(BaseModel):
    """POST /v1/messages (Anthropic's Messages API)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=256)
    max_tokens: MaxTokens
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    metadata: dict[str, Any] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool | None = None
    # Anthropic's range is 0..1; OpenAI's 0..2 is accepted, as on the chat route
    temperature: Temperature | None = None
    thinking: dict[str, Any] | None = Field(None, description="accepted and ignored")
    tool_choice: ToolChoice | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    top_k: TopK | None = None
    top_p: TopP | None = None
    output_config: OutputConfig | None = None


# ---------------------------------------------------------------------- response (documentation)


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Annotated[TextOut | ThinkingOut | ToolUseOut, Field(discriminator="type")]]
    stop_reason: StopReason
    stop_sequence: str | None
    usage: MessageUsage


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


def _user_turn(blocks: list[InputBlock], i: int) -> list[dict[str, Any]]:
    """Tool messages for the turn's tool results, then a user message for its text (if any)."""
    results: list[dict[str, Any]] = []
    texts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        param = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlock):
            results.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, param)}
            )
        elif isinstance(block, MediaBlock):
            raise _text_only(param, block.type)
        else:
            raise _misplaced(param, block.type, "user")
    if texts or not results:
        results.append({"role": "user", "content": texts})
    return results


def _assistant_turn(blocks: list[InputBlock], i: int) -> dict[str, Any]:
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        param = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": _arguments(block.input, f"{param}.input")}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, RedactedThinkingBlock):
            continue  # encrypted by Anthropic: nothing a local model can read
        elif isinstance(block, MediaBlock):
            raise _text_only(param, block.type)
        else:
            raise _misplaced(param, block.type, "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": texts or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message


def _arguments(value: dict[str, Any], param: str) -> str:
    try:
        return json_text(value)
    except ValueError as exc:
        raise InvalidRequest(f"{param} has no JSON form: {exc}", param=param) from None


def _tools(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
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
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: ToolChoice, has_tools: bool) -> str | dict[str, Any]:
    if choice.type in ("any", "tool") and not has_tools:
        raise InvalidRequest(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice 'tool' needs a name", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def to_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that `body` means; InvalidRequest (naming the Messages field) if none."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.system, str) and body.system:
        messages.append({"role": "system", "content": body.system})
    elif isinstance(body.system, list) and body.system:
        messages.append({"role": "system", "content": [b.model_dump() for b in body.system]})
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            messages.extend(_user_turn(message.content, i))
        else:
            messages.append(_assistant_turn(message.content, i))
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences,
    }
    if body.tools:
        chat["tools"] = _tools(body.tools)
    config = body.output_config
    if config is not None and config.format is not None:
        # the text block follows the schema: the same grammar as the chat route's json_schema
        schema = {"name": "output", "schema": config.format.schema_}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    if config is not None and config.effort in ("low", "medium", "high"):
        chat["reasoning_effort"] = config.effort
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice, bool(body.tools))
        if body.tool_choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # every field is checked above: a gap in that is still a 400
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        problem = f"the request does not map onto a chat request: {where}: {first['msg']}"
        raise InvalidRequest(problem) from None


# ---------------------------------------------------------------------- output


class ContentBlocks:
    """Chat output pieces -> Anthropic content blocks, and the stream events that build them.

    `feed` and `finish` return (event name, payload) pairs; `blocks` is the content so far. At
    most one block is open; a piece of another kind (or a new tool call) closes it. Tool-use ids
    are the chat call ids with Anthropic's prefix (toolu_ instead of call_).
    """

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: int | None = None  # index of the open block
        self._call_blocks: dict[int, int] = {}  # tool-call index -> block index
        self._arguments: dict[int, str] = {}  # block index -> arguments text so far

    def feed(self, pieces: list[OutPiece]) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        for piece in pieces:
            if isinstance(piece, ToolCallStart):
                call_id = "toolu_" + piece.id.removeprefix("call_")
                block = {"type": "tool_use", "id": call_id, "name": piece.name, "input": {}}
                events += self._start(block)
                self._call_blocks[piece.index] = len(self.blocks) - 1
                self._arguments[len(self.blocks) - 1] = ""
            elif isinstance(piece, ToolCallArgs):
                at = self._call_blocks[piece.index]
                self._arguments[at] += piece.text
                delta = {"type": "input_json_delta", "partial_json": piece.text}
                events.append(_delta(at, delta))
            elif piece[1]:
                kind, text = piece
                if kind == "reasoning":
                    events += self._extend("thinking", text, {"thinking": "", "signature": ""})
                else:
                    events += self._extend("text", text, {"text": ""})
        return events

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        """Close the open block; an answer with neither text nor a tool call gets an empty text
        block (what the whole answer shows as empty content)."""
        events = self._close()
        if not any(block["type"] in ("text", "tool_use") for block in self.blocks):
            events += self._start({"type": "text", "text": ""}) + self._close()
        return events

    def content(self) -> list[dict[str, Any]]:
        """The whole answer's blocks: a tool_use gets its input parsed, and is left out when its
        arguments are not a complete JSON object."""
        out: list[dict[str, Any]] = []
        for at, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                value = self._input(at)
                if value is None:
                    continue
                block = {**block, "input": value}
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

    def _extend(self, kind: str, text: str, empty: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Add text to the open block of `kind` ("text" or "thinking", also its text field's name),
        starting one if another kind is open."""
        events: list[tuple[str, dict[str, Any]]] = []
        if self._open is None or self.blocks[self._open]["type"] != kind:
            events += self._start({"type": kind, **empty})
        at = len(self.blocks) - 1
        self.blocks[at][kind] += text
        events.append(_delta(at, {"type": f"{kind}_delta", kind: text}))
        return events

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        start = {"type": "content_block_start", "index": self._open, "content_block": dict(block)}
        return [*events, ("content_block_start", start)]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        at = self._open
        if at is None:
            return []
        self._open = None
        events: list[tuple[str, dict[str, Any]]] = []
        if self.blocks[at]["type"] == "thinking":
            # Anthropic's streams end a thinking block with its signature; ours is empty
            events.append(_delta(at, {"type": "signature_delta", "signature": ""}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": at}))
        return events


def _delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _stop(stats: GenerationStats, calls: int) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence)."""
    if stats.finish_reason == "length":
        return "max_tokens", None
    if stats.stop_string is not None:
        return "stop_sequence", stats.stop_string
    return ("tool_use" if calls else "end_turn"), None


def _usage(stats: GenerationStats) -> dict[str, int]:
    return {
        "input_tokens": stats.prompt_tokens - stats.cached_tokens,
        "output_tokens": stats.completion_tokens,
        "cache_read_input_tokens": stats.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


# ---------------------------------------------------------------------- route


async def create_message(ctx: ServeContext, body: MessagesRequest, request: Request) -> Response:
    """POST /v1/messages."""
    ctx.warn_unknown(body.model_extra)
    plan = await prepare_chat(ctx, to_chat_request(body), request)
    head = {
        "id": "msg_" + plan.job.id.removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": body.model,
    }
    if body.stream:
        shutdown = anyio.Event()
        return sse_response(_stream(ctx, plan, head, shutdown), ctx.settings.keepalive_s, shutdown)
    pieces, _, finished = await collect(ctx, plan, request)
    blocks = ContentBlocks()
    blocks.feed(pieces)
    blocks.finish()
    stop_reason, stop_sequence = _stop(finished.stats, blocks.complete_calls())
    message = {
        **head,
        "content": blocks.content(),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(finished.stats),
    }
    return JSONResponse(message)


async def _stream(
    ctx: ServeContext, plan: ChatPlan, head: dict[str, Any], shutdown: anyio.Event
) -> AsyncIterator[ServerSentEvent]:
    blocks = ContentBlocks()
    start_usage = {
        "input_tokens": len(plan.job.request.prompt_tokens),
        "output_tokens": 0,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    message = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}
    try:
        yield named_event("message_start", {"type": "message_start", "message": message})
        async for item in streamed(ctx, plan, shutdown):
            if isinstance(item, Pieces):
                for name, payload in blocks.feed(item.pieces):
                    yield named_event(name, payload)
                continue
            for name, payload in blocks.finish():
                yield named_event(name, payload)
            stop_reason, stop_sequence = _stop(item.stats, blocks.complete_calls())
            delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
            usage = _usage(item.stats)
            yield named_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
            yield named_event("message_stop", {"type": "message_stop"})
    except Exception as exc:  # the worker's failure or the server stopping: reported in-band
        status, body, _ = describe(exc, ctx.engine.queue_full_status)
        error = dict(body["error"]) if isinstance(body["error"], dict) else {}
        error["type"] = "overloaded_error" if status in (429, 503) else "api_error"
        yield named_event("error", {"type": "error", "error": error})
    finally:
        # a no-op once the job finished; stops it when the reader left before it was streamed
        plan.job.cancel()
