"""What a benchmark run measured: one Run per system run, and the whole BenchResult (the
report's JSON). Shared by the harness that fills them and the ratios and reports read from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Run:
    """One system's measurement (figures from its `generate --json` report and its cgroup)."""

    system: str
    cap_bytes: int | None
    ok: bool
    error: str | None = None
    wall_s: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)
    cgroup_peak_bytes: int | None = None
    cgroup_stat: dict[str, int] = field(default_factory=dict)
    page_cache_dropped: bool = False
    page_cache_warmed: bool = False  # the model file was read into the page cache before the run
    repeat: int = 0  # which run of a system measured several times (System.repeats), from 0
    note: str = ""


@dataclass
class BenchResult:
    """Everything one `moeflash bench suite` run measured."""

    model: dict[str, Any]
    environment: dict[str, Any]
    cgroup: str
    page_cache: str
    ceiling: list[dict[str, Any]]
    runs: list[Run]
    ratios: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "environment": self.environment,
            "cgroup": self.cgroup,
            "page_cache": self.page_cache,
            "ceiling": self.ceiling,
            "runs": [asdict(r) for r in self.runs],
            "ratios": self.ratios,
        }
