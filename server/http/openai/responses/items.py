"""A Responses request's input items -> the engine's chat messages, one rule per item type.

The rules (docs/api.md, "Input items and content blocks", lists them for users):
  message                        -> a message of its role; text, output_text and refusal parts
                                    are its text, a text/* file its text; images, audio and
                                    other files are refused (the models take text only)
  function_call, custom_tool_call -> an assistant turn's tool call (consecutive calls: one turn)
  *_call_output                  -> a tool message for its call; with no call_id, for the earliest
                                    unanswered call of the same name and namespace, else a tool
                                    result of that name
  reasoning                      -> the next assistant turn's reasoning (encrypted_content is
                                    dropped, logged once)
  a built-in or hosted tool's call (HOSTED_CALLS) -> a tool call under that tool's name, its
                                    fields as arguments, and the result it carries (HOSTED_RESULTS)
                                    as that call's tool message
  a built-in tool's output (HOSTED_OUTPUTS) -> a tool message for the call it names
  additional_tools, tool_search_output -> their tools join the request's (the search output is
                                    also its call's tool message: the names it loaded)
  configuration_update           -> its reasoning effort and text format apply (the last wins)
  DROPPED_ITEMS                  -> left out, logged once per type
  REFUSED_ITEMS, item_reference  -> 400 naming the item
"""

from __future__ import annotations

import base64
import binascii
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from server.engine.chat import ChatMessage, ToolCall
from server.engine.tool_calls import json_text
from server.errors import InvalidRequest
from server.http.openai.responses.protocol import (
    DROPPED_ITEMS,
    HOSTED_CALLS,
    HOSTED_OUTPUTS,
    HOSTED_RESULTS,
    OPAQUE_FIELDS,
    REFUSED_ITEMS,
    ConfigurationUpdateItem,
    ContentPart,
    CustomToolCallItem,
    DroppedItem,
    FunctionCallItem,
    HostedItem,
    InputFile,
    InputItem,
    InputMedia,
    ItemReference,
    MessageItem,
    ReasoningItem,
    ReasoningOptions,
    RefusalPart,
    TextOptions,
    ToolOutputItem,
    ToolsItem,
)

logger = logging.getLogger(__name__)


def flat_name(name: str, namespace: str | None) -> str:
    """The one name the model sees for tool `name` of `namespace`: joined by "__", MCP's
    delimiter, which Codex's MCP namespaces (`mcp__server__`) already end with."""
    if namespace is None:
        return name
    return namespace + name if namespace.endswith("__") else f"{namespace}__{name}"


def warn_once(warned: set[str], key: str, message: str) -> None:
    """Log `message` the first time `key` is seen in `warned` (the app's set, never a module's)."""
    if key not in warned:
        warned.add(key)
        logger.warning("%s (logged once)", message)


def _file_text(part: InputFile, where: str) -> str:
    data = part.file_data or ""
    head, _, payload = data.partition(",")
    if head.startswith("data:text/") and head.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise InvalidRequest(
                f"{where}.file_data is not base64 of UTF-8 text", param=f"{where}.file_data"
            ) from None
    raise InvalidRequest(
        f"this model takes text only: the file at {where} is not a text/* data URL (PDFs, images "
        "and stored files are not read)",
        param=where,
        code="unsupported_content",
    )


def content_text(content: str | list[ContentPart], where: str) -> str:
    """The text of a message's or an output's content; InvalidRequest for media."""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        if isinstance(part, InputMedia):
            raise InvalidRequest(
                f"this model takes text only: the content part at {at} is {part.type!r}",
                param=at,
                code="unsupported_content",
            )
        if isinstance(part, InputFile):
            parts.append(_file_text(part, at))
        elif isinstance(part, RefusalPart):
            parts.append(part.refusal)
        else:
            parts.append(part.text)
    return "".join(parts)


def _shown(fields: dict[str, Any], leave_out: tuple[str, ...] = ()) -> str:
    """What a hosted item shows the model of `fields`: one string as it is, else JSON."""
    kept = {
        k: v for k, v in fields.items() if k not in OPAQUE_FIELDS and k not in leave_out and v is not None
    }
    if len(kept) == 1:
        (only,) = kept.values()
        if isinstance(only, str):
            return only
    return json_text(kept)


