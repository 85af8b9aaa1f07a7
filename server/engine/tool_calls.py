"""Model output -> content, reasoning and tool-call pieces, incrementally (the response side).

`ChatOutput` turns generated text into the pieces every API presents, for streamed and whole
answers alike. Native calls are parsed from the text in each family's notation
(<tool_call>{...}</tool_call> for Hermes/Qwen, Gemma 4's <|tool_call>call:NAME{...}<tool_call|>,
harmony's to=functions.X channel headers, read by its splitter); grammar-forced calls
(tool_choice named or required) are scanned as they stream. Arguments reach a client as strict
JSON only: a call whose arguments have none stays visible as content.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from server.engine import gemma_calls
from server.engine.reasoning import Splitter

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"

# how the output is read: free text (calls parsed from it), the arguments of one named tool, or
# grammar-forced JSON calls (tool_choice required)
OutputMode = Literal["text", "named", "required"]


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
        mode: OutputMode = "text",
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
