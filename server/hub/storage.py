"""Where pulled models live: the Hugging Face cache (the default) or a models directory.

The cache (HF_HUB_CACHE) is laid out as huggingface_hub lays it out, so its tools see the files:
models--OWNER--NAME/blobs/<sha256>, snapshots/<commit>/<path> -> ../../blobs/<sha256>, and
refs/main holding the commit. A models directory holds the files flat, by their base names (a
split set's parts side by side), as `serve --models-dir` reads it. A file being downloaded is
`<its final path>.incomplete` (in the cache, blobs/<sha256>.incomplete): it gets its final name
only once its sha256 matched the Hub's, so nothing partial ever looks complete.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from server.hub.catalog import GGUF_SUFFIX, HubFile
from server.loading.model_files import gguf_models, model_stem, split_files

PARTIAL_SUFFIX = ".incomplete"


@dataclass(frozen=True)
class LocalModel:
    """A model on disk: its files (the first one is what `serve --model` takes)."""

    name: str  # the file stem without a split suffix: the id `serve` gives it
    files: tuple[Path, ...]
    origin: str  # "OWNER/NAME@commit" for the cache, the directory for a models directory

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.files if p.exists())


class Storage(Protocol):
    """One place models are pulled into, listed from and removed from."""

    def destination(self, repo: str, commit: str, file: HubFile) -> Path:
        """The path the verified file gets."""
        ...

    def partial(self, repo: str, commit: str, file: HubFile) -> Path:
        """The path the file is downloaded to, kept across interrupted pulls."""
        ...

    def place(self, repo: str, commit: str, file: HubFile) -> Path:
        """Give the verified partial file its final path (returned)."""
        ...

    def models(self) -> list[LocalModel]:
        """Every complete model held here."""
        ...

    def remove(self, model: LocalModel) -> list[Path]:
        """Delete `model`'s files (returned), and what only they used."""
        ...


def _gguf_models(files: list[Path], origin: str) -> list[LocalModel]:
    # one entry per single GGUF or complete split set, named by its first file
    return [LocalModel(model_stem(p), tuple(split_files(p)), origin) for p in gguf_models(files)]


class DirectoryStorage:
    """A models directory: GGUF files by their base names."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def destination(self, repo: str, commit: str, file: HubFile) -> Path:
        return self.directory / PurePosixPath(file.path).name

    def partial(self, repo: str, commit: str, file: HubFile) -> Path:
        final = self.destination(repo, commit, file)
        return final.with_name(final.name + PARTIAL_SUFFIX)

    def place(self, repo: str, commit: str, file: HubFile) -> Path:
        final = self.destination(repo, commit, file)
        os.replace(self.partial(repo, commit, file), final)
        return final

    def models(self) -> list[LocalModel]:
        if not self.directory.is_dir():
            return []
        return _gguf_models([p for p in self.directory.iterdir() if p.is_file()], str(self.directory))

    def remove(self, model: LocalModel) -> list[Path]:
        for path in model.files:
            path.unlink(missing_ok=True)
        return list(model.files)


def _repo_folder(repo: str) -> str:
    # huggingface_hub's name for a model repository's folder in its cache
    return "models--" + repo.replace("/", "--")


def default_storage(models_dir: Path | None) -> Storage:
    """`models_dir` as a models directory, else the Hugging Face cache (HF_HUB_CACHE, as
    huggingface_hub read it when it was imported)."""
    if models_dir is not None:
        return DirectoryStorage(models_dir)
    from huggingface_hub import constants

    return CacheStorage(Path(constants.HF_HUB_CACHE))


class CacheStorage:
    """The Hugging Face cache, in huggingface_hub's layout."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir

    def _blob(self, repo: str, file: HubFile) -> Path:
        assert file.sha256 is not None  # pull refuses a file without one before asking for a path
        return self.cache_dir / _repo_folder(repo) / "blobs" / file.sha256

    def destination(self, repo: str, commit: str, file: HubFile) -> Path:
        return self.cache_dir / _repo_folder(repo) / "snapshots" / commit / file.path

    def partial(self, repo: str, commit: str, file: HubFile) -> Path:
        blob = self._blob(repo, file)
        return blob.with_name(blob.name + PARTIAL_SUFFIX)

    def place(self, repo: str, commit: str, file: HubFile) -> Path:
        blob = self._blob(repo, file)
        os.replace(self.partial(repo, commit, file), blob)
        link = self.destination(repo, commit, file)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
        refs = self.cache_dir / _repo_folder(repo) / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        (refs / "main").write_text(commit)
        return link

    def models(self) -> list[LocalModel]:
        found: list[LocalModel] = []
        if not self.cache_dir.is_dir():
            return found
        for folder in sorted(self.cache_dir.glob("models--*--*")):
            repo = folder.name.removeprefix("models--").replace("--", "/", 1)
            for snapshot in sorted((folder / "snapshots").glob("*")):
                by_dir: dict[Path, list[Path]] = {}
                for path in snapshot.rglob("*" + GGUF_SUFFIX):
                    by_dir.setdefault(path.parent, []).append(path)
                for files in by_dir.values():
                    found += _gguf_models(files, f"{repo}@{snapshot.name[:12]}")
        return found

    def remove(self, model: LocalModel) -> list[Path]:
        removed: list[Path] = []
        for link in model.files:
            blob = link.resolve()
            folder = next(p for p in link.parents if p.name.startswith("models--"))
            link.unlink(missing_ok=True)
            removed.append(link)
            still_used = any(p.resolve() == blob for p in (folder / "snapshots").rglob("*") if p.is_symlink())
            if not still_used and blob.is_file():
                blob.unlink()
        for link in model.files:
            folder = next(p for p in link.parents if p.name.startswith("models--"))
            if folder.is_dir() and not any(p.is_symlink() for p in (folder / "snapshots").rglob("*")):
                shutil.rmtree(folder)
        return removed
