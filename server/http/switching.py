"""Serving a directory of models, one loaded at a time: which model a request names, and the switch.

`ModelSwitch.using(model_id)` is how a route gets the model it prepares a request on: the model
is leased until the block ends (the checks, the template, the tokens and the job's submission;
the lease and its keep_alive: server/http/residency.py). A request that names another model of
the directory switches: in arrival order (the residency's FIFO lock), it waits until no lease is
held and the engine has no running or waiting job, then the engine releases its model and loads
the other (`Engine.restart`). A job is queued on the model it was
prepared on, and that model is released only once no job runs or waits, so no request is ever
served on another model; interleaved requests for two models are served in arrival order, a
switch each time. Everything a model owns (its warm start, its prompt cache) goes with it.
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

from server.engine.worker import Engine
from server.errors import NotFound
from server.http.residency import LOAD_WAIT_S, Residency
from server.loading.gguf_header import read_metadata
from server.loading.loader import LoadedModel
from server.loading.model_files import model_stem, split_files

logger = logging.getLogger(__name__)


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
    ) -> None:
        self.ctx_size = ctx_size  # the context a model gets when it is loaded
        self.mode = mode  # how a model is loaded (auto, resident or streaming)
        self._engine = engine
        self.residency = Residency(engine, keep_alive_s=keep_alive_s)
        self._models = {m.name: m for m in models}
        self._loaded = loaded
        self._load = load
        self.switches = 0

    @property
    def models(self) -> list[DirectoryModel]:
        return list(self._models.values())

    @property
    def loaded(self) -> str:
        """The name of the model the engine holds (or is loading)."""
        return self._loaded

    def resolve(self, model_id: str) -> DirectoryModel:
        """The model `model_id` names; NotFound with the names if none."""
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
