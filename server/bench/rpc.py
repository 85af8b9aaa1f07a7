"""The RPC benchmark: the main server alone under a memory cap, and with a helper holding its last
layers, over the loopback and over shaped links.

    moeflash bench rpc --shape qwen30b-q4km-k6-shape --caps 0.25 --helper-layers 24

Two processes on this machine, each in a memory cgroup of its own: `moeflash worker` (the helper,
capped at its layers' weights plus a margin, its --memory the same less part of the margin) and
`moeflash generate --json` (the main server, capped at the cap), reaching the helper through a
relay (server/bench/link.py) that is the loopback or a shaped link and counts what crosses it. Per
round the systems alternate: alone, then the helper over each link. Each run decodes `tokens`
tokens greedily after the prompt (the trace's prompt with --route-trace). The report gives the
decode tokens/s, the time to first token, the expert bytes the main server read from flash per
token and, over the decode steps' window, the bytes each way, the round trips and the time the main
server waited on the link and the helper per token; the helper's peak memory and flash reads; and
what the relay itself delivers on each link (its round-trip time and rate).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from server.bench.cgroup import MemoryCgroup, probe
from server.bench.link import LOOPBACK, SHAPES, Shape, ShapedLink, measure
from server.errors import ConfigError, HelperError, MoeflashError
from server.units import format_size

_MIB = 1 << 20
# beside its layers' weights the helper holds their KV, llama.cpp's compute buffer, the worker
# process itself (Python, the libraries) and the page cache of the tensor cache it writes; its
# cgroup gets this much more, its --memory half of it
HELPER_MARGIN = 2048 * _MIB
ALONE = "alone"


def helper_bytes(path: Path, layers: int) -> int:
    """Bytes of the weights of the model's last `layers` layers; ConfigError for a count that
    leaves no layer here or none there."""
    from server.loading.budget import model_tensors
    from server.rpc.devices import layer_bytes

    per_layer = layer_bytes(model_tensors(path))
    n_layer = 1 + max(per_layer)
    if not 0 < layers < n_layer:
        raise ConfigError(f"--helper-layers must be 1..{n_layer - 1}, got {layers}")
    return sum(per_layer[il] for il in range(n_layer - layers, n_layer))


def _worker(
    state: Path, memory: int, cache_max: int, cgroup: MemoryCgroup
) -> tuple[subprocess.Popen[str], str]:
    """A `moeflash worker` in `cgroup`, answering HELLO: its process and endpoint."""
    from server.bench.served import free_port
    from server.rpc.hello import wait_for_helper

    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "--log-level", "WARNING", "worker", "--port", str(port)]
    argv += ["--memory", str(memory), "--cache-max", str(cache_max), "--state-dir", str(state)]
    log = (state / "worker.log").open("w")
    proc = cgroup.popen(argv, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"127.0.0.1:{port}"
    try:
        wait_for_helper(endpoint, lambda: proc.poll() is None)
    except HelperError as exc:
        proc.kill()
        raise MoeflashError(f"{exc}: {(state / 'worker.log').read_text()[-2000:]}") from None
    return proc, endpoint


def _read_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _one_run(
    argv: list[str], cgroup: MemoryCgroup, link: ShapedLink | None, worker: subprocess.Popen[str]
) -> dict[str, Any]:
    """One `generate --json` in `cgroup`: its figures, and what crossed `link` while it decoded."""
    helper_read = _read_bytes(worker.pid)
    done = cgroup.run(argv, timeout=3600)
    if done.returncode != 0:
        raise MoeflashError(f"the run failed ({' '.join(argv[-8:])}): {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = max(1, report["decode_tokens"])
    row: dict[str, Any] = {
        "decode_tok_s": report["decode_tok_s"],
        "ttft_s": report["ttft_s"],
        "load_s": report["load_s"],
        "main_flash_bytes_per_token": sum(t["storage_read_bytes"] for t in report["per_token"]) / tokens,
        "helper_read_bytes": _read_bytes(worker.pid) - helper_read,
        "tokens": report["tokens"],
    }
    if link is not None:
        window = link.window(*report["decode_window"])
        row |= {
            "up_bytes_per_token": window.up_bytes / tokens,
            "down_bytes_per_token": window.down_bytes / tokens,
            "round_trips_per_token": window.round_trips / tokens,
            "waited_ms_per_token": window.waited_s * 1000 / tokens,
        }
    return row


def run_rpc(
    path: Path,
    cap: int,
    *,
    helper_layers: int,
    shapes: list[Shape],
    rounds: int,
    tokens: int,
    settings_flags: tuple[str, ...],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Every system `rounds` times, alternated; the runs and each link's own figures."""
    support = probe()
    if support.version is None:
        raise ConfigError(f"the RPC benchmark needs memory cgroups: {support.reason}")
    weights = helper_bytes(path, helper_layers)
    base = [sys.executable, "-m", "server.cli", "--log-level", "WARNING", "generate", "-m", str(path)]
    base += [
        "--mode",
        "streaming",
        "-n",
        str(tokens),
        "--temp",
        "0",
        "--ignore-eos",
        "--json",
        *settings_flags,
    ]
    runs: dict[str, list[dict[str, Any]]] = {ALONE: [], **{s.name: [] for s in shapes}}
    with ExitStack() as stack:
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="moeflash-rpc-")))
        helper_group = stack.enter_context(MemoryCgroup(weights + HELPER_MARGIN, support))
        main_group = stack.enter_context(MemoryCgroup(cap, support))
        worker, endpoint = _worker(state, weights + HELPER_MARGIN // 2, 2 * weights, helper_group)
        stack.callback(worker.wait, timeout=60)  # out of its cgroup before the cgroup goes
        stack.callback(worker.kill)
        links = {s.name: stack.enter_context(ShapedLink(endpoint, s)) for s in shapes}
        for r in range(rounds):
            for name in runs:
                link = links.get(name)
                rpc = ["--rpc", link.endpoint, "--rpc-layers", str(helper_layers)] if link is not None else []
                progress(f"round {r + 1}/{rounds}: {name}")
                runs[name].append(_one_run([*base, *rpc], main_group, link, worker))
                progress(
                    f"  {runs[name][-1]['decode_tok_s']:.2f} tok/s, ttft {runs[name][-1]['ttft_s']:.1f} s"
                )
        helper_peak = helper_group.peak_bytes()
        oom = helper_group.oom_kills() + main_group.oom_kills()
    return {
        "cap_bytes": cap,
        "helper_layers": helper_layers,
        "helper_weight_bytes": weights,
        "helper_cap_bytes": weights + HELPER_MARGIN,
        "helper_peak_bytes": helper_peak,
        "oom_kills": oom,
        "links": {s.name: {"asked": asdict(s), "measured": measure(s)} for s in shapes},
        "runs": runs,
    }


def summary(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per system: medians over the rounds, decode speed over the main server alone's."""
    alone = statistics.median(r["decode_tok_s"] for r in data["runs"][ALONE])
    rows = []
    for name, runs in data["runs"].items():
        row: dict[str, Any] = {"system": name if name == ALONE else f"helper, {name}"}
        for key in runs[0]:
            if key != "tokens" and isinstance(runs[0][key], int | float):
                row[key] = statistics.median(r[key] for r in runs)
        row["decode_vs_alone"] = row["decode_tok_s"] / alone if alone else 0.0
        # under a route trace the helper's layers route by the model's own router (the trace
        # replays where the main server computes): other tokens, by design
        traced = "route_trace" in data.get("model", {})
        same = all(r["tokens"] == data["runs"][ALONE][0]["tokens"] for r in runs)
        row["same_tokens_as_alone"] = None if traced and name != ALONE else same
        rows.append(row)
    return rows


def markdown(data: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    """The report's markdown."""
    env = data.get("environment", {})
    rounds = len(next(iter(data["runs"].values())))
    routing = data["model"].get("route_trace", {}).get("path", "the model's own router (random weights)")
    helper_read = statistics.median(
        r["helper_read_bytes"] for name, runs in data["runs"].items() if name != ALONE for r in runs
    )
    lines = [
        f"# RPC helper: {data['model']['name']}",
        "",
        f"`{command}`",
        "",
        f"Machine: {env.get('cpu_model', '?')}. The main server capped at "
        f"{format_size(data['cap_bytes'], unit='GiB', digits=2)}; the helper holding the last "
        f"{data['helper_layers']} layers ({format_size(data['helper_weight_bytes'], unit='GiB', digits=2)} "
        f"of weights) in a cgroup of {format_size(data['helper_cap_bytes'], unit='GiB', digits=2)} "
        f"(peak {format_size(data['helper_peak_bytes'], unit='GiB', digits=2)}); "
        f"{rounds} rounds, alternated; OOM kills: "
        f"{data['oom_kills']}. Routing: {routing}. The helper holds its layers in RAM: what it read from "
        f"flash per run, {format_size(helper_read, unit='GiB', digits=2)} (median), is its tensor cache at "
        "load, which spares the main server sending those weights again.",
        "",
        "| system | decode tok/s | vs alone | TTFT s | main flash MiB/token | up KiB/token | down KiB/token "
        "| round trips/token | waited ms/token | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        same = {True: "yes", False: "NO", None: "n/a"}[row["same_tokens_as_alone"]]
        lines.append(
            f"| {row['system']} | {row['decode_tok_s']:.2f} | {row['decode_vs_alone']:.2f}x "
            f"| {row['ttft_s']:.1f} "
            f"| {format_size(row['main_flash_bytes_per_token'], unit='MiB', digits=1, bare=True)} "
            f"| {format_size(row.get('up_bytes_per_token', 0), unit='KiB', digits=1, bare=True)} "
            f"| {format_size(row.get('down_bytes_per_token', 0), unit='KiB', digits=1, bare=True)} "
            f"| {row.get('round_trips_per_token', 0):.1f} "
            f"| {row.get('waited_ms_per_token', 0):.1f} | {same} |"
        )
    lines += ["", "The links as the relay delivers them (server/bench/link.py, measured in this run):", ""]
    lines += ["| link | asked | round trip ms | rate Mbit/s |", "|---|---|---|---|"]
    for name, link in data["links"].items():
        shape, got = link["asked"], link["measured"]
        asked = (
            f"{shape['rate_bps'] / 1e6:.0f} Mbit/s, {shape['delay_s'] * 1000:.0f} ms"
            if shape["rate_bps"]
            else "unshaped"
        )
        lines.append(f"| {name} | {asked} | {got['rtt_s'] * 1000:.2f} | {got['rate_bps'] / 1e6:.0f} |")
    return "\n".join(lines) + "\n"


def parse_links(text: str) -> list[Shape]:
    """Link names (loopback, 1gbit-1ms, 300mbit-3ms), comma-separated."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise ConfigError(f"--links: unknown {unknown}; known: {', '.join(SHAPES)}")
    return [SHAPES[n] for n in names] or [LOOPBACK]
