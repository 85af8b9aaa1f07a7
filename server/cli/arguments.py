"""The command line's flags, from the settings groups (server/settings.py) by pydantic-settings'
CLI source: kebab-case flags, `--x/--no-x` booleans, repeatable lists. What the source is told
here keeps today's spellings: a field's own flag or short flag (`json_schema_extra`), and help
that names the default and the environment variable. Unset flags stay None, so the lower sources
(environment, TOML, defaults) still apply."""

from __future__ import annotations

import argparse
from collections.abc import Set
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_settings import CliSettingsSource

from server.settings import ModelSettings, ServerSettings, Settings

S = TypeVar("S", bound=Settings)


def flags_of(name: str, field: FieldInfo) -> list[str]:
    """A field's flags: its own (`flag`, `short`) or `--kebab-case` of its name."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    flag = extra.get("flag")
    short = extra.get("short")
    long = flag if isinstance(flag, str) else "--" + name.replace("_", "-")
    return [short, long] if isinstance(short, str) else [long]


def _help(cls: type[Settings], name: str, field: FieldInfo) -> str:
    """The field's description, its default (unless the description says what it is) and its
    environment variable."""
    env = f"env {cls.model_config.get('env_prefix', '')}{name.upper()}"
    if "(default: " in str(field.description):
        return f"{field.description} ({env})"
    default = field.get_default(call_default_factory=True)
    shown = "unset" if default in (None, []) else default
    return f"{field.description} (default: {shown}; {env})"


def _metavar(field: FieldInfo) -> str | None:
    """`{a,b}` for a choice of words, else argparse's own (the flag's name in capitals)."""
    choices = get_args(field.annotation) if get_origin(field.annotation) is Literal else ()
    return "{" + ",".join(str(c) for c in choices) + "}" if choices else None


def _source(cls: type[Settings], group: Any, leave_out: Set[str] = frozenset()) -> CliSettingsSource[Any]:
    """pydantic-settings' CLI source for `cls`, its flags but those of `leave_out` added to `group`."""

    def add(_parser: Any, *_names: str, **kwargs: Any) -> Any:
        name = kwargs["dest"]
        field = cls.model_fields[name]
        if name in leave_out:
            return None
        kwargs.update(help=_help(cls, name, field), default=None)
        if "metavar" in kwargs:  # booleans have none
            kwargs["metavar"] = _metavar(field)
        return group.add_argument(*flags_of(name, field), **kwargs)

    return CliSettingsSource(
        cls,
        root_parser=argparse.ArgumentParser(add_help=False),
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_exit_on_error=False,
        cli_parse_none_str="\0",  # no value a flag can be given means unset ("null" is a file name)
        add_argument_method=add,
    )


def add_arguments(
    parser: argparse.ArgumentParser, classes: tuple[type[Settings], ...], leave_out: Set[str] = frozenset()
) -> None:
    """Add `--config` and one flag per field of `classes` but those of `leave_out` (serve: the
    server's, the model's and the store's; generate: the model's and the route trace's), a group
    per class."""
    tables = ", ".join(f"[{cls.TABLE}]" for cls in classes)
    parser.add_argument("--config", type=Path, default=None, help=f"TOML file with {tables}")
    for cls in classes:
        _source(cls, parser.add_argument_group(cls.__name__.removesuffix("Settings").lower()), leave_out)


def settings_of(cls: type[S], args: argparse.Namespace) -> S:
    """The settings `cls` a command line gave: its flags over the environment over its --config
    TOML file over the defaults."""
    given = {name: value for name in cls.model_fields if (value := getattr(args, name, None)) is not None}
    source = _source(cls, argparse.ArgumentParser(add_help=False))
    return cls.read(source(parsed_args=given), getattr(args, "config", None))


def settings_from_args(args: argparse.Namespace) -> tuple[ServerSettings, ModelSettings]:
    """The server's and the model's settings a `serve` command line gave."""
    return settings_of(ServerSettings, args), settings_of(ModelSettings, args)


def given_flags(args: argparse.Namespace, cls: type[Settings], skip: tuple[str, ...] = ()) -> list[str]:
    """The flags of `cls` that a command line gave, as argv again (the bench passes them on to
    every `generate` it runs); fields in `skip` left out."""
    argv: list[str] = []
    for name, field in cls.model_fields.items():
        value = getattr(args, name, None)
        if value is None or name in skip:
            continue
        flag = flags_of(name, field)[-1]
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(value, list):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv
