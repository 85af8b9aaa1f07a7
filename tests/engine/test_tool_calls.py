"""Tool calls parsed out of model output (server/engine/tool_calls.py): native notations of each
family, grammar-forced calls as they stream, and arguments that only ever reach a client as
strict JSON."""

from __future__ import annotations

import json

import pytest

from server.engine.gemma_calls import parse_call
from server.engine.reasoning import GemmaSplitter, HarmonySplitter, PlainSplitter
from server.engine.tool_calls import GEMMA4_CALLS, ChatOutput, ToolCallArgs, ToolCallStart
from tests.engine.pieces import joined


def test_harmony_tool_call_goes_to_its_arguments() -> None:
    text = (
        "<|channel|>analysis<|message|>need weather<|end|><|start|>assistant to=functions.get_weather"
        '<|channel|>commentary <|constrain|>json<|message|>{"unit": "c"}'
    )
    output = ChatOutput(HarmonySplitter())
    pieces = [p for i in range(0, len(text), 4) for p in output.feed(text[i : i + 4])] + output.finish()
    starts = [p for p in pieces if isinstance(p, ToolCallStart)]
    args = "".join(p.text for p in pieces if isinstance(p, ToolCallArgs))
    assert [s.name for s in starts] == ["get_weather"]
    assert json.loads(args) == {"unit": "c"}
    assert output.n_calls == 1


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param('{"note": "a\x05b"}', id="raw-control-character"),
        pytest.param('{"x": NaN}', id="nan"),
        pytest.param('{"x": 1e999}', id="infinity"),
        pytest.param('{"s": "\\ud800"}', id="lone-surrogate"),
        pytest.param('{"unit": "c"', id="unterminated"),
    ],
)
def test_harmony_arguments_a_strict_parser_refuses_stay_content(arguments: str) -> None:
    """Harmony's arguments have no grammar: what no strict parser takes never becomes a call."""
    text = (
        "<|channel|>analysis<|message|>go<|end|><|start|>assistant to=functions.get_weather"
        f"<|channel|>commentary <|constrain|>json<|message|>{arguments}"
    )
    output = ChatOutput(HarmonySplitter())
    pieces = [p for i in range(0, len(text), 3) for p in output.feed(text[i : i + 3])] + output.finish()
    assert not [p for p in pieces if isinstance(p, ToolCallStart | ToolCallArgs)]
    assert output.n_calls == 0
    assert joined([p for p in pieces if isinstance(p, tuple)])["content"] == arguments


@pytest.mark.parametrize(
    ("body", "is_call"),
    [
        pytest.param('{"name": "f", "arguments": "{\\"a\\": 1}"}', True, id="arguments-as-a-json-string"),
        pytest.param('{"name": "f", "arguments": "not json"}', False, id="arguments-string-not-json"),
        pytest.param('{"name": "f", "arguments": {"x": Infinity}}', False, id="infinity"),
        pytest.param('{"name": "f", "arguments": {"x": 1e400}}', False, id="overflow"),
    ],
)
def test_hermes_arguments_are_strict_json(body: str, is_call: bool) -> None:
    output = ChatOutput(PlainSplitter(), parse_tools=True)
    pieces = output.feed(f"<tool_call>{body}</tool_call>") + output.finish()
    args = "".join(p.text for p in pieces if isinstance(p, ToolCallArgs))
    assert output.n_calls == int(is_call)
    if is_call:
        assert json.loads(args) == {"a": 1}
    else:
        assert pieces == [("content", f"<tool_call>{body}</tool_call>")]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_gemma4_tool_calls_are_parsed_out_of_the_content(size: int) -> None:
    q = '<|"|>'
    text = (
        "<|channel>thought\nneed weather<channel|>Checking."
        f"<|tool_call>call:get_weather{{city:{q}Paris, FR{q},days:[1,2],"
        "opts:{metric:true,note:None}}<tool_call|>"
        '<|tool_call>call:g{"a": "b"}<tool_call|>'
        f"<|tool_call>call:broken{{city:{q}Paris}}<tool_call|>"
    )
    output = ChatOutput(GemmaSplitter(), parse_tools=True, syntax=GEMMA4_CALLS)
    pieces = [p for i in range(0, len(text), size) for p in output.feed(text[i : i + size])]
    pieces += output.finish()
    starts = [p for p in pieces if isinstance(p, ToolCallStart)]
    args = [
        json.loads("".join(p.text for p in pieces if isinstance(p, ToolCallArgs) and p.index == s.index))
        for s in starts
    ]
    assert [s.name for s in starts] == ["get_weather", "g"]
    assert args == [{"city": "Paris, FR", "days": [1, 2], "opts": {"metric": True, "note": None}}, {"a": "b"}]
    assert joined([p for p in pieces if isinstance(p, tuple)]) == {
        "reasoning": "need weather",
        # a call that does not parse stays visible as text rather than being lost
        "content": f"Checking.<|tool_call>call:broken{{city:{q}Paris}}<tool_call|>",
    }


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("call:f{}", ("f", {})),
        ("call:f", ("f", {})),
        ('call:ns.f-2{n:-1.5e1,s:<|"|>a:{b}<|"|>}', ("ns.f-2", {"n": -15.0, "s": "a:{b}"})),
        ("call:f{a:}", None),
        ("call:f[1]", None),
        ("call:f{a:1} trailing", None),
        ('call:f{a:<|"|>open}', None),
        ('{"name": "f"}', None),
    ],
)
def test_gemma4_call_notation(body: str, expected: object) -> None:
    assert parse_call(body) == expected


