"""The Llama every loader returns: llama_cpp.Llama plus a record of each llama_decode call.

A decode step is one llama_decode: its tokens, its wall time and, for a streamed model, the
expert streamer's counters over it (streaming_ext.StreamerStats, named as in C). The token loop
hands a step to whoever watches the tokens (the HTTP timings, `moeflash generate`'s telemetry);
`totals()` is the same record summed since the load, which the engine subtracts around a job and
/metrics exports. One record, one set of names, from the C counters to the API timings.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llama_cpp

from server.errors import ConfigError, ExpertReadError

if TYPE_CHECKING:
    from server.loading.budget import MemoryTerms
    from server.loading.pressure import MemoryWatch
    from streaming_ext import RouteTracer, Streamer, StreamerStats

# decode steps kept: the server reads the latest, `generate` one per token of a run
_STEPS_KEPT = 4096


@dataclass(frozen=True)
class DecodeStep:
    """One llama_decode call (or, from `totals()` and subtraction, a sum of them)."""

    n_tokens: int
    wall_ns: int
    # the streamer's counters over the call (gauges as after it); None for a resident model
    streamer: StreamerStats | None = None

    @property
    def compute_ns(self) -> int | None:
        """Wall time less waiting for flash and cache management; None when nothing is streamed."""
        s = self.streamer
        return None if s is None else max(0, self.wall_ns - s.flash_wait_ns - s.cache_ns)

    @property
    def routed(self) -> bool:
        """Whether the streamer watched routing in the call (not once every expert is resident:
        then hits and misses are not counted, which is not "no hits")."""
        return self.streamer is not None and self.streamer.routes > 0

    def __sub__(self, before: DecodeStep) -> DecodeStep:
        streamer = None
        if self.streamer is not None and before.streamer is not None:
            streamer = self.streamer - before.streamer
        return DecodeStep(self.n_tokens - before.n_tokens, self.wall_ns - before.wall_ns, streamer)


class MeasuredLlama(llama_cpp.Llama):
    """A Llama whose decode calls are recorded; `streamer` is set for a streamed model, `tracer`
    when its routing is replayed from or recorded to a route trace (its callback is the context's
    cb_eval, the streamer's chained behind it).

    `memory` is what the process holds beside the weights or the expert cache (server/loading/
    budget.py), set by the loader once the context exists; `memory_watch`, when the loader set
    one, moves the expert budget with memory pressure (server/loading/pressure.py)."""

    streamer: Streamer | None
    tracer: RouteTracer | None
    memory: MemoryTerms | None
    memory_watch: MemoryWatch | None
    steps: deque[DecodeStep]

    def __init__(
        self,
        model_path: str,
        *,
        streamer: Streamer | None = None,
        tracer: RouteTracer | None = None,
        **kwargs: Any,
    ) -> None:
        self.streamer = streamer
        self.tracer = tracer
        if tracer is not None:
            if streamer is not None:
                tracer.chain(kwargs["cb_eval"], kwargs["cb_eval_user_data"])
            kwargs = {**kwargs, "cb_eval": tracer.eval_callback, "cb_eval_user_data": tracer.handle}
        self.memory = None
        self.memory_watch = None
        self.steps = deque(maxlen=_STEPS_KEPT)
        self._tokens_total = 0
        self._wall_total_ns = 0
        super().__init__(model_path, **kwargs)
        self.measure_decode()

    def measure_decode(self) -> None:
        """Wrap the context's decode (again after the context is re-created). llama-cpp-python has
        no hook after llama_decode; the context's decode is the narrowest seam, and a failed expert
        read raises there, before Llama.eval counts the batch as done."""
        ctx = self._ctx
        original = ctx.decode

        def decode(batch: Any) -> None:
            self.follow_memory()
            streamer = self.streamer
            before = streamer.stats() if streamer is not None else None
            if self.tracer is not None:
                self.tracer.begin_batch(int(batch.batch.n_tokens))
            start = time.monotonic_ns()
            try:
                original(batch)
            except RuntimeError as exc:
                misfit = self.tracer.take_error() if self.tracer is not None else None
                if misfit is not None:
                    raise ConfigError(f"the route trace does not fit: {misfit}") from exc
                failure = streamer.take_error() if streamer is not None else None
                if failure is not None:
                    raise ExpertReadError(str(failure)) from exc
                raise
            wall = time.monotonic_ns() - start
            delta = None
            if streamer is not None and before is not None:
                failure = streamer.take_error()
                if failure is not None:
                    raise ExpertReadError(str(failure))
                delta = streamer.stats() - before
            n_tokens = int(batch.batch.n_tokens)
            self._tokens_total += n_tokens
            self._wall_total_ns += wall
            self.steps.append(DecodeStep(n_tokens, wall, delta))

        ctx.decode = decode  # type: ignore[method-assign]

    def follow_memory(self) -> None:
        """Move the expert budget as the memory watch proposes (nothing without one). The decode
        thread calls it before each decode call, and between requests while idle."""
        if self.memory_watch is not None:
            self.memory_watch.apply()

    def begin_phase(self, phase: int) -> None:
        """The decode calls from now on are a prompt's (0) or its decode steps (1): a route
        trace replays and records them as that phase (nothing to do without one)."""
        if self.tracer is not None:
            self.tracer.begin_phase(phase)

    def totals(self) -> DecodeStep:
        """Every decode call since the load as one step; the streamer's counters are cumulative
        (its reads at load, e.g. a preload, included)."""
        stats = self.streamer.stats() if self.streamer is not None else None
        return DecodeStep(self._tokens_total, self._wall_total_ns, stats)

    def close(self) -> None:
        """Free the model first (its buffers belong to the streamer's buffer types, its context
        calls the tracer), then the streamer and the tracer (idempotent); the memory watch,
        which reads the streamer, stops first."""
        if self.memory_watch is not None:
            self.memory_watch.close()
        super().close()
        if self.streamer is not None:
            self.streamer.close()
        if self.tracer is not None:
            self.tracer.close()
