"""`moeflash serve`: the OpenAI-compatible HTTP server on one model, or on a directory of models
(--models-dir) switching between them on request (server/lifecycle/switching.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from typing import TYPE_CHECKING, Any

from server.cli.arguments import add_arguments, settings_from_args, settings_of
from server.errors import ConfigError, ModelLoadError, MoeflashError
from server.lifecycle.served import served_engine
from server.loading.budget import return_freed_buffers
from server.loading.model_files import split_files
from server.settings import ModelSettings, ServerSettings, StoreSettings
from server.units import format_size

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

_YEAR_S = 365 * 24 * 3600.0

_LAN_WARNING = """
  ************************************************************************
  *  WARNING: serving on %s WITHOUT an API key.
  *  Anyone on the network can use this model (--insecure-no-key).
  *  Set --api-key or --api-key-file (or MOEFLASH_API_KEY) instead.
  ************************************************************************"""


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
