"""Model loading behind one function, `load_model(settings) -> LoadedModel`: the one place a model
is loaded, for `generate` and for the served model server/lifecycle/served.py puts together
(with the server's prompt cache and warm start).

Two modes. resident (server/loading/resident.py): llama.cpp maps the file the stock way. streaming: the
expert streamer (server/loading/streaming.py) keeps dense weights in RAM and streams routed experts from
flash into a bounded cache. Both measure what the context holds against the memory limit. auto
(the default) streams when the model file does not fit comfortably in the memory this process
may use. `load_model` is the only place that decides how a model is loaded;
the Llama it returns records every decode call (server/loading/measured.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server import __version__
from server.errors import ConfigError, ModelLoadError
from server.loading.model_files import model_stem, split_files
from server.settings import ModelSettings, RouteTraceSettings
from server.units import format_size

if TYPE_CHECKING:
    from server.engine.prompt_cache import PromptCache
    from server.lifecycle.hot_set import WarmStart
    from server.loading.budget import PromptCacheRam
    from server.loading.measured import MeasuredLlama
    from server.loading.route_trace import ModelShape

logger = logging.getLogger(__name__)

# bytes hashed from the start of the file for system_fingerprint: the GGUF header and
# metadata live there; hashing a 60 GB file at start-up is not an option
_FINGERPRINT_BYTES = 1 << 20

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelInfo:
    """What the API and the start-up log say about the loaded model."""

    path: Path
    id: str
    names: tuple[str, ...]  # every name a request may use: the id, the other aliases, the file stem
    architecture: str
    file_size: int  # bytes, all split files together
    n_ctx: int  # the context window of one request (a slot's), tokens
    parallel: int  # requests decoded together (the context's slots)
    n_ctx_train: int
    n_vocab: int
    chat_template: str | None
    mode: str  # "resident" | "streaming"
    budget_bytes: int | None  # the expert cache's (streaming), None for a resident model
    budget_reason: str | None  # why that budget (the start-up log says the same)
    fingerprint: str  # system_fingerprint: build + model hash
    created: int  # file mtime, seconds since the epoch (the /v1/models `created`)
    any_model: bool = False  # --alias '*': a request naming any other id is served too
    # the --rpc helpers: each one's layers here (0: it answered but holds none), and those left
    # out because they did not answer (--rpc-optional)
    helpers: tuple[tuple[str, int], ...] = ()
    helpers_left_out: tuple[str, ...] = ()


@dataclass
class LoadedModel:
    """A loaded llama_cpp.Llama and its description; owned by the engine's worker thread."""

    llama: MeasuredLlama
    info: ModelInfo
    # the model's routing shape when its routing is replayed or recorded (a recorded trace's header)
    route_shape: ModelShape | None = None
    # the server's warm start of a streamed model (server/lifecycle/hot_set.py), None elsewhere
    warm_start: WarmStart | None = None
    # the server's prompt cache (server/engine/prompt_cache.py), None elsewhere
    prompt_cache: PromptCache | None = None
    _closed: bool = field(default=False, repr=False)

    def idle(self) -> bool:
        """Between requests, no request waiting: the budget follows memory, and warm start saves
        the hot set when due and reads the last one back a chunk at a time. True while read-back
        remains (the caller comes back at once)."""
        self.llama.follow_memory()
        return self.warm_start.idle() if self.warm_start is not None else False

    def after_request(self) -> None:
        """After each request: warm start saves the hot set when due (a server that is never idle
        still keeps it)."""
        if self.warm_start is not None:
            self.warm_start.save_if_due()

    def close(self) -> None:
        """Save the hot set and the prompt states, then free the context and the model (idempotent)."""
        if not self._closed:
            self._closed = True
            try:
                if self.warm_start is not None:
                    self.warm_start.close()
                if self.prompt_cache is not None:
                    self.prompt_cache.close(self.llama)
            finally:
                self.llama.close()


def _model_names(settings: ModelSettings, path: Path) -> tuple[str, ...]:
    """The id (the first alias, else the file stem without a split suffix), then the other names."""
    return tuple(dict.fromkeys([*settings.model_aliases, model_stem(path)]))


def _fingerprint(path: Path, size: int) -> str:
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        digest.update(fh.read(_FINGERPRINT_BYTES))
    return f"fp_moeflash-{__version__}-{digest.hexdigest()[:12]}"


def _check_file(path: Path) -> list[Path]:
    files = split_files(path)
    for part in files:
        if not part.is_file():
            raise ModelLoadError(f"model file not found: {part}")
        with part.open("rb") as fh:
            if fh.read(4) != GGUF_MAGIC:
                raise ModelLoadError(f"not a GGUF file (bad magic): {part}")
    return files


