"""Streaming model loader: a llama_cpp.Llama whose experts are streamed from flash.

`load_streaming_llama(path, options, **llama_kwargs)` returns a `StreamingLlama`: a Llama (the
rest of the program cannot tell it from a resident one) whose expert tensors live in the
streamer's reserved memory and whose cb_eval is the streamer's C callback. The file is mapped
without being read (load mode MMAP_NO_PREFETCH); dense weights are read once into anonymous
memory, except the token embeddings of a model with its own output matrix, which stay mapped
from the file (a token reads one row); experts are read on demand into a cache bounded by the
budget.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from server.budget import (
    BUDGET_ALL,
    BudgetChoice,
    MemoryTerms,
    check_budget_floor,
    choose_budget,
    max_heads,
    memory_limit,
    memory_terms,
    streamer_dense_bytes,
)
from server.context import ContextBytes, check_flash_attn, fit_context
from server.errors import ConfigError, ExpertReadError, ModelLoadError
from server.gguf_header import read_metadata
from streaming_ext import Policy, Reader, Streamer, StreamerConfig, StreamerError, StreamerStats

logger = logging.getLogger(__name__)

# llama.cpp matches these with std::regex_search against tensor names, first match wins
EXPERT_PATTERN = r"^blk\.\d+\.ffn_(gate|up|down|gate_up)_exps\.weight$"
DENSE_PATTERN = r".*"
# a token reads one row of the embeddings: mapped from the file, not read into memory, unless the
# output matrix is the same tensor (no output.weight: llama.cpp then multiplies by it every token)
EMBEDDINGS = "token_embd.weight"
UNTIED_OUTPUT = "output.weight"


@dataclass(frozen=True)
class StreamingOptions:
    """The streamer's levers. budget: bytes, None for automatic (server/budget.py), BUDGET_ALL."""

    budget_bytes: int | None = None
    lanes: int = 4
    direct_io: bool = True
    overlap: bool = False  # measured slower on 2 cores (bench/reports/qwen30b-shape.md)
    policy: str = "layer"  # "layer" | "lru" | "none"
    # fault injection (tests): expert reads fail with this errno after this many bytes
    fault_errno: int = 0
    fault_after_bytes: int = 0
    # negative control (tests): expert (skip_expert - 1) is never read, its memory left as it was
    skip_expert: int = 0
    # read every expert at load (needs a budget holding them all, e.g. BUDGET_ALL)
    preload: bool = False
    # read the next layer's predicted experts while this layer computes (streaming_ext/src/mf_predict.c)
    prefetch: bool = True


@dataclass(frozen=True)
class DecodeTelemetry:
    """One llama_decode call: its tokens, wall time and the streamer's share of it."""

    n_tokens: int
    wall_ns: int
    flash_wait_ns: int
    cache_ns: int
    compute_ns: int  # wall minus waiting for flash minus cache management
    bytes_read: int
    hits: int  # routed experts already resident (read ahead by a prefetch included)
    misses: int
    evictions: int
    prefetched: int  # experts read ahead for the next layer
    prefetch_used: int  # routed experts a prefetch had read
    memory_bytes: int = 0  # expert memory with pages after the step (frames in use and kept warm)
    # False once every expert is resident under a budget holding them all: the streamer no longer
    # watches routing (nothing left to read), so hits and misses are not counted
    routed: bool = True


def parse_policy(name: str) -> Policy:
    """Policy from its option name ("layer", "lru", "none")."""
    try:
        return Policy[name.upper()]
    except KeyError:
        raise ConfigError(f"unknown cache policy {name!r}: choose layer, lru or none") from None


class StreamingLlama(llama_cpp.Llama):
    """A Llama whose experts are streamed; `streamer` and `telemetry` expose the streamer."""

    streamer: Streamer
    budget: BudgetChoice
    memory: MemoryTerms | None  # what the process holds beside the expert cache
    telemetry: deque[DecodeTelemetry]
    compute_ns_total: int

    def __init__(self, model_path: str, *, streamer: Streamer, **kwargs: Any) -> None:
        self.streamer = streamer
        self.budget = BudgetChoice(0, "not chosen yet")
        self.memory = None
        # one record per llama_decode, bounded: the server reads the latest, the CLI all of them
        self.telemetry = deque(maxlen=4096)
        self.compute_ns_total = 0  # sum of the records' compute_ns, never trimmed
        super().__init__(model_path, **kwargs)
        self._wrap_decode()

    def _wrap_decode(self) -> None:
        # llama-cpp-python has no hook after llama_decode; wrapping the context's decode is the
        # narrowest seam: a failed read raises here, before Llama.eval counts the batch as done
        ctx = self._ctx
        original = ctx.decode
        streamer = self.streamer
        records = self.telemetry
        owner = self

        def decode(batch: Any) -> None:
            before = streamer.stats()
            start = time.monotonic_ns()
            try:
                original(batch)
            except RuntimeError as exc:
                failure = streamer.take_error()
                if failure is not None:
                    raise ExpertReadError(str(failure)) from exc
                raise
            wall = time.monotonic_ns() - start
            failure = streamer.take_error()
            if failure is not None:
                raise ExpertReadError(str(failure))
            d = streamer.stats() - before
            owner.compute_ns_total += max(0, wall - d.wait_ns - d.manage_ns)
            records.append(
                DecodeTelemetry(
                    n_tokens=int(batch.batch.n_tokens),
                    wall_ns=wall,
                    flash_wait_ns=d.wait_ns,
                    cache_ns=d.manage_ns,
                    compute_ns=max(0, wall - d.wait_ns - d.manage_ns),
                    bytes_read=d.bytes_read,
                    hits=d.hits,
                    misses=d.misses,
                    evictions=d.evictions,
                    prefetched=d.prefetched,
                    prefetch_used=d.prefetch_used,
                    memory_bytes=d.memory_bytes,
                    routed=d.routes > 0,
                )
            )

        ctx.decode = decode  # type: ignore[method-assign]

    def stats(self) -> StreamerStats:
        """The streamer's cumulative counters."""
        return self.streamer.stats()

    def close(self) -> None:
        """Free the model first (its buffers belong to the streamer), then the streamer."""
        super().close()
        self.streamer.close()


