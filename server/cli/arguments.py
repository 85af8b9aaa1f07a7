"""The command line's flags, made from the settings' fields (server/settings.py): one flag per
field, with its description, default and environment variable; unset flags stay None so the
lower sources (environment, TOML, defaults) still apply."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from server.settings import ENV_PREFIX, SETTINGS_CLASSES, ModelSettings, ServerSettings, load_settings


def flags_of(name: str, field: FieldInfo) -> list[str]:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    flag = extra.get("flag")
    short = extra.get("short")
    long = flag if isinstance(flag, str) else "--" + name.replace("_", "-")
    return [short, long] if isinstance(short, str) else [long]


def add_arguments(
    parser: argparse.ArgumentParser, classes: tuple[type[BaseSettings], ...] = SETTINGS_CLASSES
) -> None:
    """Add one flag per field of `classes` (serve: both; generate and bench: the model's); unset
    flags stay None so lower sources (env, TOML, defaults) still apply."""
    tables = " and ".join(
        f"[{cls.__name__.removesuffix('Settings').lower()}]" for cls in classes if cls in SETTINGS_CLASSES
    )
    if tables:  # only the server's and the model's settings are read from a TOML file
        parser.add_argument("--config", type=Path, default=None, help=f"TOML file with {tables}")
    for cls in classes:
        group = parser.add_argument_group(cls.__name__.removesuffix("Settings").lower())
        for name, field in cls.model_fields.items():
            default = field.get_default(call_default_factory=True)
            shown = "unset" if default in (None, []) else default
            prefix = cls.model_config.get("env_prefix") or ENV_PREFIX
            help_text = f"{field.description} (default: {shown}; env {prefix}{name.upper()})"
            flags = flags_of(name, field)
            if field.annotation == list[str]:
                group.add_argument(*flags, dest=name, action="append", help=help_text)
            elif field.annotation is bool:
                group.add_argument(
                    *flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
                )
            else:
                choices = get_args(field.annotation) if get_origin(field.annotation) is Literal else ()
                metavar = "{" + ",".join(str(c) for c in choices) + "}" if choices else None
                group.add_argument(*flags, dest=name, default=None, metavar=metavar, help=help_text)


def given_flags(args: argparse.Namespace, cls: type[BaseSettings], skip: tuple[str, ...] = ()) -> list[str]:
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


def settings_from_args(
    args: argparse.Namespace, classes: tuple[type[BaseSettings], ...] = SETTINGS_CLASSES
) -> tuple[ServerSettings, ModelSettings]:
    """The settings a command line gave (flags over env over its --config TOML over defaults)."""
    cli = {name: getattr(args, name, None) for cls in classes for name in cls.model_fields}
    return load_settings(cli, getattr(args, "config", None))
