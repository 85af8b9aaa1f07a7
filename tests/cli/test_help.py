"""Every command's `--help`, as a user reads it, held to the text committed in tests/cli/help/:
a change to the flags, their spelling, help or defaults shows up here as a diff to review.

`python -m tests.cli.test_help` writes the files anew (after a change meant to be seen)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.cli import build_parser

HELP_DIR = Path(__file__).with_name("help")
COLUMNS = "100"


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield words
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*words, name))


def _parser_of(words: tuple[str, ...]) -> argparse.ArgumentParser:
    chosen = build_parser()
    for name in words:
        sub = next(a for a in chosen._actions if isinstance(a, argparse._SubParsersAction))
        chosen = sub.choices[name]
    return chosen


def help_text(words: tuple[str, ...]) -> str:
    """The `--help` of `moeflash <words>` at a fixed width, this machine's home written `~`."""
    os.environ["COLUMNS"] = COLUMNS  # argparse reads the width from the environment
    text = _parser_of(words).format_help()
    return text.replace(str(Path.home()), "~")


def _file(words: tuple[str, ...]) -> Path:
    return HELP_DIR / ("-".join(("moeflash", *words)) + ".txt")


def all_commands() -> list[tuple[str, ...]]:
    return list(_commands(build_parser()))


@pytest.mark.parametrize("words", all_commands(), ids=lambda w: " ".join(("moeflash", *w)))
def test_help_is_the_committed_text(words: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", COLUMNS)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    path = _file(words)
    assert path.exists(), f"no committed help for {' '.join(words)}: run python -m tests.cli.test_help"
    assert help_text(words) == path.read_text(encoding="utf-8"), (
        f"moeflash {' '.join(words)} --help changed; if meant, run python -m tests.cli.test_help and "
        "review the diff"
    )


def test_every_committed_help_is_a_command() -> None:
    expected = {_file(words).name for words in all_commands()}
    assert {p.name for p in HELP_DIR.glob("*.txt")} == expected


def main() -> int:
    os.environ.pop("XDG_STATE_HOME", None)
    HELP_DIR.mkdir(exist_ok=True)
    for stale in HELP_DIR.glob("*.txt"):
        stale.unlink()
    for words in all_commands():
        _file(words).write_text(help_text(words), encoding="utf-8")
        print("wrote", _file(words).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