def _streamer_config(options: StreamingOptions) -> StreamerConfig:
    return StreamerConfig(
        lanes=options.lanes,
        reader=Reader.DIRECT if options.direct_io else Reader.BUFFERED,
        overlap=options.overlap,
        policy=parse_policy(options.policy),
        fault_errno=options.fault_errno,
        fault_after_bytes=options.fault_after_bytes,
        skip_expert=options.skip_expert,
        prefetch=options.prefetch,
    )


def load_streaming_llama(
    model_path: str | os.PathLike[str],
    options: StreamingOptions,
    *,
    n_ctx: int = 4096,
    flash_attn: str = "auto",
    **llama_kwargs: Any,
) -> StreamingLlama:
    """Load `model_path` (a GGUF or the first file of a split set) with its experts streamed.

    `flash_attn`: "on", "off", or "auto" (on when the context's attention buffers would keep the
    cache from holding the budget asked for, or every expert for an automatic one). The budget
    counts what the context holds, measured (server/budget.py). Raises ConfigError for bad
    options (lanes, budget below one layer's experts, a context the memory cannot hold, ...) and
    ModelLoadError for a file that cannot be streamed (missing, truncated, not MoE, ...), in both
    cases before any generation.
    """
    path = Path(model_path)
    if not path.is_file():
        raise ModelLoadError(f"model file {path} does not exist")
    if not 1 <= options.lanes <= 16:
        raise ConfigError(f"lanes must be 1..16, got {options.lanes}")
    flash_first = check_flash_attn(flash_attn)
    parse_policy(options.policy)
    limit = memory_limit()  # before the load: what the process holds now is `in_use`
    # the streamer indexes the file first: a bad file is refused before llama.cpp sees it
    try:
        streamer = Streamer(path, _streamer_config(options))
    except StreamerError as exc:
        raise ModelLoadError(str(exc)) from exc
    try:
        overrides = [(EXPERT_PATTERN, streamer.expert_buft)]
        mapped = streamer.tensor_bytes(EMBEDDINGS) if streamer.tensor_bytes(UNTIED_OUTPUT) else 0
        if mapped:
            overrides.append(("^" + re.escape(EMBEDDINGS) + "$", streamer.rows_buft))
        overrides.append((DENSE_PATTERN, streamer.dense_buft))
        dense = streamer_dense_bytes(path, streamer.expert_bytes) - mapped
        if options.budget_bytes == BUDGET_ALL:
            options = dataclasses.replace(options, budget_bytes=streamer.expert_bytes)
        if options.budget_bytes is not None:
            # an explicit budget is checked before anything is loaded
            check_budget_floor(options.budget_bytes, streamer.layer_bytes)
        kwargs = dict(llama_kwargs)
        kwargs.setdefault("verbose", False)
        try:
            llm = StreamingLlama(
                str(path),
                streamer=streamer,
                n_ctx=n_ctx,
                load_mode=llama_cpp.LLAMA_LOAD_MODE_MMAP_NO_PREFETCH,
                use_extra_bufts=False,
                tensor_buft_overrides=overrides,
                cb_eval=streamer.eval_callback,
                cb_eval_user_data=streamer.handle,
                flash_attn=flash_first,
                **kwargs,
            )
        except ValueError as exc:
            failure = streamer.take_error()
            detail = f": {failure}" if failure else ""
            raise ModelLoadError(f"llama.cpp could not load {path}{detail} ({exc})") from exc
        try:
            failure = streamer.take_error()
            if failure is not None:
                raise ModelLoadError(f"loading {path} failed: {failure}")
            wanted = options.budget_bytes or streamer.expert_bytes

            def fits(context: ContextBytes) -> bool:
                return limit.bytes - memory_terms(limit, dense, context).total >= wanted

            ctx_before = llm._ctx
            context = fit_context(
                llm, flash_attn=flash_attn, n_head_max=max_heads(read_metadata(path)), fits=fits
            )
            if llm._ctx is not ctx_before:
                llm._wrap_decode()
            terms = memory_terms(limit, dense, context)
            choice = choose_budget(
                requested=options.budget_bytes,
                expert_bytes=streamer.expert_bytes,
                layer_bytes=streamer.layer_bytes,
                terms=terms,
                limit=limit,
                n_ctx=llm.n_ctx(),
            )
            streamer.set_budget(choice.bytes)
            streamer.check_loaded()
            if options.preload:
                streamer.preload()
        except (StreamerError, ModelLoadError, ConfigError) as exc:
            llm.close()
            if isinstance(exc, StreamerError):
                raise ModelLoadError(str(exc)) from exc
            raise
        llm.budget = choice
        llm.memory = terms
        logger.info("expert budget %.1f MiB: %s", choice.bytes / 2**20, choice.reason)
        logger.info("expert memory: %s", streamer.memory_note())
        if mapped:
            logger.info("%s (%.1f MiB) mapped from the file, not read into RAM", EMBEDDINGS, mapped / 2**20)
        return llm
    except BaseException:
        streamer.close()  # idempotent; the model (if any) was freed first
        raise
