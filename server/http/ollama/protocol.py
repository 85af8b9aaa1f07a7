"""The Ollama API's wire models: the requests of the /api routes and the answers built for them.

Fields follow Ollama's API reference (docs/api.md in the ollama repository) and the official
`ollama` Python library's types. Every number of a request is bounded (out of range is a 400);
unknown fields, and options that only mean something to Ollama's own loader (num_ctx, num_gpu,
num_thread, ...), are accepted and logged once. Answers leave out what is None, as Ollama does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.http.protocol import Penalty, RepeatPenalty, Seed, Temperature, TopK, TopP

Name = Annotated[str, Field(min_length=1, max_length=256)]
# "json", "" (free text) or a JSON schema
Format = Literal["", "json"] | dict[str, Any]
# seconds (a number, also as text) or a Go duration ("5m", "1h30m", "-1m"); negative: for ever
_DURATION = r"^\s*-?(\d+(\.\d+)?|(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+)\s*$"
KeepAlive = (
    Annotated[float, Field(ge=-(2**31), le=2**31)] | Annotated[str, Field(max_length=32, pattern=_DURATION)]
)
# false / true, or an effort for models that take one (gpt-oss)
Think = bool | Literal["low", "medium", "high"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Options(_Request):
    """The runtime options this server honours; the others are accepted and logged once."""

    num_predict: Annotated[int, Field(ge=-2, le=2**31 - 1)] | None = None  # -1, -2: no limit
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    min_p: TopP | None = None
    repeat_penalty: RepeatPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: list[Annotated[str, Field(max_length=1024)]] | None = Field(default=None, max_length=16)


class FunctionCall(_Part):
    name: Name
    # an object, as Ollama sends it; JSON text is taken too (clients written for OpenAI send it)
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(_Part):
    function: FunctionCall


class Message(_Part):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_name: str | None = Field(None, max_length=256)


class ToolFunction(_Part):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Part):
    type: Literal["function"] = "function"
    function: ToolFunction


class _Generation(_Request):
    model: Name
    format: Format | None = None
    options: Options | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class ChatRequest(_Generation):
    """POST /api/chat."""

    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = Field(None, max_length=128)


class GenerateRequest(_Generation):
    """POST /api/generate: a prompt (with the model's chat template, unless raw)."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class ModelRequest(_Request):
    """POST /api/show, DELETE /api/delete, POST /api/pull: a model by `model` (older clients send
    `name`)."""

    model: Name | None = None
    name: Name | None = None
    stream: bool = True  # /api/pull's progress

    @property
    def model_name(self) -> str | None:
        return self.model or self.name


# ---------------------------------------------------------------------- answers


class Out(BaseModel):
    """An answer or a stream line; None fields are left out, as Ollama leaves them out."""

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class TopLogprobOut(Out):
    token: str
    logprob: float


class LogprobOut(Out):
    token: str
    logprob: float
    top_logprobs: list[TopLogprobOut] | None = None


class FunctionOut(Out):
    name: str
    arguments: dict[str, Any]


class ToolCallOut(Out):
    function: FunctionOut


class MessageOut(Out):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    thinking: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class Durations(Out):
    """What the last line of an answer adds: why it ended and what it took (nanoseconds)."""

    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatLine(Durations):
    model: str
    created_at: str
    message: MessageOut
    done: bool
    logprobs: list[LogprobOut] | None = None


class GenerateLine(Durations):
    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool
    logprobs: list[LogprobOut] | None = None


class Details(Out):
    parent_model: str = ""
    format: str = "gguf"
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class TagModel(Out):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: Details


class Tags(Out):
    models: list[TagModel]


class RunningModel(TagModel):
    expires_at: str
    size_vram: int
    context_length: int


class Running(Out):
    models: list[RunningModel]


class Show(Out):
    modelfile: str
    parameters: str
    template: str
    details: Details
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class Version(Out):
    version: str


class Status(Out):
    """A line of /api/pull's progress (and its last: "success")."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None
