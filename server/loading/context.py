"""A llama.cpp context's host memory, measured.

`context_bytes(llama)` asks llama.cpp (patch 0004, `llama_get_context_bytes`) what the context
holds beside the weights: the KV cache, the compute buffers reserved for a full micro-batch over
the whole context (allocated at creation, filled only when a prompt that long arrives) and the
output buffer. Without flash attention one more buffer grows on the first long prompt: ggml's
work buffer for the attention product, where the F32 scores (n_kv x n_ubatch x n_head) are
converted to F16 for the V matmul; llama.cpp does not reserve it, so it is computed here from
those sizes (docs/memory.md says how to measure it).

Flash attention and the repacked weight layouts are settings, never memory decisions: they
change what is computed, and a model must give the same text resident or streamed, under any
memory limit. Flash attention is off by default: a prompt decoded whole or in two parts gives
other logits with it (docs/memory.md), and the prompt cache and prompt chunks beside running
requests split prompts. The repacked layouts are on by default. Each slot has a KV stream of its
own (`kv_unified` off): a request's cells then lie in its stream in its own order, so it
computes the same bits alone or beside others (docs/api.md, "Concurrency and life cycle").
`recreate_context` swaps a loaded Llama's context for one with more slots (the weights stay
where they are); `fit_slots` chooses the slots (`--parallel`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server.errors import ConfigError
from server.units import format_size

if TYPE_CHECKING:
    from llama_cpp import Llama

    from server.loading.measured import MeasuredLlama

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
    n_ctx: int  # the context's tokens these buffers are for, every slot's together
    n_seq: int = 1  # the slots (requests decoded together) sharing them

    @property
    def total(self) -> int:
        return self.kv + self.compute + self.output + self.attention_scratch


def check_on_off(name: str, setting: str | None) -> bool:
    """Whether the kernel choice `name` (flash_attn, repack) is on for `setting` ("on" or "off";
    None: ModelSettings' default, the one declaration of it); ConfigError for anything else,
    before any load."""
    from server.settings import ModelSettings

    if setting is None:
        setting = str(ModelSettings.model_fields[name].default)
    if setting not in ("on", "off"):
        raise ConfigError(f"{name} must be on or off, got {setting!r}")
    return setting == "on"


def llama_params(
    n_ctx: int, parallel: int | str, flash_attn: str | None, repack: str | None, **llama_kwargs: Any
) -> dict[str, Any]:
    """The Llama arguments both loaders pass: one place picks the kernels (flash attention; the
    CPU backend's repacked layouts, `use_extra_bufts`, which the streamer's buffer types then give
    its weights too: Streamer.set_repack) and the context, so a resident model and its streamed
    twin compute the same. A number of slots is created at once; "auto" starts from one
    (fit_slots). ConfigError for a bad `flash_attn` or `repack`, before any load."""
    slots = parallel if isinstance(parallel, int) else 1
    return {
        "verbose": False,
        **llama_kwargs,
        "n_ctx": n_ctx * slots,
        "n_seq_max": slots,
        "kv_unified": False,
        "use_extra_bufts": check_on_off("repack", repack),
        "flash_attn": check_on_off("flash_attn", flash_attn),
    }


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
    # a micro-batch's tokens attend their own stream's cells: n_ctx_seq of them at most
    n_kv = int(llama_cpp.llama_n_ctx_seq(llama._ctx.ctx))
    scratch = 0 if flash else n_kv * llama.context_params.n_ubatch * n_head_max * _F16_BYTES
    return ContextBytes(
        kv=int(measured.memory),
        compute=int(measured.compute),
        output=int(measured.output),
        attention_scratch=scratch,
        flash_attn=flash,
        n_ctx=llama.n_ctx(),
        n_seq=int(llama.context_params.n_seq_max),
    )


def recreate_context(llama: MeasuredLlama, *, n_seq: int) -> None:
    """Replace `llama`'s context by one with `n_seq` slots of the same per-slot context in one
    KV stream each (same parameters otherwise, the eval callback and flash attention included). Only
    before the first decode: the KV cache starts empty."""
    from llama_cpp import _internals

    old = llama._ctx
    params = llama.context_params
    params.n_ctx = llama.n_ctx_seq * n_seq
    params.n_seq_max = n_seq
    params.kv_unified = False
    # first: both contexts at once would hold two KV caches
    old.close()  # type: ignore[no-untyped-call]
    llama._ctx = llama._stack.enter_context(
        contextlib.closing(_internals.LlamaContext(model=llama._model, params=params, verbose=llama.verbose))
    )
    llama.context_changed()


def fit_slots(
    llama: MeasuredLlama,
    *,
    parallel: int | str,
    n_head_max: int,
    room: Callable[[ContextBytes], int],
    context: ContextBytes,
) -> ContextBytes:
    """Give `llama` (created with one slot, or the slots `parallel` names, `context` its bytes) the
    slots `parallel` asks for: a
    number, or "auto": the most, up to AUTO_PARALLEL, whose extra contexts take at most a quarter
    of what one slot leaves for the expert cache or the weights (`room(context)`, bytes); each slot
    holds a full context. Returns the context's bytes; a number the memory cannot hold is for the
    loader's checks to refuse."""
    from server.settings import AUTO_PARALLEL

    if parallel == 1:
        return context
    if llama.context_params.n_seq_max != 1 and parallel == "auto":
        recreate_context(llama, n_seq=1)
        context = context_bytes(llama, n_head_max)
    left = room(context)
    per_slot = context.kv + context.attention_scratch
    if parallel == "auto":
        n = AUTO_PARALLEL
        while n > 1 and (n - 1) * per_slot > left // 4:
            n -= 1
    else:
        n = int(parallel)
    while n > 1:
        if n != llama.context_params.n_seq_max:
            recreate_context(llama, n_seq=n)
        measured = context_bytes(llama, n_head_max)
        extra = left - room(measured)
        if parallel != "auto" or extra <= left // 4:
            logger.info(
                "parallel %d: %d requests decode together, each in a %d-token context; the contexts take "
                "%s (KV %s, compute %s%s), %s more than one, of %s left for the expert cache or weights",
                n,
                n,
                llama.n_ctx_seq,
                format_size(measured.total),
                format_size(measured.kv),
                format_size(measured.compute),
                f", attention scratch {format_size(measured.attention_scratch)}"
                if measured.attention_scratch
                else "",
                format_size(extra),
                format_size(left),
            )
            return measured
        n -= 1
    if llama.context_params.n_seq_max != 1:
        recreate_context(llama, n_seq=1)
    logger.info(
        "parallel 1: one request at a time (auto: a second %d-token context, %s, would take more than a "
        "quarter of the %s left for the expert cache or weights)",
        llama.n_ctx_seq,
        format_size(per_slot),
        format_size(max(0, left)),
    )
    return context_bytes(llama, n_head_max)
