"""`moeflash serve`: the OpenAI-compatible HTTP server on one model, or on a directory of models
(--models-dir) switching between them on request (server/lifecycle/switching.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from server.cli.arguments import add_arguments, settings_from_args, settings_of
from server.errors import ConfigError, ModelLoadError, MoeflashError
from server.loading.budget import return_freed_buffers
from server.loading.loader import LoadedModel, load_model
from server.loading.model_files import gguf_models, model_stem, split_files
from server.settings import ModelSettings, ServerSettings, StoreSettings
from server.units import format_size

if TYPE_CHECKING:
    from pathlib import Path

    from server.engine.worker import Engine
    from server.lifecycle.switching import ModelSwitch

logger = logging.getLogger(__name__)

_YEAR_S = 365 * 24 * 3600.0

_LAN_WARNING = """
  ************************************************************************
  *  WARNING: serving on %s WITHOUT an API key.
  *  Anyone on the network can use this model (--insecure-no-key).
  *  Set --api-key or --api-key-file (or MOEFLASH_API_KEY) instead.
  ************************************************************************"""


def served_engine(
    server_settings: ServerSettings, model_settings: ModelSettings, models_dir: Path | None
) -> tuple[Engine, ModelSwitch | None]:
    """The engine `serve` runs, loading --model; with `models_dir`, also the switch between the
    directory's models (--model, if given, is loaded first, else the first by name)."""
    from server.engine.worker import Engine
    from server.lifecycle.switching import DirectoryModel, ModelSwitch

    def engine(loader: Callable[[], LoadedModel]) -> Engine:
        return Engine(
            loader,
            max_queue=server_settings.max_queue,
            queue_full_status=server_settings.queue_full_status,
            retry_after_s=server_settings.retry_after_s,
        )

    if models_dir is None:
        if model_settings.model is None:
            raise ConfigError("no model given: moeflash serve --model PATH (or --models-dir DIR)")
        if not model_settings.model.is_file():
            raise ConfigError(f"model file not found: {model_settings.model}")
        return engine(lambda: load_model(model_settings, served=server_settings)), None
    if model_settings.alias:
        raise ConfigError("--alias names one model: with --models-dir each model goes by its file stem")
    if not models_dir.is_dir():
        raise ConfigError(f"the models directory {models_dir} does not exist")
    paths = gguf_models(p for p in models_dir.iterdir() if p.is_file())
    first = model_settings.model
    if first is not None and first.resolve() not in {p.resolve() for p in paths}:
        if model_stem(first) in {model_stem(p) for p in paths}:
            raise ConfigError(f"--model {first} has the name of a model of {models_dir}: serve one of them")
        paths.insert(0, first)
    if not paths:
        raise ConfigError(f"no GGUF model in {models_dir} (moeflash pull --models-dir {models_dir} gets one)")
    models = [DirectoryModel.read(p) for p in paths]
    start = next((m for m in models if first is not None and m.path.resolve() == first.resolve()), models[0])

    def load(path: Path) -> LoadedModel:
        return load_model(model_settings.model_copy(update={"model": path}), served=server_settings)

    served = engine(lambda: load(start.path))
    switch = ModelSwitch(
        served,
        models,
        start.name,
        load,
        ctx_size=model_settings.ctx_size,
        mode=model_settings.mode,
        keep_alive_s=server_settings.keep_alive,
        directory=models_dir,
        first=first,
    )
    logger.info("serving %d models of %s: %s", len(models), models_dir, ", ".join(m.name for m in models))
    return served, switch


def run(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit status."""
    import uvicorn

    from server.engine.worker import EngineState
    from server.http.app import create_app

    server_settings, model_settings = settings_from_args(args)
    return_freed_buffers()  # before any model: it loads and frees large buffers
    engine, switch = served_engine(
        server_settings, model_settings, settings_of(StoreSettings, args).models_dir
    )
    key = server_settings.resolved_api_key()
    lan = not server_settings.is_loopback()
    if lan and key is None:
        if not server_settings.insecure_no_key:
            raise ConfigError(
                f"serving on {server_settings.host} (beyond this machine) needs an API key: --api-key, "
                "--api-key-file or MOEFLASH_API_KEY; --insecure-no-key serves without one"
            )
        logger.warning(_LAN_WARNING, server_settings.host)
    if model_settings.model is not None and switch is None:
        path = model_settings.model
        size = sum(p.stat().st_size for p in split_files(path) if p.is_file())
        logger.info("loading %s (%s) in mode %s", path, format_size(size), model_settings.mode)
    app = create_app(server_settings, engine, switch)
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
    add_arguments(parser, (ServerSettings, ModelSettings, StoreSettings))
    parser.set_defaults(func=run)
