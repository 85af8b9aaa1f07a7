"""Tool calls and structured output: grammars in, tool-call pieces out.

Grammars come from llama-cpp-python: `json_schema_to_gbnf` for JSON schemas and its
JSON_GBNF for json_object. Written here (the library has no equivalent outside its
chatml-function-calling handler): the choice of grammar for tool_choice required / named,
the compile check with a time cap, and `ChatOutput`, which turns the generated text into
content / reasoning / tool-call pieces incrementally for both streamed and whole responses.

tool_choice and what constrains the output:
  none          no grammar, no tool-call parsing
  auto          free text; for Hermes/Qwen templates a LAZY grammar (llama.cpp's
                grammar_lazy_patterns) makes everything after <tool_call> valid calls of the
                given tools; native calls are parsed from the text (<tool_call>{...}</tool_call>,
                Gemma 4's <|tool_call>call:NAME{...}<tool_call|>, or to=functions.X for harmony;
                the last two have no grammar yet)
  named         the output IS the arguments, constrained by the function's parameters schema
  required      {"name": ..., "arguments": {...}} for one of the tools, or an array of them
                when parallel_tool_calls is true
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server import gemma_calls
from server.errors import InvalidRequest
from server.protocol import NamedToolChoice, Tool
from server.reasoning import Splitter

if TYPE_CHECKING:
    from llama_cpp import Llama

# at most this many calls in one parallel "required" answer: keeps the grammar's output bounded
MAX_PARALLEL_CALLS = 8

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_text(value: Any) -> str:
    """`value` as strict JSON text; ValueError when it has none (NaN, infinities, lone surrogates,
    which could not be written as UTF-8). Tool arguments reach a client through this or through a
    JSON grammar."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"a lone surrogate: {exc}") from None
    return text


def strict_json(text: str) -> Any:
    """The value of `text` if a strict parser accepts it (json_text's rules too); ValueError if not."""
    value = json.loads(text, parse_constant=_refuse_constant)
    json_text(value)
    return value


def _hermes_call(body: str) -> tuple[str, Any] | None:
    try:
        call = strict_json(body)
        name = call["name"]
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # arguments written as a JSON string, as OpenAI sends them
            arguments = strict_json(arguments)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return (name, arguments) if isinstance(name, str) else None


@dataclass(frozen=True)
class CallSyntax:
    """How a model family writes native tool calls in its text: the markers around one call,
    and the reader of what is between them ((name, arguments), or None: not a call)."""

    open: str
    close: str
    parse: Callable[[str], tuple[str, Any] | None]


HERMES_CALLS = CallSyntax(_OPEN, _CLOSE, _hermes_call)
GEMMA4_CALLS = CallSyntax("<|tool_call>", "<tool_call|>", gemma_calls.parse_call)


def call_syntax(style: str) -> CallSyntax:
    """The native tool-call syntax of a template's family, by its reasoning style (harmony's calls
    are channel headers, which its splitter reads)."""
    return GEMMA4_CALLS if style == "gemma" else HERMES_CALLS


def new_call_id() -> str:
    """An id in OpenAI's shape: call_ + 24 random characters."""
    return "call_" + secrets.token_hex(12)


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


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def tool_grammar(
    tools: list[Tool], choice: str | NamedToolChoice | None, parallel: bool, max_bytes: int
) -> tuple[str | None, str | None]:
    """(grammar, forced tool name) for a tool_choice; (None, None) when the model chooses."""
    if not tools or choice in (None, "none", "auto"):
        return None, None
    if isinstance(choice, NamedToolChoice):
        matches = [t for t in tools if t.function.name == choice.function.name]
        if not matches:
            raise InvalidRequest(
                f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice"
            )
        return schema_grammar(_parameters(matches[0]), max_bytes, "tools"), matches[0].function.name
    schema = _calls_schema(tools, parallel)
    return schema_grammar(schema, max_bytes, "tools"), None


def _one_call_schema(tools: list[Tool]) -> dict[str, Any]:
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }


def _calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
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
    llama: Llama, template: str, tools: list[Tool], parallel: bool, max_bytes: int
) -> LazyGrammar | None:
    """For Hermes/Qwen templates (<tool_call>{json}</tool_call>): free text until the model
    writes <tool_call>, then valid calls of the given tools only. None for other templates."""
    if not tools or _OPEN not in template:
        return None
    body = schema_grammar(_one_call_schema(tools), max_bytes, "tools")
    # the converter names its start rule root; here it is one piece of a larger grammar
    body = body.replace("root ::=", "tool-call-json ::=", 1)
    repeat = f" (tool-ws tool-call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    grammar = (
        f"root ::= tool-call{repeat}\n"
        f'tool-call ::= "{_OPEN}" tool-ws tool-call-json tool-ws "{_CLOSE}"\n'
        "tool-ws ::= [ \\t\\n]{0,4}\n" + body
    )
    opener = llama.tokenize(_OPEN.encode(), add_bos=False, special=True)
    if len(opener) == 1:
        return LazyGrammar(grammar, (opener[0],), ())
    # no single token for the tag: trigger on the text (the grammar starts at the group)
    return LazyGrammar(grammar, (), (r"[\s\S]*?(<tool_call>)[\s\S]*",))


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    text: str


OutPiece = tuple[str, str] | ToolCallStart | ToolCallArgs


