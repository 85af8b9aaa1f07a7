"""`moeflash bench rpc` end to end on a tiny model, and the shaped link it measures through. No
timing assertions: the link's figures are checked against what it was asked with a wide margin,
the bench's only for being there."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from server.bench.cgroup import probe
from server.bench.link import SHAPES, measure
from tests.commands import moeflash


def test_a_shaped_link_delays_and_paces() -> None:
    # a 300 Mbit/s link with 3 ms each way: a round trip of at least 6 ms, no more than 300 Mbit/s
    got = measure(SHAPES["300mbit-3ms"], bulk_bytes=8 << 20, pings=10)
    assert got["rtt_s"] >= 0.006
    assert got["rate_bps"] <= 300e6 * 1.05


def test_bench_rpc_on_a_tiny_model(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    support = probe()
    if support.version is None:
        pytest.skip(f"memory cgroups unavailable: {support.reason}")
    out = tmp_path / "rpc"
    model = tiny_model("tiny-qwen3moe")
    proc = moeflash(
        "bench", "rpc", "--model", str(model), "--caps", "256M", "--rounds", "1", "--tokens", "8",
        "--links", "loopback,300mbit-3ms", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert set(data["runs"]) == {"alone", "loopback", "300mbit-3ms"} and data["helper_layers"] == 2
    rows = {row["system"]: row for row in data["summary"]}
    linked = rows["helper, 300mbit-3ms"]
    assert linked["round_trips_per_token"] >= 1 and linked["up_bytes_per_token"] > 0
    assert all(row["same_tokens_as_alone"] for row in rows.values())
    assert "| helper, loopback |" in out.with_suffix(".md").read_text()
