"""Structured output always parses: a strict-parser fuzz of every grammar path.

Random weights sample freely among the tokens a grammar allows, byte tokens of control
characters and of invalid UTF-8 included: the harshest model for a grammar. Over many seeds and
schemas (nested objects, arrays, enums, numbers, strings, patterns), for response_format
json_object and json_schema and for tool_choice named, required and auto, on models of three
template families (Hermes, harmony, Gemma 4; harmony's and Gemma's own call syntaxes, which have
no grammar, are checked in tests/engine/test_output_parsing.py), every answer must be
accepted by strict parsers: Python's json.loads (strict: no raw control characters) and jiter,
pydantic's parser (which also refuses lone surrogates). An answer cut short by max_tokens is
checked as a prefix of valid JSON: no character a strict parser would refuse.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import TypeAdapter

from tests.servers import RunningServer, running_server

SEEDS = range(8)
MESSAGES: list[Any] = [{"role": "user", "content": "fill the form"}]
STRICT = TypeAdapter(Any)

SCHEMAS: dict[str, dict[str, Any]] = {
    "strings": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "note": {"type": "string"}},
        "required": ["name", "note"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "owner": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["id", "tags"],
            },
            "score": {"type": "number"},
        },
        "required": ["owner", "score"],
    },
    "enums-and-arrays": {
        "type": "object",
        "properties": {
            "level": {"enum": ["low", "mid", "high"]},
            "values": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
            "flag": {"type": "boolean"},
        },
        "required": ["level", "values", "flag"],
    },
    "free-object": {"type": "object"},
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[^a-c]{1,8}.x$"}},
        "required": ["code"],
    },
    "array-of-strings": {"type": "array", "items": {"type": "string"}, "minItems": 1},
}

FORM_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "submit", "parameters": SCHEMAS["nested"]},
}
NOTE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "note", "parameters": SCHEMAS["strings"]},
}


def parse_strictly(text: str) -> Any:
    """The value of `text` if both strict parsers accept it (AssertionError naming the text if not)."""
    try:
        value = json.loads(text)
        STRICT.validate_json(text)
    except ValueError as exc:
        raise AssertionError(f"not strict JSON ({exc}): {text!r}") from exc
    return value


def assert_valid_prefix(text: str) -> None:
    """`text` can be the start of strict JSON: inside strings no raw control character, only JSON's
    escapes, and no \\u escape of a surrogate."""
    in_string = False
    i = 0
    while i < len(text):
        ch = text[i]
        if not in_string:
            in_string = ch == '"'
        elif ch == '"':
            in_string = False
        elif ch == "\\":
            escape = text[i + 1 : i + 2]
            assert escape == "" or escape in '"\\/bfnrtu', f"bad escape at {i}: {text!r}"
            if escape == "u":
                digits = text[i + 2 : i + 6]
                assert len(digits) < 4 or not 0xD800 <= int(digits, 16) <= 0xDFFF, f"surrogate: {text!r}"
                i += 4
            i += 1
        else:
            assert ord(ch) >= 0x20 and ch != "\x7f", f"raw control character {ch!r} at {i}: {text!r}"
        i += 1


def check(text: str, finish_reason: str | None) -> None:
    if finish_reason == "length":
        assert_valid_prefix(text)
    else:
        parse_strictly(text)


@pytest.fixture(scope="module", params=["tiny-qwen3moe", "tiny-gptoss", "tiny-gemma4"])
def server(tiny_model: Any, request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """Three template families: Hermes (<tool_call>), harmony (gpt-oss), Gemma 4."""
    with running_server(tiny_model(request.param), ctx_size=1024) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def sampling(server: RunningServer, seed: int) -> dict[str, Any]:
    """Hot sampling with a nudge towards closing quotes and brackets, so most answers end."""
    tokenize = server.model.llama.tokenize
    closers = {str(tokenize(piece.encode(), add_bos=False)[0]): 5.0 for piece in ('"', "}", "]")}
    return {"temperature": 1.3, "seed": seed, "max_tokens": 160, "logit_bias": closers}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_answers_parse(client: openai.OpenAI, server: RunningServer, name: str) -> None:
    ended = 0
    for seed in SEEDS:
        result = client.chat.completions.create(
            model=server.model_id,
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}},
            **sampling(server, seed),
        )
        choice = result.choices[0]
        check(choice.message.content or "", choice.finish_reason)
        ended += choice.finish_reason == "stop"
    assert ended > 0, "no answer ended: the fuzz checked prefixes only"


def test_json_object_answers_parse(client: openai.OpenAI, server: RunningServer) -> None:
    for seed in SEEDS:
        result = client.chat.completions.create(
            model=server.model_id,
            messages=MESSAGES,
            response_format={"type": "json_object"},
            **sampling(server, seed),
        )
        choice = result.choices[0]
        check(choice.message.content or "", choice.finish_reason)


@pytest.mark.parametrize("choice", ["named", "required", "required-parallel"])
def test_tool_arguments_parse(client: openai.OpenAI, server: RunningServer, choice: str) -> None:
    tool_choice: Any = (
        {"type": "function", "function": {"name": "submit"}} if choice == "named" else "required"
    )
    calls = 0
    for seed in SEEDS:
        result = client.chat.completions.create(
            model=server.model_id,
            messages=MESSAGES,
            tools=[FORM_TOOL, NOTE_TOOL],
            tool_choice=tool_choice,
            parallel_tool_calls=choice == "required-parallel",
            **sampling(server, seed),
        )
        answer = result.choices[0]
        # a forced call is a call: only max_tokens may cut it off before it is one
        assert answer.finish_reason in ("tool_calls", "length"), answer
        assert answer.message.tool_calls or answer.finish_reason == "length", answer
        for call in answer.message.tool_calls or []:
            check(call.function.arguments, answer.finish_reason)  # type: ignore[union-attr]
            calls += 1
    assert calls, "no seed produced a call"


def test_tool_choice_auto_arguments_parse(client: openai.OpenAI, server: RunningServer) -> None:
    """The lazy grammar after <tool_call>: the model is pushed into a call, then sampled hot."""
    opener = server.model.llama.tokenize(b"<tool_call>", add_bos=False, special=True)
    if len(opener) != 1:
        pytest.skip("the model has no single <tool_call> token")
    for seed in SEEDS:
        params = sampling(server, seed)
        params["logit_bias"][str(opener[0])] = 100
        result = client.chat.completions.create(
            model=server.model_id,
            messages=MESSAGES,
            tools=[FORM_TOOL, NOTE_TOOL],
            tool_choice="auto",
            **params,
        )
        answer = result.choices[0]
        # pushed into <tool_call>, the grammar makes it a call unless max_tokens cuts it off
        assert answer.message.tool_calls or answer.finish_reason == "length", answer
        for call in answer.message.tool_calls or []:
            parse_strictly(call.function.arguments)  # type: ignore[union-attr]


def test_the_fuzz_catches_what_strict_parsers_refuse() -> None:
    """The checks themselves: what the unpatched converter let through fails them."""
    for bad in ('{"a": "x\ny"}', '{"a": "\x05"}', '"\\ud800"'):
        with pytest.raises(AssertionError):
            parse_strictly(bad)
    for bad_prefix in ('{"a": "x\x08', '{"a": "\\udc00', '["\x1f'):
        with pytest.raises(AssertionError):
            assert_valid_prefix(bad_prefix)
    assert_valid_prefix('{"a": "\\u00e9\\n", "b": [1, "x')
