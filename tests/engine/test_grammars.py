"""Which grammar constrains a chat request's output (server/engine/grammars.py), and its refusals."""

from __future__ import annotations

import json

import pytest
from llama_cpp import Llama

from server.engine.chat import ChatMessage, ChatRequest, ChatTool, NamedTool, OutputFormat, ToolChoice
from server.engine.generation import SamplingParams
from server.engine.grammars import GrammarLimits, output_constraint, schema_grammar, tool_grammar
from server.errors import InvalidRequest

WEATHER = ChatTool("get_weather", "weather", {"type": "object", "properties": {"unit": {"type": "string"}}})
TIME = ChatTool("get_time")
CAP = GrammarLimits(max_schema_bytes=64 * 1024, max_compile_ms=2000)


def _chat(
    tools: tuple[ChatTool, ...] = (WEATHER, TIME),
    choice: ToolChoice | None = None,
    fmt: OutputFormat | None = None,
) -> ChatRequest:
    return ChatRequest(
        (ChatMessage("user", "hi"),), SamplingParams(max_tokens=8), tools, choice, output_format=fmt
    )


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_the_model_chooses_without_a_grammar(choice: ToolChoice | None) -> None:
    assert tool_grammar([WEATHER], choice, True, CAP, []) == (None, None)


def test_a_named_tool_forces_its_arguments() -> None:
    grammar, name = tool_grammar([WEATHER, TIME], NamedTool("get_time"), True, CAP, [])
    assert name == "get_time" and grammar is not None and "root ::=" in grammar


def test_a_named_tool_that_is_not_in_tools_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="'nope', which is not in tools") as refused:
        tool_grammar([WEATHER], NamedTool("nope"), True, CAP, [])
    assert refused.value.param == "tool_choice"


def test_schemas_over_the_cap_are_refused() -> None:
    tiny = GrammarLimits(max_schema_bytes=10, max_compile_ms=2000)
    with pytest.raises(InvalidRequest, match="over the 10-byte cap") as big:
        schema_grammar({"type": "object"}, tiny, "response_format", [])
    assert big.value.param == "response_format"


def test_a_ref_that_does_not_resolve_means_any_value() -> None:
    notes: list[str] = []
    grammar = schema_grammar({"$ref": "#/nowhere"}, CAP, "tools", notes)
    assert "root ::= alternative-0 | array | string | number | boolean | null" in grammar
    assert notes == ["tools: $ref '#/nowhere' does not resolve here: any value"]


@pytest.mark.parametrize(
    ("chat", "mode", "param", "whole"),
    [
        pytest.param(_chat(choice=NamedTool("get_weather")), "named", "tools", True, id="named"),
        pytest.param(_chat(choice="required"), "required", "tools", True, id="required"),
        pytest.param(
            _chat(fmt=OutputFormat("json_schema", {"type": "object"})),
            "text",
            "response_format",
            True,
            id="schema",
        ),
        pytest.param(
            _chat(fmt=OutputFormat("json_schema")), "text", "response_format", True, id="any-object"
        ),
        pytest.param(
            _chat(choice="none", fmt=OutputFormat("json_object")), "text", "response_format", True, id="json"
        ),
        pytest.param(
            _chat(choice="required", fmt=OutputFormat("json_object")),
            "required",
            "tools",
            True,
            id="calls-first",
        ),
        # auto on a template without <tool_call>: free text, calls parsed from it
        pytest.param(_chat(choice="auto"), "text", "response_format", False, id="auto"),
        pytest.param(_chat(fmt=OutputFormat("text")), "text", "response_format", False, id="text"),
    ],
)
def test_output_constraint(chat: ChatRequest, mode: str, param: str, whole: bool, vocab_llama: Llama) -> None:
    # no template here has <tool_call>, so no lazy grammar; the model compiles the grammar
    constraint = output_constraint(chat, vocab_llama, "{{ messages }}", False, CAP)
    assert constraint.mode == mode and constraint.param == param
    assert constraint.whole_output is whole and constraint.lazy is None
    assert (constraint.grammar is not None) is whole
    assert constraint.forced_name == ("get_weather" if mode == "named" else None)


def test_names_and_constants_that_json_escapes_come_out_as_valid_json(vocab_llama: Llama) -> None:
    # json.dumps writes a newline, quote, backslash or control byte escaped; the grammar must
    # spell those escapes, not the raw characters (a raw newline made a strict parser refuse it)
    from llama_cpp import LlamaGrammar

    name, value = 'a\n"\\\x01', 'b"\n\\'
    schema = {
        "type": "object",
        "properties": {name: {"const": value}},
        "required": [name],
        "additionalProperties": False,
    }
    grammar = LlamaGrammar.from_string(schema_grammar(schema, CAP, "response_format", []), verbose=False)
    vocab_llama.reset()
    out = vocab_llama.create_completion("x", grammar=grammar, max_tokens=48, temperature=0.0)
    text = out["choices"][0]["text"]  # type: ignore[index]
    assert json.loads(text, strict=True) == {name: value}, text
