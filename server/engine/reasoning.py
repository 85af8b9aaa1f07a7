"""Split generated text into content, reasoning and tool-call bodies, incrementally.

llama-cpp-python has no parser for model output (its server leaves <think> blocks and
harmony channels in the content), so these small state machines are written here. Each
takes text deltas and returns (kind, text) pieces; a possible partial marker at the end of
a delta is held back until the next delta decides it.

Kinds: "content", "reasoning", and for harmony tool calls "tool:<name>" (the arguments).
"""

from __future__ import annotations

import re

Piece = tuple[str, str]

_HARMONY_MARKERS = (
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|start|>",
    "<|constrain|>",
    "<|call|>",
    "<|return|>",
)
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z]+)")


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class PlainSplitter:
    """No reasoning markup: everything is content."""

    def feed(self, text: str) -> list[Piece]:
        return [("content", text)] if text else []

    def finish(self) -> list[Piece]:
        return []


class ThinkSplitter:
    """Qwen3 / DeepSeek style: reasoning between <think> and </think>, content after."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, start_in_reasoning: bool = False) -> None:
        self._reasoning = start_in_reasoning
        self._buf = ""
        # models put newlines after either marker ("<think>\n", "</think>\n\n"); they are
        # part of neither the reasoning nor the answer
        self._strip_newlines = False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            marker = self.CLOSE if self._reasoning else self.OPEN
            at = self._buf.find(marker)
            if at < 0:
                break
            self._emit(out, self._buf[:at])
            self._buf = self._buf[at + len(marker) :]
            self._reasoning = not self._reasoning
            self._strip_newlines = True
        hold = _held_suffix(self._buf, (self.CLOSE if self._reasoning else self.OPEN,))
        self._emit(out, self._buf[: len(self._buf) - hold])
        self._buf = self._buf[len(self._buf) - hold :]
        return out

    def _emit(self, out: list[Piece], text: str) -> None:
        if self._strip_newlines:
            text = text.lstrip("\n")
            self._strip_newlines = not text
        if text:
            out.append(("reasoning" if self._reasoning else "content", text))

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        self._emit(out, self._buf)
        self._buf = ""
        return out


class GemmaSplitter(ThinkSplitter):
    """Gemma 4: reasoning in the thought channel, <|channel>thought ... <channel|>, content after
    (the markers are USER_DEFINED tokens, so they reach the text without special rendering)."""

    OPEN, CLOSE = "<|channel>thought", "<channel|>"


class HarmonySplitter:
    """gpt-oss harmony: <|channel|>analysis -> reasoning, final/commentary -> content,
    a header with to=functions.NAME -> that tool call's arguments."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_header = False
        self._header = ""
        self._kind = "content"  # output before any header is treated as the final answer

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            hits = [(self._buf.find(m), m) for m in _HARMONY_MARKERS]
            hits = [(at, m) for at, m in hits if at >= 0]
            if not hits:
                break
            at, marker = min(hits)
            self._text(out, self._buf[:at])
            self._buf = self._buf[at + len(marker) :]
            self._marker(marker)
        hold = _held_suffix(self._buf, _HARMONY_MARKERS)
        self._text(out, self._buf[: len(self._buf) - hold])
        self._buf = self._buf[len(self._buf) - hold :]
        return out

    def _text(self, out: list[Piece], text: str) -> None:
        if not text:
            return
        if self._in_header:
            self._header += text
        else:
            out.append((self._kind, text))

    def _marker(self, marker: str) -> None:
        if marker == "<|message|>":
            header = self._header
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search("<|channel|>" + header.split("<|channel|>")[-1]) if header else None
            if recipient is not None:
                self._kind = "tool:" + recipient.group(1)
            elif channel is not None and channel.group(1) == "analysis":
                self._kind = "reasoning"
            else:
                self._kind = "content"
            self._in_header, self._header = False, ""
        elif marker == "<|channel|>":
            if not self._in_header:
                self._in_header, self._header = True, ""
            self._header += "<|channel|>"
        elif marker in ("<|start|>", "<|end|>", "<|call|>", "<|return|>"):
            self._in_header, self._header = True, ""
        elif marker == "<|constrain|>":
            self._header += " "

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if not self._in_header:
            self._text(out, self._buf)
        self._buf = ""
        return out


Splitter = PlainSplitter | ThinkSplitter | HarmonySplitter


def make_splitter(style: str, prompt: str) -> Splitter:
    """The splitter for a template's reasoning style; `prompt` tells if a <think> is open."""
    if style == "harmony":
        return HarmonySplitter()
    if style in ("think", "gemma"):
        kind = ThinkSplitter if style == "think" else GemmaSplitter
        tail = prompt.rstrip()
        opened = tail.rfind(kind.OPEN) > tail.rfind(kind.CLOSE)
        return kind(start_in_reasoning=opened)
    return PlainSplitter()
