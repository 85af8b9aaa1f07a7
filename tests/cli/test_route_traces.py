"""`moeflash generate --record-route-trace / --route-trace` and `moeflash bench suite --route-trace`,
run as users run them.

Replaying a run's own recorded routing reproduces its text token for token (the replay puts back
exactly what the router chose), and records the same trace again; bench routes every system by
the trace and says so in the report; a trace that does not fit is refused before anything runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from server.bench.cgroup import probe
from server.bench.harness import PROMPT_20
from server.loading.route_trace import load_trace
from tests.commands import moeflash
from tests.models import expert_layer_bytes


def generate(model: Path, *flags: str) -> dict[str, object]:
    proc = moeflash("generate", "--model", str(model), "-n", "8", "--ignore-eos", "--json", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, object] = json.loads(proc.stdout)
    return report


def routes(path: Path) -> list[tuple[bool, int, int, tuple[int, ...]]]:
    return [(r.decode, r.step, r.layer, r.experts) for r in load_trace(path).routes]


@pytest.mark.parametrize("mode", ["resident", "streaming"])
def test_replaying_a_recorded_trace_reproduces_the_run(
    tiny_model: Callable[..., Path], tmp_path: Path, mode: str
) -> None:
    model = tiny_model("tiny-qwen3moe")
    first, again = tmp_path / "first.route.csv", tmp_path / "again.route.csv"
    own = generate(model, "--mode", mode, "--record-route-trace", str(first))
    assert own["route_trace"] is None
    replayed = generate(
        model, "--mode", mode, "--route-trace", str(first), "--record-route-trace", str(again)
    )
    assert replayed["route_trace"] == str(first)
    assert replayed["tokens"] == own["tokens"] and replayed["text"] == own["text"]
    assert routes(again) == routes(first) and len(routes(first)) > 8
    header = first.read_text().splitlines()[:3]
    assert header[0] == "# route_trace v1"
    assert "arch=qwen3moe n_layer=4 n_expert=16 n_expert_used=4" in header[1]
    assert header[2].startswith("# layer=0 expert_bytes=") and int(header[2].split("=")[2].split()[0]) > 0


def test_generate_refuses_a_trace_of_another_model(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    trace = tmp_path / "three-layers.route.csv"
    generate(tiny_model("tiny-qwen3moe", n_layer=3), "--record-route-trace", str(trace))
    proc = moeflash("generate", "--model", str(tiny_model("tiny-qwen3moe")), "--route-trace", str(trace))
    assert proc.returncode != 0
    assert "cannot route" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    missing = moeflash("generate", "--model", str(tiny_model("tiny-qwen3moe")), "--route-trace", "nope.csv")
    assert missing.returncode != 0 and "cannot read route trace nope.csv" in missing.stderr


def test_bench_routes_every_system_by_the_trace(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    support = probe()
    if support.version is None:
        pytest.skip(f"memory cgroups unavailable: {support.reason}")
    model = tiny_model("tiny-qwen3moe")
    # the bench's own prompt: the trace is then the model's own routing, which its router predicts
    trace = tmp_path / "own.route.csv"
    generate(model, "--prompt", PROMPT_20, "--prompt-tokens", "12", "--record-route-trace", str(trace))
    out = tmp_path / "report"
    proc = moeflash(
        "bench",
        "suite",
        "--model",
        str(model),
        "--caps",
        "400M",
        "--mmap-tokens",
        "2",
        "--ceiling-seconds",
        "0.2",
        "--no-levers",
        "--route-trace",
        str(trace),
        # two layers' experts: the cache evicts, so hit rates and the replay mean something
        "--budget",
        str(2 * expert_layer_bytes(model)),
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["runs"] and all(r["ok"] for r in data["runs"]), [r["error"] for r in data["runs"]]
    decode_steps = len(load_trace(trace).steps(decode=True))
    for run in data["runs"]:
        assert run["report"]["route_trace"] == str(trace.resolve()), run["system"]
        if "512" not in run["system"] and "full-context" not in run["system"]:
            assert run["report"]["prompt_tokens"] == 12, run["system"]
        if run["system"] in (
            "streaming",
            "streaming-prefetch-history",
            "streaming-prefetch-from-trace",
            "streaming-prefetch-emulated",
            "lever-no-prefetch",
            "lever-no-overlap",
        ):
            # without --tokens, the trace's whole decode
            assert len(run["report"]["per_token"]) == decode_steps, run["system"]
    report = out.with_suffix(".md").read_text()
    assert f"replayed from {trace}" in report and "### Trace routing: prefetch bounds" in report
    per_cap = next(iter(data["ratios"]["per_cap"].values()))
    # the serial lever runs under a trace too: the I/O efficiency while waiting is its own, where
    # every read is waited for (the default overlaps reads with the matmuls)
    assert "lever-no-overlap" in {r["system"] for r in data["runs"]}
    assert per_cap["serial_lever_tok_s"] and per_cap["io_efficiency"], per_cap
    traced = per_cap["trace"]
    # an oracle's prefetch is never wrong on a decode token; the model's router, on its own
    # routing, may be
    assert traced["prefetch_trace"]["prefetch_accuracy"] == 1.0
    assert traced["prefetch_emulated"]["prefetch_accuracy"] is not None
    # the emulated predictor's share of the cached speed, beside the most its bytes allow
    assert traced["emulated_vs_cached"] is not None and 0 < traced["emulated_vs_cached_bound"] <= 1.0
    assert traced["prefetch_router"]["prefetch_accuracy"] is not None
    assert traced["prefetch_history"]["prefetch_accuracy"] is not None
    # the streamer's cache, prefetch off, hits exactly what the replay of its routes through the
    # same policy code at the same budget hits: the replay models the run
    assert traced["replay_disagreement_points"] == pytest.approx(0.0, abs=1e-9), traced
    assert 0.0 < traced["replay_cache_hit_rate"] <= traced["replay_belady_hit_rate"] < 1.0
    names = {t["name"] for t in data["ratios"]["targets"]}
    assert "hit rate (prefetch off) off the replay's, points" in names
    other = tiny_model("tiny-qwen3moe", n_layer=3)
    refused = moeflash("bench", "suite", "--model", str(other), "--route-trace", str(trace))
    assert refused.returncode != 0 and "cannot route" in refused.stderr, refused.stderr[-2000:]
    # recording is generate's (one run): the suite has no such flag
    recording = moeflash(
        "bench", "suite", "--model", str(model), "--record-route-trace", str(tmp_path / "x.csv")
    )
    assert recording.returncode == 2 and "unrecognized arguments: --record-route-trace" in recording.stderr