class _CallScanner:
    """Streams grammar-forced `{"name": ..., "arguments": {...}}` calls (or an array of them).

    A character-level JSON scanner: the name is announced as soon as its string closes and
    the arguments value is passed through as it is generated, so "required" tool calls
    stream like any other. The grammar guarantees the shape; this only tracks where it is.
    """

    def __init__(self, parallel: bool) -> None:
        self._obj_depth = 2 if parallel else 1
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._token = ""  # the string being read (a key or the name)
        self._key = ""
        self._expect_key = False
        self._await_args = False
        self._in_args = False
        self._args_pending = ""  # arguments seen before the name (not with our grammar's order)
        self._name: str | None = None
        self._index = -1
        self._calls = 0

    @property
    def calls(self) -> int:
        return self._calls

    def feed(self, text: str) -> list[OutPiece]:
        out: list[OutPiece] = []
        args = ""
        for ch in text:
            if self._in_args:
                args += ch
                self._track(ch)
                if self._depth == self._obj_depth and not self._in_string:
                    # the closing bracket of the arguments object brought us back to the call
                    self._in_args = False
                    self._emit_args(args, out)
                    args = ""
                continue
            self._scan(ch, out)
            if self._in_args:
                args += ch  # the opening bracket of the arguments object
        if args:
            self._emit_args(args, out)
        return out

    def _emit_args(self, text: str, out: list[OutPiece]) -> None:
        if self._name is None:
            self._args_pending += text
        else:
            out.append(ToolCallArgs(self._index, text))

    def _track(self, ch: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1

    def _scan(self, ch: str, out: list[OutPiece]) -> None:
        was_in_string = self._in_string
        depth_before = self._depth
        self._track(ch)
        at_call = depth_before == self._obj_depth
        if was_in_string:
            if self._in_string:
                self._token += ch
            elif at_call:
                self._string_done(out)
            return
        if ch == '"' and at_call:
            self._token = ""
        elif ch == "{" and self._depth == self._obj_depth:
            # a new call object opens
            self._index, self._name, self._args_pending = self._calls, None, ""
            self._calls += 1
            self._expect_key = True
        elif at_call and ch == ":":
            self._expect_key = False
            if self._key == "arguments":
                self._await_args = True
        elif at_call and ch == ",":
            self._expect_key = True
        elif at_call and ch in "{[" and self._await_args:
            self._await_args = False
            self._in_args = True

    def _string_done(self, out: list[OutPiece]) -> None:
        if self._expect_key:
            self._key = self._token
        elif self._key == "name":
            self._name = self._token
            out.append(ToolCallStart(self._index, new_call_id(), self._name))
            if self._args_pending:
                out.append(ToolCallArgs(self._index, self._args_pending))
                self._args_pending = ""


class ChatOutput:
    """Generated text -> content, reasoning and tool-call pieces, incrementally.

    mode "text": reasoning split, then native tool calls parsed when `parse_tools`;
    "named": everything is the arguments of `forced_name`; "required": JSON with calls,
    parsed when generation ends.
    """

    def __init__(
        self,
        splitter: Splitter,
        *,
        mode: str = "text",
        forced_name: str | None = None,
        parse_tools: bool = False,
        syntax: CallSyntax = HERMES_CALLS,
        parallel: bool = False,
    ) -> None:
        self._splitter = splitter
        self._mode = mode
        self._forced_name = forced_name
        self._parse_tools = parse_tools
        self._syntax = syntax
        self._calls = 0
        self._scanner = _CallScanner(parallel) if mode == "required" else None
        self._tool_buf = ""
        self._in_tool = False
        # whitespace between and after tool calls is layout, not content
        self._after_call = False
        self._harmony_call: tuple[str, str] | None = None  # (name, arguments so far)

    @property
    def n_calls(self) -> int:
        return self._scanner.calls if self._scanner is not None else self._calls

    def feed(self, text: str) -> list[OutPiece]:
        """Pieces that can be shown after this delta."""
        if self._mode == "named":
            out: list[OutPiece] = []
            if self._calls == 0:
                out.append(ToolCallStart(0, new_call_id(), self._forced_name or ""))
                self._calls = 1
            if text:
                out.append(ToolCallArgs(0, text))
            return out
        if self._scanner is not None:
            return self._scanner.feed(text)
        return self._route(self._splitter.feed(text))

    def finish(self) -> list[OutPiece]:
        """Pieces left when generation ended."""
        if self._mode == "named":
            return self.feed("") if self._calls == 0 else []
        if self._scanner is not None:
            return []  # cut short by max_tokens: what streamed stays, finish_reason says length
        out = self._route(self._splitter.finish())
        out.extend(self._end_harmony_call())
        if self._after_call and not self._tool_buf.strip():
            self._tool_buf = ""
        if self._tool_buf:
            # an unterminated call: show what the model wrote rather than lose it
            out.append(("content", (self._syntax.open if self._in_tool else "") + self._tool_buf))
            self._tool_buf, self._in_tool = "", False
        return out

    def _route(self, pieces: list[tuple[str, str]]) -> list[OutPiece]:
        out: list[OutPiece] = []
        for kind, text in pieces:
            if kind.startswith("tool:"):
                # harmony's arguments have no grammar: a call is held until it ends, then checked
                name = kind[5:]
                if self._harmony_call is not None and self._harmony_call[0] != name:
                    out.extend(self._end_harmony_call())
                held = self._harmony_call[1] if self._harmony_call is not None else ""
                self._harmony_call = (name, held + text)
                continue
            out.extend(self._end_harmony_call())
            if kind == "content" and self._parse_tools:
                out.extend(self._content_with_calls(text))
            else:
                out.append((kind, text))
        return out

    def _end_harmony_call(self) -> list[OutPiece]:
        """The held harmony call as a tool call, or as content when its arguments are not strict
        JSON (the text the model wrote, rather than arguments no client can parse)."""
        if self._harmony_call is None:
            return []
        name, text = self._harmony_call
        self._harmony_call = None
        try:
            return self._call(name, strict_json(text))
        except ValueError:
            return [("content", text)]

    def _content_with_calls(self, text: str) -> list[OutPiece]:
        out: list[OutPiece] = []
        opener, closer = self._syntax.open, self._syntax.close
        self._tool_buf += text
        while True:
            if self._in_tool:
                end = self._tool_buf.find(closer)
                if end < 0:
                    return out
                out.extend(self._parsed_call(self._tool_buf[:end]))
                self._tool_buf = self._tool_buf[end + len(closer) :]
                self._in_tool = False
                self._after_call = True
            else:
                start = self._tool_buf.find(opener)
                if start < 0:
                    keep = 0
                    for n in range(min(len(opener) - 1, len(self._tool_buf)), 0, -1):
                        if self._tool_buf.endswith(opener[:n]):
                            keep = n
                            break
                    shown = self._tool_buf[: len(self._tool_buf) - keep]
                    if self._after_call and not shown.strip():
                        return out  # hold: only layout so far
                    self._after_call = False
                    if shown:
                        out.append(("content", shown))
                    self._tool_buf = self._tool_buf[len(self._tool_buf) - keep :]
                    return out
                if self._tool_buf[:start].strip() or (start and not self._after_call):
                    out.append(("content", self._tool_buf[:start]))
                self._tool_buf = self._tool_buf[start + len(opener) :]
                self._in_tool = True

    def _parsed_call(self, body: str) -> list[OutPiece]:
        call = self._syntax.parse(body)
        if call is not None:
            try:
                return self._call(*call)
            except ValueError:
                pass  # arguments with no strict JSON form (an infinity, a lone surrogate)
        return [("content", self._syntax.open + body + self._syntax.close)]

    def _call(self, name: str, arguments: Any) -> list[OutPiece]:
        """A call's pieces; ValueError (nothing counted) when its arguments have no strict JSON form."""
        text = json_text(arguments)
        index = self._calls
        self._calls += 1
        return [ToolCallStart(index, new_call_id(), name), ToolCallArgs(index, text)]
