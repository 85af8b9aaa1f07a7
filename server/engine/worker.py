"""The engine: ONE worker thread owns the model and decodes its requests together.

DESIGN
- The worker thread loads the model (so a long load never blocks the HTTP server: /health
  answers 503 meanwhile), then runs the token loop (server/engine/token_loop.py): between two
  steps it starts waiting jobs, in arrival order, in the model's free slots (`--parallel`), and
  each step decodes every running job's next tokens at once. Only this thread touches the Llama,
  so llama.cpp needs no locking.
- One mutex + condition variable guard the waiting deque, the running jobs and the state.
  `submit` refuses with QueueFull when `max_queue` jobs already wait (the running ones do
  not count), and with ServiceUnavailable while loading, after a failed load, or stopping.
- Each job has its own event channel: the worker hands events to the job's asyncio loop
  with call_soon_threadsafe; the HTTP side awaits them. A job is cancelled by setting its
  event (client gone); the token loop checks it before every step, so a cancelled generation
  stops within one step and frees its slot.
- `close()` (lifespan shutdown, i.e. SIGTERM) cancels the running jobs, fails the waiting
  ones, joins the worker and releases the model. `release()` does the same to an idle engine
  but keeps its loader (state RELEASED: the memory is given back) and `reload()` loads it again;
  `restart(loader)` loads another model (server/lifecycle/residency.py and switching.py decide when).
"""

from __future__ import annotations

import asyncio
import ctypes
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from server.engine.generation import GenerationRequest, GenerationStats, TextDelta
from server.engine.token_loop import JournalEntry, Sequence, TokenLoop
from server.errors import HelperLost, QueueFull, ServiceUnavailable
from server.loading.loader import LoadedModel, ModelInfo
from server.loading.measured import DecodeStep

logger = logging.getLogger(__name__)

# finished jobs remembered for /metrics and for tests that inspect what the worker did
_HISTORY = 256
# how often an idle engine applies the memory watch's budget proposals (server/loading/pressure.py)
# and saves the hot set when due (server/lifecycle/hot_set.py)
_IDLE_POLL_S = 0.5


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"
    RELEASING = "releasing"  # the model being freed, for a release or a switch
    RELEASED = "released"  # idle, the model freed; `reload` loads it again


@dataclass(frozen=True)
class Finished:
    """The last event of a successful job."""

    stats: GenerationStats
    # the job's decode calls as one step (its streamer counters: a streamed model only)
    telemetry: DecodeStep | None


@dataclass(frozen=True)
class Failed:
    """The last event of a job that raised on the worker."""

    error: BaseException


Event = TextDelta | Finished | Failed


@dataclass
class Job:
    """One request's life on the engine: its input, its event channel, its cancel flag."""

    id: str
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    stats: GenerationStats = field(default_factory=GenerationStats)
    submitted_ns: int = field(default_factory=time.monotonic_ns)
    _events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Ask the worker to stop this job (safe from any thread, idempotent)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _post(self, event: Event) -> None:
        # called on the worker thread; a closed loop means nobody listens any more
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:
            self._cancel.set()

    async def events(self) -> AsyncIterator[Event]:
        """The job's events in order, ending with Finished or Failed."""
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, Finished | Failed):
                return


