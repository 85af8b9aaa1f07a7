"""Output pieces -> the response's output items and the stream events that build them."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from server.engine.generation import GenerationStats
from server.engine.tool_calls import OutPiece, ToolCallArgs, ToolCallStart, strict_json
from server.http.openai.responses.mapping import Offered, Toolbox
from server.http.openai.responses.protocol import (
    CustomToolCallOut,
    FunctionCallOut,
    IncompleteDetails,
    InputTokensDetails,
    ItemOut,
    ItemStatus,
    MessageOut,
    NamedFunction,
    OutputText,
    OutputTokensDetails,
    ReasoningEcho,
    ReasoningOut,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)


def new_id(prefix: str) -> str:
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
class OutputShape:
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
class OutputBuilder:
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
            item = _Item(kind, new_id("ctc" if tool.custom else "fc"), call_id=piece.id, tool=tool)
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
            yield from self._open(_Item(wanted, new_id("rs" if wanted == "reasoning" else "msg")))
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
