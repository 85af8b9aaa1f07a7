"""The files of a model: one GGUF, or every file of a gguf-split set named by its first file."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path, PurePath

# the part suffix gguf-split and llama.cpp give a split set's files: x-00001-of-00003.gguf
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_part(name: str) -> tuple[str, int, int] | None:
    """(prefix, index, count) of a split set's file name, None for any other name."""
    found = _SPLIT.match(name)
    if found is None:
        return None
    return found["prefix"], int(found["index"]), int(found["count"])


def split_files(path: Path) -> list[Path]:
    """All files of a model: `x-00001-of-00003.gguf` expands to its three parts."""
    part = split_part(path.name)
    if part is None:
        return [path]
    prefix, _, count = part
    return [path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def model_stem(path: PurePath) -> str:
    """The name a model goes by: its file stem, without a split set's part suffix."""
    part = split_part(path.name)
    return part[0] if part is not None else path.name.removesuffix(".gguf")


def gguf_models(paths: Iterable[Path]) -> list[Path]:
    """The models among `paths`, each by its (first) file, sorted: every GGUF file and every
    complete split set; vision projectors (mmproj*) are not models."""
    found: list[Path] = []
    for path in sorted(paths):
        name = path.name.lower()
        if not name.endswith(".gguf") or name.startswith("mmproj"):
            continue
        part = split_part(path.name)
        if part is not None and part[1] != 1:
            continue
        if all(p.is_file() for p in split_files(path)):
            found.append(path)
    return found
