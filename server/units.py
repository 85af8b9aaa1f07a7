"""Sizes and durations as people write them, and sizes as every message and report writes them."""

from __future__ import annotations

import math
import re
from typing import Literal

_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from `123`, `512M`, `4G`, `1.5GiB` (binary units: the budget is about RAM)."""
    if isinstance(text, int):
        return text
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    suffix = value[-1:] if value[-1:] in _SIZE_SUFFIXES else ""
    number = value[: len(value) - len(suffix)] if suffix else value
    try:
        size = float(number) * _SIZE_SUFFIXES[suffix]
    except ValueError as exc:
        raise ValueError(f"not a size: {text!r} (use e.g. 512M or 4G)") from exc
    if size < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return int(size)


# what format_size writes: binary units, largest first; decimal MB and GB only when asked for (the
# committed bench reports' columns in MB, set beside disk rates in MB/s)
SizeUnit = Literal["TiB", "GiB", "MiB", "KiB", "B", "GB", "MB"]
_SIZE_UNITS: dict[SizeUnit, int] = {
    "TiB": 1 << 40,
    "GiB": 1 << 30,
    "MiB": 1 << 20,
    "KiB": 1 << 10,
    "B": 1,
    "GB": 10**9,
    "MB": 10**6,
}
_BINARY_UNITS: tuple[SizeUnit, ...] = ("TiB", "GiB", "MiB", "KiB", "B")


def format_size(
    n: float, *, unit: SizeUnit | None = None, digits: int | None = None, bare: bool = False
) -> str:
    """Bytes as every message, log line and report writes them: by default in the largest binary
    unit that leaves at least 1, with two decimals (4.50 MiB, 17.28 GiB; whole bytes below 1 KiB:
    512 B). `unit`: that unit whatever the size, for a table's column or figures set against one
    another; `digits`: that many decimals; `bare`: the number alone, for a column whose header
    names the unit (it needs `unit`)."""
    if unit is None:
        if bare:
            raise ValueError("a size written without its unit needs a fixed unit")
        # a name of its own: mypy would infer next()'s type from unit's, None included
        largest = next(u for u in _BINARY_UNITS if abs(n) >= _SIZE_UNITS[u] or u == "B")
        unit = largest
    size = _SIZE_UNITS[unit]
    places = (0 if size == 1 else 2) if digits is None else digits
    number = f"{n / size:.{places}f}"
    return number if bare else f"{number} {unit}"


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")


def parse_duration(text: str | float) -> float:
    """Seconds from a number of seconds (`300`, `-1`) or a Go duration (`5m`, `1h30m`, `2.5s`,
    `300ms`), as Ollama's keep_alive takes them; ValueError for anything else."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        body = str(text).strip()
        sign = -1.0 if body.startswith("-") else 1.0
        body = body.removeprefix("-")
        parts = _DURATION_PART.findall(body)
        if re.fullmatch(r"\d+(?:\.\d+)?", body):
            seconds = sign * float(body)
        elif parts and "".join(n + u for n, u in parts) == body:
            seconds = sign * sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
        else:
            raise ValueError(f"not a duration: {text!r} (use seconds or e.g. 30s, 5m, 1h30m; -1: never)")
    if not math.isfinite(seconds):
        raise ValueError(f"not a duration: {text!r}")
    return seconds
