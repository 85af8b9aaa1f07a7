"""The switch-time measurement (server/bench/switch_time.py) on two tiny streamed models under a
cgroup cap: it runs both servers and reports every figure (no figure is asserted on: time)."""

from __future__ import annotations

from typing import Any

import pytest

from server.bench.cgroup import probe
from server.bench.switch_time import measure


@pytest.mark.slow
def test_switch_time_reports_its_figures(tiny_model: Any) -> None:
    support = probe()
    if support.version is None:
        pytest.skip(f"memory cgroups unavailable: {support.reason}")
    a = tiny_model("tiny-qwen3moe", seed=0)
    b = tiny_model("tiny-qwen3moe", seed=1)
    result = measure(a, b, 1536 << 20, rounds=1)
    cold, switch = result["cold_b"], result["switch"]
    assert cold["load_s"] > 0 and cold["first_token_s"] > 0 and cold["peak_bytes"] > 0
    assert switch["switch_to_b_first_token_s"] > 0 and switch["switch_to_a_first_token_s"] > 0
    assert switch["oom_kills"] == 0 and switch["rounds"] == 1
