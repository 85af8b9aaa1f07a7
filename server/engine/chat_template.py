"""Chat prompts from the GGUF chat template, rendered by llama-cpp-python's Jinja2ChatFormatter.

The formatter renders in jinja2's ImmutableSandboxedEnvironment (a template from a
downloaded file cannot reach Python internals). What is added here: the engine's chat messages
and tools (server/engine/chat.py) turned into the plain dicts chat templates expect (OpenAI's
shapes, which HF templates are written for), template errors turned into 400s, and the
template's reasoning style detected so the output can be split.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import jinja2

from server.engine.chat import ChatMessage, ChatTool
from server.errors import InvalidRequest

if TYPE_CHECKING:
    from llama_cpp import Llama

logger = logging.getLogger(__name__)

ReasoningStyle = Literal["none", "think", "harmony", "gemma"]


def reasoning_style(template: str) -> ReasoningStyle:
    """How the model separates reasoning: harmony channels (gpt-oss), Gemma 4's thought channel,
    <think> tags, or not."""
    if "<|channel|>" in template:
        return "harmony"
    if "<|channel>" in template:
        return "gemma"
    if "<think>" in template:
        return "think"
    return "none"


def user_message(text: str) -> ChatMessage:
    """A user turn of plain text (`moeflash generate --chat`)."""
    return ChatMessage("user", text)


class ChatTemplate:
    """The model's chat template, ready to render chat messages into prompt tokens."""

    def __init__(self, llama: Llama, template: str | None) -> None:
        from llama_cpp.llama_chat_format import CHATML_CHAT_TEMPLATE, Jinja2ChatFormatter

        if not template:
            logger.warning("the model has no chat template in its metadata: using ChatML")
            template = CHATML_CHAT_TEMPLATE
        self.source = template
        self.style: ReasoningStyle = reasoning_style(template)
        self._llama = llama
        model = llama._model
        bos_id, eos_id = model.token_bos(), model.token_eos()
        self._bos = model.token_get_text(bos_id) if bos_id >= 0 else ""
        self._eos = model.token_get_text(eos_id) if eos_id >= 0 else ""
        self._add_bos = bool(model.add_bos_token()) and bos_id >= 0
        self._knows_developer = "developer" in template
        try:
            self._formatter = Jinja2ChatFormatter(template=template, eos_token=self._eos, bos_token=self._bos)
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the model's chat template does not compile: {exc}") from exc

    def _message_dict(self, message: ChatMessage) -> dict[str, Any]:
        role = message.role
        if role == "developer" and not self._knows_developer:
            role = "system"  # templates older than the developer role know it as system
        out: dict[str, Any] = {"role": role, "content": message.content}
        if role == "assistant":
            if message.reasoning:
                # Qwen3 templates read reasoning_content, gpt-oss's reads thinking
                out["reasoning_content"] = message.reasoning
                out["thinking"] = message.reasoning
            if message.tool_calls:
                out["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": _arguments(call.arguments)},
                    }
                    for call in message.tool_calls
                ]
        if role == "tool":
            out["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                out["name"] = message.name
        return out

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ChatTool] = (),
        tool_choice: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text (generation prompt included); InvalidRequest if the template refuses."""
        dicts: list[Any] = [self._message_dict(m) for m in messages]
        tool_dicts: list[Any] | None = [_tool_dict(tool) for tool in tools] if tools else None
        try:
            result = self._formatter(
                messages=dicts, tools=tool_dicts, tool_choice=cast(Any, tool_choice), **(extra or {})
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            # raise_exception() in templates raises ValueError ("roles must alternate", ...)
            raise InvalidRequest(
                f"the chat template refused these messages: {exc}", param="messages"
            ) from exc
        return result.prompt

    def tokenize(self, text: str) -> tuple[int, ...]:
        """Prompt tokens; control tokens in the text are parsed as such (the template wrote them)."""
        add_bos = self._add_bos and not (self._bos and text.startswith(self._bos))
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            # JSON can escape a lone surrogate ("\ud800"): valid JSON, but no text to tokenize
            raise InvalidRequest(
                f"the request's text is not valid Unicode: a lone surrogate {text[exc.start : exc.end]!a}",
                param="messages",
            ) from None
        return tuple(self._llama.tokenize(data, add_bos=add_bos, special=True))


def _arguments(arguments: str) -> Any:
    # HF chat templates expect arguments as a mapping (they tojson it); keep text that is not JSON
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _tool_dict(tool: ChatTool) -> dict[str, Any]:
    # OpenAI's tool shape, unset fields left out (templates tojson it: the order is the prompt's)
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}
