"""Grammars for tool calls and structured output: what constrains a chat request's output.

Grammars come from llama-cpp-python: `json_schema_to_gbnf` for JSON schemas and its
JSON_GBNF for json_object. Written here (the library has no equivalent outside its
chatml-function-calling handler): the choice of grammar for a request, and the compile check
with a time cap. Every refusal is an InvalidRequest naming the request part it comes from.

tool_choice and what constrains the output:
  none          no grammar, no tool-call parsing
  auto          free text; for Hermes/Qwen templates a LAZY grammar (llama.cpp's
                grammar_lazy_patterns) makes everything after <tool_call> valid calls of the
                given tools (Gemma 4's and harmony's calls have no grammar yet)
  named         the output IS the arguments, constrained by the function's parameters schema
  required      {"name": ..., "arguments": {...}} for one of the tools, or an array of them
                when parallel_tool_calls is true
Without a forced call, output_format json_schema / json_object constrains the whole output.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from server.engine.chat import ChatRequest, ChatTool, NamedTool, ToolChoice
from server.engine.schemas import LEVELS, Level, is_any, prepare_schema
from server.engine.tool_calls import HERMES_CALLS, OutputMode
from server.errors import InvalidRequest

if TYPE_CHECKING:
    from llama_cpp import Llama

log = logging.getLogger(__name__)

# at most this many calls in one parallel "required" answer: keeps the grammar's output bounded
MAX_PARALLEL_CALLS = 8
# llama.cpp's grammar parser recurses a few frames per nested group; converter-written grammars
# nest a handful deep (patterns more): the cap keeps the parse far inside a phone's 1 MiB
# thread stack (docs/structured-output.md measures the frames)
MAX_GRAMMAR_NESTING = 64
# rules llama.cpp's parser may make of one grammar: a bounded repetition x{0,n} is n rules, and
# 100k of them take ~22 MB and ~0.1 s to build (docs/structured-output.md)
MAX_GRAMMAR_RULES = 100_000
# degradation notes written into the one log line of a request
MAX_LOGGED_NOTES = 12
_REPETITION = re.compile(r"\{\s*(\d+)\s*(,)?\s*(\d*)\s*\}")


def schema_grammar(schema: Any, limits: GrammarLimits, param: str, notes: list[str]) -> str:
    """GBNF for a client JSON schema at `limits.level` (llama-cpp-python's converter, after
    server.engine.schemas degrades what it cannot take); what was degraded goes to `notes`.
    InvalidRequest if it cannot be made."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    prepared = prepare_schema(schema, param, limits.level)
    text = json.dumps(prepared.schema)
    if len(text) > limits.max_schema_bytes:
        raise InvalidRequest(
            f"the JSON schema is {len(text)} bytes, over the {limits.max_schema_bytes}-byte cap", param=param
        )
    try:
        grammar = str(json_schema_to_gbnf(text))
    except (ValueError, KeyError, TypeError, AssertionError, IndexError, RecursionError) as exc:
        raise InvalidRequest(f"unsupported JSON schema: {exc}", param=param) from exc
    notes.extend(prepared.notes)
    return grammar


def tool_parameters(tool: ChatTool, limits: GrammarLimits, param: str, notes: list[str]) -> dict[str, Any]:
    """The converter's schema of a tool's arguments: always an object."""
    prepared = prepare_schema(tool.parameters or {"type": "object"}, param, limits.level)
    notes.extend(prepared.notes)
    return {"type": "object"} if is_any(prepared.schema) else prepared.schema


@dataclass(frozen=True)
class GrammarLimits:
    """Caps on a request's grammar (the settings' max_json_schema_bytes and
    max_grammar_compile_ms) and how much of its schemas to keep (`level`)."""

    max_schema_bytes: int
    max_compile_ms: int
    level: Level = LEVELS[0]


