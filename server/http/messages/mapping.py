"""A Messages request -> the engine's ChatRequest (`to_chat_request`).

The mapping:
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
allows it (system and content blocks, tool definitions): the prompt cache keeps prefixes unasked.
Claude Code opens its system prompt with an `x-anthropic-billing-header: ...; cch=...;` line
whose checksum changes on every request: it would make every prompt differ from the first tokens
on and defeat the prompt cache, so that block (or line) is dropped before rendering (llama.cpp's
PR #20623 does the same).
count_tokens renders its request through this same mapping, template and tokenizer, so its
count is the prompt a Messages request with those fields is served.
"""

from __future__ import annotations

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
from server.engine.token_loop import SamplingParams
from server.engine.tool_calls import json_text
from server.errors import InvalidRequest
from server.http.messages.protocol import (
    CountTokensRequest,
    InputBlock,
    MediaBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoiceParam,
    ToolDefinition,
    ToolResultBlock,
    ToolUseBlock,
)


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


def _system_turn(blocks: list[InputBlock], i: int) -> ChatMessage:
    texts: list[str] = []
    for j, block in enumerate(blocks):
        param = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, MediaBlock):
            raise _text_only(param, block.type)
        else:
            raise _misplaced(param, block.type, "system")
    return ChatMessage("system", "".join(texts))


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


def to_chat_request(body: MessagesRequest | CountTokensRequest) -> ChatRequest:
    """The chat request that `body` means; InvalidRequest (naming the Messages field) if none.
    A count_tokens request has no sampling fields: its prompt is the same, its sampling unused."""
    messages: list[ChatMessage] = []
    system = _system_text(body.system)
    if system:
        messages.append(ChatMessage("system", system))
    for i, message in enumerate(body.messages):
        if message.role == "system" and i == 0:
            # the top-level field holds the opening system prompt; a system turn only follows others
            raise InvalidRequest(
                "a conversation cannot open with a system message: put it in the top-level 'system' field",
                param="messages.0.role",
            )
        if isinstance(message.content, str):
            messages.append(ChatMessage(message.role, message.content))
        elif message.role == "user":
            messages.extend(_user_turn(message.content, i))
        elif message.role == "system":
            messages.append(_system_turn(message.content, i))
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
