"""Settings: sizes (read and written), precedence of CLI over environment over TOML, the shipped
config, refusals."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from server.cli.arguments import add_arguments, settings_from_args
from server.errors import ConfigError
from server.settings import GROUPS, ModelSettings, ServerSettings, load_settings
from server.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [("123", 123), ("4k", 4096), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("2g", 2 << 30)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (9 << 19, "4.50 MiB"), (5 << 40, "5.00 TiB")],
)
def test_format_size_picks_the_largest_unit(n: int, text: str) -> None:
    assert format_size(n) == text
    assert format_size(-n) == ("-" if n else "") + text


def test_format_size_in_a_fixed_unit_and_digits() -> None:
    # a table's column keeps one unit, however small or large the figure
    assert format_size(9 << 29, unit="GiB", digits=2) == "4.50 GiB"
    assert format_size(3 << 20, unit="GiB", digits=2) == "0.00 GiB"
    assert format_size(9 << 29, unit="MiB", digits=0) == "4608 MiB"
    assert format_size(-352 << 20, unit="MiB", digits=0) == "-352 MiB"  # a budget's shortfall
    assert format_size(1536, unit="KiB", digits=1) == "1.5 KiB"
    assert format_size(1536, unit="KiB") == "1.50 KiB"  # two decimals unless told
    assert format_size(512, unit="B") == "512 B"
    assert format_size(9 << 19, digits=1) == "4.5 MiB"
    assert format_size(165.3 * 2**20, unit="MiB", digits=1) == "165.3 MiB"  # a mean per token
    # decimal units only when asked for: the bench reports' columns beside disk rates in MB/s
    assert format_size(890 * 10**6, unit="MB", digits=0) == "890 MB"
    assert format_size(17_990_000_000, unit="GB", digits=2) == "17.99 GB"
    assert format_size(17_990_000_000) == "16.75 GiB"


def test_format_size_bare_is_the_number_of_a_named_column() -> None:
    assert format_size(9 << 29, unit="MiB", digits=0, bare=True) == "4608"
    with pytest.raises(ValueError, match="needs a fixed unit"):
        format_size(1024, bare=True)


def test_settings_precedence_cli_over_env_over_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "moeflash.toml"
    config.write_text('[server]\nport = 9001\nhost = "0.0.0.0"\nmax_queue = 3\n[model]\nctx_size = 1024\n')
    monkeypatch.setenv("MOEFLASH_PORT", "9002")
    monkeypatch.setenv("MOEFLASH_CORS_ORIGINS", "http://a.example, http://b.example")
    server, model = load_settings({"port": "9003", "max_queue": None}, config)
    assert server.port == 9003  # CLI
    assert server.cors_origins == ["http://a.example", "http://b.example"]  # env
    assert server.host == "0.0.0.0" and server.max_queue == 3  # TOML
    assert model.ctx_size == 1024
    server, _ = load_settings({}, config)
    assert server.port == 9002


def test_shipped_config_file_is_valid() -> None:
    config = Path(__file__).resolve().parents[1] / "configs" / "default.toml"
    for group in GROUPS:  # every table is there, and holds the defaults
        assert group.read({}, config).model_dump() == group.read({}).model_dump(), group.TABLE
    assert set(tomllib.loads(config.read_text())) == {group.TABLE for group in GROUPS}


def test_prefetch_written_as_on_or_off_still_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    # configs and env vars from before --prefetch router|history|off said true or false
    assert ModelSettings(prefetch=True).prefetch == "router"
    assert ModelSettings(prefetch=False).prefetch == "off"
    monkeypatch.setenv("MOEFLASH_PREFETCH", "false")
    assert ModelSettings().prefetch == "off"
    with pytest.raises(ValidationError):
        ModelSettings(prefetch="sometimes")


def test_automatic_flash_attention_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "auto" once turned flash attention on when memory ran short, which changed the text
    config = tmp_path / "moeflash.toml"
    config.write_text('[model]\nflash_attn = "auto"\n')
    with pytest.raises(ConfigError, match="'auto' .* is gone"):
        load_settings({}, config)
    monkeypatch.setenv("MOEFLASH_FLASH_ATTN", "auto")
    with pytest.raises(ConfigError, match="'auto' .* is gone"):
        load_settings({})
    monkeypatch.setenv("MOEFLASH_FLASH_ATTN", "on")
    assert load_settings({})[1].flash_attn == "on"
    assert ModelSettings.model_fields["flash_attn"].default == "off"


@pytest.mark.parametrize(
    "cli",
    [
        pytest.param({"port": "70000"}, id="port"),
        pytest.param({"ctx_size": "1"}, id="ctx"),
        pytest.param({"budget": "lots"}, id="budget"),
        pytest.param({"queue_full_status": "500"}, id="status"),
    ],
)
def test_bad_settings_are_a_config_error(cli: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        load_settings(cli)


def test_api_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    server, _ = load_settings({"api_key_file": key_file})
    assert server.resolved_api_key() == "s3cret"
    key_file.write_text("")
    with pytest.raises(ConfigError):
        server.resolved_api_key()


def test_alias_star_is_off_by_default() -> None:
    _, model = load_settings({})
    assert model.any_model is False and model.model_aliases == []
    _, model = load_settings({"alias": ["gpt-4o"]})
    assert model.any_model is False and model.model_aliases == ["gpt-4o"]


def test_alias_star_from_flag_env_and_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, (ServerSettings, ModelSettings))
    _, model = settings_from_args(parser.parse_args(["--alias", "my-model", "--alias", "*"]))
    # '*' is a rule, never a name: the model's names (and its id, the first) leave it out
    assert model.any_model is True and model.model_aliases == ["my-model"]
    _, model = settings_from_args(parser.parse_args(["--alias", "*", "--alias", "my-model"]))
    assert model.any_model is True and model.model_aliases == ["my-model"]
    monkeypatch.setenv("MOEFLASH_ALIAS", "a, *")
    _, model = load_settings({})
    assert model.any_model is True and model.model_aliases == ["a"]
    monkeypatch.delenv("MOEFLASH_ALIAS")
    config = tmp_path / "moeflash.toml"
    config.write_text('[model]\nalias = ["*"]\n')
    _, model = load_settings({}, config)
    assert model.any_model is True and model.model_aliases == []


def test_alias_star_is_documented_in_the_flag_help() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, (ServerSettings, ModelSettings))
    assert "'*'" in parser.format_help()