def choose_mode(settings: ModelSettings, file_size: int) -> tuple[str, str]:
    """("resident" | "streaming", why) for the configured mode and the model's size."""
    if settings.mode != "auto":
        return settings.mode, "chosen in the settings"
    from server.loading.budget import memory_limit

    limit = memory_limit()
    # resident needs the whole file in page cache plus KV and compute buffers: keep headroom
    if file_size <= (limit.bytes - limit.in_use) * 0.6:
        return "resident", f"auto: the file ({format_size(file_size)}) fits in {limit.source}"
    return "streaming", f"auto: the file ({format_size(file_size)}) exceeds 60% of {limit.source}"


def load_model(
    settings: ModelSettings,
    routing: RouteTraceSettings | None = None,
    prompt_cache_ram: PromptCacheRam = None,
) -> LoadedModel:
    """Load the model `settings` names, its routing replayed from or recorded to a route trace
    as `routing` says, `prompt_cache_ram` (a size or "auto"; None: no prompt cache) counted in its
    memory for the prompt cache a served model gets (server/lifecycle/served.py).
    ModelLoadError/ConfigError when it cannot be."""
    model = _load_model(settings, routing, prompt_cache_ram)
    info = model.info
    budget = (
        "no budget (resident)" if info.budget_bytes is None else f"budget {format_size(info.budget_bytes)}"
    )
    logger.info(
        "model ready: %s (architecture %s, file %s, %s, mode %s, context %d tokens, parallel %d; "
        "flash attention %s, repacked layouts %s)",
        info.id,
        info.architecture,
        format_size(info.file_size),
        budget,
        info.mode,
        info.n_ctx,
        info.parallel,
        settings.flash_attn,
        settings.repack,
    )
    return model


def _load_model(
    settings: ModelSettings, routing: RouteTraceSettings | None, prompt_cache: PromptCacheRam
) -> LoadedModel:
    """The model and its context, `prompt_cache` RAM counted in its memory."""
    if settings.model is None:
        raise ConfigError("no model given (--model PATH or MOEFLASH_MODEL)")
    path = settings.model.expanduser().resolve()
    files = _check_file(path)
    file_size = sum(part.stat().st_size for part in files)
    mode, why = choose_mode(settings, file_size)
    logger.info("loading %s %s (%s)", path, mode, why)

    threads = settings.threads or os.cpu_count() or 1
    kwargs: dict[str, Any] = {
        "n_batch": settings.n_batch,
        "n_ubatch": settings.n_batch,
        # sliding-window layers keep the window (plus a micro-batch), not the whole context:
        # gemma4-26b-shape at 32k tokens, 6.4 GB of KV cache less (engine/token_loop.py checks a
        # reused prefix still has its window)
        "swa_full": False,
        # every core (llama-cpp-python's own default decodes on half of them)
        "n_threads": threads,
        "n_threads_batch": threads,
        "verbose": False,
    }
    from server.loading.route_trace import build_tracer

    if routing is not None and routing.prefetch_trace_error > 0 and not routing.prefetch_from_trace:
        raise ConfigError("--prefetch-trace-error needs --prefetch-from-trace")
    if routing is not None and routing.prefetch_from_trace:
        if routing.route_trace is None or mode != "streaming" or settings.prefetch == "off":
            raise ConfigError(
                f"--prefetch-from-trace needs --route-trace, streaming and prefetch on (mode {mode}, "
                f"prefetch {settings.prefetch})"
            )
    traced = build_tracer(routing, path) if routing is not None else None
    if traced is not None:
        kwargs["tracer"] = traced[0]
    try:
        devices, helpers, local = _devices(settings, path, mode)
        kwargs.update(devices)
        if traced is not None and local:
            traced[0].keep_layers(local)
        llama = _load(settings, path, mode, {**kwargs, "prompt_cache": prompt_cache})
        llama.helpers = tuple(endpoint for endpoint, n in helpers if n)
    except ModelLoadError as exc:
        if traced is not None:
            traced[0].close()
        if settings.rpc and kwargs.get("n_gpu_layers"):
            raise _helpers_failed(exc, settings.rpc) from exc
        raise
    except BaseException:
        if traced is not None:
            traced[0].close()
        raise
    if routing is not None and routing.prefetch_from_trace and llama.tracer and llama.streamer:
        llama.tracer.predict_for(llama.streamer, routing.prefetch_trace_error)
    model = _described(settings, llama, path, file_size, mode, traced[1] if traced else None)
    answered = {endpoint for endpoint, _ in helpers}
    model.info = replace(
        model.info,
        helpers=helpers,
        helpers_left_out=tuple(endpoint for endpoint in settings.rpc if endpoint not in answered),
    )
    return model


