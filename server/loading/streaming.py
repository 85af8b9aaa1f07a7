"""Streaming model loader: a llama_cpp.Llama whose experts are streamed from flash.

`load_streaming_llama(path, config, budget=..., **llama_kwargs)` returns a `StreamingLlama`: a Llama (the
rest of the program cannot tell it from a resident one) whose expert tensors live in the
streamer's reserved memory and whose cb_eval is the streamer's C callback. The file is mapped
without being read (load mode MMAP_NO_PREFETCH); dense weights are read once into anonymous
memory, except the token embeddings of a model with its own output matrix, which stay mapped
from the file (a token reads one row); experts are read on demand into a cache bounded by the
budget.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import llama_cpp

from server.errors import ConfigError, ModelLoadError
from server.loading.budget import (
    BudgetChoice,
    MemoryLimit,
    MemoryTerms,
    PromptCacheRam,
    check_budget_floor,
    choose_budget,
    max_heads,
    memory_limit,
    memory_terms,
    model_tensors,
    streamer_dense_bytes,
    tied_output_bytes,
)
from server.loading.context import ContextBytes, context_bytes, fit_slots, llama_params
from server.loading.gguf_header import read_metadata
from server.loading.measured import MeasuredLlama
from server.loading.pressure import BudgetBand, MemoryWatch
from server.settings import Budget
from server.units import format_size
from streaming_ext import Streamer, StreamerConfig, StreamerError, StreamerStats

logger = logging.getLogger(__name__)

# llama.cpp matches these with std::regex_search against tensor names, first match wins
EXPERT_PATTERN = r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.weight$"
DENSE_PATTERN = r".*"
# a token reads one row of the embeddings: mapped from the file, not read into memory, unless the
# output matrix is the same tensor (no output.weight: llama.cpp then multiplies by it every token)
EMBEDDINGS = "token_embd.weight"
UNTIED_OUTPUT = "output.weight"


class StreamingLlama(MeasuredLlama):
    """A Llama whose experts are streamed; `budget` says what the expert cache holds and why."""

    streamer: Streamer
    budget: BudgetChoice

    def __init__(self, model_path: str, *, streamer: Streamer, **kwargs: Any) -> None:
        self.budget = BudgetChoice(0, "not chosen yet")
        super().__init__(model_path, streamer=streamer, **kwargs)

    def stats(self) -> StreamerStats:
        """The streamer's cumulative counters."""
        return self.streamer.stats()


