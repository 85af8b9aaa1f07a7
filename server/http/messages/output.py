"""Chat output -> Anthropic content blocks, stop reason, usage and stream events.

The chat pieces become content blocks in order of arrival (thinking, text, tool_use);
consecutive pieces of one kind share a block, another kind closes it. Whole and streamed
answers are built by the same `ContentBlocks`, so they agree; a whole answer leaves out a tool call
whose input is not a complete JSON object (cut by max_tokens), a stream cannot take back what
it sent (stop_reason "max_tokens" says so). Usage follows Anthropic's accounting: input_tokens
are the prompt tokens not read from the KV cache, cache_read_input_tokens those that were;
message_start (sent before the prefill) counts the whole prompt as input, message_delta carries
the final totals (the SDKs overwrite with them).
"""

from __future__ import annotations

from typing import Any, Literal

from server.engine.generation import GenerationStats
from server.engine.tool_calls import OutPiece, ToolCallArgs, ToolCallStart, strict_json
from server.http.messages.protocol import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDeltaOut,
    MessageUsage,
    SignatureDeltaOut,
    StopReason,
    TextDeltaOut,
    TextOut,
    ThinkingDeltaOut,
    ThinkingOut,
    ToolUseOut,
)
from server.http.protocol import OutModel

Event = tuple[str, dict[str, Any]]


def as_event(payload: OutModel) -> Event:
    """(event name, payload) of a stream event: the name is the payload's type."""
    data = payload.to_json()
    return str(data["type"]), data


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
                    as_event(ContentBlockDelta(index=at, delta=InputJsonDeltaOut(partial_json=piece.text)))
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
        events.append(as_event(ContentBlockDelta(index=len(self.blocks) - 1, delta=delta)))
        return events

    def _start(self, block: TextOut | ThinkingOut | ToolUseOut) -> list[Event]:
        events = self._close()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        return [*events, as_event(ContentBlockStart(index=self._open, content_block=block))]

    def _close(self) -> list[Event]:
        at = self._open
        if at is None:
            return []
        self._open = None
        events: list[Event] = []
        if isinstance(self.blocks[at], ThinkingOut):
            # Anthropic's streams end a thinking block with its signature; ours is empty
            events.append(as_event(ContentBlockDelta(index=at, delta=SignatureDeltaOut(signature=""))))
        events.append(as_event(ContentBlockStop(index=at)))
        return events


def stop_reason_of(stats: GenerationStats, calls: int) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence)."""
    if stats.finish_reason == "length":
        return "max_tokens", None
    if stats.stop_string is not None:
        return "stop_sequence", stats.stop_string
    return ("tool_use" if calls else "end_turn"), None


def usage_of(stats: GenerationStats) -> MessageUsage:
    return MessageUsage(
        input_tokens=stats.prompt_tokens - stats.cached_tokens,
        output_tokens=stats.completion_tokens,
        cache_read_input_tokens=stats.cached_tokens,
        cache_creation_input_tokens=0,
    )
