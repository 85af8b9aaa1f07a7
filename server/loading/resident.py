"""Resident model loader: llama.cpp maps the whole file the stock way (load mode MMAP), with the
kernels and context the streamed loader uses (context.llama_params): the resident reference of
the byte-identity gates.

The weights are page cache, which the kernel reclaims rather than killing the process, but for
those in the CPU backend's repacked layouts (`--repack on`), which llama.cpp copies into anonymous
memory (the file's pages of them are page cache again). Those and what the context holds must fit
beside the process: measured once the context exists (server/loading/budget.py), a context the
memory cannot hold is refused. Flash attention and the layouts are the settings', never the
memory's (server/loading/context.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import llama_cpp

from server.errors import ModelLoadError
from server.loading.budget import (
    PromptCacheRam,
    check_resident,
    max_heads,
    memory_limit,
    memory_terms,
    repacked_bytes,
)
from server.loading.context import ContextBytes, context_bytes, fit_slots, llama_params
from server.loading.gguf_header import read_metadata
from server.loading.measured import MeasuredLlama
from server.loading.model_files import split_files


class ResidentLlama(MeasuredLlama):
    """A Llama mapped the stock way; `memory` is what the process holds beside its weights."""


def load_resident_llama(
    model_path: str | os.PathLike[str],
    *,
    n_ctx: int = 4096,
    flash_attn: str | None = None,
    repack: str | None = None,
    parallel: int | str = 1,
    prompt_cache: PromptCacheRam = None,
    **llama_kwargs: Any,
) -> ResidentLlama:
    """Load `model_path` resident, with the slots `parallel` asks for (context.fit_slots), each an
    `n_ctx`-token context. ConfigError when its context (and `prompt_cache`, the RAM the server
    keeps prompt states in) cannot be held in this memory, ModelLoadError when llama.cpp cannot
    load it."""
    params = llama_params(n_ctx, parallel, flash_attn, repack, **llama_kwargs)
    path = Path(model_path)
    limit = memory_limit()  # before the load: what the process holds now is `in_use`
    try:
        llm = ResidentLlama(str(path), load_mode=llama_cpp.LLAMA_LOAD_MODE_MMAP, **params)
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelLoadError(f"llama.cpp could not load {path}: {exc}") from exc
    try:
        repacked = repacked_bytes(path) if params["use_extra_bufts"] else 0
        mapped = sum(part.stat().st_size for part in split_files(path)) - repacked
        n_head_max = max_heads(read_metadata(path))
        context = context_bytes(llm, n_head_max)

        def room(context: ContextBytes) -> int:
            return limit.bytes - memory_terms(limit, repacked, context, prompt_cache).total - mapped

        context = fit_slots(llm, parallel=parallel, n_head_max=n_head_max, room=room, context=context)
        terms = memory_terms(limit, repacked, context, prompt_cache)
        check_resident(terms, limit, mapped, llm.n_ctx())
    except BaseException:
        llm.close()
        raise
    llm.memory = terms
    return llm
