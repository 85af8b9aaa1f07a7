"""The served model, put together in one place: the model (server/loading/loader.py) with the
server's prompt cache (server/engine/prompt_cache.py) and, streamed, warm start's hot set
(server/lifecycle/hot_set.py); and the engine `serve` runs on it, with the switch between a
directory's models (server/lifecycle/switching.py) when it serves one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from server.errors import ConfigError
from server.loading.loader import LoadedModel, load_model
from server.loading.model_files import gguf_models, model_stem
from server.settings import ModelSettings, ServerSettings
from server.units import format_size

if TYPE_CHECKING:
    from pathlib import Path

    from server.engine.prompt_cache import PromptCache
    from server.engine.worker import Engine
    from server.lifecycle.switching import ModelSwitch

logger = logging.getLogger(__name__)


def load_served(settings: ModelSettings, served: ServerSettings) -> LoadedModel:
    """The model `settings` names as the server serves it: the prompt cache `served` asks for (its
    RAM counted in the model's memory) and warm start for a streamed model."""
    ram = served.prompt_cache_ram
    model = load_model(settings, prompt_cache_ram=None if ram == 0 else ram)
    try:
        if ram != 0:
            model.prompt_cache = _prompt_cache(served, model)
        streamer = model.llama.streamer
        if served.warm_start and streamer is not None:
            from server.lifecycle.hot_set import WarmStart

            model.warm_start = WarmStart(
                streamer, model.info.path, served.state_dir, save_every_s=served.hot_set_save_s
            )
            logger.info("warm start: the hot set is kept in %s", model.warm_start.path)
    except BaseException:
        model.close()
        raise
    return model


def _prompt_cache(served: ServerSettings, model: LoadedModel) -> PromptCache:
    """The model's prompt cache, in the RAM its memory budget counted, its states on flash under
    the state directory."""
    from server.engine.prompt_cache import PromptCache, StateKey, Window, model_identity, state_directory

    memory = model.llama.memory
    key = StateKey.of(model.llama, model_identity(model.info.path))
    flash = served.prompt_cache_flash
    directory = state_directory(served.state_dir, model.info.path, key) if flash else None
    cache = PromptCache(
        key,
        ram_bytes=memory.prompt_cache if memory is not None else 0,
        flash_bytes=flash,
        directory=directory,
        window=Window.of(model.llama),
    )
    where = f" in {directory}" if directory is not None else ""
    logger.info(
        "prompt cache: %s in RAM, %s on flash%s", format_size(cache.ram_limit), format_size(flash), where
    )
    return cache


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
        return engine(lambda: load_served(model_settings, server_settings)), None
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
        return load_served(model_settings.model_copy(update={"model": path}), server_settings)

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