def test_hermes_tool_calls_are_parsed_out_of_the_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    output = ChatOutput(PlainSplitter(), parse_tools=True)
    pieces = [p for i in range(0, len(text), 3) for p in output.feed(text[i : i + 3])] + output.finish()
    content = "".join(p[1] for p in pieces if isinstance(p, tuple))
    starts = [p for p in pieces if isinstance(p, ToolCallStart)]
    assert content == "Let me check.\n"
    assert [s.name for s in starts] == ["f", "g"] and [s.index for s in starts] == [0, 1]
    args = {
        s.index: "".join(p.text for p in pieces if isinstance(p, ToolCallArgs) and p.index == s.index)
        for s in starts
    }
    assert json.loads(args[0]) == {"a": 1} and json.loads(args[1]) == {}


def test_a_broken_tool_call_stays_content() -> None:
    output = ChatOutput(PlainSplitter(), parse_tools=True)
    pieces = output.feed("<tool_call>not json</tool_call>") + output.finish()
    assert pieces == [("content", "<tool_call>not json</tool_call>")]
    assert output.n_calls == 0


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_stream_their_arguments(size: int, parallel: bool) -> None:
    calls = [
        {"name": "get_weather", "arguments": {"unit": "c", "note": 'a \\"}{[ b'}},
        {"name": "get_time", "arguments": {"zone": {"nested": [1, {"x": "}"}]}}},
    ]
    text = json.dumps(calls if parallel else calls[0], indent=1)
    output = ChatOutput(PlainSplitter(), mode="required", parallel=parallel)
    chunks = [output.feed(text[i : i + size]) for i in range(0, len(text), size)] + [output.finish()]
    pieces = [p for chunk in chunks for p in chunk]
    starts = [p for p in pieces if isinstance(p, ToolCallStart)]
    expected = calls if parallel else calls[:1]
    assert [s.name for s in starts] == [c["name"] for c in expected]
    assert output.n_calls == len(expected)
    for start in starts:
        args = "".join(p.text for p in pieces if isinstance(p, ToolCallArgs) and p.index == start.index)
        assert json.loads(args) == expected[start.index]["arguments"]
    if size == 1:  # the arguments really arrive piece by piece
        assert sum(isinstance(p, ToolCallArgs) for p in pieces) > 2 * len(expected)
    assert not any(isinstance(p, tuple) for p in pieces)  # no stray content


def test_required_output_cut_short_keeps_what_streamed() -> None:
    output = ChatOutput(PlainSplitter(), mode="required")
    pieces = output.feed('{"name": "f", "arguments": {"a": ') + output.finish()
    assert isinstance(pieces[0], ToolCallStart) and pieces[0].name == "f"
    assert "".join(p.text for p in pieces if isinstance(p, ToolCallArgs)) == '{"a": '
