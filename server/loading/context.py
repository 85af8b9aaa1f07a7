"""A llama.cpp context's host memory, measured, and flash attention to shrink it.

`context_bytes(llama)` asks llama.cpp (patch 0004, `llama_get_context_bytes`) what the context
holds beside the weights: the KV cache, the compute buffers reserved for a full micro-batch over
the whole context (allocated at creation, filled only when a prompt that long arrives) and the
output buffer. Without flash attention one more buffer grows on the first long prompt: ggml's
work buffer for the attention product, where the F32 scores (n_kv x n_ubatch x n_head) are
converted to F16 for the V matmul; llama.cpp does not reserve it, so it is computed here from
those sizes. Flash attention never materialises the scores: on qwen30b-8l-shape at 8192 tokens
the compute buffers are 96 instead of 558 MiB, and the work buffer is gone
(docs/memory.md says how to measure it). `recreate_with_flash_attention` swaps a loaded Llama's
context for one with flash attention on; the weights stay where they are.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.errors import ConfigError

if TYPE_CHECKING:
    from llama_cpp import Llama

logger = logging.getLogger(__name__)

_F16_BYTES = 2


@dataclass(frozen=True)
class ContextBytes:
    """Host bytes of a llama.cpp context beside the weights."""

    kv: int
    compute: int
    output: int
    attention_scratch: int  # ggml's work buffer for the attention product (0 with flash attention)
    flash_attn: bool
    n_ctx: int  # the context's tokens these buffers are for

    @property
    def total(self) -> int:
        return self.kv + self.compute + self.output + self.attention_scratch


def check_flash_attn(setting: str) -> bool:
    """Whether a context is created with flash attention for `setting` ("on", "off", "auto": off
    first, see fit_context); ConfigError for anything else, before any load."""
    if setting not in ("auto", "on", "off"):
        raise ConfigError(f"flash_attn must be auto, on or off, got {setting!r}")
    return setting == "on"


def flash_attn_on(llama: Llama) -> bool:
    """Whether the context computes attention with flash attention."""
    import llama_cpp

    return bool(llama.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED)


def context_bytes(llama: Llama, n_head_max: int) -> ContextBytes:
    """What `llama`'s context holds (module docstring); `n_head_max`: the most attention heads of
    any layer (gemma4's layers differ)."""
    import llama_cpp

    measured = llama_cpp.llama_get_context_bytes(llama._ctx.ctx)
    flash = flash_attn_on(llama)
    scratch = 0 if flash else llama.n_ctx() * llama.context_params.n_ubatch * n_head_max * _F16_BYTES
    return ContextBytes(
        kv=int(measured.memory),
        compute=int(measured.compute),
        output=int(measured.output),
        attention_scratch=scratch,
        flash_attn=flash,
        n_ctx=llama.n_ctx(),
    )


def recreate_with_flash_attention(llama: Llama) -> None:
    """Replace `llama`'s context by one with flash attention on (same parameters otherwise, the
    eval callback included). Only before the first decode: the KV cache starts empty."""
    import llama_cpp
    from llama_cpp import _internals

    old = llama._ctx
    llama.context_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    # first: both contexts at once would hold two KV caches
    old.close()  # type: ignore[no-untyped-call]
    llama._ctx = llama._stack.enter_context(
        contextlib.closing(
            _internals.LlamaContext(model=llama._model, params=llama.context_params, verbose=llama.verbose)
        )
    )


def fit_context(
    llama: Llama, *, flash_attn: str, n_head_max: int, fits: Callable[[ContextBytes], bool]
) -> ContextBytes:
    """The context's bytes; with `flash_attn` "auto", a context that does not `fits` the memory
    (without flash attention: its scores crowd the expert cache or the weights) is re-created
    with flash attention, logged with both sizes."""
    measured = context_bytes(llama, n_head_max)
    if flash_attn != "auto" or measured.flash_attn or fits(measured):
        return measured
    recreate_with_flash_attention(llama)
    after = context_bytes(llama, n_head_max)
    logger.info(
        "flash attention on: the %d-token context's buffers take %.0f MiB instead of %.0f MiB "
        "(compute %.0f -> %.0f MiB, attention scratch %.0f -> 0 MiB), left to the cache",
        llama.n_ctx(),
        after.total / 2**20,
        measured.total / 2**20,
        measured.compute / 2**20,
        after.compute / 2**20,
        measured.attention_scratch / 2**20,
    )
    return after
