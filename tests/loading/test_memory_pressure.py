"""The expert budget follows memory pressure (server/loading/pressure.py).

- The band's rule on made-up headrooms: shrink at once, grow only after calm polls, within the
  floor and the load's budget, in moves of at least one expert.
- The headroom read inside a real cgroup names it and its limit.
- End to end: `moeflash generate` streams under a cgroup v1 limit; the test lowers the limit to
  just above what the process holds while it decodes, and the process gives memory back to under
  the new limit's margin within a bounded time with no OOM kill, then takes it again once the
  limit is raised; the tokens equal the resident run's.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from server.bench.cgroup import MemoryCgroup, probe
from server.loading.budget import margin_bytes
from server.loading.pressure import BudgetBand, Headroom
from server.modelgen import generate_model, preset

MIB = 2**20
GIB = 2**30


def room(free_mib: int, *, limit_gib: int = 4, stalled: bool = False) -> Headroom:
    return Headroom(free_mib * MIB, limit_gib * GIB, "test", stalled)


def test_band_shrinks_at_once_to_leave_the_margin_free() -> None:
    band = BudgetBand(floor=100 * MIB, ceiling=2000 * MIB, step=8 * MIB)
    m = margin_bytes(4 * GIB)
    # a full cache of 1500 MiB with 50 MiB free: give back enough to leave m free
    assert band.propose(1500 * MIB, 1500 * MIB, room(50)) == 1500 * MIB + 50 * MIB - m


def test_band_looks_ahead_at_the_budget_not_yet_filled() -> None:
    band = BudgetBand(floor=100 * MIB, ceiling=2000 * MIB, step=8 * MIB)
    m = margin_bytes(4 * GIB)
    # 600 MiB free looks fine, but the cache holds 500 of its 1500 MiB budget: filling it would
    # take 1000 MiB more than there is
    assert band.propose(1500 * MIB, 500 * MIB, room(600)) == 500 * MIB + 600 * MIB - m


def test_band_grows_only_after_calm_polls_and_never_past_the_load_budget() -> None:
    band = BudgetBand(floor=100 * MIB, ceiling=2000 * MIB, step=8 * MIB, calm_polls=3)
    assert band.propose(1000 * MIB, 1000 * MIB, room(3000)) is None
    assert band.propose(1000 * MIB, 1000 * MIB, room(3000)) is None
    assert band.propose(1000 * MIB, 1000 * MIB, room(3000)) == 2000 * MIB
    # one poll inside the band starts the count again
    band = BudgetBand(floor=100 * MIB, ceiling=2000 * MIB, step=8 * MIB, calm_polls=2)
    m = margin_bytes(4 * GIB)
    inside = (m + m // 2) // MIB
    assert band.propose(1000 * MIB, 1000 * MIB, room(3000)) is None
    assert band.propose(1000 * MIB, 1000 * MIB, room(inside)) is None
    assert band.propose(1000 * MIB, 1000 * MIB, room(3000)) is None
    assert band.propose(1000 * MIB, 1000 * MIB, room(3000)) == 2000 * MIB


def test_band_keeps_the_floor_the_step_and_gives_back_under_stalls() -> None:
    band = BudgetBand(floor=400 * MIB, ceiling=2000 * MIB, step=8 * MIB)
    # nothing free at all, and the margin is more than the budget above the floor: the floor
    assert band.propose(500 * MIB, 500 * MIB, room(0)) == 400 * MIB
    # the margin is free but tasks stall on memory: one step back
    m = margin_bytes(4 * GIB)
    calm = (m + m // 2) // MIB
    assert band.propose(1000 * MIB, 1000 * MIB, room(calm, stalled=True)) == 1000 * MIB - 8 * MIB
    # a move under one step (here larger than the margin) is not made
    band = BudgetBand(floor=400 * MIB, ceiling=2000 * MIB, step=m)
    assert band.propose(1000 * MIB, 1000 * MIB, room(m // MIB // 2 - 1)) is None


def test_headroom_inside_a_cgroup_names_its_limit() -> None:
    support = probe()
    if support.version is None:
        pytest.skip(f"memory cgroups unavailable: {support.reason}")
    code = textwrap.dedent(
        """
        import json
        from server.loading.pressure import read_headroom
        r = read_headroom()
        print(json.dumps({"free": r.free_bytes, "limit": r.limit_bytes, "source": r.source}))
        """
    )
    with MemoryCgroup(512 * MIB, support) as cgroup:
        proc = cgroup.run([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert got["limit"] == 512 * MIB and "cgroup" in got["source"], got
    assert 0 < got["free"] < 512 * MIB, got


# ---------------------------------------------------------------- end to end, under cgroup v1

N_TOKENS = 400
CAP = 720 * MIB
PROMPT = "The quick brown fox jumps over the lazy dog"


def _pressure_model(directory: Path) -> Path:
    """A 1 GB qwen3moe: 8 layers of 64 experts of 1.7 MiB (one layer's, the floor, is 113 MiB)."""
    spec = dataclasses.replace(
        preset("qwen30b-shape"),
        n_layer=8,
        n_embd=1024,
        n_head=16,
        n_head_kv=4,
        head_dim=64,
        n_expert=64,
        n_ff_exp=1024,
        n_vocab=32000,
        name="pressure-qwen3moe",
    )
    return generate_model(spec, directory / "pressure.gguf")[0]


def _generate(model: Path, *extra: str) -> list[str]:
    # flash attention fixed: under the cap "auto" may turn it on, which changes the numerics
    return [
        sys.executable, "-m", "server.cli", "--log-level", "INFO", "generate", "--model", str(model),
        "-p", PROMPT, "-n", str(N_TOKENS), "--ignore-eos", "--ctx-size", "512", "--n-batch", "32",
        "--flash-attn", "on", "--json", *extra,
    ]  # fmt: skip


def _working_set(cgroup: MemoryCgroup) -> int:
    """What the kernel cannot reclaim without killing: usage less inactive file pages."""
    usage = int((cgroup.path / "memory.usage_in_bytes").read_text())
    return usage - cgroup.stat().get("total_inactive_file", 0)


def _wait_for(what: str, check: Callable[[], bool], proc: subprocess.Popen[str], timeout_s: float) -> float:
    """Seconds until check() holds (AssertionError when the run ends or the time runs out first)."""
    start = time.monotonic()
    while not check():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.slow
def test_budget_follows_a_cgroup_limit_lowered_and_raised_mid_generation(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    support = probe()
    if support.version != 1:
        pytest.skip(f"needs a cgroup v1 memory controller: {support.reason}")
    model = _pressure_model(tmp_path_factory.mktemp("pressure"))
    try:
        resident = subprocess.run(
            _generate(model, "--mode", "resident"), capture_output=True, text=True, timeout=900, check=False
        )
        assert resident.returncode == 0, resident.stderr[-3000:]
        expected = json.loads(resident.stdout.strip().splitlines()[-1])["tokens"]

        with MemoryCgroup(CAP, support) as cgroup:
            proc = cgroup.popen(
                _generate(model, "--mode", "streaming"), stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            try:
                # the cache fills to its budget: the working set stops growing
                samples: list[int] = []

                def settled() -> bool:
                    samples.append(_working_set(cgroup))
                    return len(samples) > 30 and max(samples[-20:]) - min(samples[-20:]) < 4 * MIB

                _wait_for("the cache filled", settled, proc, 240)
                full = samples[-1]
                # just above what it holds: the kernel takes it (v1 refuses a limit under an
                # unreclaimable usage), and the process must give memory back before its next reads
                lowered = full + 8 * MIB
                (cgroup.path / "memory.limit_in_bytes").write_text(str(lowered))
                target = lowered - margin_bytes(lowered) // 2
                shrink_s = _wait_for("memory back under the lowered limit's margin",
                                     lambda: _working_set(cgroup) <= target, proc, 10)  # fmt: skip
                low = _working_set(cgroup)
                time.sleep(2)
                # room over twice the margin, beyond what the budget of the load can take back
                raised = CAP + 256 * MIB
                (cgroup.path / "memory.limit_in_bytes").write_text(str(raised))
                grow_s = _wait_for(
                    "the cache grew again", lambda: _working_set(cgroup) > low + 32 * MIB, proc, 60
                )
                out, err = proc.communicate(timeout=900)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
            kills = cgroup.oom_kills()
        assert proc.returncode == 0, err[-3000:]
        assert kills == 0, f"{kills} OOM kills"
        report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        budgets = [r["budget_bytes"] for r in report["per_token"]]
        print(
            f"full {full / MIB:.0f} MiB, limit lowered to {lowered / MIB:.0f} MiB: under "
            f"{target / MIB:.0f} MiB in {shrink_s:.1f} s ({low / MIB:.0f} MiB); raised to "
            f"{raised / MIB:.0f} MiB: grew in {grow_s:.1f} s; budget {budgets[0] / MIB:.0f} -> "
            f"{min(budgets) / MIB:.0f} -> {budgets[-1] / MIB:.0f} MiB"
        )
        assert report["tokens"] == expected, "moving the budget changed the output"
        assert report["totals"]["violations"] == 0
        assert min(budgets) < budgets[0] and budgets[-1] > min(budgets), budgets
    finally:
        model.unlink(missing_ok=True)
