"""The usage block and the opt-in timings extension of chat and legacy completions (docs/api.md).

The timings come from the model's decode steps (server/loading/measured.py): the streamer's
counters under their C names, in milliseconds here. A resident model streams nothing: its
streamer figures are null.
"""

from __future__ import annotations

from typing import Any

from server.engine.token_loop import GenerationStats
from server.loading.measured import DecodeStep


def usage_of(stats: GenerationStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def _streamer_ms(step: DecodeStep | None) -> dict[str, Any]:
    """The streamer's share of `step`: flash wait, compute, cache, hit rate, bytes read."""
    s = step.streamer if step is not None else None
    if step is None or s is None:
        return dict.fromkeys(("flash_wait_ms", "compute_ms", "cache_ms", "hit_rate", "bytes_read"))
    lookups = s.hits + s.misses
    return {
        "flash_wait_ms": s.flash_wait_ns / 1e6,
        "compute_ms": (step.compute_ns or 0) / 1e6,
        "cache_ms": s.cache_ns / 1e6,
        "hit_rate": s.hits / lookups if lookups else None,
        "bytes_read": s.bytes_read,
    }


def timings_of(stats: GenerationStats, telemetry: DecodeStep | None) -> dict[str, Any]:
    """A whole request's timings: its prompt and decode time, and what its decode calls spent."""
    decode_s = stats.decode_ns / 1e9
    return {
        "prompt_ms": stats.prompt_ns / 1e6,
        "decode_ms": stats.decode_ns / 1e6,
        "tok_per_s": stats.completion_tokens / decode_s if decode_s > 0 and stats.completion_tokens else None,
        **_streamer_ms(telemetry),
    }


def token_timings(step: DecodeStep) -> dict[str, Any]:
    """The timings of one streamed token's decode step, in the shape of the final timings (no
    prompt_ms: the prompt is the first token's step), plus prefetch_hits (routed experts that a
    read-ahead had brought in), expert_memory_bytes (the expert cache's memory in use) and
    budget_bytes (its budget, which follows memory pressure)."""
    s = step.streamer
    return {
        "prompt_ms": None,
        "decode_ms": step.wall_ns / 1e6,
        "tok_per_s": 1e9 / step.wall_ns if step.wall_ns > 0 else None,
        **_streamer_ms(step),
        "prefetch_hits": s.prefetch_hits if s is not None and step.routed else None,
        "expert_memory_bytes": s.expert_memory_bytes if s is not None else None,
        "budget_bytes": s.budget_bytes if s is not None else None,
    }
