"""Serving a directory of models, one loaded at a time: which model a request names, and the switch.

`ModelSwitch.using(model_id)` is how a route gets the model it prepares a request on: the model
is leased until the block ends (the checks, the template, the tokens and the job's submission;
the lease and its keep_alive: server/lifecycle/residency.py). A request that names another model of
the directory switches: in arrival order (the residency's FIFO lock), it waits until no lease is
held and the engine has no running or waiting job, then the engine releases its model and loads
the other (`Engine.restart`). A job is queued on the model it was
prepared on, and that model is released only once no job runs or waits, so no request is ever
served on another model; interleaved requests for two models are served in arrival order, a
switch each time. Everything a model owns (its warm start, its prompt cache) goes with it.

The directory is read again when it changed (one stat of it tells: a pull renames each file into
place) whenever the models are listed and whenever a request names one (`rescan`): a model pulled
into it is served from then on, and one deleted is gone, except the loaded one while the engine
holds it (its open file outlives the name): it is served until it is released or switched from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool

from server.engine.worker import Engine, EngineState
from server.errors import ModelLoadError, NotFound
from server.lifecycle.residency import LOAD_WAIT_S, Residency
from server.loading.gguf_header import read_metadata
from server.loading.loader import LoadedModel
from server.loading.model_files import gguf_models, model_stem, split_files

logger = logging.getLogger(__name__)

# a directory modified this recently may change again without its mtime moving (file system
# timestamps are coarser than a nanosecond): it is read again on the next call, as git treats a
# "racily clean" index entry
_RACY_NS = 2_000_000_000
# the directory's mtime (ns), and size and mtime of each file that could not be read yet
_Signature = tuple[int, tuple[tuple[str, int, int], ...]]


@dataclass(frozen=True)
class DirectoryModel:
    """A model of the served directory: the name requests use, its (first) file, and what its
    GGUF header says (read once, at start-up: /v1/models and Ollama's /api/tags describe every
    model without loading it)."""

    name: str
    path: Path
    size: int  # bytes, every file of a split set
    created: int  # the file's mtime, seconds since the epoch
    metadata: dict[str, Any]  # the header's scalars (server/loading/gguf_header.py)

    @classmethod
    def read(cls, path: Path) -> DirectoryModel:
        """The model whose (first) file is `path`; ModelLoadError if its header cannot be read."""
        files = split_files(path)
        return cls(
            name=model_stem(path),
            path=path,
            size=sum(p.stat().st_size for p in files),
            created=int(path.stat().st_mtime),
            metadata=read_metadata(path),
        )

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))


class ModelSwitch:
    """The models of `--models-dir` and the one the engine holds (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        models: list[DirectoryModel],
        loaded: str,
        load: Callable[[Path], LoadedModel],
        *,
        ctx_size: int,
        mode: str,
        keep_alive_s: float,
        directory: Path,
        first: Path | None = None,
    ) -> None:
        self.ctx_size = ctx_size  # the context a model gets when it is loaded
        self.mode = mode  # how a model is loaded (auto, resident or streaming)
        self._engine = engine
        self.residency = Residency(engine, keep_alive_s=keep_alive_s)
        self._models = {m.name: m for m in models}
        self._loaded = loaded
        self._load = load
        self.switches = 0
        self.directory = directory
        self._first = first  # --model, served first even from outside the directory
        self._unreadable: list[Path] = []  # models whose header could not be read (yet): tried again
        self._seen: _Signature | None = self._signature()  # the directory when it was read
        self._gone: set[str] = set()  # deleted, but still the loaded model: served while held

    @property
    def models(self) -> list[DirectoryModel]:
        """The models served, as last read (`listed` reads the directory again if it changed)."""
        return list(self._models.values())

    def listed(self) -> list[DirectoryModel]:
        """The models served now: the directory read again first if it changed."""
        self.rescan()
        return self.models

    @property
    def loaded(self) -> str:
        """The name of the model the engine holds (or is loading)."""
        return self._loaded

    def rescan(self) -> None:
        """Read the directory again if it changed since it was last read (else one stat); called on
        the event loop. A model whose header cannot be read (a file still being copied in) is left
        out and tried again on the next call."""
        try:
            signature = self._signature()
            if signature != self._seen:
                self._scan()
        except OSError as exc:  # the models served stay as they were
            logger.warning("cannot read the models directory %s: %s", self.directory, exc)
            return
        if signature != self._seen:
            self._seen = signature
            if time.time_ns() - signature[0] < _RACY_NS:
                self._seen = None  # a change within the clock's grain may follow unseen: look again
        for name in [n for n in self._gone if not self._held(n)]:
            self._gone.discard(name)
            self._models.pop(name, None)
            logger.info("model %s is no longer served: its file was deleted", name)

    def _signature(self) -> _Signature:
        # the directory's mtime changes when a file is added, removed or renamed into it
        unread = []
        for path in self._unreadable:
            try:
                stat = path.stat()
            except OSError:
                continue
            unread.append((str(path), stat.st_size, stat.st_mtime_ns))
        return (self.directory.stat().st_mtime_ns, tuple(unread))

    def _held(self, name: str) -> bool:
        return name == self._loaded and self._engine.state is EngineState.READY

    def _scan(self) -> None:
        paths = gguf_models(p for p in self.directory.iterdir() if p.is_file())
        first = self._first
        if first is not None and first.is_file() and first.resolve() not in {p.resolve() for p in paths}:
            paths.insert(0, first)
        known = {m.path: m for m in self._models.values()}
        models: dict[str, DirectoryModel] = {}
        unreadable, self._unreadable = self._unreadable, []
        for path in paths:
            try:
                model = known.get(path)
                files = split_files(path)
                same = model is not None and model.size == sum(f.stat().st_size for f in files)
                if model is None or not same or model.created != int(path.stat().st_mtime):
                    model = DirectoryModel.read(path)
            except (ModelLoadError, OSError) as exc:
                log = logger.debug if path in unreadable else logger.warning  # once a file
                log("not serving %s (yet): %s", path, exc)
                self._unreadable.append(path)
                continue
            models.setdefault(model.name, model)  # a name already taken (by --model) stays its
        found = set(models)
        for name, model in self._models.items():
            if name not in found and self._held(name):
                models[name] = model  # deleted, but the engine holds it
        self._gone = set(models) - found
        added = [n for n in models if n not in self._models]
        removed = [n for n in self._models if n not in models]
        if added or removed:
            logger.info(
                "models directory %s changed: %s added, %s removed",
                self.directory,
                ", ".join(added) or "none",
                ", ".join(removed) or "none",
            )
        self._models = models

    def resolve(self, model_id: str) -> DirectoryModel:
        """The model `model_id` names (the directory read again first if it changed); NotFound with
        the names if none."""
        self.rescan()
        found = self._models.get(model_id)
        if found is None:
            served = ", ".join(repr(name) for name in self._models)
            raise NotFound(
                f"the model {model_id!r} does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        return found

    @asynccontextmanager
    async def using(
        self, model_id: str, ready: Callable[[], LoadedModel], keep_alive_s: float | None = None
    ) -> AsyncIterator[LoadedModel]:
        """The model `model_id` names, loaded (after a switch if another is, or again if it was
        released), leased for the block; `ready` gives the engine's model (ServiceUnavailable while
        it loads or if it failed); `keep_alive_s` as Residency.lease takes it."""
        wanted = self.resolve(model_id)

        async def switch() -> bool:
            if wanted.name == self._loaded:
                return False
            await self._switch(wanted)
            return True

        async with self.residency.lease(keep_alive_s, before=switch):
            yield ready()

    async def unload(self, model_id: str) -> None:
        """Release the model `model_id` names if it is the loaded one (Ollama's keep_alive 0)."""
        name = self.resolve(model_id).name
        await self.residency.unload(lambda: name == self._loaded)

    async def _switch(self, wanted: DirectoryModel) -> None:
        engine = self._engine
        await self.residency.wait_idle()
        started = time.monotonic()
        logger.info("switching from %s to %s", self._loaded, wanted.name)
        self._loaded = wanted.name
        self.switches += 1
        await run_in_threadpool(engine.restart, lambda: self._load(wanted.path))
        ready = await run_in_threadpool(engine.wait_ready, LOAD_WAIT_S)
        logger.info(
            "switched to %s in %.2f s%s",
            wanted.name,
            time.monotonic() - started,
            "" if ready else f" (the load failed: {engine.load_error})",
        )
