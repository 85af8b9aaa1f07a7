"""The usage block and the opt-in timings extension of chat and legacy completions (docs/api.md).

Timings are read from one record, the decode step (server/loading/measured.py DecodeStep), at
one of two scopes named in the object: "token" (the step that produced a streamed chunk's token)
or "request" (every decode call of the request, the prompt's included). Every figure of the
object has the scope it names; gauges (expert_memory_bytes, budget_bytes) are as at its end. A
resident model streams nothing: its streamer figures are null.
"""

from __future__ import annotations

from typing import Any

from server.engine.generation import GenerationStats
from server.http.protocol import Timings
from server.loading.measured import DecodeStep


def usage_of(stats: GenerationStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def _ms(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e6


def _timings(step: DecodeStep | None, **scoped: Any) -> dict[str, Any]:
    s = step.streamer if step is not None else None
    return Timings(
        **scoped,
        flash_wait_ms=_ms(s.flash_wait_ns) if s is not None else None,
        compute_ms=_ms(step.compute_ns) if step is not None else None,
        cache_ms=_ms(s.cache_ns) if s is not None else None,
        helper_wait_ms=_ms(step.helper_wait_ns) if step is not None and step.helper_wait_ns else None,
        hit_rate=step.hit_rate if step is not None else None,
        bytes_read=s.bytes_read if s is not None else None,
        prefetch_hits=s.prefetch_hits if s is not None and step is not None and step.routed else None,
        expert_memory_bytes=s.expert_memory_bytes if s is not None else None,
        budget_bytes=s.budget_bytes if s is not None else None,
    ).model_dump()


def timings_of(stats: GenerationStats, telemetry: DecodeStep | None) -> dict[str, Any]:
    """A whole request's timings ("request" scope): its prompt and decode time, and what all its
    decode calls spent."""
    decode_s = stats.decode_ns / 1e9
    return _timings(
        telemetry,
        scope="request",
        prompt_ms=stats.prompt_ns / 1e6,
        decode_ms=stats.decode_ns / 1e6,
        tok_per_s=stats.completion_tokens / decode_s if decode_s > 0 and stats.completion_tokens else None,
    )


def token_timings(step: DecodeStep) -> dict[str, Any]:
    """The timings of one streamed token's decode step ("token" scope: no prompt_ms, the prompt
    being the first token's step)."""
    return _timings(
        step,
        scope="token",
        prompt_ms=None,
        decode_ms=step.wall_ns / 1e6,
        tok_per_s=1e9 / step.wall_ns if step.wall_ns > 0 else None,
    )
