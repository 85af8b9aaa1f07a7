"""The Llama every loader returns: llama_cpp.Llama plus a record of each llama_decode call.

A decode step is one llama_decode: its tokens, its wall time and, for a streamed model, the
expert streamer's counters over it (streaming_ext.StreamerStats, named as in C). The token loop
hands a step to whoever watches the tokens (the HTTP timings, `moeflash generate`'s telemetry);
`totals()` is the same record summed since the load, which the engine subtracts around a job and
/metrics exports. One record, one set of names, from the C counters (declared once in
moeflash_stream.h) to the API timings, and each derived figure (compute time, the hit rates)
defined once, on the record.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import llama_cpp

from server.errors import ConfigError, ExpertReadError, HelperLost
from streaming_ext import StreamerStats
from streaming_ext.batch import DecodeCall

if TYPE_CHECKING:
    from server.loading.budget import MemoryTerms
    from server.loading.pressure import MemoryWatch
    from server.rpc.ggml import Ggml
    from streaming_ext import RouteTracer, Streamer

# decode steps kept: the server reads the latest, `generate` one per token of a run
_STEPS_KEPT = 4096


@dataclass(frozen=True)
class DecodeStep:
    """One llama_decode call, or a span of them (summed with +, or `totals()` differences): the
    record every figure of the server, `generate --json` and the benchmarks is read from.

    The figures below are each defined here once. Their scope is the record's: a token's step, a
    request's decode calls, a benchmark run. A gauge among the counters (declared GAUGE in C) is
    the value at the end of the span.
    """

    n_tokens: int
    wall_ns: int
    # the streamer's counters over the span; None for a resident model
    streamer: StreamerStats | None = None
    # time spent waiting on RPC helpers (the link and their layers' compute; server/rpc)
    helper_wait_ns: int = 0
    # one decode call's expert reads shared among its KV sequences by routing (index: the
    # sequence; Streamer.take_seq_bytes), and those of routes no token was announced for; a span
    # (+, -) has neither
    seq_bytes: tuple[float, ...] = ()
    unmapped_bytes: float = 0.0

    @property
    def compute_ns(self) -> int | None:
        """Wall time less waiting for flash, cache management and RPC helpers; None when nothing
        is streamed."""
        s = self.streamer
        if s is None:
            return None
        return max(0, self.wall_ns - s.flash_wait_ns - s.cache_ns - self.helper_wait_ns)

    @property
    def routed(self) -> bool:
        """Whether the streamer watched routing in the span (not once every expert is resident:
        then hits and misses are not counted, which is not "no hits")."""
        return self.streamer is not None and self.streamer.routes > 0

    def _of_routed(self, count: int) -> float | None:
        s = self.streamer
        if s is None or not self.routed or s.hits + s.misses == 0:
            return None
        return count / (s.hits + s.misses)

    @property
    def hit_rate(self) -> float | None:
        """Routed experts found resident, whether cached or read ahead for this span's tokens:
        hits / (hits + misses). None when routing was not watched."""
        return self._of_routed(self.streamer.hits) if self.streamer is not None else None

    @property
    def cache_hit_rate(self) -> float | None:
        """Routed experts the cache already held, read-aheads apart: (hits - prefetch_hits) /
        (hits + misses). hit_rate = cache_hit_rate + prefetch_hit_rate."""
        s = self.streamer
        return self._of_routed(s.hits - s.prefetch_hits) if s is not None else None

    @property
    def prefetch_hit_rate(self) -> float | None:
        """Routed experts that a read-ahead had brought in: prefetch_hits / (hits + misses)."""
        return self._of_routed(self.streamer.prefetch_hits) if self.streamer is not None else None

    @property
    def prefetch_accuracy(self) -> float | None:
        """Of the entries read ahead, the share their layer then routed: prefetch_hits /
        prefetched. None when nothing was read ahead or routing was not watched."""
        s = self.streamer
        if s is None or not self.routed or s.prefetched == 0:
            return None
        return s.prefetch_hits / s.prefetched

    # the figures to_json() adds to the counters, in this order
    FIGURES: ClassVar[tuple[str, ...]] = (
        "compute_ns",
        "hit_rate",
        "cache_hit_rate",
        "prefetch_hit_rate",
        "prefetch_accuracy",
    )

    def to_json(self) -> dict[str, Any]:
        """The record as JSON: n_tokens, wall_ns, every counter under its C name (null for a
        resident model) and the figures above."""
        counters: dict[str, int | None] = dict.fromkeys((s.name for s in StreamerStats.declared()), None)
        if self.streamer is not None:
            counters.update(self.streamer.as_dict())
        return {
            "n_tokens": self.n_tokens,
            "wall_ns": self.wall_ns,
            "helper_wait_ns": self.helper_wait_ns,
            **counters,
            **{name: getattr(self, name) for name in self.FIGURES},
        }

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> DecodeStep:
        """The record to_json() wrote (a resident one has null counters)."""
        streamed = record.get("routes") is not None
        return cls(
            int(record.get("n_tokens") or 0),
            int(record["wall_ns"]),
            StreamerStats.from_dict(record) if streamed else None,
            int(record.get("helper_wait_ns") or 0),
        )

    def __sub__(self, before: DecodeStep) -> DecodeStep:
        streamer = None
        if self.streamer is not None and before.streamer is not None:
            streamer = self.streamer - before.streamer
        return DecodeStep(
            self.n_tokens - before.n_tokens,
            self.wall_ns - before.wall_ns,
            streamer,
            self.helper_wait_ns - before.helper_wait_ns,
        )

    def share(self, part: int, seq: int | None = None) -> DecodeStep:
        """The share of `part` of this step's tokens, those of KV sequence `seq` (a request's, when
        a step decodes several): its wall time and counters in proportion, but the expert bytes
        read by routing, each read's bytes split evenly among the tokens routing its expert
        (docs/api.md, "Telemetry of a shared step")."""
        if part >= self.n_tokens:
            return self
        streamer = self.streamer.share(part, self.n_tokens) if self.streamer is not None else None
        routed = sum(self.seq_bytes) + self.unmapped_bytes
        if streamer is not None and self.streamer is not None and seq is not None and routed > 0:
            mine = (self.seq_bytes[seq] if seq < len(self.seq_bytes) else 0.0) + (
                self.unmapped_bytes * part / self.n_tokens
            )
            streamer = replace(streamer, bytes_read=round(self.streamer.bytes_read * mine / routed))
        return DecodeStep(
            part, self.wall_ns * part // self.n_tokens, streamer, self.helper_wait_ns * part // self.n_tokens
        )

    def __add__(self, later: DecodeStep) -> DecodeStep:
        streamer = None
        if self.streamer is not None and later.streamer is not None:
            streamer = self.streamer + later.streamer
        return DecodeStep(
            self.n_tokens + later.n_tokens,
            self.wall_ns + later.wall_ns,
            streamer,
            self.helper_wait_ns + later.helper_wait_ns,
        )


@dataclass
class Slot:
    """One KV sequence of the context: the tokens its cells hold (positions 0..len-1), whether a
    request decodes in it, and when one last started in it (least recently used goes first)."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    busy: bool = False
    used: int = 0


