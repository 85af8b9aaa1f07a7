"""The engine's chat vocabulary: one chat request, whichever API it came in through.

Chat completions, Responses and Messages each map their own request onto these types (in
server/http); the engine renders, constrains and parses from them alone, so it never sees an
HTTP request model. Content is plain text by the time it gets here: each API joins its text
parts and refuses media itself, naming its own fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from server.engine.generation import SamplingParams

Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant made earlier in the conversation; `arguments` as the client sent them
    (JSON text, passed to templates as a mapping when it parses)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str = ""
    # assistant turns: the calls it made and its earlier reasoning (templates that use it)
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    # tool turns: the call this is the result of, and its tool's name where known
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ChatTool:
    """A function the model may call; `parameters` is a JSON schema (None: any object)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@dataclass(frozen=True)
class NamedTool:
    """tool_choice that forces one tool, by name."""

    name: str


# None (not given) behaves as "auto" but reaches the template as None
ToolChoice = Literal["none", "auto", "required"] | NamedTool


@dataclass(frozen=True)
class OutputFormat:
    """What the answer's text must be: free text, any JSON object, or JSON following `schema`
    (json_schema without a schema: any object)."""

    type: Literal["text", "json_object", "json_schema"]
    schema: dict[str, Any] | None = None


@dataclass(frozen=True)
class ChatRequest:
    """One chat generation.

    `sampling.max_tokens` is what the client allows (its value, else the server's cap): the
    serving path clamps it to the context left. `sampling.grammar` is left None: the grammar
    comes from `tools`, `tool_choice` and `output_format`. `template_kwargs` are extra variables
    for the chat template (chat_template_kwargs, reasoning_effort).
    """

    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    tools: tuple[ChatTool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    output_format: OutputFormat | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
