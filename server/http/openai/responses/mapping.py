"""A Responses request -> the engine's ChatRequest: input items as messages, tools (namespaces,
custom tools) as function tools under flat names."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import ValidationError

from server.engine.chat import ChatRequest, ChatTool, NamedTool, OutputFormat
from server.engine.chat import ToolChoice as ChatToolChoice
from server.engine.generation import SamplingParams
from server.errors import InvalidRequest
from server.http.openai.responses.items import conversation, flat_name, warn_once
from server.http.openai.responses.protocol import (
    CustomTool,
    FunctionTool,
    LenientModel,
    NamedFunction,
    NamespaceTool,
    ResponsesRequest,
    TextOptions,
)

logger = logging.getLogger(__name__)

_ToolModel = TypeVar("_ToolModel", bound=LenientModel)


@dataclass(frozen=True)
class Offered:
    """Where a tool offered to the model under a flat name came from."""

    name: str
    namespace: str | None = None
    custom: bool = False


def _validated(model: type[_ToolModel], value: dict[str, Any], where: str) -> _ToolModel:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        path = ".".join(str(p) for p in (where, *first.get("loc", ())))
        raise InvalidRequest(f"{path}: {first.get('msg')}", param=path) from None


def _kind(tool: Any, where: str) -> str:
    if not isinstance(tool, dict):
        raise InvalidRequest(f'{where} is not an object: a tool is an object with a "type"', param=where)
    kind = tool.get("type")
    if not isinstance(kind, str):
        raise InvalidRequest(f'{where} has no "type" (function, custom, namespace, ...)', param=where)
    return kind


def _custom_parameters(tool: CustomTool, warned: set[str]) -> dict[str, Any]:
    """A custom tool's input as a function's one string argument. A regex format constrains it
    (a JSON Schema pattern, which degrades like any schema); a Lark grammar, which llama.cpp
    cannot compile, is shown to the model and not enforced."""
    string: dict[str, Any] = {"type": "string", "description": "the tool's input, as free text"}
    fmt = tool.format or {}
    grammar = fmt.get("definition")
    if fmt.get("type") == "grammar" and isinstance(grammar, str):
        if fmt.get("syntax") == "regex":
            anchored = grammar.startswith("^") and grammar.endswith("$")
            string = {"type": "string", "pattern": grammar if anchored else f"^({grammar})$"}
        else:
            string["description"] = f"the tool's input, in the language of this grammar:\n{grammar}"
            warn_once(warned, "tools.custom.grammar", "custom tools: a Lark grammar is shown, not enforced")
    return {
        "type": "object",
        "properties": {"input": string},
        "required": ["input"],
        "additionalProperties": False,
    }


@dataclass
class Toolbox:
    """The request's tools as the engine's function tools, and where each flat name came from."""

    tools: list[ChatTool] = field(default_factory=list)
    offered: dict[str, Offered] = field(default_factory=dict)

    @classmethod
    def of(cls, tools: list[Any] | None, warned: set[str]) -> Toolbox:
        """The tools of a request; InvalidRequest for a malformed entry. Hosted tools are left
        out, logged once per type through `warned` (the app's set, never a module's)."""
        box = cls()
        box.add_all(tools or [], "tools", warned)
        return box

    def add_all(self, tools: list[Any], at: str, warned: set[str], *, again: bool = False) -> None:
        """Offer `tools` (the list at `at`); with `again`, a name already offered keeps its first
        definition (tools an input item loads that the request offers too)."""
        for i, tool in enumerate(tools):
            where = f"{at}.{i}"
            kind = _kind(tool, where)
            if again and kind in ("function", "custom") and tool.get("name") in self.offered:
                continue
            if kind in ("function", "custom"):
                self._add(tool, kind, None, where, warned)
            elif kind == "namespace":
                space = _validated(NamespaceTool, tool, where)
                for j, inner in enumerate(space.tools):
                    inner_where = f"{where}.tools.{j}"
                    inner_kind = _kind(inner, inner_where)
                    if inner_kind not in ("function", "custom"):
                        raise InvalidRequest(
                            f"{inner_where} is a {inner_kind!r} tool: a namespace holds function and "
                            "custom tools",
                            param=inner_where,
                        )
                    if again and flat_name(str(inner.get("name")), space.name) in self.offered:
                        continue
                    self._add(inner, inner_kind, space, inner_where, warned)
            else:
                message = f"ignoring {kind!r} tools: this server runs no hosted tools"
                warn_once(warned, f"tools.type.{kind}", message)

    def _add(
        self, tool: dict[str, Any], kind: str, space: NamespaceTool | None, where: str, warned: set[str]
    ) -> None:
        namespace = space.name if space is not None else None
        if kind == "function":
            function = _validated(FunctionTool, tool, where)
            name, description = function.name, function.description
            parameters = function.parameters or {"type": "object"}
        else:
            custom = _validated(CustomTool, tool, where)
            name, description = custom.name, custom.description
            parameters = _custom_parameters(custom, warned)
        flat = flat_name(name, namespace)
        if flat in self.offered:
            raise InvalidRequest(f"{where}: the tool name {flat!r} is taken twice", param=where)
        if space is not None and space.description:
            description = f"{space.description}\n{description}" if description else space.description
        self.offered[flat] = Offered(name, namespace, custom=kind == "custom")
        self.tools.append(ChatTool(flat, description, parameters))

    def origin(self, flat: str) -> Offered:
        """Where the tool a call names came from (a name the model made up: a plain function)."""
        return self.offered.get(flat) or Offered(flat)

    def choice(self, choice: NamedFunction) -> str:
        """The flat name a forcing tool_choice means."""
        if choice.namespace is not None or choice.name in self.offered:
            return flat_name(choice.name, choice.namespace)
        matches = [flat for flat, tool in self.offered.items() if tool.name == choice.name]
        return matches[0] if len(matches) == 1 else choice.name


def _tool_choice(
    choice: Literal["none", "auto", "required"] | NamedFunction | None, tools: Toolbox
) -> ChatToolChoice | None:
    return NamedTool(tools.choice(choice)) if isinstance(choice, NamedFunction) else choice


def _output_format(text: TextOptions | None) -> OutputFormat | None:
    fmt = text.format if text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise InvalidRequest("text.format json_schema needs a schema", param="text.format.schema")
        return OutputFormat("json_schema", fmt.schema_)
    if fmt is not None and fmt.type == "json_object":
        return OutputFormat("json_object")
    return None


def to_chat_request(
    body: ResponsesRequest, warned: set[str], max_tokens_cap: int
) -> tuple[ChatRequest, Toolbox]:
    """The chat request the engine runs for `body`, and the tools it offers (the request's and
    those its items add); `warned`: the app's set of things logged once; `max_tokens_cap`: the
    server's cap, the limit when max_output_tokens is not given. InvalidRequest for what it
    cannot run."""
    if body.previous_response_id is not None:
        raise InvalidRequest(
            "previous_response_id is not supported: this server keeps no responses (send the whole "
            "conversation as input items)",
            param="previous_response_id",
        )
    talk = conversation(body.instructions, body.input, warned)
    tools = Toolbox.of(body.tools, warned)
    for at, loaded in talk.tools:
        tools.add_all(loaded, at, warned, again=True)
    output_format = _output_format(talk.text or body.text)
    reasoning = talk.reasoning or body.reasoning
    effort = reasoning.effort if reasoning is not None else None
    if not any(message.role != "system" for message in talk.messages):
        raise InvalidRequest(
            "input holds no message to answer (only instructions or reasoning)", param="input"
        )
    sampling = SamplingParams(
        max_tokens=body.max_output_tokens or max_tokens_cap,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        logprobs=bool(body.top_logprobs),
        top_logprobs=body.top_logprobs or 0,
    )
    chat = ChatRequest(
        messages=tuple(talk.messages),
        sampling=sampling,
        tools=tuple(tools.tools),
        tool_choice=_tool_choice(body.tool_choice, tools),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        output_format=output_format,
        template_kwargs={"reasoning_effort": effort} if effort in ("low", "medium", "high") else {},
    )
    return chat, tools
