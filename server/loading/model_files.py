"""The files of a model: one GGUF, or every file of a gguf-split set named by its first file."""

from __future__ import annotations

from pathlib import Path


def split_files(path: Path) -> list[Path]:
    """All files of a model: `x-00001-of-00003.gguf` expands to its three parts."""
    stem = path.name
    marker = stem.rfind("-of-")
    if stem.endswith(".gguf") and marker > 6 and stem[marker - 6] == "-":
        try:
            count = int(stem[marker + 4 : -5])
        except ValueError:
            return [path]
        prefix = stem[: marker - 6]
        return [path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    return [path]
