"""A Messages request -> the engine's ChatRequest (`to_chat_request`).

The mapping:
  system (string or text blocks)      -> a system message
  text, search_result (its title, source and text), a document whose source is plain text or
  text blocks (its title, context and text), compaction (its summary) -> the turn's text
  user tool_result blocks             -> tool messages (tool_call_id = tool_use_id; is_error
                                         prefixes the text with "Error: ")
  tool_use, server_tool_use, mcp_tool_use -> the assistant turn's tool calls (an MCP tool's
                                         name joined to its server's by "__")
  a server or MCP tool's result (SERVER_TOOL_RESULTS) -> a tool message for its call, its
                                         content as JSON (encrypted parts left out); in an
                                         assistant turn it closes the turn's calls
  thinking blocks                     -> the assistant turn's reasoning
  DROPPED_BLOCKS (redacted_thinking, container_upload, ...) -> left out, logged once per type
  image blocks, other documents (PDF, URL, file) -> 400 unsupported_content (text only)
  tool_choice auto / any / tool / none -> auto / required / named / none
  stop_sequences, max_tokens, temperature, top_p, top_k -> their sampling equivalents
  output_config.format (a JSON schema)  -> the json_schema output format; its effort (low,
                                         medium, high) -> the template's reasoning_effort
`thinking` and `metadata` are accepted and ignored, and so is `cache_control` wherever Anthropic
allows it (system and content blocks, tool definitions): the prompt cache keeps prefixes unasked.
Claude Code opens its system prompt with an `x-anthropic-billing-header: ...; cch=...;` line
whose checksum changes on every request: it would make every prompt differ from the first tokens
on and defeat the prompt cache, so that block (or line) is dropped before rendering (llama.cpp's
PR #20623 does the same).
count_tokens renders its request through this same mapping, template and tokenizer, so its
count is the prompt a Messages request with those fields is served.
"""

from __future__ import annotations

import logging
from typing import Any

from server.engine.chat import (
    ChatMessage,
    ChatRequest,
    ChatTool,
    NamedTool,
    OutputFormat,
    ToolCall,
    ToolChoice,
)
from server.engine.generation import SamplingParams
from server.engine.tool_calls import json_text
from server.errors import InvalidRequest
from server.http.messages.protocol import (
    DROPPED_BLOCKS,
    CompactionBlock,
    CountTokensRequest,
    DocumentBlock,
    DroppedBlock,
    InputBlock,
    MediaBlock,
    MessagesRequest,
    ResultPart,
    SearchResultBlock,
    ServerToolResultBlock,
    ServerToolUseBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoiceParam,
    ToolDefinition,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)

logger = logging.getLogger(__name__)


def _text_only(param: str, kind: str) -> InvalidRequest:
    return InvalidRequest(
        f"this model takes text only: the content block at {param} is {kind!r}; send text blocks "
        "(type 'text') or a string",
        param=param,
        code="unsupported_content",
    )


def _misplaced(param: str, kind: str, role: str) -> InvalidRequest:
    return InvalidRequest(f"a {kind!r} block cannot be in a {role} turn ({param})", param=param)


def _document_text(block: DocumentBlock, param: str) -> str:
    """A document's text (its title and context first): a plain-text source's data, or a content
    source's text blocks; InvalidRequest for a PDF, a URL or a stored file."""
    source = block.source
    kind = source.get("type")
    if kind == "text" and isinstance(source.get("data"), str):
        body = str(source["data"])
    elif kind == "content" and isinstance(source.get("content"), str):
        body = str(source["content"])
    elif kind == "content" and isinstance(source.get("content"), list):
        parts: list[str] = []
        for k, part in enumerate(source["content"]):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise _text_only(
                    f"{param}.source.content.{k}", str(part.get("type") if isinstance(part, dict) else part)
                )
            parts.append(part["text"])
        body = "".join(parts)
    else:
        raise InvalidRequest(
            f"this model takes text only: the document at {param} has a {kind!r} source (PDFs, URLs and "
            "stored files are not read); send its text as a 'text' source",
            param=f"{param}.source",
            code="unsupported_content",
        )
    return "\n".join(text for text in (block.title, block.context, body) if text)


def _search_result_text(block: SearchResultBlock) -> str:
    return "\n".join([block.title, block.source, *(part.text for part in block.content)])


