"""The Responses API's request models, and the response object with its output items."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from server.http.protocol import OutModel, absent

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]


class LenientModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------- request


class InputText(LenientModel):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


class InputMedia(LenientModel):
    """Images, files and audio: accepted by validation so the refusal says it in plain words."""

    type: Literal["input_image", "input_file", "input_audio"]


ContentPart = Annotated[InputText | InputMedia, Field(discriminator="type")]


class MessageItem(LenientModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(LenientModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    namespace: str | None = None
    arguments: str


class CustomToolCallItem(LenientModel):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    namespace: str | None = None
    input: str


class ToolOutputItem(LenientModel):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(LenientModel):
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


class FunctionTool(LenientModel):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomTool(LenientModel):
    """A freeform tool: its input is text, optionally in a grammar's language."""

    type: Literal["custom"]
    name: ToolName
    description: str | None = None
    format: dict[str, Any] | None = None  # {"type": "text"} or {"type": "grammar", "syntax", "definition"}


class NamespaceTool(LenientModel):
    """Function and custom tools grouped under one name (Codex's MCP servers and sub-agents)."""

    type: Literal["namespace"]
    name: ToolName
    description: str | None = None
    tools: list[Any] = Field(max_length=128)


class NamedFunction(LenientModel):
    """tool_choice forcing one function or custom tool; a namespaced one by its namespace and
    name, or by its name alone when no other offered tool has that name."""

    type: Literal["function", "custom"]
    name: str
    namespace: str | None = None


class TextFormat(LenientModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(LenientModel):
    format: TextFormat | None = None


class ReasoningOptions(LenientModel):
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