def load_streaming_llama(
    model_path: str | os.PathLike[str],
    config: StreamerConfig,
    *,
    budget: Budget = "auto",
    preload: bool = False,
    follow_memory: bool = True,
    n_ctx: int = 4096,
    flash_attn: str | None = None,
    repack: str | None = None,
    parallel: int | str = 1,
    prompt_cache: PromptCacheRam = None,
    local_layers: int = 0,
    **llama_kwargs: Any,
) -> StreamingLlama:
    """Load `model_path` (a GGUF or the first file of a split set) with its experts streamed.

    `budget`: the expert cache's bytes, "all" or "auto"; `preload` reads every expert at load (the
    budget must hold them all); `follow_memory` moves the budget with memory pressure, between one
    layer's experts and the budget chosen here (server/loading/pressure.py; not when the budget
    holds every expert, which then lives in the tensors). `flash_attn`, `repack`: "on" or "off"
    (the same as resident, whatever the memory; None: the settings' default). `parallel`: the slots, each
    an `n_ctx`-token context (context.fit_slots). The budget counts what the context holds, measured, and
    `prompt_cache`, the RAM the server keeps prompt states in (server/loading/budget.py).
    `local_layers`: the layers computed here when the rest are on RPC helpers (server/rpc; their
    tensors are left to llama.cpp's placement, their experts are not streamed), 0: all. Raises
    ConfigError for bad options (lanes, budget below one layer's experts, a context the memory
    cannot hold, ...) and ModelLoadError for a file that cannot be streamed (missing, truncated,
    not MoE, ...), in both cases before any generation.
    """
    path = Path(model_path)
    if not path.is_file():
        raise ModelLoadError(f"model file {path} does not exist")
    if not 1 <= config.lanes <= 16:
        raise ConfigError(f"lanes must be 1..16, got {config.lanes}")
    params = llama_params(n_ctx, parallel, flash_attn, repack, **llama_kwargs)
    limit = memory_limit()  # before the load: what the process holds now is `in_use`
    # the streamer indexes the file first: a bad file is refused before llama.cpp sees it
    if local_layers:
        config = replace(config, layers=local_layers)
    try:
        streamer = Streamer(path, config)
    except StreamerError as exc:
        raise ModelLoadError(str(exc)) from exc
    try:
        streamer.set_repack(params["use_extra_bufts"])
        placement = _place(path, streamer, budget, local_layers)
        llm = _load_llama(path, streamer, placement.overrides, params)
        try:
            choice, terms = _fit_memory(
                llm, path, streamer, placement, limit, parallel, prompt_cache, preload
            )
        except (StreamerError, ModelLoadError, ConfigError) as exc:
            llm.close()
            if isinstance(exc, StreamerError):
                raise ModelLoadError(str(exc)) from exc
            raise
        llm.budget = choice
        llm.memory = terms
        logger.info("expert budget %s: %s", format_size(choice.bytes, unit="MiB", digits=1), choice.reason)
        if follow_memory and not streamer.stats().hold_all:
            _follow_memory(llm, streamer, choice)
        logger.info("expert memory: %s", streamer.memory_note())
        if placement.mapped:
            logger.info(
                "%s (%s) mapped from the file, not read into RAM", EMBEDDINGS, format_size(placement.mapped)
            )
        return llm
    except BaseException:
        streamer.close()  # idempotent; the model (if any) was freed first
        raise


@dataclass(frozen=True)
class _Placement:
    """Where the model's tensors go, and the expert budget asked for."""

    overrides: list[tuple[str, Any]]  # llama.cpp's tensor_buft_overrides, first match wins
    mapped: int  # bytes of the embeddings left mapped from the file (0: read into RAM)
    dense: int  # bytes of the dense weights read into RAM
    requested: int | None  # the expert budget asked for; None: auto


def _layers_pattern(layers: range) -> str:
    return r"blk\.(?:" + "|".join(str(il) for il in layers) + r")\."


def _place(path: Path, streamer: Streamer, budget: Budget, local_layers: int = 0) -> _Placement:
    """The tensors' buffers: experts the streamer's, the embeddings mapped where a separate output
    matrix lets them be, the rest dense; with `local_layers`, the tensors of the layers above are
    left to llama.cpp (an RPC helper's). An explicit budget is checked here, before anything is
    loaded (ConfigError below one layer's experts)."""
    tensors = model_tensors(path)
    remote = range(0)
    expert_pattern, dense_pattern, remote_bytes = EXPERT_PATTERN, DENSE_PATTERN, 0
    if local_layers:
        n_layer = 1 + max(int(name.split(".")[1]) for name in tensors if name.startswith("blk."))
        remote = range(local_layers, n_layer)
        expert_pattern = EXPERT_PATTERN.replace(r"blk\.\d+\.", _layers_pattern(range(local_layers)))
        dense_pattern = "^(?!" + _layers_pattern(remote) + ").*"
        remote_bytes = sum(
            streamer.tensor_bytes(name)
            for name in tensors
            if name.startswith("blk.") and int(name.split(".")[1]) in remote
        )
    overrides = [(expert_pattern, streamer.expert_buft)]
    embeddings = "^" + re.escape(EMBEDDINGS) + "$"
    mapped = streamer.tensor_bytes(EMBEDDINGS)
    untied = streamer.tensor_bytes(UNTIED_OUTPUT) > 0
    # a tied output matrix's repacked copy of the embeddings (anonymous memory, as resident)
    tied_copy = (
        0 if untied or not streamer.repack else tied_output_bytes(tensors, streamer.lib.repacked_bytes)
    )
    if untied:
        overrides.append((embeddings, streamer.rows_buft))
    elif tied_copy:
        # the output matrix is a second, repacked copy of them (resident too): llama.cpp's CPU
        # buffer type lets it keep the rows mapped and the copy repacked (streaming_ext's mf_cpu_buft)
        overrides.append((embeddings, streamer.cpu_buft))
    else:
        mapped = 0
    overrides.append((dense_pattern, streamer.dense_buft))
    dense = streamer_dense_bytes(path, streamer.expert_bytes) - remote_bytes + tied_copy - mapped
    requested = streamer.expert_bytes if budget == "all" else None if budget == "auto" else budget
    if requested is not None:
        check_budget_floor(requested, streamer.layer_bytes)
    return _Placement(overrides, mapped, dense, requested)


