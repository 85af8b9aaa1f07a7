"""Client JSON Schemas degrade instead of failing (server/engine/schemas.py, grammars.py).

What a degraded schema still honours is checked against llama.cpp itself: a grammar sampler
built from the converter's GBNF, fed the tokens of a candidate text one by one, accepts the text
when every token keeps a finite logit and the end of generation is allowed after the last one.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from llama_cpp import Llama

from server.engine.chat import ChatMessage, ChatRequest, ChatTool, NamedTool, OutputFormat
from server.engine.generation import SamplingParams
from server.engine.grammars import (
    MAX_GRAMMAR_NESTING,
    GrammarLimits,
    grammar_cost,
    output_constraint,
    schema_grammar,
)
from server.engine.schemas import ANY_VALUE, LEVELS, MAX_DEPTH, nested_repetition, prepare_schema
from server.errors import InvalidRequest

LIMITS = GrammarLimits(max_schema_bytes=64 * 1024, max_compile_ms=10_000)


Accepts = Callable[[str, Any], bool]


@pytest.fixture(scope="module")
def accepts(vocab_llama: Llama) -> Accepts:
    """accepts(grammar, value): whether llama.cpp's grammar sampler lets the model write
    `value` (a JSON value, written compactly)."""
    import llama_cpp

    def allowed(sampler: Any, token: int) -> bool:
        data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
        candidates = llama_cpp.llama_token_data_array(data, 1, -1, False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates))
        return bool(data[0].logit != float("-inf"))

    def check(grammar: str, value: Any) -> bool:
        text = json.dumps(value, separators=(",", ":"))
        sampler = llama_cpp.llama_sampler_init_grammar(vocab_llama._model.vocab, grammar.encode(), b"root")
        assert sampler, "the grammar does not compile"
        try:
            for token in vocab_llama.tokenize(text.encode(), add_bos=False, special=False):
                if not allowed(sampler, token):
                    return False
                llama_cpp.llama_sampler_accept(sampler, token)
            return allowed(sampler, vocab_llama.token_eos())
        finally:
            llama_cpp.llama_sampler_free(sampler)

    return check


def _grammar(schema: Any, notes: list[str] | None = None) -> str:
    return schema_grammar(schema, LIMITS, "response_format", [] if notes is None else notes)


# ---- the pre-pass alone


@pytest.mark.parametrize(
    "schema",
    [
        pytest.param({"description": "anything"}, id="annotation-only"),
        pytest.param(True, id="true"),
        pytest.param({}, id="empty"),
        pytest.param({"title": "t", "examples": [1], "$comment": "c", "x-vendor": 1}, id="annotations"),
        pytest.param({"maxLength": 5}, id="bound-without-type"),
        pytest.param({"type": "bogus"}, id="unknown-type"),
    ],
)
def test_schemas_that_constrain_nothing_mean_any_value(schema: Any) -> None:
    assert prepare_schema(schema, "tools").schema == ANY_VALUE


def test_annotation_only_property_takes_any_value(accepts: Accepts) -> None:
    # Claude Code's tools have properties like this: a description and no type
    schema = {"type": "object", "properties": {"v": {"description": "any value"}}, "required": ["v"]}
    grammar = _grammar(schema)
    for value in (1, "s", None, [1, {"a": 2}], {"k": True}):
        assert accepts(grammar, {"v": value}), value
    assert not accepts(grammar, {})


@pytest.mark.parametrize(
    ("schema", "note"),
    [
        pytest.param({"type": "string", "maxLength": 100_000}, "maxLength: 100000 relaxed", id="maxLength"),
        pytest.param({"type": "array", "maxItems": 100_000}, "maxItems: 100000 relaxed", id="maxItems"),
        pytest.param({"type": "array", "minItems": 5000}, "minItems: 5000 relaxed", id="minItems"),
        pytest.param({"type": "integer", "minimum": 3}, "dropped 'minimum'", id="unknown-keyword"),
        pytest.param({"type": "string", "format": "email"}, "dropped format 'email'", id="unknown-format"),
        pytest.param({"type": "string", "maxLength": -1}, "maxLength: dropped", id="negative-bound"),
        pytest.param({"type": "string", "maxLength": "9"}, "maxLength: dropped", id="string-bound"),
    ],
)
def test_what_is_dropped_or_relaxed_is_noted(schema: dict[str, Any], note: str) -> None:
    prepared = prepare_schema(schema, "tools")
    assert any(note in n for n in prepared.notes), prepared.notes
    assert prepared.schema == {"type": schema["type"]}


def test_bounds_within_llama_cpp_s_limit_are_kept_exactly(accepts: Accepts) -> None:
    schema = {"type": "string", "minLength": 2, "maxLength": 1500}
    prepared = prepare_schema(schema, "tools")
    assert prepared.schema == schema and prepared.notes == []
    grammar = _grammar(schema)
    assert accepts(grammar, "x" * 1500) and accepts(grammar, "xy")
    assert not accepts(grammar, "x" * 1501) and not accepts(grammar, "x")


def test_a_huge_max_length_accepts_long_strings(accepts: Accepts) -> None:
    notes: list[str] = []
    grammar = _grammar({"type": "string", "maxLength": 524_288}, notes)
    assert accepts(grammar, "y" * 3000)
    assert notes == ["response_format.maxLength: 524288 relaxed to unbounded (over 2000)"]


def test_array_bounds_are_honoured(accepts: Accepts) -> None:
    grammar = _grammar({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3})
    assert accepts(grammar, [1, 2]) and accepts(grammar, [1, 2, 3])
    assert not accepts(grammar, [1]) and not accepts(grammar, [1, 2, 3, 4])
    many = _grammar({"type": "array", "items": {"type": "integer"}, "maxItems": 100_000})
    assert accepts(many, list(range(2100)))


def test_a_type_list_keeps_the_other_keywords(accepts: Accepts) -> None:
    # the converter alone reads ["string", "null"] as bare types and loses maxLength
    grammar = _grammar({"type": ["string", "null"], "maxLength": 3})
    assert accepts(grammar, "abc") and accepts(grammar, None)
    assert not accepts(grammar, "abcd")


def test_nullable_adds_null(accepts: Accepts) -> None:
    grammar = _grammar({"type": "integer", "nullable": True})
    assert accepts(grammar, 3) and accepts(grammar, None) and not accepts(grammar, "3")


def test_deep_schemas_are_any_value_below_the_depth_cap(accepts: Accepts) -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(500):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    notes: list[str] = []
    grammar = _grammar(schema, notes)
    assert any(f"deeper than {MAX_DEPTH}" in n for n in notes)
    value: Any = "not an integer"
    for _ in range(500):
        value = {"a": value}
    assert accepts(grammar, value)
    assert not accepts(grammar, {"a": 1})


def test_refs_resolve_and_recursive_refs_compile(accepts: Accepts) -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 4},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["name", "children"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    }
    grammar = _grammar(tree)
    assert accepts(grammar, {"name": "a", "children": [{"name": "b", "children": []}]})
    assert not accepts(grammar, {"name": "toolong", "children": []})


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        pytest.param(False, "the schema false", id="false"),
        pytest.param([1, 2], "must be a JSON Schema object, got list", id="list"),
        pytest.param("string", "must be a JSON Schema object, got str", id="string"),
        pytest.param({"type": "object", "properties": {"a": 3}}, "must be a JSON Schema", id="bad-property"),
    ],
)
def test_what_nothing_can_be_made_of_is_refused(schema: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        prepare_schema(schema, "response_format")


def test_grammar_cost_counts_nesting_and_repetition_rules() -> None:
    assert grammar_cost('root ::= "((" [(] x') == (0, 1)
    assert grammar_cost("root ::= ((a)?)?") == (2, 3)
    assert grammar_cost('root ::= a{0,500} "\\"" b{3}\nb ::= "x"') == (0, 2 + 501 + 4)


# ---- the ladder, on the model: each level is tried until a grammar compiles


def _chat(tools: tuple[ChatTool, ...] = (), fmt: OutputFormat | None = None, **kw: Any) -> ChatRequest:
    return ChatRequest(
        (ChatMessage("user", "hi"),), SamplingParams(max_tokens=8), tools, output_format=fmt, **kw
    )


def test_a_pattern_nested_past_the_cap_is_dropped(vocab_llama: Llama, accepts: Accepts) -> None:
    deep = "^" + "(" * (MAX_GRAMMAR_NESTING + 5) + "a" + ")" * (MAX_GRAMMAR_NESTING + 5) + "$"
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": deep}},
        "required": ["code"],
    }
    fmt = OutputFormat("json_schema", schema)
    constraint = output_constraint(_chat(fmt=fmt), vocab_llama, "", False, LIMITS)
    assert constraint.grammar is not None
    assert accepts(constraint.grammar, {"code": "anything"})


def test_many_large_bounds_step_down_to_fit_the_rule_cap(vocab_llama: Llama, accepts: Accepts) -> None:
    props = {f"p{i}": {"type": "string", "maxLength": 1900} for i in range(80)}
    fmt = OutputFormat("json_schema", {"type": "object", "properties": props, "required": ["p0"]})
    constraint = output_constraint(_chat(fmt=fmt), vocab_llama, "", False, LIMITS)
    assert constraint.grammar is not None
    assert accepts(constraint.grammar, {"p0": "z" * 2500})  # relaxed at a lower level


def test_the_last_level_keeps_structure() -> None:
    prepared = prepare_schema({"type": "string", "maxLength": 10, "pattern": "^a+$"}, "tools", LEVELS[-1])
    assert prepared.schema == {"type": "string"}


def test_a_named_tool_with_an_any_value_schema_still_takes_an_object(
    vocab_llama: Llama, accepts: Accepts
) -> None:
    tool = ChatTool("run", "", {"description": "whatever the model wants"})
    constraint = output_constraint(
        _chat(tools=(tool,), tool_choice=NamedTool("run")), vocab_llama, "", False, LIMITS
    )
    assert constraint.grammar is not None
    assert accepts(constraint.grammar, {"x": 1}) and not accepts(constraint.grammar, [1])


def test_a_grammar_at_the_nesting_cap_compiles_on_a_small_thread_stack(tiny_model: Any) -> None:
    # a phone's threads have 1 MiB of stack: the cap must hold with a quarter of that. In a
    # process of its own, so an overflow fails this test instead of ending the suite.
    program = f"""