def _helpers_failed(exc: ModelLoadError, endpoints: list[str]) -> ModelLoadError:
    """What a load that placed layers on RPC helpers failed of: a helper lost meanwhile, or (a
    helper refuses buffers past its --memory, and llama.cpp says only that the load failed) the
    layers not fitting."""
    from server.errors import HelperError
    from server.rpc.ggml import Ggml

    ggml = Ggml.load()
    lost = [endpoint for endpoint in endpoints if ggml.lost(endpoint)]
    if lost:
        return HelperError(f"RPC helper {', '.join(lost)} was lost while the model loaded ({exc})")
    return ModelLoadError(
        f"{exc}; the layers placed on the RPC helpers may not fit their --memory (--rpc-layers, and each "
        "helper's log)"
    )


def _devices(
    settings: ModelSettings, path: Path, mode: str
) -> tuple[dict[str, Any], tuple[tuple[str, int], ...], int]:
    """The Llama arguments that name the devices besides the CPU: none, or the RPC helpers of
    --rpc and the last layers they hold (server/rpc/devices.py; HelperError for one that cannot
    be used, unless --rpc-optional leaves it out), each helper's endpoint and layers, and the
    layers kept here when helpers hold some (0: all). A streamed model streams the experts of the
    layers it keeps."""
    if not settings.rpc:
        return {"devices": []}, (), 0
    from server.rpc.devices import connect, plan
    from server.settings import AUTO_PARALLEL

    slots = settings.parallel if isinstance(settings.parallel, int) else AUTO_PARALLEL
    helpers = connect(settings.rpc, optional=settings.rpc_optional)
    if not helpers:
        logger.warning("no RPC helper answers: every layer runs here (--rpc-optional)")
        return {"devices": []}, (), 0
    asked = settings.rpc_layers
    if isinstance(asked, list) and len(helpers) < len(settings.rpc):  # counts of the helpers left
        asked = [
            n
            for endpoint, n in zip(settings.rpc, asked, strict=False)
            if endpoint in {h.endpoint for h in helpers}
        ]
    split = plan(helpers, asked, path, settings.ctx_size * slots)
    logger.info("devices: %s", split.describe())
    kwargs = split.llama_kwargs()
    if mode == "streaming" and split.remote:
        kwargs["local_layers"] = split.local
    helpers_layers = tuple((h.endpoint, n) for h, n in zip(split.helpers, split.layers, strict=True))
    return kwargs, helpers_layers, split.local if split.remote else 0


def _load(settings: ModelSettings, path: Path, mode: str, kwargs: dict[str, Any]) -> MeasuredLlama:
    if mode == "streaming":
        from server.loading.streaming import load_streaming_llama

        return load_streaming_llama(
            path,
            settings.streamer_config(),
            budget=settings.budget,
            preload=settings.preload,
            follow_memory=settings.follow_memory,
            n_ctx=settings.ctx_size,
            flash_attn=settings.flash_attn,
            repack=settings.repack,
            parallel=settings.parallel,
            **kwargs,
        )
    from server.loading.resident import load_resident_llama

    return load_resident_llama(
        path,
        n_ctx=settings.ctx_size,
        flash_attn=settings.flash_attn,
        repack=settings.repack,
        parallel=settings.parallel,
        **kwargs,
    )


def _described(
    settings: ModelSettings,
    llama: MeasuredLlama,
    path: Path,
    file_size: int,
    mode: str,
    route_shape: ModelShape | None,
) -> LoadedModel:
    from server.loading.streaming import StreamingLlama

    budget_bytes, budget_reason = None, None
    if isinstance(llama, StreamingLlama):
        budget_bytes, budget_reason = llama.budget.bytes, llama.budget.reason
    metadata: dict[str, str] = dict(llama.metadata)
    template = metadata.get("tokenizer.chat_template")
    if settings.chat_template_file is not None:
        try:
            template = settings.chat_template_file.read_text(encoding="utf-8")
        except OSError as exc:
            llama.close()
            raise ConfigError(f"cannot read the chat template {settings.chat_template_file}: {exc}") from exc
    names = _model_names(settings, path)
    info = ModelInfo(
        path=path,
        id=names[0],
        names=names,
        architecture=metadata.get("general.architecture", "unknown"),
        file_size=file_size,
        n_ctx=llama.n_ctx_seq,
        parallel=len(llama.slots),
        n_ctx_train=llama._model.n_ctx_train(),
        n_vocab=llama.n_vocab(),
        chat_template=template,
        mode=mode,
        budget_bytes=budget_bytes,
        budget_reason=budget_reason,
        fingerprint=_fingerprint(path, file_size),
        created=int(os.stat(path).st_mtime),
        any_model=settings.any_model,
    )
    return LoadedModel(llama=llama, info=info, route_shape=route_shape)
