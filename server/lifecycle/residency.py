"""How long the engine keeps its model: leases, keep_alive, release and reload.

Every request gets its model through `Residency.lease` (ServeContext.using; with --models-dir
inside ModelSwitch.using, which switches under the same lock): under one FIFO lock, a released
model is loaded again, then leased until the request's job is submitted. A model stays loaded for
its keep_alive once it is idle (no lease held, no job running or waiting): each request sets it,
from Ollama's `keep_alive` or else the server's --keep-alive (by default negative: for as long as
the server runs). `watch` (a task for the app's life) releases the model when that much idle time
has passed, under the lock and only while idle, so no request is lost: one that arrives during the
release waits for the lock, then reloads the model. Released, the engine gives its memory back
(Engine.release: the context, the streamer and its expert cache; the warm start and the prompt
cache are saved and go with the model, as on a switch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.concurrency import run_in_threadpool

from server.engine.worker import Engine, EngineState

logger = logging.getLogger(__name__)

# how often a pending switch or release looks whether the engine has finished its jobs, and how
# often the watcher looks while the model is busy (the engine does not tell the event loop)
POLL_S = 0.01
_BUSY_POLL_S = 0.25
# a load longer than this counts as failed (the engine says why)
LOAD_WAIT_S = 3600.0
# after a release that raised, before the watcher tries again
_RETRY_S = 5.0


class Residency:
    """The engine's model: who holds it, how long it stays loaded (see the module docstring)."""

    def __init__(self, engine: Engine, *, keep_alive_s: float) -> None:
        self.engine = engine
        self.default_keep_alive_s = keep_alive_s  # a request that says nothing; negative: never
        self._keep_alive_s = keep_alive_s  # the last request's
        self._lock = asyncio.Lock()  # FIFO: reloads, switches, releases and leases in arrival order
        self._leases = 0
        self._last_used = time.monotonic()  # when the last lease ended
        self._changed = asyncio.Event()  # a lease ended, or the keep_alive changed: the watcher looks again
        self.releases = 0
        self.reloads = 0

    @property
    def busy(self) -> bool:
        """A request holds the model, or the engine runs or queues a job."""
        engine = self.engine
        return bool(self._leases or engine.busy)

    async def wait_idle(self) -> None:
        """Until no request holds the model and no job runs or waits (call with the lock held, as
        `lease`'s `before` does: no new lease can start meanwhile)."""
        while self.busy:
            await asyncio.sleep(POLL_S)

    @contextlib.asynccontextmanager
    async def lease(
        self, keep_alive_s: float | None = None, before: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[None]:
        """Hold the model for the block, loading it again first if it was released (or its reload
        failed); `before` runs first under the lock (a switch: True if it loaded a model);
        `keep_alive_s` (None: the server's) is how long the model stays loaded once idle after this
        request."""
        async with self._lock:
            loaded = await before() if before is not None else False
            engine = self.engine
            failed_again = engine.state is EngineState.FAILED and engine.loads > 0
            if not loaded and (engine.state is EngineState.RELEASED or failed_again):
                await self._reload()
            self._keep_alive_s = self.default_keep_alive_s if keep_alive_s is None else keep_alive_s
            self._leases += 1
        try:
            yield
        finally:
            self._leases -= 1
            self._last_used = time.monotonic()
            self._changed.set()

    async def unload(self, still: Callable[[], bool] = lambda: True) -> None:
        """Ollama's "unload now" (keep_alive 0 on an empty request): release the model at once if it
        is idle, else as soon as its requests are done (the watcher does); nothing unless `still`
        holds under the lock (with --models-dir: the model named is the loaded one)."""
        async with self._lock:
            if not still():
                return
            self._keep_alive_s = 0.0
            self._changed.set()
            if self.engine.state is EngineState.READY and not self.busy:
                await self._release()

    def expires_in(self) -> float | None:
        """Seconds before the loaded model is released (0: as soon as the watcher looks; while busy,
        its keep_alive, counted from when the work ends); None if never, or if no model is loaded."""
        if self._keep_alive_s < 0 or self.engine.state is not EngineState.READY:
            return None
        if self.busy:
            return self._keep_alive_s
        last = max(self._last_used, self.engine.idle_since)
        return max(0.0, last + self._keep_alive_s - time.monotonic())

    async def watch(self) -> None:
        """Release the model once it has been idle for its keep_alive; runs until cancelled."""
        while True:
            self._changed.clear()  # before looking: a change after this wakes the wait below
            left = self.expires_in()
            busy = self.busy
            if left is not None and left <= 0 and not busy:
                try:
                    async with self._lock:
                        due = self.expires_in()  # a request may have come meanwhile
                        if due is not None and due <= 0 and not self.busy:
                            await self._release()
                except Exception:  # noqa: BLE001 - the server stays up; the next look tries again
                    logger.exception("releasing the idle model failed")
                    await asyncio.sleep(_RETRY_S)
                continue
            timeout = left
            if (busy and left is not None) or self.engine.state is EngineState.LOADING:
                timeout = _BUSY_POLL_S  # the engine does not say when its work or a load ends
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    async def _release(self) -> None:
        started = time.monotonic()
        await run_in_threadpool(self.engine.release)
        self.releases += 1
        logger.info("model released after its keep_alive (%.2f s)", time.monotonic() - started)

    async def _reload(self) -> None:
        started = time.monotonic()
        logger.info("loading the released model again")
        await run_in_threadpool(self.engine.reload)
        ready = await run_in_threadpool(self.engine.wait_ready, LOAD_WAIT_S)
        self.reloads += 1
        logger.info(
            "model reloaded in %.2f s%s",
            time.monotonic() - started,
            "" if ready else f" (the load failed: {self.engine.load_error})",
        )
