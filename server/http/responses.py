"""POST /v1/responses: OpenAI's Responses API on the chat engine.

The request maps onto the engine's ChatRequest (`prepare_chat` checks and submits it, one engine
path for every API): instructions become a system message, input items messages (calls an
assistant's tool calls, their outputs tool messages, reasoning items its reasoning). The answer's
output items: reasoning, a message with one output_text part, one call item per call. Stateless:
nothing is kept, so previous_response_id is refused.

Tools (`Toolbox`): a `namespace` tool's functions are offered under joined names and their calls
come back as the API returns them, a function_call item with `namespace` and `name` apart (what
Codex CLI and the openai SDK dispatch on); a `custom` tool is a function of one string, `input`,
its call a custom_tool_call item; hosted tools (web_search, mcp, ...) are left out, logged once
per type.

A stream sends the events the openai SDK's `responses.stream` accumulates, each with a
sequence_number: response.created, response.in_progress, per output item output_item.added,
content_part.added, the deltas, their .done events and output_item.done, and last
response.completed (response.incomplete when max_output_tokens cut the answer). A call cut short
has no JSON arguments and is left out; a custom call's input is sent whole as its call closes.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.engine.chat import ChatMessage, ChatRequest, ChatTool, NamedTool, OutputFormat, ToolCall
from server.engine.chat import ToolChoice as ChatToolChoice
from server.engine.token_loop import GenerationStats, SamplingParams
from server.engine.tool_calls import OutPiece, ToolCallArgs, ToolCallStart, json_text, strict_json
from server.errors import InvalidRequest
from server.http.errors import describe
from server.http.protocol import OutModel, absent
from server.http.serving import Pieces, Plan, ServeContext, collect, finish_reason, prepare_chat, streamed
from server.http.sse import named_event, sse_response

logger = logging.getLogger(__name__)

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


_ToolModel = TypeVar("_ToolModel", bound=_Lenient)


# ---------------------------------------------------------------------- request


class InputText(_Lenient):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


class InputMedia(_Lenient):
    """Images, files and audio: accepted by validation so the refusal says it in plain words."""

    type: Literal["input_image", "input_file", "input_audio"]


ContentPart = Annotated[InputText | InputMedia, Field(discriminator="type")]


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    namespace: str | None = None
    arguments: str


class CustomToolCallItem(_Lenient):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    namespace: str | None = None
    input: str


class ToolOutputItem(_Lenient):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    summary: list[InputText] = Field(default_factory=list)
    content: list[InputText] | None = None


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return str(kind)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[ToolOutputItem, Tag("function_call_output")]
    | Annotated[ToolOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


# the chat tools' name rule (OpenAI's for every function name), for namespaces too
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomTool(_Lenient):
    """A freeform tool: its input is text, optionally in a grammar's language."""

    type: Literal["custom"]
    name: ToolName
    description: str | None = None
    format: dict[str, Any] | None = None  # {"type": "text"} or {"type": "grammar", "syntax", "definition"}


class NamespaceTool(_Lenient):
    """Function and custom tools grouped under one name (Codex's MCP servers and sub-agents)."""

    type: Literal["namespace"]
    name: ToolName
    description: str | None = None
    tools: list[Any] = Field(max_length=128)


class NamedFunction(_Lenient):
    """tool_choice forcing one function or custom tool; a namespaced one by its namespace and
    name, or by its name alone when no other offered tool has that name."""

    type: Literal["function", "custom"]
    name: str
    namespace: str | None = None


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Lenient):
    format: TextFormat | None = None


