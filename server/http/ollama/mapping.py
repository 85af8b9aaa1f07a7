"""An Ollama request -> the engine's ChatRequest (`chat_request`, `generate_request`).

The mapping:
  messages (system, user, assistant, tool) -> chat messages; an assistant's tool_calls get ids
                                     (call_<turn>_<n>) that the tool messages after it take, by
                                     tool_name, else in order
  tools                             -> function tools
  format "json" / a JSON schema     -> the json_object / json_schema output format
  think true / false / an effort    -> the template's enable_thinking / reasoning_effort
  options                           -> sampling: num_predict (-1, -2: the server's cap),
                                     temperature, top_k, top_p, min_p, repeat_penalty,
                                     presence_penalty, frequency_penalty, seed (-1: random), stop
  /api/generate's system and prompt -> a system and a user message (raw: the prompt as it is)
Absent options take Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9, repeat_penalty
1.1 over the last 64 tokens, as Ollama's DefaultOptions), so an Ollama client samples as it
would from Ollama. Images, a Go `template`, `suffix` and `context` are refused in plain words.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.engine.chat import ChatMessage, ChatRequest, ChatTool, OutputFormat, ToolCall
from server.engine.generation import SamplingParams
from server.engine.tool_calls import json_text
from server.errors import InvalidRequest
from server.http.ollama.protocol import ChatRequest as OllamaChat
from server.http.ollama.protocol import Format, GenerateRequest, Message, Options, Think, Tool


@dataclass(frozen=True)
class Defaults:
    """Ollama's sampling defaults (api/types.go DefaultOptions)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    repeat_penalty: float = 1.1


OLLAMA_DEFAULTS = Defaults()


def _pick(value: float | None, default: float) -> float:
    return default if value is None else value


def sampling(
    options: Options | None, cap: int, logprobs: bool | None, top_logprobs: int | None
) -> SamplingParams:
    """The engine's sampling parameters; `cap` is the server's max_tokens cap (num_predict -1 or -2,
    or none, asks for as much as the server allows, clamped to the context left later)."""
    o = options or Options()
    d = OLLAMA_DEFAULTS
    if o.num_predict == 0:
        raise InvalidRequest(
            "options.num_predict must be positive, or -1 / -2 for no limit", param="num_predict"
        )
    max_tokens = cap if o.num_predict is None or o.num_predict < 0 else min(o.num_predict, cap)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_pick(o.temperature, d.temperature),
        top_p=_pick(o.top_p, d.top_p),
        top_k=int(_pick(o.top_k, d.top_k)),
        min_p=_pick(o.min_p, d.min_p),
        repeat_penalty=_pick(o.repeat_penalty, d.repeat_penalty),
        presence_penalty=o.presence_penalty or 0.0,
        frequency_penalty=o.frequency_penalty or 0.0,
        seed=None if o.seed is None or o.seed < 0 else o.seed,
        stop=tuple(s for s in o.stop or () if s),
        logprobs=bool(logprobs) or bool(top_logprobs),
        top_logprobs=top_logprobs or 0,
    )


def output_format(fmt: Format | None) -> OutputFormat | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return OutputFormat("json_object")
    assert isinstance(fmt, dict)
    return OutputFormat("json_schema", fmt)


def template_kwargs(think: Think | None) -> dict[str, object]:
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}  # Qwen3's and others' templates read it
    return {"reasoning_effort": think}  # gpt-oss templates read it


def _text_only(param: str) -> InvalidRequest:
    return InvalidRequest(
        f"this model takes text only: {param} holds images; send text",
        param=param,
        code="unsupported_content",
    )


def _arguments(arguments: dict[str, object] | str, param: str) -> str:
    if isinstance(arguments, str):
        return arguments
    try:
        return json_text(arguments)
    except ValueError as exc:
        raise InvalidRequest(f"{param} has no JSON form: {exc}", param=param) from None


def _messages(messages: list[Message]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    pending: list[ToolCall] = []  # the last assistant turn's calls that no tool message answered yet
    for i, m in enumerate(messages):
        if m.images:
            raise _text_only(f"messages.{i}.images")
        if m.role == "assistant":
            pending = [
                ToolCall(f"call_{i}_{j}", c.function.name, _arguments(c.function.arguments, f"messages.{i}"))
                for j, c in enumerate(m.tool_calls or ())
            ]
            out.append(ChatMessage("assistant", m.content, tool_calls=tuple(pending), reasoning=m.thinking))
        elif m.role == "tool":
            answered = next((c for c in pending if c.name == m.tool_name), pending[0] if pending else None)
            if answered is not None:
                pending.remove(answered)
            call_id = answered.id if answered is not None else f"call_{i}"
            out.append(ChatMessage("tool", m.content, tool_call_id=call_id))
        else:
            out.append(ChatMessage(m.role, m.content))
    return out


def _tools(tools: list[Tool] | None) -> tuple[ChatTool, ...]:
    return tuple(
        ChatTool(t.function.name, t.function.description, t.function.parameters) for t in tools or ()
    )


def chat_request(body: OllamaChat, cap: int) -> ChatRequest:
    """The chat request /api/chat's `body` means; `cap` the server's max_tokens cap."""
    return ChatRequest(
        messages=tuple(_messages(body.messages)),
        sampling=sampling(body.options, cap, body.logprobs, body.top_logprobs),
        tools=_tools(body.tools),
        output_format=output_format(body.format),
        template_kwargs=template_kwargs(body.think),
    )


def check_generate(body: GenerateRequest) -> None:
    """What /api/generate cannot do, refused in plain words."""
    if body.images:
        raise _text_only("images")
    if body.suffix:
        raise InvalidRequest("suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.template:
        raise InvalidRequest(
            "a Go template cannot be rendered here: the model's own chat template is used, or none "
            "with raw: true",
            param="template",
        )
    if body.context:
        raise InvalidRequest(
            "context (the deprecated token history) is not supported: send the conversation to /api/chat",
            param="context",
        )


def generate_request(body: GenerateRequest, cap: int) -> ChatRequest:
    """The chat request a templated (not raw) /api/generate means: its system and its prompt."""
    messages = [ChatMessage("system", body.system)] if body.system else []
    messages.append(ChatMessage("user", body.prompt))
    return ChatRequest(
        messages=tuple(messages),
        sampling=sampling(body.options, cap, body.logprobs, body.top_logprobs),
        output_format=output_format(body.format),
        template_kwargs=template_kwargs(body.think),
    )