import threading
from llama_cpp import Llama
from server.engine.grammars import MAX_GRAMMAR_NESTING, check_grammar
llama = Llama({str(tiny_model("tiny-qwen3moe"))!r}, n_ctx=64, verbose=False)
grammar = 'root ::= ' + '(' * MAX_GRAMMAR_NESTING + '"a"' + ')' * MAX_GRAMMAR_NESTING
threading.stack_size(256 << 10)
thread = threading.Thread(target=check_grammar, args=(llama, grammar, 10_000, "tools"))
thread.start()
thread.join()
print("compiled")
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("pattern", "nested"),
    [
        pytest.param("^(a{0,1000}){0,1000}$", True, id="bounded-of-bounded"),
        pytest.param("^(b*)+$", True, id="star-of-star"),
        pytest.param("^(((x)+))*$", True, id="deep"),
        pytest.param("^(ab|c){0,5000}$", False, id="group-without-repetition"),
        pytest.param("^(?:x+)$", False, id="non-capturing-once"),
        pytest.param("^(a[)*]b)*$", False, id="class-holds-the-quantifier"),
        pytest.param("^\\(a*\\)*$", False, id="escaped-parentheses"),
    ],
)
def test_nested_repetitions_in_patterns_are_found(pattern: str, nested: bool) -> None:
    assert nested_repetition(pattern) is nested
    prepared = prepare_schema({"type": "string", "pattern": pattern}, "tools")
    assert ("pattern" in prepared.schema) is not nested