class ReasoningOptions(_Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class ResponsesRequest(BaseModel):
    """The Responses API request fields this server honours (others are accepted and logged)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str = Field(max_length=256)
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    tools: list[Any] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


def _text_of(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for j, part in enumerate(content):
        if isinstance(part, InputMedia):
            raise InvalidRequest(
                f"this model takes text only: the content part at {where}.content.{j} is {part.type!r}",
                param=f"{where}.content.{j}",
                code="unsupported_content",
            )
        parts.append(part.text)
    return "".join(parts)


def flat_name(name: str, namespace: str | None) -> str:
    """The one name the model sees for tool `name` of `namespace`: joined by "__", MCP's
    delimiter, which Codex's MCP namespaces (`mcp__server__`) already end with."""
    if namespace is None:
        return name
    return namespace + name if namespace.endswith("__") else f"{namespace}__{name}"


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


def _warn_once(warned: set[str], key: str, message: str) -> None:
    if key not in warned:
        warned.add(key)
        logger.warning("%s (logged once)", message)


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
            _warn_once(warned, "tools.custom.grammar", "custom tools: a Lark grammar is shown, not enforced")
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
        for i, tool in enumerate(tools or []):
            where = f"tools.{i}"
            kind = _kind(tool, where)
            if kind in ("function", "custom"):
                box._add(tool, kind, None, where, warned)
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
                    box._add(inner, inner_kind, space, inner_where, warned)
            else:
                message = f"ignoring {kind!r} tools: this server runs no hosted tools"
                _warn_once(warned, f"tools.type.{kind}", message)
        return box

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


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The chat messages for the request's instructions and input items."""
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append(ChatMessage("system", body.instructions))
    if isinstance(body.input, str):
        return [*messages, ChatMessage("user", body.input)]
    reasoning = ""
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        if isinstance(item, ReasoningItem):
            reasoning += "".join(part.text for part in (item.content or item.summary))
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            if isinstance(item, FunctionCallItem):
                arguments = item.arguments
            else:  # offered as a function with one string argument: sent back as one
                arguments = json_text({"input": item.input})
            call = ToolCall(item.call_id, flat_name(item.name, item.namespace), arguments)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                # consecutive function_call items: one assistant turn with parallel calls
                messages[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(ChatMessage("assistant", tool_calls=(call,), reasoning=reasoning or None))
                reasoning = ""
        elif isinstance(item, ToolOutputItem):
            messages.append(ChatMessage("tool", _text_of(item.output, where), tool_call_id=item.call_id))
        elif item.role == "assistant":
            messages.append(
                ChatMessage("assistant", _text_of(item.content, where), reasoning=reasoning or None)
            )
            reasoning = ""
        else:
            messages.append(ChatMessage(item.role, _text_of(item.content, where)))
    return messages


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


def to_chat_request(body: ResponsesRequest, tools: Toolbox, max_tokens_cap: int) -> ChatRequest:
    """The chat request the engine runs for `body` with its `tools` (`max_tokens_cap`: the
    server's cap, the limit when max_output_tokens is not given); InvalidRequest for what it
    cannot run."""
    if body.previous_response_id is not None:
        raise InvalidRequest(
            "previous_response_id is not supported: this server keeps no responses (send the whole "
            "conversation as input items)",
            param="previous_response_id",
        )
    messages = _messages(body)
    output_format = _output_format(body.text)
    effort = body.reasoning.effort if body.reasoning is not None else None
    if not any(message.role != "system" for message in messages):
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
    return ChatRequest(
        messages=tuple(messages),
        sampling=sampling,
        tools=tuple(tools.tools),
        tool_choice=_tool_choice(body.tool_choice, tools),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        output_format=output_format,
        template_kwargs={"reasoning_effort": effort} if effort in ("low", "medium", "high") else {},
    )


# ---------------------------------------------------------------------- response


class OutputText(OutModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(OutModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed"]


class ReasoningOut(OutModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


class MessageOut(OutModel):
    id: str
    type: Literal["message"] = "message"
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallOut(OutModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    namespace: str | None = absent()  # a function of a namespace tool: its name there
    name: str
    arguments: str


class CustomToolCallOut(OutModel):
    id: str
    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str
    namespace: str | None = absent()
    name: str
    input: str


ItemOut = ReasoningOut | MessageOut | FunctionCallOut | CustomToolCallOut
OutputItem = Annotated[ItemOut, Field(discriminator="type")]


class InputTokensDetails(OutModel):
    cached_tokens: int


class OutputTokensDetails(OutModel):
    reasoning_tokens: int


class ResponseUsage(OutModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(OutModel):
    reason: Literal["max_output_tokens"]


class ReasoningEcho(OutModel):
    effort: str | None
    summary: None = None


ResponseStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseObject(OutModel):
    """The response object: the whole answer, and what stream events carry of it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: None = None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: ReasoningEcho
    store: bool = False  # stateless: nothing is kept, whatever the request's store says
    temperature: float
    text: dict[str, Any]  # {"format": the request's text.format}
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None
    metadata: dict[str, str]
    user: str | None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _usage(stats: GenerationStats) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=stats.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=stats.cached_tokens),
        output_tokens=stats.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        total_tokens=stats.prompt_tokens + stats.completion_tokens,
    )


def _custom_input(arguments: str) -> str | None:
    """A custom call's input from the JSON arguments of the function it was offered as: its
    `input` string (or the one string a model wrote under another key, else the arguments);
    None while they are not JSON (cut short)."""
    try:
        value = strict_json(arguments)
    except ValueError:
        return None
    if isinstance(value, dict):
        strings = [v for v in value.values() if isinstance(v, str)]
        if isinstance(value.get("input"), str):
            return str(value["input"])
        if len(value) == 1 and len(strings) == 1:
            return strings[0]
    return arguments


@dataclass
class _Item:
    """One output item while it is built: reasoning, message, function_call or custom_tool_call."""

    kind: str
    id: str
    text: str = ""  # reasoning or output text; a call's arguments
    call_id: str = ""
    tool: Offered = Offered("")

    def model(self, status: ItemStatus) -> ItemOut:
        if self.kind == "reasoning":
            return ReasoningOut(id=self.id, content=[ReasoningText(text=self.text)], status=status)
        if self.kind == "message":
            return MessageOut(id=self.id, status=status, content=[OutputText(text=self.text)])
        name, namespace = self.tool.name, self.tool.namespace
        if self.kind == "custom_tool_call":
            text = _custom_input(self.text) if status == "completed" else ""
            return CustomToolCallOut(
                id=self.id, call_id=self.call_id, namespace=namespace, name=name, input=text or ""
            )
        return FunctionCallOut(
            id=self.id,
            status=status,
            call_id=self.call_id,
            namespace=namespace,
            name=name,
            arguments=self.text,
        )

    def complete(self) -> bool:
        """Not a call whose arguments were cut short by max_output_tokens (no JSON in them)."""
        if self.kind == "function_call":
            try:
                strict_json(self.text)
            except ValueError:
                return False
        return self.kind != "custom_tool_call" or _custom_input(self.text) is not None

    def to_json(self, status: ItemStatus) -> dict[str, Any]:
        return self.model(status).to_json()


@dataclass
class _Shape:
    """What the response object echoes of the request."""

    id: str
    created: int
    body: ResponsesRequest

    def response(
        self,
        status: ResponseStatus,
        output: list[ItemOut],
        stats: GenerationStats | None,
    ) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
        choice = b.tool_choice
        echoed = choice.model_dump(exclude_none=True) if isinstance(choice, NamedFunction) else choice
        response = ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            instructions=b.instructions,
            max_output_tokens=b.max_output_tokens,
            model=b.model,
            output=output,
            parallel_tool_calls=b.parallel_tool_calls is not False,
            reasoning=ReasoningEcho(effort=b.reasoning.effort if b.reasoning else None),
            temperature=b.temperature if b.temperature is not None else 1.0,
            text=text,
            tool_choice=echoed or "auto",
            tools=b.tools or [],
            top_p=b.top_p if b.top_p is not None else 1.0,
            usage=_usage(stats) if stats is not None else None,
            metadata=b.metadata or {},
            user=b.user,
        )
        return response.to_json()


@dataclass
class _Builder:
    """Output pieces -> output items, in order; `feed` says what a stream sends for each step."""

    tools: Toolbox
    items: list[_Item] = field(default_factory=list)
    open: _Item | None = None
    calls: dict[int, _Item] = field(default_factory=dict)  # ToolCallStart.index -> its item

    def feed(self, piece: OutPiece) -> Iterator[tuple[str, dict[str, Any]]]:
        if isinstance(piece, ToolCallStart):
            yield from self._close()
            tool = self.tools.origin(piece.name)
            kind = "custom_tool_call" if tool.custom else "function_call"
            item = _Item(kind, _new_id("ctc" if tool.custom else "fc"), call_id=piece.id, tool=tool)
            self.calls[piece.index] = item
            yield from self._open(item)
            return
        if isinstance(piece, ToolCallArgs):
            item = self.calls[piece.index]
            item.text += piece.text
            if item.kind == "custom_tool_call":
                return  # JSON until the call closes: its input is decoded and sent then
            yield (
                "response.function_call_arguments.delta",
                {"item_id": item.id, "output_index": self.items.index(item), "delta": piece.text},
            )
            return
        kind, text = piece
        wanted = "reasoning" if kind == "reasoning" else "message"
        if self.open is None or self.open.kind != wanted:
            yield from self._close()
            yield from self._open(_Item(wanted, _new_id("rs" if wanted == "reasoning" else "msg")))
        assert self.open is not None
        self.open.text += text
        delta = "response.reasoning_text.delta" if wanted == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if wanted == "reasoning" else {"logprobs": []}
        yield delta, {**self._where(self.open), "content_index": 0, "delta": text, **extra}

    def finish(self) -> Iterator[tuple[str, dict[str, Any]]]:
        yield from self._close()

    def output(self) -> list[ItemOut]:
        """The finished items, without calls whose arguments were cut short."""
        return [item.model("completed") for item in self.items if item.complete()]

    def _where(self, item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.items.index(item)}

    def _open(self, item: _Item) -> Iterator[tuple[str, dict[str, Any]]]:
        self.items.append(item)
        self.open = item
        added = item.model("in_progress")
        if isinstance(added, FunctionCallOut | CustomToolCallOut):
            yield "response.output_item.added", {"output_index": len(self.items) - 1, "item": added.to_json()}
            return
        # a message or reasoning item opens empty, then gets its one text part
        part = added.content[0]
        added.content = []
        yield "response.output_item.added", {"output_index": len(self.items) - 1, "item": added.to_json()}
        yield "response.content_part.added", {**self._where(item), "content_index": 0, "part": part.to_json()}

    def _close(self) -> Iterator[tuple[str, dict[str, Any]]]:
        item, self.open = self.open, None
        if item is None:
            return
        where = self._where(item)
        if not item.complete():
            return  # cut short: no .done events for arguments that are not JSON
        if item.kind == "function_call":
            done = {**where, "name": item.tool.name, "arguments": item.text}
            yield "response.function_call_arguments.done", done
        elif item.kind == "custom_tool_call":
            text = _custom_input(item.text) or ""
            yield "response.custom_tool_call_input.delta", {**where, "delta": text}
            yield "response.custom_tool_call_input.done", {**where, "input": text}
        elif item.kind == "message":
            yield (
                "response.output_text.done",
                {**where, "content_index": 0, "text": item.text, "logprobs": []},
            )
            part = OutputText(text=item.text).to_json()
            yield "response.content_part.done", {**where, "content_index": 0, "part": part}
        else:
            yield "response.reasoning_text.done", {**where, "content_index": 0, "text": item.text}
            part = ReasoningText(text=item.text).to_json()
            yield "response.content_part.done", {**where, "content_index": 0, "part": part}
        yield (
            "response.output_item.done",
            {"output_index": where["output_index"], "item": item.to_json("completed")},
        )


def _status(stats: GenerationStats, plan: Plan) -> ResponseStatus:
    return "incomplete" if finish_reason(stats, plan.output.n_calls) == "length" else "completed"


async def create_response(ctx: ServeContext, body: ResponsesRequest, request: Request) -> Response:
    """POST /v1/responses."""
    ctx.warn_unknown(body.model_extra)
    tools = Toolbox.of(body.tools, ctx.warned_fields)
    chat = to_chat_request(body, tools, ctx.settings.max_completion_tokens)
    plan = await prepare_chat(ctx, chat, model_id=body.model)
    shape = _Shape(_new_id("resp"), plan.created, body)
    if body.stream:
        shutdown = anyio.Event()
        return sse_response(_stream(ctx, plan, shape, tools, shutdown), ctx.settings.keepalive_s, shutdown)
    pieces, _, finished = await collect(ctx, plan, request)
    builder = _Builder(tools)
    for piece in pieces:
        for _ in builder.feed(piece):
            pass
    for _ in builder.finish():
        pass
    return JSONResponse(shape.response(_status(finished.stats, plan), builder.output(), finished.stats))


async def _stream(
    ctx: ServeContext, plan: Plan, shape: _Shape, tools: Toolbox, shutdown: anyio.Event
) -> AsyncIterator[ServerSentEvent]:
    sequence = 0

    def sse(kind: str, payload: dict[str, Any]) -> ServerSentEvent:
        nonlocal sequence
        sequence += 1
        return named_event(kind, {"type": kind, "sequence_number": sequence - 1, **payload})

    yield sse("response.created", {"response": shape.response("in_progress", [], None)})
    yield sse("response.in_progress", {"response": shape.response("in_progress", [], None)})
    builder = _Builder(tools)
    try:
        async for item in streamed(ctx, plan, shutdown):
            if isinstance(item, Pieces):
                for piece in item.pieces:
                    for kind, payload in builder.feed(piece):
                        yield sse(kind, payload)
            else:
                for kind, payload in builder.finish():
                    yield sse(kind, payload)
                status = _status(item.stats, plan)
                final = shape.response(status, builder.output(), item.stats)
                yield sse(
                    "response.completed" if status == "completed" else "response.incomplete",
                    {"response": final},
                )
    except Exception as exc:  # noqa: BLE001 - after the 200, an error is an event (the API's own)
        _, body, _ = describe(exc, ctx.engine.queue_full_status)
        error = body["error"]
        assert isinstance(error, dict)
        yield sse(
            "error", {"code": error.get("code"), "message": error.get("message"), "param": error.get("param")}
        )
