"""Prometheus metrics on a registry owned by the app (no process-global collectors)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.engine.token_loop import GenerationStats
from server.engine.worker import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    """Values read from the engine at scrape time: queue depth and streamer counters."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self):  # type: ignore[no-untyped-def]  # prometheus_client's signature
        yield GaugeMetricFamily(
            "moeflash_queue_depth", "requests waiting for the model", value=self._engine.queue_depth
        )
        yield GaugeMetricFamily(
            "moeflash_busy", "1 while a generation runs", value=int(self._engine.running_job is not None)
        )
        yield GaugeMetricFamily(
            "moeflash_model_ready",
            "1 once the model is loaded",
            value=int(self._engine.state.value == "ready"),
        )
        totals = self._engine.totals()
        # resident models stream nothing: the counters are exported as 0 so dashboards still work
        s = totals.streamer if totals is not None else None
        yield CounterMetricFamily("moeflash_expert_cache_hits", "expert cache hits", value=s.hits if s else 0)
        yield CounterMetricFamily(
            "moeflash_expert_cache_misses", "expert cache misses", value=s.misses if s else 0
        )
        yield CounterMetricFamily(
            "moeflash_expert_bytes_read", "expert bytes read from flash", value=s.bytes_read if s else 0
        )
        yield CounterMetricFamily(
            "moeflash_flash_wait_seconds",
            "time decode waited for expert reads",
            value=s.flash_wait_ns / 1e9 if s else 0.0,
        )
        yield CounterMetricFamily(
            "moeflash_cache_seconds",
            "time decode spent managing the expert cache",
            value=s.cache_ns / 1e9 if s else 0.0,
        )
        yield GaugeMetricFamily(
            "moeflash_expert_memory_bytes",
            "expert cache memory in use (frames of resident experts and free ones kept warm)",
            value=s.expert_memory_bytes if s else 0,
        )
        yield CounterMetricFamily(
            "moeflash_experts_restored",
            "experts read back by warm start (the last run's hot set)",
            value=s.restored if s else 0,
        )
        model = self._engine.model
        warm = model.warm_start if model is not None else None
        yield GaugeMetricFamily(
            "moeflash_warm_start_pending_experts",
            "experts of the last run's hot set still to be read back",
            value=warm.pending_experts if warm is not None else 0,
        )
        yield GaugeMetricFamily(
            "moeflash_expert_budget_bytes",
            "the expert cache's budget now (it follows memory pressure)",
            value=s.budget_bytes if s else 0,
        )


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
    """The prompt cache's counters and bytes (server/loading/prompt_cache.py), read at scrape time;
    0 without one."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self):  # type: ignore[no-untyped-def]  # prometheus_client's signature
        model = self._engine.model
        cache = model.prompt_cache if model is not None else None
        stats = cache.stats() if cache is not None else None
        hits, restored = (stats.hits, stats.restored_tokens) if stats else (0, 0)
        yield CounterMetricFamily(
            "moeflash_prompt_cache_hits", "prompts that restored a kept state", value=hits
        )
        yield CounterMetricFamily(
            "moeflash_prompt_cache_restored_tokens",
            "prompt tokens restored instead of prefilled",
            value=restored,
        )
        yield GaugeMetricFamily(
            "moeflash_prompt_cache_ram_bytes",
            "prompt states held in RAM",
            value=stats.ram_bytes if stats else 0,
        )
        yield GaugeMetricFamily(
            "moeflash_prompt_cache_flash_bytes",
            "prompt states on flash",
            value=stats.flash_bytes if stats else 0,
        )
