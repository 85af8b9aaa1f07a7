"""`moeflash bench parallel` end to end on a tiny model: every stream count ran, the steps were
shared, the latencies were measured. No timing assertions."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from server.bench.cgroup import probe
from tests.commands import moeflash


def test_bench_parallel_on_a_tiny_model(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    support = probe()
    if support.version is None:
        pytest.skip(f"memory cgroups unavailable: {support.reason}")
    out = tmp_path / "parallel"
    model = tiny_model("tiny-qwen3moe")
    proc = moeflash(
        "bench", "parallel", "--model", str(model), "--caps", "all", "--rounds", "1", "--tokens", "16",
        "--ctx-size", "4096", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    [cached] = data["caps"]
    assert sorted(r["streams"] for r in cached["runs"]) == [1, 2, 4]
    assert all(r["tokens"] == 16 * r["streams"] for r in cached["runs"])
    four = next(r for r in cached["runs"] if r["streams"] == 4)
    assert four["shared_steps"] > 0 and four["step_tokens"] > four["steps"]
    latency = cached["latencies"][0]
    assert latency["long_prompt_tokens"] > 1000 and latency["gap_during_prefill_s"] is not None
    report = out.with_suffix(".md").read_text()
    assert "every expert cached" in report and "Targets (issue 53)" in report