def _readable(block: InputBlock | ResultPart, param: str) -> str | None:
    """The text a text-like block shows the model (text, a text document, a search result, a
    compaction's summary, a tool reference's name); None for a block of another kind;
    InvalidRequest for an image."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, DocumentBlock):
        return _document_text(block, param)
    if isinstance(block, SearchResultBlock):
        return _search_result_text(block)
    if isinstance(block, CompactionBlock) and block.content:
        return block.content
    if isinstance(block, ToolReferenceBlock):
        return block.tool_name
    if isinstance(block, MediaBlock):
        raise _text_only(param, block.type)
    return None


def _result_text(block: ToolResultBlock, param: str) -> str:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        # as chat content parts are joined
        text = "".join(_readable(part, f"{param}.content.{k}") or "" for k, part in enumerate(block.content))
    return "Error: " + text if block.is_error else text


def _server_content(value: Any, param: str) -> Any:
    """A server tool result's content as the model reads it: encrypted parts left out, a
    document as its text; InvalidRequest for an image or a PDF in it (text only)."""
    if isinstance(value, list):
        return [_server_content(v, f"{param}.{k}") for k, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if value.get("type") == "image":
        raise _text_only(param, "image")
    if value.get("type") == "document" and isinstance(value.get("source"), dict):
        return _document_text(DocumentBlock.model_validate(value), param)
    return {k: _server_content(v, f"{param}.{k}") for k, v in value.items() if k != "encrypted_content"}


def _server_result_text(block: ServerToolResultBlock, param: str) -> str:
    content = _server_content(block.content, f"{param}.content")
    text = content if isinstance(content, str) else json_text(content)
    return "Error: " + text if block.is_error else text


class _Turns:
    """The chat messages a conversation's turns make, block by block."""

    def __init__(self, warned: set[str]) -> None:
        self.messages: list[ChatMessage] = []
        self._warned = warned
        self._texts: list[str] = []
        self._calls: list[ToolCall] = []
        self._reasoning: list[str] = []

    def _close_assistant(self) -> None:
        if self._texts or self._calls or self._reasoning:
            self.messages.append(
                ChatMessage(
                    "assistant",
                    "".join(self._texts),
                    tool_calls=tuple(self._calls),
                    reasoning="".join(self._reasoning) or None,
                )
            )
        self._texts, self._calls, self._reasoning = [], [], []

    def _drop(self, kind: str) -> None:
        if f"block.{kind}" not in self._warned:
            self._warned.add(f"block.{kind}")
            reason = DROPPED_BLOCKS.get(kind, "a failed compaction (no summary) holds nothing to read")
            logger.warning("dropping %r content blocks: %s (logged once)", kind, reason)

    def user(self, blocks: list[InputBlock], i: int) -> None:
        """Tool messages for the turn's tool results, then a user message for its text (if any)."""
        results: list[ChatMessage] = []
        texts: list[str] = []
        for j, block in enumerate(blocks):
            param = f"messages.{i}.content.{j}"
            text = _readable(block, param)
            if text is not None:
                texts.append(text)
            elif isinstance(block, ToolResultBlock):
                results.append(
                    ChatMessage("tool", _result_text(block, param), tool_call_id=block.tool_use_id)
                )
            elif isinstance(block, ServerToolResultBlock):
                results.append(
                    ChatMessage("tool", _server_result_text(block, param), tool_call_id=block.tool_use_id)
                )
            elif isinstance(block, DroppedBlock | CompactionBlock):
                self._drop(block.type if isinstance(block, DroppedBlock) else "compaction")
            else:
                raise _misplaced(param, block.type, "user")
        self.messages += results
        if texts or not results:
            self.messages.append(ChatMessage("user", "".join(texts)))

    def system(self, blocks: list[InputBlock], i: int) -> None:
        texts: list[str] = []
        for j, block in enumerate(blocks):
            param = f"messages.{i}.content.{j}"
            text = _readable(block, param)
            if text is None:
                raise _misplaced(param, block.type, "system")
            texts.append(text)
        self.messages.append(ChatMessage("system", "".join(texts)))

    def assistant(self, blocks: list[InputBlock], i: int) -> None:
        """One assistant message for the turn; a server tool's result (Anthropic keeps it in the
        assistant's turn) closes it with the calls so far, as a tool message after it."""
        for j, block in enumerate(blocks):
            param = f"messages.{i}.content.{j}"
            text = _readable(block, param)
            if text is not None:
                self._texts.append(text)
            elif isinstance(block, ToolUseBlock):
                self._calls.append(ToolCall(block.id, block.name, _arguments(block.input, f"{param}.input")))
            elif isinstance(block, ServerToolUseBlock):
                name = f"{block.server_name}__{block.name}" if block.server_name else block.name
                self._calls.append(ToolCall(block.id, name, _arguments(block.input, f"{param}.input")))
            elif isinstance(block, ThinkingBlock):
                self._reasoning.append(block.thinking)
            elif isinstance(block, ServerToolResultBlock):
                self._close_assistant()
                self.messages.append(
                    ChatMessage("tool", _server_result_text(block, param), tool_call_id=block.tool_use_id)
                )
            elif isinstance(block, DroppedBlock | CompactionBlock):
                self._drop(block.type if isinstance(block, DroppedBlock) else "compaction")
            else:
                raise _misplaced(param, block.type, "assistant")
        self._close_assistant()
        if not blocks:
            self.messages.append(ChatMessage("assistant", ""))


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


_BILLING_HEADER = "x-anthropic-billing-header:"


def _system_text(system: str | list[TextBlock] | None) -> str:
    """The top-level system prompt's text without Claude Code's billing-header block (a text block,
    or the first line of a string, that starts with `x-anthropic-billing-header:`)."""
    if isinstance(system, str):
        first, _, rest = system.partition("\n")
        return rest if first.startswith(_BILLING_HEADER) else system
    if not system:
        return ""
    return "".join(block.text for block in system if not block.text.startswith(_BILLING_HEADER))


def to_chat_request(body: MessagesRequest | CountTokensRequest, warned: set[str]) -> ChatRequest:
    """The chat request that `body` means; InvalidRequest (naming the Messages field) if none.
    A count_tokens request has no sampling fields: its prompt is the same, its sampling unused.
    `warned`: the app's set of things logged once (blocks dropped)."""
    messages: list[ChatMessage] = []
    system = _system_text(body.system)
    if system:
        messages.append(ChatMessage("system", system))
    turns = _Turns(warned)
    for i, message in enumerate(body.messages):
        if message.role == "system" and i == 0:
            # the top-level field holds the opening system prompt; a system turn only follows others
            raise InvalidRequest(
                "a conversation cannot open with a system message: put it in the top-level 'system' field",
                param="messages.0.role",
            )
        if isinstance(message.content, str):
            turns.messages.append(ChatMessage(message.role, message.content))
        elif message.role == "user":
            turns.user(message.content, i)
        elif message.role == "system":
            turns.system(message.content, i)
        else:
            turns.assistant(message.content, i)
    messages += turns.messages
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
