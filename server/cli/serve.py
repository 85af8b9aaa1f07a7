"""`moeflash serve`: the OpenAI-compatible HTTP server on one model."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from typing import TYPE_CHECKING, Any

from server.errors import ConfigError, ModelLoadError, MoeflashError
from server.loading.loader import LoadedModel, load_model
from server.loading.model_files import split_files
from server.settings import ModelSettings, ServerSettings, add_arguments, settings_from_args

if TYPE_CHECKING:
    from server.loading.prompt_cache import PromptCache

logger = logging.getLogger(__name__)

_YEAR_S = 365 * 24 * 3600.0

_LAN_WARNING = """
  ************************************************************************
  *  WARNING: serving on %s WITHOUT an API key.
  *  Anyone on the network can use this model (--insecure-no-key).
  *  Set --api-key or --api-key-file (or MOEFLASH_API_KEY) instead.
  ************************************************************************"""


def _size(n: int) -> str:
    """Bytes in binary units, e.g. 4.5 MiB or 17.28 GiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def load_served_model(server_settings: ServerSettings, settings: ModelSettings) -> LoadedModel:
    """The engine's loader in `serve`: the model with its prompt cache, warm-started when streamed
    (and asked for)."""
    ram = server_settings.prompt_cache_ram
    model = load_model(settings, prompt_cache=None if ram == 0 else ram)
    info = model.info
    streamer = model.llama.streamer
    try:
        if ram != 0:
            model.prompt_cache = _prompt_cache(server_settings, model)
        if server_settings.warm_start and streamer is not None:
            from server.loading.hot_set import WarmStart

            model.warm_start = WarmStart(
                streamer, info.path, server_settings.state_dir, save_every_s=server_settings.hot_set_save_s
            )
            logger.info("warm start: the hot set is kept in %s", model.warm_start.path)
    except BaseException:
        model.close()
        raise
    budget = "no budget (resident)" if info.budget_bytes is None else f"budget {_size(info.budget_bytes)}"
    logger.info(
        "model ready: %s (architecture %s, file %s, %s, mode %s, context %d tokens)",
        info.id,
        info.architecture,
        _size(info.file_size),
        budget,
        info.mode,
        info.n_ctx,
    )
    return model


def _prompt_cache(server_settings: ServerSettings, model: LoadedModel) -> PromptCache:
    """The model's prompt cache, in the RAM its memory budget counted, its states on flash under
    the state directory."""
    from server.loading.prompt_cache import PromptCache, StateKey, Window, model_identity, state_directory

    memory = model.llama.memory
    key = StateKey.of(model.llama, model_identity(model.info.path))
    flash = server_settings.prompt_cache_flash
    directory = state_directory(server_settings.state_dir, model.info.path, key) if flash else None
    cache = PromptCache(
        key,
        ram_bytes=memory.prompt_cache if memory is not None else 0,
        flash_bytes=flash,
        directory=directory,
        window=Window.of(model.llama),
    )
    logger.info(
        "prompt cache: %s in RAM, %s on flash%s",
        _size(cache.ram_limit),
        _size(flash),
        f" in {directory}" if directory is not None else "",
    )
    return cache


def run(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit status."""
    import uvicorn

    from server.engine.worker import Engine, EngineState
    from server.http.app import create_app

    server_settings, model_settings = settings_from_args(args)
    if model_settings.model is None:
        raise ConfigError("no model given: moeflash serve --model PATH (or MOEFLASH_MODEL)")
    path = model_settings.model
    if not path.is_file():
        raise ConfigError(f"model file not found: {path}")
    key = server_settings.resolved_api_key()
    lan = not server_settings.is_loopback()
    if lan and key is None:
        if not server_settings.insecure_no_key:
            raise ConfigError(
                f"serving on {server_settings.host} (beyond this machine) needs an API key: --api-key, "
                "--api-key-file or MOEFLASH_API_KEY; --insecure-no-key serves without one"
            )
        logger.warning(_LAN_WARNING, server_settings.host)
    size = sum(p.stat().st_size for p in split_files(path) if p.is_file())
    logger.info("loading %s (%s) in mode %s", path, _size(size), model_settings.mode)
    engine = Engine(
        lambda: load_served_model(server_settings, model_settings),
        max_queue=server_settings.max_queue,
        queue_full_status=server_settings.queue_full_status,
        retry_after_s=server_settings.retry_after_s,
    )
    app = create_app(server_settings, engine)
    host = server_settings.host
    shown = f"[{host}]" if ":" in host else host
    logger.info(
        "serving on http://%s:%d/  (OpenAI API at /v1, API key %s)",
        shown,
        server_settings.port,
        "required" if key else "not required",
    )
    if lan:
        from server.http.pairing import pairing_banner

        # user-facing: the link and QR code that pair a phone or laptop
        print(pairing_banner(host, server_settings.port, key), file=sys.stderr, flush=True)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=server_settings.port,
            log_level="warning",
            timeout_graceful_shutdown=10,
            # our own logging config (the CLI's) stays in force
            log_config=None,
        )
    )

    def stop_if_the_load_fails() -> None:
        # a model that cannot be loaded (e.g. a context the memory cannot hold) ends the server
        if not engine.wait_ready(_YEAR_S) and engine.state is EngineState.FAILED:
            server.should_exit = True

    threading.Thread(target=stop_if_the_load_fails, name="moeflash-load-watch", daemon=True).start()
    server.run()
    failure = engine.load_error
    if failure is not None:
        raise failure if isinstance(failure, MoeflashError) else ModelLoadError(str(failure))
    return 0


def register(subparsers: Any) -> None:
    """Add `serve` to the moeflash command line (flags generated from the settings)."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over the OpenAI-compatible HTTP API",
        description="Serve a GGUF model over an OpenAI-compatible HTTP API (default 127.0.0.1:8000).",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
