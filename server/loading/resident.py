"""Resident model loader: llama.cpp maps the whole file the stock way (load mode MMAP) with
use_extra_bufts off, so no weight is repacked into another layout; the resident reference of the
byte-identity gates uses the same setting.

The weights are page cache, which the kernel reclaims rather than killing the process; what the
context holds is not, so it must fit beside the process: measured once the context exists
(server/loading/budget.py), a context the memory cannot hold is refused, and with `flash_attn` "auto"
flash attention comes on when the context and the weights do not both fit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import llama_cpp

from server.errors import ModelLoadError
from server.loading.budget import PromptCacheRam, check_resident, max_heads, memory_limit, memory_terms
from server.loading.context import ContextBytes, check_flash_attn, fit_context
from server.loading.gguf_header import read_metadata
from server.loading.measured import MeasuredLlama
from server.loading.model_files import split_files


class ResidentLlama(MeasuredLlama):
    """A Llama mapped the stock way; `memory` is what the process holds beside its weights."""


def load_resident_llama(
    model_path: str | os.PathLike[str],
    *,
    n_ctx: int = 4096,
    flash_attn: str = "auto",
    prompt_cache: PromptCacheRam = None,
    **llama_kwargs: Any,
) -> ResidentLlama:
    """Load `model_path` resident. ConfigError when its context (and `prompt_cache`, the RAM the
    server keeps prompt states in) cannot be held in this memory, ModelLoadError when llama.cpp
    cannot load it."""
    flash_first = check_flash_attn(flash_attn)
    path = Path(model_path)
    limit = memory_limit()  # before the load: what the process holds now is `in_use`
    kwargs = dict(llama_kwargs)
    kwargs.setdefault("verbose", False)
    try:
        llm = ResidentLlama(
            str(path),
            n_ctx=n_ctx,
            load_mode=llama_cpp.LLAMA_LOAD_MODE_MMAP,
            use_extra_bufts=False,
            flash_attn=flash_first,
            **kwargs,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelLoadError(f"llama.cpp could not load {path}: {exc}") from exc
    try:
        file_bytes = sum(part.stat().st_size for part in split_files(path))

        def fits(context: ContextBytes) -> bool:
            return limit.bytes - memory_terms(limit, 0, context, prompt_cache).total >= file_bytes

        ctx_before = llm._ctx
        context = fit_context(
            llm, flash_attn=flash_attn, n_head_max=max_heads(read_metadata(path)), fits=fits
        )
        if llm._ctx is not ctx_before:
            llm.measure_decode()
        terms = memory_terms(limit, 0, context, prompt_cache)
        check_resident(terms, limit, file_bytes, llm.n_ctx())
    except BaseException:
        llm.close()
        raise
    llm.memory = terms
    return llm