class MeasuredLlama(llama_cpp.Llama):
    """A Llama whose decode calls are recorded; `streamer` is set for a streamed model, `tracer`
    when its routing is replayed from or recorded to a route trace (its callback is the context's
    cb_eval, the streamer's chained behind it). `slots` are the context's KV sequences, one per
    request decoded at once (n_seq_max, `--parallel`): what each holds is the token loop's to
    say (server/engine/token_loop.py).

    `memory` is what the process holds beside the weights or the expert cache (server/loading/
    budget.py), set by the loader once the context exists; `memory_watch`, when the loader set
    one, moves the expert budget with memory pressure (server/loading/pressure.py)."""

    streamer: Streamer | None
    tracer: RouteTracer | None
    helpers: tuple[str, ...]  # the RPC helpers holding layers (server/rpc), set by the loader
    memory: MemoryTerms | None
    memory_watch: MemoryWatch | None
    steps: deque[DecodeStep]
    slots: list[Slot]

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
        self.helpers = ()
        self._ggml: Ggml | None = None
        self.steps = deque(maxlen=_STEPS_KEPT)
        self._tokens_total = 0
        self._wall_total_ns = 0
        self._helper_wait_total_ns = 0
        super().__init__(model_path, **kwargs)
        self.context_changed()

    @property
    def n_ctx_seq(self) -> int:
        """The tokens one request may hold: the context divided among the slots."""
        return self.n_ctx() // len(self.slots)

    def clear(self) -> None:
        """Empty the KV cache and every slot (after a failed step, whose cells are unknown)."""
        if self._ctx.memory is not None:
            llama_cpp.llama_memory_clear(self._ctx.memory, True)
        for slot in self.slots:
            slot.tokens.clear()
        self.n_tokens = 0

    def context_changed(self) -> None:
        """Wrap the context's decode and make its slots (again after the context is re-created).
        llama-cpp-python has no hook after llama_decode; the context's decode is the narrowest
        seam, and a failed expert read raises there, before Llama.eval counts the batch as done."""
        self.slots = [Slot(seq) for seq in range(int(self.context_params.n_seq_max))]
        ctx = self._ctx
        original = ctx.decode

        def decode(batch: Any) -> None:
            self.follow_memory()
            streamer = self.streamer
            before = streamer.stats() if streamer is not None else None
            if self.tracer is not None or streamer is not None:
                raw = batch.batch
                n = int(raw.n_tokens)
                call = DecodeCall.of(
                    [raw.seq_id[i][0] for i in range(n)],
                    [bool(raw.logits[i]) for i in range(n)],
                    int(self.context_params.n_ubatch),
                )
                if self.tracer is not None:
                    self.tracer.begin_batch(call)
                if streamer is not None:
                    streamer.begin_batch(call)
            waited = self._helper_wait_ns()
            start = time.monotonic_ns()
            try:
                original(batch)
            except RuntimeError as exc:
                self._check_helpers()
                self._check_tracer()
                failure = streamer.take_error() if streamer is not None else None
                if failure is not None:
                    raise ExpertReadError(str(failure)) from exc
                raise
            self._check_helpers()
            self._check_tracer()
            wall = time.monotonic_ns() - start
            delta = None
            by_seq: tuple[float, ...] = ()
            unmapped = 0.0
            if streamer is not None and before is not None:
                failure = streamer.take_error()
                if failure is not None:
                    raise ExpertReadError(str(failure))
                delta = streamer.stats() - before
                by_seq, unmapped = streamer.take_seq_bytes(len(self.slots))
            n_tokens = int(batch.batch.n_tokens)
            helper_wait = max(0, self._helper_wait_ns() - waited)  # 0 across a reconnection
            self._tokens_total += n_tokens
            self._wall_total_ns += wall
            self._helper_wait_total_ns += helper_wait
            self.steps.append(DecodeStep(n_tokens, wall, delta, helper_wait, by_seq, unmapped))

        ctx.decode = decode  # type: ignore[method-assign]

    def _rpc(self) -> Ggml:
        if self._ggml is None:
            from server.rpc.ggml import Ggml

            self._ggml = Ggml.load()
        return self._ggml

    def _helper_wait_ns(self) -> int:
        """Nanoseconds waited on this model's helpers so far (0 without helpers)."""
        return sum(self._rpc().wait_ns(endpoint) for endpoint in self.helpers) if self.helpers else 0

    def _check_tracer(self) -> None:
        """ConfigError when the route trace stopped a graph (a node it does not fit): ggml goes on
        with the graph's next split after a callback's refusal, so the call may have returned."""
        misfit = self.tracer.take_error() if self.tracer is not None else None
        if misfit is not None:
            raise ConfigError(f"the route trace does not fit: {misfit}")

    def _check_helpers(self) -> None:
        """HelperLost when ggml's connection to a helper failed: the step just decoded computed
        garbage from then on (ggml's RPC calls return zeros once lost, patch 0014)."""
        if self.helpers:
            ggml = self._rpc()
            gone = [endpoint for endpoint in self.helpers if ggml.lost(endpoint)]
            if gone:
                raise HelperLost(
                    f"RPC helper {', '.join(gone)} was lost during a decode step (gone, or the link cut): "
                    "the step's output is discarded and the model is loaded again"
                )

    def follow_memory(self) -> None:
        """Move the expert budget as the memory watch proposes (nothing without one). The decode
        thread calls it before each decode call, and between requests while idle."""
        if self.memory_watch is not None:
            self.memory_watch.apply()

    def begin_phase(self, phase: int, seq: int = 0) -> None:
        """The tokens of KV sequence `seq` decoded from now on are a new request's prompt (0) or
        its decode steps (1): a route trace replays and records them as that phase (nothing to do
        without one)."""
        if self.tracer is not None:
            self.tracer.begin_phase(phase, seq)

    def totals(self) -> DecodeStep:
        """Every decode call since the load as one step; the streamer's counters are cumulative
        (its reads at load, e.g. a preload, included)."""
        stats = self.streamer.stats() if self.streamer is not None else None
        return DecodeStep(self._tokens_total, self._wall_total_ns, stats, self._helper_wait_total_ns)

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
