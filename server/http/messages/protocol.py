"""The Messages API's wire models: the requests, the whole answer and the stream events.

Every number of a request is bounded (out of range is a 400); unknown fields are accepted and
logged once (route.py warns). output.py and route.py build the answer and its events.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from server.http.protocol import MaxTokens, OutModel, Temperature, TopK, TopP

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class _Block(BaseModel):
    # cache_control, citations and other annotations of a block are ignored
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------- request


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class MediaBlock(_Block):
    """An image: accepted by validation so that the request is refused in plain words (the
    models served take text only), not with the validator's internals."""

    type: Literal["image"]


class DocumentBlock(_Block):
    """A document: text when its source is plain text or text blocks, else (a PDF, a URL, a
    stored file) refused in plain words."""

    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None


class SearchResultBlock(_Block):
    type: Literal["search_result"]
    source: str
    title: str
    content: list[TextBlock]


class ToolReferenceBlock(_Block):
    """A tool a tool search found (inside a tool_result): shown as its name."""

    type: Literal["tool_reference"]
    tool_name: str


ResultPart = Annotated[
    TextBlock | MediaBlock | DocumentBlock | SearchResultBlock | ToolReferenceBlock,
    Field(discriminator="type"),
]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]


class ServerToolUseBlock(_Block):
    """A call of one of Anthropic's server tools (web_search, code_execution, ...), or of an MCP
    server's tool (mcp_tool_use: `server_name`): shown as a tool call."""

    type: Literal["server_tool_use", "mcp_tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    server_name: str | None = None
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[ResultPart] | None = None
    is_error: bool | None = None


class ServerToolResultBlock(BaseModel):
    """A server or MCP tool's result (SERVER_TOOL_RESULTS): shown as that call's tool result, its
    content as it came (encrypted parts left out)."""

    model_config = ConfigDict(extra="ignore")
    type: str
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: Any = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class CompactionBlock(_Block):
    """A summary of the conversation before it (Anthropic's context compaction): shown as text;
    one whose summary is null (a failed compaction) is dropped."""

    type: Literal["compaction"]
    content: str | None = None


class DroppedBlock(_Block):
    """A block the model cannot read (DROPPED_BLOCKS): left out, logged once per type."""

    type: str


# Anthropic's server and MCP tools' result blocks (the Messages API and its beta)
SERVER_TOOL_RESULTS = frozenset(
    {
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
        "advisor_tool_result",
        "mcp_tool_result",
    }
)
# blocks only an assistant turn holds: its calls and its reasoning
ASSISTANT_BLOCKS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use", "thinking"})
# blocks the model cannot read, and why (logged once per type)
DROPPED_BLOCKS: dict[str, str] = {
    "redacted_thinking": "it is encrypted for Anthropic's models",
    "container_upload": "this server runs no code container to upload files to",
    "tool_addition": "every tool of the request is offered",
    "tool_removal": "every tool of the request is offered",
    "mcp_tool_listing": "this server connects to no MCP server",
    "fallback": "it records a switch between Anthropic's models",
}
# the typed blocks, each its own model
TYPED_BLOCKS: dict[str, type[BaseModel]] = {
    "text": TextBlock,
    "image": MediaBlock,
    "document": DocumentBlock,
    "search_result": SearchResultBlock,
    "tool_use": ToolUseBlock,
    "server_tool_use": ServerToolUseBlock,
    "mcp_tool_use": ServerToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "compaction": CompactionBlock,
}


def known_block_types() -> frozenset[str]:
    """Every content block type this server has a rule for."""
    return frozenset({*TYPED_BLOCKS, *SERVER_TOOL_RESULTS, *DROPPED_BLOCKS})


class UnknownBlock(BaseModel):
    """A block of a type no rule covers: refused, naming the type."""

    type: Any = None

    @model_validator(mode="after")
    def _refuse(self) -> UnknownBlock:
        known = ", ".join(sorted(known_block_types()))
        raise ValueError(f"unknown content block type {self.type!r}; this server takes {known}")


def _block_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return "unknown"
    if kind in TYPED_BLOCKS:
        return kind
    if kind in SERVER_TOOL_RESULTS:
        return "server_tool_result"
    return "dropped" if kind in DROPPED_BLOCKS else "unknown"


InputBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[MediaBlock, Tag("image")]
    | Annotated[DocumentBlock, Tag("document")]
    | Annotated[SearchResultBlock, Tag("search_result")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ServerToolUseBlock, Tag("server_tool_use")]
    | Annotated[ServerToolUseBlock, Tag("mcp_tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[CompactionBlock, Tag("compaction")]
    | Annotated[ServerToolResultBlock, Tag("server_tool_result")]
    | Annotated[DroppedBlock, Tag("dropped")]
    | Annotated[UnknownBlock, Tag("unknown")],
    Discriminator(_block_tag),
]


class InputMessage(_Block):
    # "system": a mid-conversation system message (after a user turn), which Claude Code sends
    role: Literal["user", "assistant", "system"]
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
