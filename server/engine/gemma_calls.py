"""Gemma 4's native tool calls: `call:NAME{key:value,...}` between <|tool_call> and <tool_call|>.

Gemma 4's chat template writes arguments in its own notation, and the model answers in it:
keys bare, strings between <|"|> quotes, numbers, true / false and nesting as in JSON, e.g.
`call:get_weather{city:<|"|>Paris<|"|>,days:[1,2],metric:true}`. This reads that notation (and
plain JSON, which it contains) into the Python value the OpenAI API's JSON arguments carry.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

QUOTE = '<|"|>'
_NAME = re.compile(r"\s*call:\s*([A-Za-z0-9_.\-]+)")
_BARE_KEY = re.compile(r"[^\s:,{}\[\]\"<]+")
_LITERAL = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|true|false|null|None")
# the template writes Python's None as it is; the model may answer with either spelling
_WORDS: dict[str, Any] = {"true": True, "false": False, "null": None, "None": None}


class _Invalid(ValueError):
    pass


def parse_call(body: str) -> tuple[str, Any] | None:
    """(name, arguments) of one call's text between the markers; None if it is not one."""
    m = _NAME.match(body)
    if m is None:
        return None
    reader = _Reader(body, m.end())
    try:
        arguments = reader.value() if reader.more() else {}
        reader.skip()
        if reader.more() or not isinstance(arguments, dict):
            return None
    except _Invalid:
        return None
    return m.group(1), arguments


class _Reader:
    def __init__(self, text: str, at: int) -> None:
        self._text = text
        self._at = at

    def more(self) -> bool:
        self.skip()
        return self._at < len(self._text)

    def skip(self) -> None:
        while self._at < len(self._text) and self._text[self._at].isspace():
            self._at += 1

    def _take(self, token: str) -> bool:
        self.skip()
        if self._text.startswith(token, self._at):
            self._at += len(token)
            return True
        return False

    def value(self) -> Any:
        self.skip()
        if self._take("{"):
            return dict(self._items("}", self._pair))
        if self._take("["):
            return self._items("]", self.value)
        if self._text.startswith(QUOTE, self._at) or self._text.startswith('"', self._at):
            return self._string()
        m = _LITERAL.match(self._text, self._at)
        if m is None:
            raise _Invalid(f"no value at {self._at}")
        self._at = m.end()
        word = m.group(0)
        if word in _WORDS:
            return _WORDS[word]
        return float(word) if any(c in word for c in ".eE") else int(word)

    def _items(self, close: str, item: Callable[[], Any]) -> list[Any]:
        parts: list[Any] = []
        if not self._take(close):
            while True:
                parts.append(item())
                if self._take(close):
                    break
                if not self._take(","):
                    raise _Invalid(f"expected , or {close} at {self._at}")
        return parts

    def _pair(self) -> tuple[str, Any]:
        self.skip()
        if self._text.startswith(QUOTE, self._at) or self._text.startswith('"', self._at):
            key = self._string()
        else:
            m = _BARE_KEY.match(self._text, self._at)
            if m is None:
                raise _Invalid(f"no key at {self._at}")
            key, self._at = m.group(0), m.end()
        if not isinstance(key, str) or not self._take(":"):
            raise _Invalid(f"expected : at {self._at}")
        return key, self.value()

    def _string(self) -> str:
        if self._text.startswith(QUOTE, self._at):
            end = self._text.find(QUOTE, self._at + len(QUOTE))
            if end < 0:
                raise _Invalid('unterminated <|"|> string')
            s = self._text[self._at + len(QUOTE) : end]
            self._at = end + len(QUOTE)
            return s
        try:
            s, self._at = json.JSONDecoder().raw_decode(self._text, self._at)
        except ValueError as exc:
            raise _Invalid(str(exc)) from None
        if not isinstance(s, str):
            raise _Invalid("expected a string")
        return s