class Engine:
    """Owns the model through one worker thread; see the module docstring for the design."""

    def __init__(
        self,
        loader: Callable[[], LoadedModel],
        *,
        max_queue: int = 16,
        queue_full_status: int = 429,
        retry_after_s: int = 1,
    ) -> None:
        self._loader = loader
        self._max_queue = max_queue
        self.queue_full_status = queue_full_status
        self._retry_after_s = retry_after_s
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._slots = 0  # the loaded model's (requests decoded together)
        self.steps = 0  # decode steps of the models loaded so far, their tokens, those shared
        self.step_tokens = 0
        self.shared_steps = 0  # by two requests or more
        self._state = EngineState.LOADING
        self._model: LoadedModel | None = None
        self._load_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._info: ModelInfo | None = None  # the model's, kept while it is released or reloads
        self._idle_since = time.monotonic()  # when the last job ended (or the model loaded)
        self.loads = 0  # models loaded so far (loads, reloads and switches)
        self.history: deque[tuple[str, GenerationStats]] = deque(maxlen=_HISTORY)
        # set to a list before the model loads: the token loop's journal (a replay's input)
        self.journal: list[JournalEntry] | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker; it loads the model first (the state says when it is ready)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moeflash-engine", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel the running job, fail the waiting ones, stop the worker, free the model."""
        self._stop(EngineState.STOPPING, EngineState.STOPPED, timeout_s)

    def _stop(self, stopping: EngineState, stopped: EngineState, timeout_s: float) -> bool:
        """Stop the worker and free the model: the state is `stopping` meanwhile (STOPPING at
        shutdown, RELEASING for a release or a restart), then `stopped`. False if the engine was
        already stopping or stopped, or shut down meanwhile."""
        with self._cond:
            if self._state in (EngineState.STOPPING, EngineState.STOPPED):
                return False
            if self._state is EngineState.RELEASED:  # nothing left to stop or free
                self._state = stopped
                return True
            self._state = stopping
            dropped = list(self._waiting)
            self._waiting.clear()
            running = list(self._running)
            for job in running:
                job.cancel()
            self._cond.notify_all()
        for job in dropped:
            job.cancel()
            job._post(Failed(ServiceUnavailable("the server is shutting down", retry_after_s=5)))
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("the engine worker did not stop within %.0f s", timeout_s)
        with self._cond:
            mine = self._state is stopping  # else close() came meanwhile and stopped the engine
            if mine:
                self._state = stopped
                self._model = None
                self._thread = None
        logger.info(
            "engine stopped: %s, %d waiting request(s) refused, model released",
            f"{len(running)} running request(s) cancelled" if running else "idle",
            len(dropped),
        )
        return mine

    def restart(self, loader: Callable[[], LoadedModel], timeout_s: float = 30.0) -> None:
        """Release the model and load another with `loader` (serve --models-dir switching models).
        The caller sees to it that no job runs or waits (server/lifecycle/switching.py): one that does
        is cancelled or refused, as at shutdown. The state is LOADING until the other is ready."""
        if not self._stop(EngineState.RELEASING, EngineState.STOPPED, timeout_s):
            return  # shut down meanwhile
        with self._cond:
            if loader is not self._loader:
                self._info = None
            self._loader = loader
            self._state = EngineState.LOADING
            self._load_error = None
        self.start()

    def release(self, timeout_s: float = 30.0) -> None:
        """Free the model and keep its loader (its keep_alive ran out): the worker stops and the model
        closes as at shutdown (the hot set and prompt states saved, then the context, the streamer
        and its expert cache freed), and the state is RELEASED until `reload`. The caller sees to
        it that no job runs or waits, as for `restart`."""
        if self._stop(EngineState.RELEASING, EngineState.RELEASED, timeout_s):
            give_back_freed_memory()
            logger.info("model released: its memory is given back until a request needs it")

    def reload(self) -> None:
        """Load the released (or failed) model again with its loader; LOADING until it is ready."""
        self.restart(self._loader)

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the model is loaded (True) or failed / timed out (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._state is EngineState.LOADING:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return self._state is EngineState.READY

    # -- state -------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        with self._cond:
            return self._state

    @property
    def info(self) -> ModelInfo | None:
        """What the served model is, loaded or released (and while it reloads); None before it
        first loads and while another model loads."""
        with self._cond:
            return self._info

    @property
    def idle_since(self) -> float:
        """time.monotonic() when the last job ended or the model finished loading."""
        with self._cond:
            return self._idle_since

    @property
    def load_error(self) -> BaseException | None:
        with self._cond:
            return self._load_error

    @property
    def model(self) -> LoadedModel | None:
        """The loaded model (read-only use outside the worker: info, tokenizer, vocab); None unless
        READY (a model being closed is not one to use)."""
        with self._cond:
            return self._model if self._state is EngineState.READY else None

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def running_jobs(self) -> tuple[Job, ...]:
        """The jobs decoding now, in the order they started."""
        with self._cond:
            return tuple(self._running)

    @property
    def slots(self) -> int:
        """Requests the loaded model decodes together (0 before it loads)."""
        with self._cond:
            return self._slots

    @property
    def busy(self) -> bool:
        """Whether a job runs or waits."""
        with self._cond:
            return bool(self._running or self._waiting)

    def totals(self) -> DecodeStep | None:
        """Every decode call of the loaded model so far (None before it is loaded); read from any
        thread: the counters are copied without locks."""
        model = self.model
        return None if model is None else model.llama.totals()

    # -- requests ----------------------------------------------------------------------

    def submit(self, job_id: str, request: GenerationRequest) -> Job:
        """Queue a job (call from the event loop that will consume its events)."""
        job = Job(id=job_id, request=request, loop=asyncio.get_running_loop())
        self._drop_cancelled()
        with self._cond:
            if self._state is EngineState.LOADING:
                raise ServiceUnavailable(
                    "the model is still loading", retry_after_s=self._retry_after_s, code="model_loading"
                )
            if self._state is not EngineState.READY:
                raise ServiceUnavailable(
                    f"the model is not available ({self._state.value})",
                    retry_after_s=self._retry_after_s,
                    code="model_unavailable",
                )
            if len(self._waiting) >= self._max_queue and len(self._running) >= self._slots:
                raise QueueFull(
                    f"{len(self._waiting)} requests are already waiting for the model",
                    retry_after_s=self._retry_after_s,
                )
            self._waiting.append(job)
            self._cond.notify_all()
        return job

    def _drop_cancelled(self) -> None:
        """Take the waiting jobs whose clients left out of the queue (they end as cancelled):
        their places are free at once, not when they would have started."""
        with self._cond:
            gone = [job for job in self._waiting if job.cancelled]
            for job in gone:
                self._waiting.remove(job)
                job.stats.finish_reason = "cancelled"
                self.history.append((job.id, replace(job.stats)))
        for job in gone:
            job._post(Finished(job.stats, None))

    # -- worker ------------------------------------------------------------------------

    def _run(self) -> None:
        while self._serve():
            pass

    def _serve(self) -> bool:
        """Load the model and serve it until stopped. True when it must be loaded again: an RPC
        helper was lost mid-step (its requests failed; the waiting ones stay queued)."""
        try:
            model = self._loader()
        except BaseException as exc:  # noqa: BLE001 - reported through state and /health
            self._load_failed(exc)
            return False
        loop = TokenLoop(model.llama, model.prompt_cache)
        loop.journal = self.journal
        self._ready(model)
        sequences: dict[int, tuple[Job, Sequence]] = {}  # by id(job)
        lost: HelperLost | None = None
        try:
            idle_work = True  # warm start begins reading back at once
            while lost is None:
                taken = self._take_waiting(idle_work)
                if taken is None:
                    break
                starting, running = taken
                self._start(loop, starting, sequences)
                if not running:
                    idle_work = model.idle()
                    continue
                lost = self._step(model, loop, sequences)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            # stopped mid-request (the jobs were cancelled): they end as cancelled, as a client
            # gone would have them, and their slots go with the model
            for seq in loop.running:
                seq.finish("cancelled")
            self._end(model, sequences, loop.running, None)
            loop.close()
            model.close()
        return lost is not None and self._loading_again(lost)

    def _loading_again(self, lost: HelperLost) -> bool:
        """LOADING again after a helper was lost, unless the engine is stopping meanwhile."""
        with self._cond:
            if self._state is not EngineState.READY:
                return False
            self._state = EngineState.LOADING
            self._load_error = lost
            self._model = None  # closed: /metrics reads no counters of it while the next loads
            self._cond.notify_all()
        logger.warning("%s: loading the model again", lost)
        return True

    def _load_failed(self, exc: BaseException) -> None:
        """The load raised: FAILED, unless the engine was stopped meanwhile."""
        logger.error("model load failed: %s", exc)
        with self._cond:
            self._load_error = exc
            if self._state is EngineState.LOADING:
                self._state = EngineState.FAILED
            self._cond.notify_all()

    def _ready(self, model: LoadedModel) -> None:
        """Serve the loaded model: READY, unless the engine was stopped meanwhile."""
        with self._cond:
            self._model = model
            self._info = model.info
            self._slots = len(model.llama.slots)
            self._idle_since = time.monotonic()
            self.loads += 1
            self._load_error = None  # a helper lost before: the model is served again
            if self._state is EngineState.LOADING:
                self._state = EngineState.READY
            self._cond.notify_all()

    def _take_waiting(self, idle_work: bool) -> tuple[list[Job], bool] | None:
        """Move the waiting jobs the free slots take to the running ones, in arrival order: those
        jobs, and whether any job runs. Idle and without idle work, it first waits for a job (at
        most _IDLE_POLL_S). None once the engine is not READY."""
        with self._cond:
            # idle, the model's idle work goes on (outside the lock): at once while warm start
            # reads back, else every _IDLE_POLL_S
            idle = not self._waiting and not self._running
            if idle and self._state is EngineState.READY and not idle_work:
                self._cond.wait(timeout=_IDLE_POLL_S)
            if self._state is not EngineState.READY:
                return None
            starting: list[Job] = []
            while self._waiting and len(self._running) + len(starting) < self._slots:
                starting.append(self._waiting.popleft())
            self._running.extend(starting)
            return starting, bool(self._running)

    def _start(
        self, loop: TokenLoop, starting: list[Job], sequences: dict[int, tuple[Job, Sequence]]
    ) -> None:
        """Start the jobs' sequences in the token loop; a job that cannot start fails alone."""
        for job in starting:
            try:
                seq = loop.start(job.request, job.stats, job._post, job._cancel.is_set)
            except Exception as exc:  # noqa: BLE001 - the request's failure (a state unreadable)
                logger.exception("request %s could not start", job.id)
                with self._cond:
                    self._running.remove(job)
                    self._cond.notify_all()
                job._post(Failed(exc))
                continue
            sequences[id(job)] = (job, seq)

    def _step(
        self, model: LoadedModel, loop: TokenLoop, sequences: dict[int, tuple[Job, Sequence]]
    ) -> HelperLost | None:
        """One decode step of every running job; the jobs it ended are reported. A step that
        raises fails the requests it decoded, not the engine; the loss of an RPC helper is
        returned (the model must be loaded again)."""
        failure: BaseException | None = None
        try:
            ended = loop.step()
        except Exception as exc:  # noqa: BLE001 - handed to the requests, which map it to HTTP
            logger.exception("a decode step failed")
            ended, failure = loop.abort(exc), exc
        plan = loop.last_plan  # empty when the step only ended cancelled requests
        with self._cond:
            self.steps += bool(plan)
            self.step_tokens += sum(part.n_tokens for part in plan)
            self.shared_steps += len(plan) > 1
        if ended:
            self._end(model, sequences, ended, failure)
        return failure if isinstance(failure, HelperLost) else None

    def _fail(self, exc: BaseException) -> None:
        """The worker itself failed (a bug, not a request's failure): FAILED, and no request may
        wait for a worker that is gone."""
        logger.exception("the engine worker failed")
        with self._cond:
            self._load_error = exc
            self._state = EngineState.FAILED
            dropped = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        for job in dropped:
            job._post(Failed(exc))

    def _end(
        self,
        model: LoadedModel,
        sequences: dict[int, tuple[Job, Sequence]],
        ended: list[Sequence],
        failure: BaseException | None,
    ) -> None:
        """Report the ended sequences' jobs: Finished with the job's share of the steps it was in,
        or Failed with the step's error."""
        if not ended:
            return
        done = {id(seq) for seq in ended}
        jobs = [(job, seq) for job, seq in sequences.values() if id(seq) in done]
        with self._cond:
            for job, _ in jobs:
                self._running.remove(job)
                self.history.append((job.id, replace(job.stats)))
            self._idle_since = time.monotonic()
            self._cond.notify_all()
        for job, seq in jobs:
            del sequences[id(job)]
            if failure is not None:
                job._post(Failed(failure))
            else:
                job._post(Finished(job.stats, seq.telemetry))
        model.after_request()


def give_back_freed_memory() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim): a freed model's small
    allocations stay in the heap otherwise and the process's RSS does not drop. A no-op without
    glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