def grammar_cost(grammar: str) -> tuple[int, int]:
    """(deepest group nesting, grammar rules) of converter-written GBNF, as llama.cpp's parser
    will see it: it recurses once per nested group, and writes one rule per count of a bounded
    repetition x{m,n}. Literals and character classes are skipped."""
    depth = deepest = 0
    rules = grammar.count("\n") + 1
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and grammar[i] != close:
                i += 2 if grammar[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        elif c in "*+?":
            rules += 1
        elif c == "{":
            match = _REPETITION.match(grammar, i)
            if match:
                low, comma, high = match.groups()
                rules += max(int(low), int(high) if high else 0) + 1
        i += 1
    return deepest, rules


def json_object_grammar() -> str:
    from llama_cpp.llama_grammar import JSON_GBNF

    return str(JSON_GBNF)


def check_grammar(llama: Llama, grammar: str, max_ms: int, param: str) -> None:
    """Compile the grammar once against the vocabulary; refuse it if invalid or too slow.
    Its shape is checked first: llama.cpp's parser must never see a grammar that overflows a
    thread's stack (MAX_GRAMMAR_NESTING) or takes too much memory (MAX_GRAMMAR_RULES)."""
    import llama_cpp

    nesting, rules = grammar_cost(grammar)
    if nesting > MAX_GRAMMAR_NESTING:
        raise InvalidRequest(
            f"the schema's grammar nests {nesting} groups deep, over the cap of {MAX_GRAMMAR_NESTING}",
            param=param,
        )
    if rules > MAX_GRAMMAR_RULES:
        raise InvalidRequest(
            f"the schema's grammar has {rules} rules, over the cap of {MAX_GRAMMAR_RULES}", param=param
        )
    start = time.perf_counter()
    sampler = llama_cpp.llama_sampler_init_grammar(llama._model.vocab, grammar.encode("utf-8"), b"root")
    elapsed_ms = (time.perf_counter() - start) * 1000
    if not sampler:
        raise InvalidRequest("the schema produced a grammar llama.cpp cannot compile", param=param)
    llama_cpp.llama_sampler_free(sampler)
    if elapsed_ms > max_ms:
        raise InvalidRequest(
            f"the grammar took {elapsed_ms:.0f} ms to compile, over the {max_ms} ms cap", param=param
        )


def tool_grammar(
    tools: Sequence[ChatTool],
    choice: ToolChoice | None,
    parallel: bool,
    limits: GrammarLimits,
    notes: list[str],
) -> tuple[str | None, str | None]:
    """(grammar, forced tool name) for a tool_choice; (None, None) when the model chooses."""
    if not tools or choice in (None, "none", "auto"):
        return None, None
    if isinstance(choice, NamedTool):
        matches = [t for t in tools if t.name == choice.name]
        if not matches:
            raise InvalidRequest(
                f"tool_choice names {choice.name!r}, which is not in tools", param="tool_choice"
            )
        schema = tool_parameters(matches[0], limits, "tools", notes)
        return schema_grammar(schema, limits, "tools", notes), matches[0].name
    schema = _calls_schema(tools, parallel, limits, notes)
    return schema_grammar(schema, limits, "tools", notes), None


def _one_call_schema(tools: Sequence[ChatTool], limits: GrammarLimits, notes: list[str]) -> dict[str, Any]:
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.name},
                    "arguments": tool_parameters(t, limits, f"tools[{i}]", notes),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for i, t in enumerate(tools)
        ]
    }


def _calls_schema(
    tools: Sequence[ChatTool], parallel: bool, limits: GrammarLimits, notes: list[str]
) -> dict[str, Any]:
    one_call = _one_call_schema(tools, limits, notes)
    if parallel:
        return {"type": "array", "items": one_call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
    return one_call


@dataclass(frozen=True)
class LazyGrammar:
    """A grammar that applies only once the model starts a tool call (tool_choice auto)."""

    grammar: str
    trigger_tokens: tuple[int, ...]
    trigger_patterns: tuple[str, ...]


def auto_tool_grammar(
    llama: Llama,
    template: str,
    tools: Sequence[ChatTool],
    parallel: bool,
    limits: GrammarLimits,
    notes: list[str],
) -> LazyGrammar | None:
    """For Hermes/Qwen templates (<tool_call>{json}</tool_call>): free text until the model
    writes <tool_call>, then valid calls of the given tools only. None for other templates."""
    opener, closer = HERMES_CALLS.open, HERMES_CALLS.close
    if not tools or opener not in template:
        return None
    body = schema_grammar(_one_call_schema(tools, limits, notes), limits, "tools", notes)
    # the converter names its start rule root; here it is one piece of a larger grammar
    body = body.replace("root ::=", "tool-call-json ::=", 1)
    repeat = f" (tool-ws tool-call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    grammar = (
        f"root ::= tool-call{repeat}\n"
        f'tool-call ::= "{opener}" tool-ws tool-call-json tool-ws "{closer}"\n'
        "tool-ws ::= [ \\t\\n]{0,4}\n" + body
    )
    opener_tokens = llama.tokenize(opener.encode(), add_bos=False, special=True)
    if len(opener_tokens) == 1:
        return LazyGrammar(grammar, (opener_tokens[0],), ())
    # no single token for the tag: trigger on the text (the grammar starts at the group)
    return LazyGrammar(grammar, (), (r"[\s\S]*?(<tool_call>)[\s\S]*",))


