"""Which files `REPO[:QUANT]` names in a Hub repository's tree: one GGUF model, taken whole.

A repository's files are grouped into models: a single `.gguf` file, or every part of a
gguf-split set (`x-00001-of-00003.gguf`, ...) as one; vision projectors (`mmproj*`) are not
models. QUANT is matched case-insensitively against each model's path as a word: `q4_k_m` finds
`Qwen3-30B-A3B-Q4_K_M.gguf` and `Q4_K_M/x-00001-of-00002.gguf`, never `IQ4_K_M`; a model whose
word ends there wins over one it only begins (`Q4_K` prefers `x-Q4_K.gguf` to `x-Q4_K_M.gguf`),
and a QUANT that is a whole path in the repository names that file. No QUANT takes the
repository's only model, else its Q4_K_M (the quant llama.cpp and Ollama default to). Nothing
found, or more than one model, is a PullError that lists the candidates.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

from server.errors import PullError
from server.loading.model_files import model_stem, split_part

GGUF_SUFFIX = ".gguf"
DEFAULT_QUANT = "Q4_K_M"


@dataclass(frozen=True)
class HubFile:
    """A file of a repository as the Hub's tree lists it."""

    path: str  # in the repository, e.g. "Q4_K_M/x-00001-of-00002.gguf"
    size: int  # bytes
    sha256: str | None  # the LFS object's sha256; None for a file the Hub keeps as a git blob


@dataclass(frozen=True)
class HubModel:
    """One model of a repository: a GGUF file, or a split set's files in part order."""

    files: tuple[HubFile, ...]

    @property
    def name(self) -> str:
        """The name it is served and listed by (the first file's stem, no part suffix)."""
        return model_stem_of(self.files[0].path)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def label(self) -> str:
        """The first file's path, plus the number of parts of a split set (for messages)."""
        more = f" (+{len(self.files) - 1} parts)" if len(self.files) > 1 else ""
        return self.files[0].path + more


def model_stem_of(path: str) -> str:
    """The served name of the model whose (first) file is at `path` in a repository."""
    return model_stem(PurePosixPath(path))


def parse_ref(ref: str) -> tuple[str, str | None]:
    """`owner/name[:QUANT]` -> (repo id, QUANT or None); a PullError for anything else."""
    repo, _, quant = ref.partition(":")
    parts = repo.split("/")
    if len(parts) != 2 or not all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", p) for p in parts):
        raise PullError(f"{ref!r} is not a Hub model: write it as OWNER/NAME or OWNER/NAME:QUANT")
    return repo, quant or None


def group_models(files: Iterable[HubFile]) -> tuple[list[HubModel], list[str]]:
    """The repository's models (by path), and the paths of split sets with parts missing."""
    singles: list[HubModel] = []
    sets: dict[tuple[str, int], dict[int, HubFile]] = {}
    for f in files:
        base = f.path.rsplit("/", 1)[-1]
        if not base.lower().endswith(GGUF_SUFFIX) or base.lower().startswith("mmproj"):
            continue
        part = split_part(f.path)
        if part is None:
            singles.append(HubModel((f,)))
        else:
            prefix, index, count = part
            sets.setdefault((prefix, count), {})[index] = f
    models = list(singles)
    broken: list[str] = []
    for (prefix, count), parts in sets.items():
        if sorted(parts) == list(range(1, count + 1)):
            models.append(HubModel(tuple(parts[i] for i in range(1, count + 1))))
        else:
            broken.append(f"{prefix}-*-of-{count:05d}.gguf ({len(parts)} of {count} parts)")
    return sorted(models, key=lambda m: m.files[0].path), broken


def _word(quant: str, ends: bool) -> re.Pattern[str]:
    # a word of the path: no letter or digit before it; after it none, nor (ends) an underscore
    after = r"(?![a-z0-9_])" if ends else r"(?![a-z0-9])"
    return re.compile(r"(?<![a-z0-9])" + re.escape(quant.lower()) + after)


def _candidates(models: list[HubModel]) -> str:
    return "; ".join(f"{m.label}" for m in models)


def choose(repo: str, quant: str | None, files: list[HubFile]) -> HubModel:
    """The model `repo:quant` names among the repository's `files` (see the module's rules)."""
    models, broken = group_models(files)
    if not models:
        held = ", ".join(f.path for f in files[:8]) + (", ..." if len(files) > 8 else "")
        incomplete = f"; incomplete split sets: {', '.join(broken)}" if broken else ""
        raise PullError(f"{repo} holds no GGUF model (its files: {held or 'none'}){incomplete}")
    if quant is None:
        if len(models) == 1:
            return models[0]
        found = [m for m in models if _word(DEFAULT_QUANT, True).search(m.files[0].path.lower())]
        if len(found) == 1:
            return found[0]
        raise PullError(
            f"{repo} holds {len(models)} models: name one as {repo}:QUANT; candidates: {_candidates(models)}"
        )
    by_path = [m for m in models if any(f.path.lower() == quant.lower() for f in m.files)]
    if by_path:
        return by_path[0]
    if any(f.path.lower() == quant.lower() for f in files):
        raise PullError(f"{repo}: {quant} is not a GGUF file, and only GGUF models can be pulled")
    for ends in (True, False):
        found = [m for m in models if _word(quant, ends).search(m.files[0].path.lower())]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise PullError(
                f"{repo}:{quant} is ambiguous, {len(found)} models match: {_candidates(found)}; "
                f"name one by a longer quant or its file name"
            )
    raise PullError(f"{repo} has no model matching {quant!r}; it holds: {_candidates(models)}")