def _load_llama(
    path: Path, streamer: Streamer, overrides: list[tuple[str, Any]], params: dict[str, Any]
) -> StreamingLlama:
    """llama.cpp's load of the mapped file with the streamer's buffers and callback (`params`:
    context.llama_params); its failure is a ModelLoadError saying the streamer's own error where
    there is one."""
    try:
        return StreamingLlama(
            str(path),
            streamer=streamer,
            load_mode=llama_cpp.LLAMA_LOAD_MODE_MMAP_NO_PREFETCH,
            tensor_buft_overrides=overrides,
            cb_eval=streamer.eval_callback,
            cb_eval_user_data=streamer.handle,
            **params,
        )
    except ValueError as exc:
        failure = streamer.take_error()
        detail = f": {failure}" if failure else ""
        raise ModelLoadError(f"llama.cpp could not load {path}{detail} ({exc})") from exc


def _fit_memory(
    llm: StreamingLlama,
    path: Path,
    streamer: Streamer,
    placement: _Placement,
    limit: MemoryLimit,
    parallel: int | str,
    prompt_cache: PromptCacheRam,
    preload: bool,
) -> tuple[BudgetChoice, MemoryTerms]:
    """Fit the slots and the expert budget to the memory beside the loaded model's context, set
    the budget, check the load and preload the experts if asked; the choice and the terms it
    counted."""
    failure = streamer.take_error()
    if failure is not None:
        raise ModelLoadError(f"loading {path} failed: {failure}")
    n_head_max = max_heads(read_metadata(path))
    context = context_bytes(llm, n_head_max)

    def room(context: ContextBytes) -> int:
        return limit.bytes - memory_terms(limit, placement.dense, context, prompt_cache).total

    context = fit_slots(llm, parallel=parallel, n_head_max=n_head_max, room=room, context=context)
    terms = memory_terms(limit, placement.dense, context, prompt_cache)
    choice = choose_budget(
        requested=placement.requested,
        expert_bytes=streamer.expert_bytes,
        layer_bytes=streamer.layer_bytes,
        terms=terms,
        limit=limit,
        n_ctx=llm.n_ctx(),
    )
    streamer.set_budget(choice.bytes)
    streamer.check_loaded()
    if preload:
        streamer.preload()
    return choice, terms


def _follow_memory(llm: StreamingLlama, streamer: Streamer, choice: BudgetChoice) -> None:
    """Start the watch that moves the budget with memory pressure, between one layer's experts
    and the budget chosen at load."""
    entry = streamer.expert_bytes // max(1, streamer.n_moe_layers * streamer.n_expert)
    band = BudgetBand(floor=streamer.layer_bytes, ceiling=choice.bytes, step=entry)
    llm.memory_watch = MemoryWatch(streamer, band)
    llm.memory_watch.start()
    logger.info("the expert budget follows memory pressure, down to %s", format_size(streamer.layer_bytes))