@dataclass(frozen=True)
class OutputConstraint:
    """How a chat request constrains its output and how the output is to be read.

    mode "named": the output is the arguments of `forced_name`; "required": JSON calls;
    "text": free text, a `lazy` grammar once a call opens, or a whole-output format grammar.
    `param` is the request part a grammar that fails to compile is blamed on.
    """

    grammar: str | None
    lazy: LazyGrammar | None
    mode: OutputMode
    forced_name: str | None
    param: str

    @property
    def whole_output(self) -> bool:
        """Whether the grammar constrains all of the output (then no reasoning markup can appear)."""
        return self.grammar is not None and self.lazy is None


def output_constraint(
    chat: ChatRequest, llama: Llama, template: str, harmony: bool, limits: GrammarLimits
) -> OutputConstraint:
    """The grammar for `chat` on a model with chat template `template` (harmony: gpt-oss's
    format, whose calls are channel headers with no grammar), compiled once to check it.
    Schemas degrade rather than fail: each of schemas.LEVELS is tried until one gives a grammar
    that is small, shallow and quick enough; what was degraded is logged in one line.
    InvalidRequest when no level does (the last level's reason)."""
    refusal: InvalidRequest | None = None
    for level in LEVELS:
        notes: list[str] = []
        try:
            constraint = _constraint(chat, llama, template, harmony, replace(limits, level=level), notes)
            if constraint.grammar is not None:
                check_grammar(llama, constraint.grammar, limits.max_compile_ms, constraint.param)
        except InvalidRequest as exc:
            refusal = exc
            continue
        if notes:
            shown = "; ".join(notes[:MAX_LOGGED_NOTES])
            more = f" (and {len(notes) - MAX_LOGGED_NOTES} more)" if len(notes) > MAX_LOGGED_NOTES else ""
            log.info("JSON schema of %s degraded: %s%s", constraint.param, shown, more)
        return constraint
    assert refusal is not None
    raise refusal


def _constraint(
    chat: ChatRequest, llama: Llama, template: str, harmony: bool, limits: GrammarLimits, notes: list[str]
) -> OutputConstraint:
    parallel = chat.parallel_tool_calls
    grammar, forced_name = tool_grammar(chat.tools, chat.tool_choice, parallel, limits, notes)
    mode: OutputMode = "named" if forced_name else "required" if grammar else "text"
    fmt = chat.output_format
    if grammar is None and fmt is not None and fmt.type == "json_schema":
        schema = fmt.schema if fmt.schema is not None else {"type": "object"}
        grammar = schema_grammar(schema, limits, "response_format", notes)
    elif grammar is None and fmt is not None and fmt.type == "json_object":
        grammar = json_object_grammar()
    lazy = None
    if grammar is None and chat.tools and chat.tool_choice != "none" and not harmony:
        # tool_choice auto: text until the model opens a call, then only valid calls
        lazy = auto_tool_grammar(llama, template, chat.tools, parallel, limits, notes)
        grammar = lazy.grammar if lazy is not None else None
    param = "tools" if mode != "text" or lazy is not None else "response_format"
    return OutputConstraint(grammar, lazy, mode, forced_name, param)
