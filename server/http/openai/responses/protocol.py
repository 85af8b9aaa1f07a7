"""The Responses API's request models, and the response object with its output items."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from server.http.protocol import OutModel, absent

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]


class LenientModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------- request


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


class InputText(LenientModel):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


class RefusalPart(LenientModel):
    """An assistant message's refusal: shown to the model as that turn's text."""

    type: Literal["refusal"]
    refusal: str


class InputMedia(LenientModel):
    """Images and audio: accepted by validation so the refusal says it in plain words."""

    type: Literal["input_image", "input_audio"]


class InputFile(LenientModel):
    """A file part: text when its data is a text/* data URL, else refused in plain words."""

    type: Literal["input_file"]
    file_data: str | None = None
    filename: str | None = None


ContentPart = Annotated[InputText | RefusalPart | InputMedia | InputFile, Field(discriminator="type")]


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
    """A call's output; with no call_id (Codex's goal tools), matched by name and namespace."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    output: str | list[ContentPart]


class ReasoningItem(LenientModel):
    type: Literal["reasoning"]
    summary: list[InputText] = Field(default_factory=list)
    content: list[InputText] | None = None
    encrypted_content: str | None = None


class HostedItem(BaseModel):
    """A built-in or hosted tool's call or output (HOSTED_CALLS, HOSTED_OUTPUTS): shown to the
    model as a tool call and its result, its fields as they came."""

    model_config = ConfigDict(extra="allow")
    type: str
    id: str | None = None
    call_id: str | None = None


class ToolsItem(LenientModel):
    """Tools that join the conversation's offer: `additional_tools`, and the tools a
    `tool_search_output` loaded (its text is the result of that search call)."""

    type: Literal["additional_tools", "tool_search_output"]
    call_id: str | None = None
    tools: list[Any] = Field(max_length=128)


class ConfigurationUpdateItem(LenientModel):
    """Reasoning effort and text format from here on: the last update wins over the request's."""

    type: Literal["configuration_update"]
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None


class DroppedItem(LenientModel):
    """An item the model cannot read (DROPPED_ITEMS): left out with one log line per type."""

    type: str


class ItemReference(LenientModel):
    """A reference to a stored item: refused, this server stores none."""

    type: Literal["item_reference"] | None = None
    id: str


# Every input item type of the Responses API, by what becomes of it. A built-in or hosted tool's
# call -> the name the model sees it called under; its fields become the call's arguments, except
# those listed in HOSTED_RESULTS, which are its result.
HOSTED_CALLS: dict[str, str] = {
    "file_search_call": "file_search",
    "computer_call": "computer",
    "web_search_call": "web_search",
    "tool_search_call": "tool_search",
    "image_generation_call": "image_generation",
    "code_interpreter_call": "code_interpreter",
    "local_shell_call": "local_shell",
    "shell_call": "shell",
    "apply_patch_call": "apply_patch",
    "mcp_list_tools": "mcp_list_tools",
    "mcp_approval_request": "mcp_approval_request",
    "mcp_call": "mcp",  # shown under its server's and tool's name: flat_name(name, server_label)
    "program": "program",
}
HOSTED_RESULTS: dict[str, tuple[str, ...]] = {
    "file_search_call": ("results",),
    "image_generation_call": ("result",),
    "code_interpreter_call": ("outputs",),
    "mcp_list_tools": ("tools", "error"),
    "mcp_call": ("output", "error"),
}
# a built-in tool's output -> the field that names the call it answers (a tool result of it)
HOSTED_OUTPUTS: dict[str, str] = {
    "local_shell_call_output": "id",
    "shell_call_output": "call_id",
    "apply_patch_call_output": "call_id",
    "mcp_approval_response": "approval_request_id",
    "program_output": "call_id",
}
# fields no model reads: ids and opaque data, left out of what a hosted item shows
OPAQUE_FIELDS = frozenset({"type", "id", "call_id", "status", "encrypted_content", "fingerprint", "caller"})
# items the model cannot read, and why (logged once per type)
DROPPED_ITEMS: dict[str, str] = {
    "compaction": "its summary is encrypted for OpenAI's models",
    "compaction_trigger": "this server does not compact conversations",
}
# items refused with a 400, and why
REFUSED_ITEMS: dict[str, str] = {
    "item_reference": "this server stores no responses or items: send the item itself in input",
    "computer_call_output": "a computer call's output is a screenshot, and this model takes text only",
}
# the typed items, each its own model
TYPED_ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "custom_tool_call": CustomToolCallItem,
    "function_call_output": ToolOutputItem,
    "custom_tool_call_output": ToolOutputItem,
    "reasoning": ReasoningItem,
    "additional_tools": ToolsItem,
    "tool_search_output": ToolsItem,
    "configuration_update": ConfigurationUpdateItem,
}


class UnknownItem(BaseModel):
    """An item of a type no rule covers: refused, naming the type."""

    type: Any = None

    @model_validator(mode="after")
    def _refuse(self) -> UnknownItem:
        known = ", ".join(sorted(known_item_types()))
        raise ValueError(f"unknown input item type {self.type!r}; this server takes {known}")


def _item_tag(value: Any) -> str:
    """The union member an item validates as: its type's ("unknown" for a type no rule covers)."""
    if isinstance(value, dict):
        kind = value.get("type", "item_reference" if "id" in value and "role" not in value else "message")
    else:
        kind = getattr(value, "type", "message")
    if not isinstance(kind, str):
        return "unknown"
    if kind in TYPED_ITEMS or kind == "item_reference":
        return kind
    if kind in HOSTED_CALLS or kind in HOSTED_OUTPUTS:
        return "hosted"
    if kind in DROPPED_ITEMS or kind in REFUSED_ITEMS:
        return "dropped"
    return "unknown"


def known_item_types() -> frozenset[str]:
    """Every input item type this server has a rule for."""
    return frozenset(
        {*TYPED_ITEMS, *HOSTED_CALLS, *HOSTED_OUTPUTS, *DROPPED_ITEMS, *REFUSED_ITEMS, "item_reference"}
    )


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[ToolOutputItem, Tag("function_call_output")]
    | Annotated[ToolOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[ToolsItem, Tag("additional_tools")]
    | Annotated[ToolsItem, Tag("tool_search_output")]
    | Annotated[ConfigurationUpdateItem, Tag("configuration_update")]
    | Annotated[ItemReference, Tag("item_reference")]
    | Annotated[HostedItem, Tag("hosted")]
    | Annotated[DroppedItem, Tag("dropped")]
    | Annotated[UnknownItem, Tag("unknown")],
    Discriminator(_item_tag),
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
