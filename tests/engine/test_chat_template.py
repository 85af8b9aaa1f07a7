"""Chat templates: the reasoning style and call syntax of each family, and Gemma 4's real template
against the synthetic one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from server.engine.chat_template import reasoning_style
from server.engine.gemma_calls import parse_call
from server.engine.tool_calls import GEMMA4_CALLS, HERMES_CALLS, call_syntax
from server.modelgen import templates


def test_reasoning_style_and_call_syntax_of_each_template_family() -> None:
    assert reasoning_style(templates.CHATML) == "think"
    assert reasoning_style(templates.HARMONY) == "harmony"
    assert reasoning_style(templates.GEMMA4) == "gemma"
    assert reasoning_style(templates.MISTRAL) == "none"
    assert call_syntax(reasoning_style(templates.GEMMA4)) is GEMMA4_CALLS
    assert call_syntax(reasoning_style(templates.CHATML)) is HERMES_CALLS


REAL_GEMMA4_TEMPLATE = (
    Path(__file__).resolve().parents[2]
    / "vendor/llama.cpp/llama-cpp-python/vendor/llama.cpp/models/templates/google-gemma-4-31B-it.jinja"
)


def test_real_gemma4_template_renders_like_ours_and_its_calls_parse() -> None:
    """Gemma 4's own template (in the pinned llama.cpp sources the build extracts) renders a
    conversation as the synthetic one does, and a call in its notation reads back."""
    if not REAL_GEMMA4_TEMPLATE.exists():
        pytest.skip("the pinned llama.cpp sources are not extracted (make setup)")
    real_source = REAL_GEMMA4_TEMPLATE.read_text()
    real, ours = (
        Jinja2ChatFormatter(template=t, eos_token="<eos>", bos_token="<bos>")
        for t in (real_source, templates.GEMMA4)
    )
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    assert real(messages=chat).prompt == ours(messages=chat).prompt  # type: ignore[arg-type]
    assert reasoning_style(real_source) == "gemma"
    arguments = {"city": "Paris, FR", "days": [1, 2], "metric": True, "opts": {"unit": "c", "n": 2.5}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    history = [*chat, {"role": "assistant", "content": None, "tool_calls": [call]}]
    prompt = real(messages=history).prompt  # type: ignore[arg-type]
    body = prompt.split(GEMMA4_CALLS.open)[1].split(GEMMA4_CALLS.close)[0]
    assert body.startswith('call:get_weather{city:<|"|>')
    assert parse_call(body) == ("get_weather", arguments)
