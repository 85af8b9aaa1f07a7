"""One settings model generates the model flags of serve, generate and the benchmarks that run
the model (bench suite, warm-start and prompt-cache) alike."""

from __future__ import annotations

import argparse

import pytest

from server.cli import build_parser
from server.cli.arguments import given_flags, settings_from_args
from server.settings import ModelSettings, ServerSettings


def _subcommand(path: str) -> argparse.ArgumentParser:
    """The parser of a (sub)command by its words, e.g. "bench suite"."""
    chosen = build_parser()
    for name in path.split():
        sub = next(a for a in chosen._actions if isinstance(a, argparse._SubParsersAction))
        chosen = sub.choices[name]
    return chosen


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize(
    "command", ["serve", "generate", "bench suite", "bench warm-start", "bench prompt-cache"]
)
def test_every_model_setting_is_a_flag_of_every_command(command: str) -> None:
    options = _options(_subcommand(command))
    for name in ModelSettings.model_fields:
        assert "--" + name.replace("_", "-") in options, (command, name)
    assert {"-m", "-c", "-t"} <= options


def test_server_settings_are_flags_of_serve_only() -> None:
    serve, generate = _options(_subcommand("serve")), _options(_subcommand("generate"))
    for name, field in ServerSettings.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flag = str(extra.get("flag", "--" + name.replace("_", "-")))
        assert flag in serve and flag not in generate, (name, flag)
    assert {"--host", "--api-key", "--max-queue"} <= serve


def test_generate_reads_the_same_settings_as_serve() -> None:
    argv = ["--model", "m.gguf", "--budget", "all", "--cache-policy", "lru", "--reader", "buffered"]
    argv += ["--prefetch", "history", "--preload", "-c", "2048", "--n-batch", "64", "--mode", "streaming"]
    _, served = settings_from_args(_subcommand("serve").parse_args(argv))
    _, generated = settings_from_args(_subcommand("generate").parse_args(argv), (ModelSettings,))
    assert served.model_dump() == generated.model_dump()
    assert generated.budget == "all" and generated.preload and generated.prefetch == "history"
    config = generated.streamer_config()
    assert (
        config.policy.name == "LRU" and config.reader.name == "BUFFERED" and config.prefetch.name == "HISTORY"
    )


def test_bench_passes_the_model_flags_it_was_given_to_generate() -> None:
    bench = _subcommand("bench suite").parse_args(
        ["--shape", "x", "--lanes", "2", "--no-overlap", "--alias", "a", "--alias", "b", "--budget", "1G"]
    )
    flags = given_flags(bench, ModelSettings, skip=("model",))
    generate = _subcommand("generate").parse_args(["--model", "m.gguf", *flags])
    _, settings = settings_from_args(generate, (ModelSettings,))
    assert settings.lanes == 2 and settings.overlap is False and settings.alias == ["a", "b"]
    assert settings.budget == 1 << 30
    assert given_flags(bench, ModelSettings, skip=("lanes", "overlap", "alias", "budget")) == []
