"""Helpers of the output-parsing tests: feed text in slices, join pieces by kind."""

from __future__ import annotations


def feed_in_pieces(splitter: object, text: str, size: int) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for i in range(0, len(text), size):
        out.extend(splitter.feed(text[i : i + size]))  # type: ignore[attr-defined]
    out.extend(splitter.finish())  # type: ignore[attr-defined]
    return out


def joined(pieces: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for kind, text in pieces:
        out[kind] = out.get(kind, "") + text
    return out
