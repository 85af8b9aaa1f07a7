"""The prompt-cache replay (server/bench/prompt_cache.py) on a tiny streamed model under a cgroup
cap: real servers, the restart, the cache on and off. Its token counts and bytes are asserted on;
its times are reported, not asserted (a timed test only measures the machine)."""

from __future__ import annotations

from typing import Any

import pytest

from server.bench.cgroup import probe
from server.bench.prompt_cache import (
    STEPS,
    _DiskProbe,
    run_prompt_cache,
    summarize,
    write_prompt_cache_report,
)
from server.errors import MoeflashError


@pytest.mark.slow
def test_the_replay_restores_each_agents_prefix_and_reports_it(tiny_model: Any, tmp_path: Any) -> None:
    support = probe()
    if support.version is None:
        pytest.skip(f"memory cgroups unavailable: {support.reason}")
    path = tiny_model("tiny-qwen3moe")
    data = run_prompt_cache(
        path,
        [1536 << 20],
        tokens=4,
        ctx_size=32768,  # the agents' prompts on the tiny vocabulary are longer than on Qwen's
        settings_flags=("--threads", "2"),
        progress=lambda _m: None,
        probe_bytes=8 << 20,
    )
    (cap,) = data["caps"]
    assert cap["oom_kills"] == 0 and 0 < cap["peak_bytes"] <= cap["cap_bytes"]
    requests = cap["requests"]
    asked = [a for a, _q in STEPS if a != "restart"]
    assert [r["agent"] for r in requests] == asked * 2
    rows = summarize(data)
    resumed = [r for r in rows if r["resumed"]]
    assert len(resumed) == 5 and sum(r["after_restart"] for r in resumed) == 3
    for r in resumed:
        # with the cache a resumed request reuses its whole conversation so far; without it, only
        # what the live sequence shares with it (the chat template's first tokens)
        assert r["cached_tokens"] > 1000 > r["cold_cached_tokens"], r
    # after the restart every state comes back from flash, and the bytes kept are reported
    assert all(r["read_bytes"] > 0 and r["read_bytes_per_s"] for r in resumed if r["after_restart"])
    # each request has its own disk probe, read once (its files are gone with the run's directory)
    assert all(r["disk_bytes_per_s"] > 0 for r in rows) and data["probe_bytes"] == 8 << 20
    assert max(r["ram_bytes"] for r in rows) > 0 and rows[-1]["flash_bytes"] > 0
    written = write_prompt_cache_report({"model": {"name": path.stem}, **data}, tmp_path / "report", "cmd")
    text = (tmp_path / "report.md").read_text()
    assert [p.suffix for p in written] == [".json", ".md"]
    assert text.count("after the restart") == 3 and "| 0 |" in text  # no OOM kill


def test_disk_probes_are_read_once_each_and_a_failed_write_says_where(tmp_path: Any) -> None:
    probes = _DiskProbe(tmp_path / "probes", 2, 4 << 20)
    assert [probes.read().bytes_total for _ in range(2)] == [4 << 20, 4 << 20]
    assert list((tmp_path / "probes").iterdir()) == []  # each file gone once read
    (tmp_path / "file").write_text("")
    with pytest.raises(MoeflashError, match="cannot write 2 disk probes of 4 MiB in"):
        _DiskProbe(tmp_path / "file" / "probes", 2, 4 << 20)