@dataclass
class Conversation:
    """What a request's input items amount to: the messages, the tools items add, and the last
    configuration update."""

    messages: list[ChatMessage] = field(default_factory=list)
    # (where, tools) of each item that adds tools
    tools: list[tuple[str, list[Any]]] = field(default_factory=list)
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    _reasoning: str = ""
    # calls made so far, in order: (call id, flat name), and the ids already answered
    _calls: list[tuple[str, str]] = field(default_factory=list)
    _answered: set[str] = field(default_factory=set)

    def _call(self, call: ToolCall) -> None:
        self._calls.append((call.id, call.name))
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant" and last.tool_calls:
            # consecutive calls: one assistant turn with parallel calls
            self.messages[-1] = replace(last, tool_calls=(*last.tool_calls, call))
        else:
            self.messages.append(
                ChatMessage("assistant", tool_calls=(call,), reasoning=self._take_reasoning())
            )

    def _result(self, text: str, call_id: str | None, name: str | None) -> None:
        if call_id is None and name is not None:
            # no call_id (Codex's goal tools): the earliest unanswered call of that name
            call_id = next((i for i, n in self._calls if n == name and i not in self._answered), None)
        if call_id is not None:
            self._answered.add(call_id)
            name = name or next((n for i, n in self._calls if i == call_id), None)
        self.messages.append(ChatMessage("tool", text, tool_call_id=call_id, name=name))

    def _take_reasoning(self) -> str | None:
        reasoning, self._reasoning = self._reasoning, ""
        return reasoning or None

    def add(self, item: InputItem, where: str, warned: set[str]) -> None:
        """Take one input item by its type's rule; InvalidRequest (naming `where`) refuses it."""
        if isinstance(item, MessageItem):
            text = content_text(item.content, f"{where}.content")
            reasoning = self._take_reasoning() if item.role == "assistant" else None
            self.messages.append(ChatMessage(item.role, text, reasoning=reasoning))
        elif isinstance(item, FunctionCallItem):
            self._call(ToolCall(item.call_id, flat_name(item.name, item.namespace), item.arguments))
        elif isinstance(item, CustomToolCallItem):
            # offered as a function with one string argument: sent back as one
            arguments = json_text({"input": item.input})
            self._call(ToolCall(item.call_id, flat_name(item.name, item.namespace), arguments))
        elif isinstance(item, ToolOutputItem):
            name = flat_name(item.name, item.namespace) if item.name is not None else None
            self._result(content_text(item.output, f"{where}.output"), item.call_id, name)
        elif isinstance(item, ReasoningItem):
            self._reasoning += "".join(part.text for part in (item.content or item.summary))
            if item.encrypted_content is not None:
                warn_once(
                    warned,
                    "input.reasoning.encrypted_content",
                    "reasoning items: encrypted_content is dropped",
                )
        elif isinstance(item, ToolsItem):
            self.tools.append((f"{where}.tools", item.tools))
            if item.type == "tool_search_output":
                names = [t.get("name") or t.get("type") for t in item.tools if isinstance(t, dict)]
                self._result(json_text({"loaded_tools": names}), item.call_id, "tool_search")
        elif isinstance(item, ConfigurationUpdateItem):
            self.reasoning = item.reasoning or self.reasoning
            self.text = item.text or self.text
        elif isinstance(item, ItemReference):
            raise InvalidRequest(f"{where}: {REFUSED_ITEMS['item_reference']}", param=where)
        elif isinstance(item, HostedItem):
            self._hosted(item)
        elif isinstance(item, DroppedItem):
            if item.type in REFUSED_ITEMS:
                raise InvalidRequest(
                    f"{where} is a {item.type!r} item: {REFUSED_ITEMS[item.type]}",
                    param=where,
                    code="unsupported_content",
                )
            warn_once(
                warned,
                f"input.{item.type}",
                f"dropping {item.type!r} input items: {DROPPED_ITEMS[item.type]}",
            )

    def _hosted(self, item: HostedItem) -> None:
        fields = dict(item.model_extra or {})
        if item.type in HOSTED_OUTPUTS:
            link = HOSTED_OUTPUTS[item.type]
            answered = (
                item.id if link == "id" else item.call_id if link == "call_id" else fields.pop(link, None)
            )
            self._result(_shown(fields), answered if isinstance(answered, str) else None, None)
            return
        tool = HOSTED_CALLS[item.type]
        results = HOSTED_RESULTS.get(item.type, ())
        name = fields.get("name")
        if item.type == "mcp_call" and isinstance(name, str):
            label = fields.get("server_label")
            tool = flat_name(name, label if isinstance(label, str) else None)
            fields = {k: v for k, v in fields.items() if k not in ("name", "server_label")}
        call_id = item.call_id or item.id or f"{item.type}_{len(self._calls)}"
        self._call(ToolCall(call_id, tool, _shown(fields, results)))
        carried = {k: fields[k] for k in results if fields.get(k) is not None}
        if item.type == "image_generation_call" and "result" in carried:
            carried["result"] = "(an image: not shown, this model reads text only)"
        if carried:
            self._result(_shown(carried), call_id, tool)


def conversation(instructions: str | None, items: str | list[InputItem], warned: set[str]) -> Conversation:
    """The conversation a request's instructions and input items make."""
    out = Conversation()
    if instructions:
        out.messages.append(ChatMessage("system", instructions))
    if isinstance(items, str):
        out.messages.append(ChatMessage("user", items))
        return out
    for i, item in enumerate(items):
        out.add(item, f"input.{i}", warned)
    return out
