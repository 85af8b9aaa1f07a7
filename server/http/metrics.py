"""Prometheus metrics on a registry owned by the app (no process-global collectors)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.engine.generation import GenerationStats
from server.engine.worker import Engine
from streaming_ext import StreamerStats
from streaming_ext.declarations import Stat

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    """Values read from the engine at scrape time: queue depth and streamer counters."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def _helpers(self) -> GaugeMetricFamily:
        """The --rpc helpers: the layers each holds, -1 for one left out (not answering)."""
        family = GaugeMetricFamily(
            "moeflash_rpc_helper_layers",
            "layers an RPC helper holds (-1: left out, it did not answer at the load)",
            labels=["endpoint"],
        )
        info = self._engine.info
        for endpoint, layers in info.helpers if info is not None else ():
            family.add_metric([endpoint], layers)
        for endpoint in info.helpers_left_out if info is not None else ():
            family.add_metric([endpoint], -1)
        return family

    def collect(self):  # type: ignore[no-untyped-def]  # prometheus_client's signature
        yield GaugeMetricFamily(
            "moeflash_queue_depth", "requests waiting for the model (now)", value=self._engine.queue_depth
        )
        running = len(self._engine.running_jobs)
        yield GaugeMetricFamily("moeflash_busy", "1 while a generation runs (now)", value=int(running > 0))
        yield GaugeMetricFamily("moeflash_slots_in_use", "requests decoding now", value=running)
        yield GaugeMetricFamily(
            "moeflash_slots", "requests the model decodes together", value=self._engine.slots
        )
        yield CounterMetricFamily(
            "moeflash_decode_steps",
            "decode steps (one llama_decode for every running request)",
            value=self._engine.steps,
        )
        yield CounterMetricFamily(
            "moeflash_shared_steps",
            "decode steps that held two requests or more",
            value=self._engine.shared_steps,
        )
        yield CounterMetricFamily(
            "moeflash_step_tokens",
            "tokens decoded in those steps (their ratio: tokens per step)",
            value=self._engine.step_tokens,
        )
        yield GaugeMetricFamily(
            "moeflash_model_ready",
            "1 once the model is loaded (now)",
            value=int(self._engine.state.value == "ready"),
        )
        yield self._helpers()
        # every counter the streamer declares (moeflash_stream.h), under its C name; nanoseconds
        # become seconds (Prometheus's base unit). Resident models stream nothing: their values
        # are 0, so that dashboards still work.
        totals = self._engine.totals()
        s = totals.streamer if totals is not None else None
        for stat in StreamerStats.declared():
            name, value = metric_of(stat, s)
            family = CounterMetricFamily if stat.kind == "COUNTER" else GaugeMetricFamily
            scope = "since the model loaded" if stat.kind == "COUNTER" else "now"
            yield family(name, f"{stat.text} ({scope})", value=value)
        model = self._engine.model
        warm = model.warm_start if model is not None else None
        yield GaugeMetricFamily(
            "moeflash_warm_start_pending_experts",
            "experts of the last run's hot set still to be read back (now)",
            value=warm.pending_experts if warm is not None else 0,
        )


def metric_of(stat: Stat, stats: StreamerStats | None) -> tuple[str, float]:
    """A streamer counter's Prometheus name (moeflash_streamer_<C name>, `_ns` as `_seconds`) and
    value (0 without a streamer)."""
    value = float(getattr(stats, stat.name)) if stats is not None else 0.0
    if stat.unit == "NS":
        return f"moeflash_streamer_{stat.name.removesuffix('_ns')}_seconds", value / 1e9
    return f"moeflash_streamer_{stat.name}", value


class MetricsMiddleware:
    """Counts every response by route and status, including the ones middleware refuses."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics, routes: frozenset[str]) -> None:
        self.app = app
        self._metrics = metrics
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # unknown paths share one label: a scanner must not grow the label set without bound
        route = scope["path"] if scope["path"] in self._routes else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class Metrics:
    """The app's counters; `render()` is the /metrics body."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "moeflash_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "moeflash_prompt_tokens", "prompt tokens processed", registry=self.registry
        )
        self.cached_tokens = Counter(
            "moeflash_cached_prompt_tokens", "prompt tokens reused from the KV cache", registry=self.registry
        )
        self.completion_tokens = Counter(
            "moeflash_completion_tokens", "tokens generated", registry=self.registry
        )
        self.tok_per_s = Gauge(
            "moeflash_tokens_per_second", "decode speed of the last finished request", registry=self.registry
        )
        self.decode_seconds = Histogram(
            "moeflash_request_decode_seconds", "decode time per request", registry=self.registry
        )
        self.registry.register(_EngineCollector(engine))
        self.registry.register(_PromptCacheCollector(engine))
        # process_resident_memory_bytes (RSS) and friends, read from /proc at scrape time
        ProcessCollector(registry=self.registry)

    def observe(self, stats: GenerationStats) -> None:
        """Account one finished generation."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.completion_tokens.inc(stats.completion_tokens)
        self.decode_seconds.observe(stats.decode_ns / 1e9)
        if stats.decode_ns > 0 and stats.completion_tokens > 0:
            self.tok_per_s.set(stats.completion_tokens / (stats.decode_ns / 1e9))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PromptCacheCollector(Collector):
    """The prompt cache's counters and bytes (server/engine/prompt_cache.py), read at scrape time;
    0 without one."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self):  # type: ignore[no-untyped-def]  # prometheus_client's signature
        model = self._engine.model
        cache = model.prompt_cache if model is not None else None
        s = cache.stats() if cache is not None else None
        for family, name, text, value in (
            (CounterMetricFamily, "hits", "prompts that restored a kept state", s and s.hits),
            (CounterMetricFamily, "restored_tokens", "prompt tokens restored", s and s.restored_tokens),
            (GaugeMetricFamily, "ram_bytes", "prompt states held in RAM", s and s.ram_bytes),
            (GaugeMetricFamily, "flash_bytes", "prompt states on flash", s and s.flash_bytes),
            (CounterMetricFamily, "read_bytes", "prompt states read from flash", s and s.read_bytes),
            (CounterMetricFamily, "read_seconds", "time reading them back", s and s.read_ns / 1e9),
            (CounterMetricFamily, "written_bytes", "prompt states written to flash", s and s.written_bytes),
        ):
            yield family(f"moeflash_prompt_cache_{name}", text, value=value or 0)
