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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server.engine.chat import ChatRequest, ChatTool, NamedTool, ToolChoice
from server.engine.tool_calls import HERMES_CALLS, OutputMode
from server.errors import InvalidRequest

if TYPE_CHECKING:
    from llama_cpp import Llama

# at most this many calls in one parallel "required" answer: keeps the grammar's output bounded
MAX_PARALLEL_CALLS = 8


def schema_grammar(schema: dict[str, Any], max_bytes: int, param: str) -> str:
    """GBNF for a JSON schema (llama-cpp-python's converter); InvalidRequest if it cannot be."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    text = json.dumps(schema)
    if len(text) > max_bytes:
        raise InvalidRequest(
            f"the JSON schema is {len(text)} bytes, over the {max_bytes}-byte cap", param=param
        )
    try:
        return str(json_schema_to_gbnf(text))
    except (
        ValueError,
        KeyError,
        TypeError,
        AssertionError,
        IndexError,
        RecursionError,
        NotImplementedError,
    ) as exc:
        raise InvalidRequest(f"unsupported JSON schema: {exc!r}", param=param) from exc


def json_object_grammar() -> str:
    from llama_cpp.llama_grammar import JSON_GBNF

    return str(JSON_GBNF)


def check_grammar(llama: Llama, grammar: str, max_ms: int, param: str) -> None:
    """Compile the grammar once against the vocabulary; refuse it if invalid or too slow."""
    import llama_cpp

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


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.parameters or {"type": "object"}


def tool_grammar(
    tools: Sequence[ChatTool], choice: ToolChoice | None, parallel: bool, max_bytes: int
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
        return schema_grammar(_parameters(matches[0]), max_bytes, "tools"), matches[0].name
    schema = _calls_schema(tools, parallel)
    return schema_grammar(schema, max_bytes, "tools"), None


def _one_call_schema(tools: Sequence[ChatTool]) -> dict[str, Any]:
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": _parameters(t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }


def _calls_schema(tools: Sequence[ChatTool], parallel: bool) -> dict[str, Any]:
    one_call = _one_call_schema(tools)
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
    llama: Llama, template: str, tools: Sequence[ChatTool], parallel: bool, max_bytes: int
) -> LazyGrammar | None:
    """For Hermes/Qwen templates (<tool_call>{json}</tool_call>): free text until the model
    writes <tool_call>, then valid calls of the given tools only. None for other templates."""
    opener, closer = HERMES_CALLS.open, HERMES_CALLS.close
    if not tools or opener not in template:
        return None
    body = schema_grammar(_one_call_schema(tools), max_bytes, "tools")
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
    chat: ChatRequest, llama: Llama, template: str, harmony: bool, max_schema_bytes: int
) -> OutputConstraint:
    """The grammar for `chat` on a model with chat template `template` (harmony: gpt-oss's
    format, whose calls are channel headers with no grammar); InvalidRequest if none can be."""
    parallel = chat.parallel_tool_calls
    grammar, forced_name = tool_grammar(chat.tools, chat.tool_choice, parallel, max_schema_bytes)
    mode: OutputMode = "named" if forced_name else "required" if grammar else "text"
    fmt = chat.output_format
    if grammar is None and fmt is not None and fmt.type == "json_schema":
        grammar = schema_grammar(fmt.schema or {"type": "object"}, max_schema_bytes, "response_format")
    elif grammar is None and fmt is not None and fmt.type == "json_object":
        grammar = json_object_grammar()
    lazy = None
    if grammar is None and chat.tools and chat.tool_choice != "none" and not harmony:
        # tool_choice auto: text until the model opens a call, then only valid calls
        lazy = auto_tool_grammar(llama, template, chat.tools, parallel, max_schema_bytes)
        grammar = lazy.grammar if lazy is not None else None
    param = "tools" if mode != "text" or lazy is not None else "response_format"
    return OutputConstraint(grammar, lazy, mode, forced_name, param)
