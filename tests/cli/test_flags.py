"""One settings model generates the model flags of serve, generate and the benchmarks that run
the model (bench suite, warm-start and prompt-cache) alike."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from server.cli import build_parser
from server.cli.arguments import given_flags, settings_from_args, settings_of
from server.errors import ConfigError
from server.settings import (
    GROUPS,
    ModelSettings,
    RouteTraceSettings,
    ServerSettings,
    StoreSettings,
    WorkerSettings,
)


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
    generated = settings_of(ModelSettings, _subcommand("generate").parse_args(argv))
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
    settings = settings_of(ModelSettings, generate)
    assert settings.lanes == 2 and settings.overlap is False and settings.alias == ["a", "b"]
    assert settings.budget == 1 << 30
    assert given_flags(bench, ModelSettings, skip=("lanes", "overlap", "alias", "budget")) == []


def test_every_settings_group_reads_its_table_below_flags_and_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "moeflash.toml"
    config.write_text(
        '[server]\nport = 9001\n[model]\nlanes = 3\nctx_size = 1024\n[store]\nmodels_dir = "~/m"\n'
        '[route_trace]\nprefetch_trace_error = 0.25\n[worker]\nport = 50060\ncache_max = "1G"\n'
    )
    monkeypatch.setenv("MOEFLASH_CTX_SIZE", "2048")
    monkeypatch.setenv("MOEFLASH_WORKER_PORT", "50061")
    serve = _subcommand("serve").parse_args(["--config", str(config), "--lanes", "5"])
    server, model = settings_from_args(serve)
    assert server.port == 9001 and model.lanes == 5 and model.ctx_size == 2048  # TOML, flag, env
    assert settings_of(StoreSettings, serve).models_dir == Path.home() / "m"
    generate = _subcommand("generate").parse_args(["--config", str(config)])
    assert settings_of(RouteTraceSettings, generate).prefetch_trace_error == 0.25
    worker = settings_of(WorkerSettings, _subcommand("worker").parse_args(["--config", str(config)]))
    assert worker.port == 50061 and worker.cache_max == 1 << 30  # env over TOML
    assert {group.TABLE for group in GROUPS} == {"server", "model", "store", "route_trace", "worker"}


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ("[model]\nctx_sise = 1024\n", r"\[model\] has no setting ctx_sise"),
        ("[modle]\nctx_size = 1024\n", r"unknown tables \['modle'\]"),
        ("[model]\nctx_size = \n", "cannot read the config file"),
        ("[model]\nctx_size = 10\n", "ctx_size"),
        ('model = "m.gguf"\n', "model must be a table"),
    ],
)
def test_a_config_file_is_read_whole_or_refused(tmp_path: Path, text: str, refusal: str) -> None:
    config = tmp_path / "moeflash.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=refusal):
        settings_from_args(_subcommand("serve").parse_args(["--config", str(config)]))


def test_bench_passes_its_config_file_to_every_run(tmp_path: Path) -> None:
    from server.cli.bench import run_flags

    config = tmp_path / "moeflash.toml"
    config.write_text('[model]\nlanes = 3\nreader = "buffered"\n')
    bench = _subcommand("bench suite").parse_args(["--shape", "x", "--config", str(config), "--lanes", "2"])
    flags = run_flags(bench)
    assert flags == ["--config", str(config), "--lanes", "2"]
    settings = settings_of(ModelSettings, _subcommand("generate").parse_args(["-m", "m.gguf", *flags]))
    assert settings.lanes == 2 and settings.reader == "buffered"
