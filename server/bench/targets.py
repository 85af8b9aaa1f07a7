"""The benchmark's targets, checked against one report's ratios.

The thresholds are those of the benchmark issue (#5), written for qwen30b-shape on a 2-core
machine: every ratio is judged in every report, so a regression shows as "not met" in the
Markdown without anyone re-reading the issue. Speedup targets depend on how tight the cap is
(20x at 25% of the file, 18x at 50%); a cap looser than 50% has none.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from server.units import format_size

# a cap counts as "25%" when it is within this of the fraction (caps are rounded to bytes)
_FRACTION_SLACK = 0.01
SPEEDUP_TARGETS = ((0.25, 20.0), (0.5, 18.0))  # (largest cap fraction, speedup over stock mmap)
# trace replay: the default policy's decode hit rate over Belady's at 2000 MiB (set for Qwen)
REPLAY_SHARE_OF_BELADY = 0.85
# the traces the default policy was designed and tuned on; any other replayed trace is a holdout,
# where the policy must keep, per budget in token working sets, the lowest share of the `rates`
# reference (every entry's decode rate known in advance) it reaches on these
POLICY_TUNED_ON = ("qwen", "gemma")
# time to first token of the 20-token prompt, seconds: half of the 20-30 s the issue measured for
# BigMoeOnEdge on qwen30b-shape at these caps (a whole-file read at load, then ~12 GB of experts);
# that engine is not on this machine to measure side by side
TTFT_20_S = 10.0
# bytes read at load over the file's non-expert bytes: the load reads dense weights, never the
# experts (stock mmap with MAP_POPULATE reads the whole file); the slack covers the libraries
LOAD_READ_OVER_NON_EXPERT = 1.1
# under trace routing (issue 22, set for the Qwen trace on qwen30b-q4km-k6-shape): decode at a
# 25% cap at least BigMoeOnEdge's 5.2 tok/s on a phone, rounded down; cache management at most
# this share of a token's time; the cache without prefetch at least this share of Belady's hit
# rate on the same routes and budget; and that hit rate within this many points of the replay
TRACE_TOK_S_AT_25 = 5.0
TRACE_CACHE_SHARE = 0.05
TRACE_SHARE_OF_BELADY = 0.90
TRACE_REPLAY_POINTS = 1.0
# decode under a cap over every expert cached, the two in the same rounds and settings (issue 42):
# (largest cap fraction, share) with the defaults, and at 25% with the emulated predictor
CACHED_SHARE_TARGETS = ((0.25, 0.65), (0.5, 0.90))
EMULATED_CACHED_SHARE_AT_25 = 0.80


@dataclass(frozen=True)
class Target:
    """One target: the measured value against its threshold."""

    name: str
    scope: str  # "all" or the cap it was measured under
    value: float | None
    threshold: float
    at_least: bool  # True: value >= threshold is met; False: value <= threshold
    bound: float | None = None  # the most the run's own figures allow the value, where computed

    @property
    def met(self) -> bool | None:
        """Met, not met, or None when the value is missing (a run failed or was skipped)."""
        if self.value is None:
            return None
        return self.value >= self.threshold if self.at_least else self.value <= self.threshold

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


def speedup_target(cap_fraction: float) -> float | None:
    """The speedup a cap of this fraction of the file must reach, None when it has no target."""
    for fraction, speedup in SPEEDUP_TARGETS:
        if cap_fraction <= fraction + _FRACTION_SLACK:
            return speedup
    return None


def check_targets(ratios: dict[str, Any], file_bytes: int) -> list[Target]:
    """Every target the ratios (server/bench/ratios.py) can be judged on."""
    out = [Target("residency (all cached / resident)", "all", ratios.get("residency_overhead"), 0.95, True)]
    for cap in ratios.get("per_cap", {}).values():
        fraction = cap["cap_bytes"] / file_bytes
        scope = f"{format_size(cap['cap_bytes'], unit='GiB', digits=2)} ({fraction:.0%})"
        speedup = speedup_target(fraction)
        if speedup is not None:
            out.append(Target("speedup over stock mmap", scope, cap.get("speedup_vs_mmap"), speedup, True))
        share = _cached_share_target(fraction)
        if share is not None:
            out.append(
                Target(
                    "decode / every expert cached",
                    scope,
                    cap.get("vs_cached"),
                    share,
                    True,
                    bound=cap.get("vs_cached_bound"),
                )
            )
        out += [
            Target("roofline efficiency", scope, cap.get("roofline_efficiency"), 0.85, True),
            Target("I/O efficiency while waiting", scope, cap.get("io_efficiency"), 0.85, True),
            Target("memory discipline", scope, cap.get("memory_discipline"), 1.1, False),
            Target(
                "memory discipline, a prompt filling the context",
                scope,
                cap.get("memory_discipline_full_context"),
                1.1,
                False,
            ),
            Target("512-token prefill / I/O roofline", scope, cap.get("prefill_512_efficiency"), 0.85, True),
            Target("time to first token, 20-token prompt (s)", scope, cap.get("ttft_20_s"), TTFT_20_S, False),
            Target(
                "bytes read at load / non-expert bytes",
                scope,
                cap.get("load_read_over_non_expert"),
                LOAD_READ_OVER_NON_EXPERT,
                False,
            ),
        ]
        if "trace" in cap:
            out += _trace_targets(cap, scope, fraction)
    return out


def _cached_share_target(cap_fraction: float) -> float | None:
    for fraction, share in CACHED_SHARE_TARGETS:
        if cap_fraction <= fraction + _FRACTION_SLACK:
            return share
    return None


def _trace_targets(cap: dict[str, Any], scope: str, fraction: float) -> list[Target]:
    trace = cap["trace"]
    out = []
    if fraction <= 0.25 + _FRACTION_SLACK:
        out.append(
            Target("decode tok/s, trace-routed", scope, cap.get("streaming_tok_s"), TRACE_TOK_S_AT_25, True)
        )
        out.append(
            Target(
                "decode / every expert cached, emulated predictor",
                scope,
                trace.get("emulated_vs_cached"),
                EMULATED_CACHED_SHARE_AT_25,
                True,
                bound=trace.get("emulated_vs_cached_bound"),
            )
        )
    return out + [
        Target("cache management / token time", scope, trace.get("cache_share"), TRACE_CACHE_SHARE, False),
        Target(
            "cache hit rate (prefetch off) / Belady's",
            scope,
            trace.get("share_of_belady"),
            TRACE_SHARE_OF_BELADY,
            True,
        ),
        Target(
            "hit rate (prefetch off) off the replay's, points",
            scope,
            trace.get("replay_disagreement_points"),
            TRACE_REPLAY_POINTS,
            False,
        ),
    ]
