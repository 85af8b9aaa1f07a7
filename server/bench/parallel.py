"""The parallel benchmark: several clients at once on one `moeflash serve --parallel 4`.

    moeflash bench parallel --shape qwen30b-shape --caps all,0.5,0.25

Real `moeflash serve` processes (one per cap, under a memory cgroup; `all`: every expert read at
load with `--budget all --preload`), streamed greedy chat completions over HTTP, each from a
prompt of its own (no shared prefix), the end-of-generation tokens biased out so that every
answer has its length. Per cap, in `rounds` rounds alternated:

- aggregate tokens/s of 1, 2 and 4 streams of `tokens` tokens sent at once, counted from the
  first request sent to the last token of the last stream, prefill included; from /metrics the
  steps those streams took, how many held two requests or more, their tokens per step and the
  expert bytes read per decoded token;
- a short request (a 16-token question, 8 tokens) alone, then sent once a 256-token answer
  streams: its time to first token beside it over alone;
- a 2,000-token prompt alone, then sent once a 256-token answer streams: its time to first
  token beside it over alone, and the running answer's mean gap between tokens while the long
  prompt prefills (its rate meanwhile; and its longest gap) over its mean gap alone.

The cgroup's peak memory over the cap says the memory discipline.
"""

from __future__ import annotations

import logging
import re
import shutil
import statistics
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from server.bench.cgroup import MemoryCgroup, probe
from server.bench.served import BenchServer, eog_bias, stream_chat, write_report
from server.errors import MoeflashError
from server.units import format_size

STREAMS = (1, 2, 4)
SLOTS = 4
# the long prompt's words: about 2,000 tokens with the shapes' vocabularies (the report gives its count)
LONG_WORDS = 420
# the caps' word for "no cap, every expert read at load"
ALL = "all"
_WORDS = ("river", "engine", "market", "garden", "signal", "archive", "harbor", "lantern", "meadow", "canyon")


def _prompt(tag: str, words: int) -> list[dict[str, str]]:
    """A user message of about `words` words, its own from the first word on."""
    text = " ".join(_WORDS[(i * 7 + len(tag) + sum(map(ord, tag))) % len(_WORDS)] for i in range(words))
    return [{"role": "user", "content": f"{tag}: {text}. Tell me more."}]


def _counters(server: BenchServer) -> dict[str, float]:
    names = ("decode_steps_total", "shared_steps_total", "step_tokens_total", "streamer_bytes_read_total")
    return {name: server.metric(f"moeflash_{name}") for name in names}


def _together(server: BenchServer, n: int, tokens: int, bias: dict[str, float], tag: str) -> dict[str, Any]:
    """`n` streams sent at once: aggregate tokens/s and what the steps held."""
    before = _counters(server)
    with ThreadPoolExecutor(max_workers=n) as pool:
        answers = list(
            pool.map(
                lambda i: stream_chat(server.url, _prompt(f"{tag} stream {i}", 12), tokens, bias), range(n)
            )
        )
    after = _counters(server)
    start = min(a["sent"] for a in answers)
    end = max(a["sent"] + a["total_s"] for a in answers)
    decoded = sum(a["usage"]["completion_tokens"] for a in answers)
    delta = {k: after[k] - before[k] for k in before}
    return {
        "streams": n,
        "tokens": decoded,
        "seconds": end - start,
        "tokens_per_s": decoded / (end - start),
        "steps": delta["decode_steps_total"],
        "shared_steps": delta["shared_steps_total"],
        "step_tokens": delta["step_tokens_total"],
        "bytes_read_per_token": delta["streamer_bytes_read_total"] / decoded,
    }


def _gaps(chunks: list[float], start: float, end: float) -> list[float]:
    """The gaps between a stream's consecutive tokens that end within [start, end] (seconds after
    its request was sent)."""
    return [b - a for a, b in zip(chunks, chunks[1:], strict=False) if start <= b <= end]


def _beside(
    server: BenchServer, messages: list[dict[str, str]], tokens: int, bias: dict[str, float], tag: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`messages` sent once a 256-token answer streams: its answer, and the running one's."""
    started = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(stream_chat, server.url, _prompt(f"{tag} running", 12), 256, bias, started)
        if not started.wait(600):
            raise MoeflashError("the running answer produced no token in 600 s")
        beside = stream_chat(server.url, messages, tokens, bias)
        return beside, running.result()


def _latency(server: BenchServer, bias: dict[str, float], tag: str) -> dict[str, Any]:
    short = _prompt(f"{tag} short", 4)
    long = _prompt(f"{tag} long", LONG_WORDS)
    short_alone = stream_chat(server.url, short, 8, bias)
    short_beside, _ = _beside(server, _prompt(f"{tag} short again", 4), 8, bias, f"{tag} a")
    alone = stream_chat(server.url, _prompt(f"{tag} running alone", 12), 256, bias)
    long_alone = stream_chat(server.url, long, 8, bias)
    long_beside, running = _beside(server, _prompt(f"{tag} long again", LONG_WORDS), 8, bias, f"{tag} b")
    # the running answer's gaps while the long prompt prefilled: from its sending to its first token
    sent_at = long_beside["sent"] - running["sent"]
    during = _gaps(running["chunk_s"], sent_at, sent_at + long_beside["ttft_s"])
    return {
        "short_prompt_tokens": short_alone["usage"]["prompt_tokens"],
        "short_ttft_alone_s": short_alone["ttft_s"],
        "short_ttft_beside_s": short_beside["ttft_s"],
        "long_prompt_tokens": long_alone["usage"]["prompt_tokens"],
        "long_ttft_alone_s": long_alone["ttft_s"],
        "long_ttft_beside_s": long_beside["ttft_s"],
        "gap_alone_s": statistics.mean(_gaps(alone["chunk_s"], 0.0, float("inf"))),
        "gap_during_prefill_s": statistics.mean(during) if during else None,
        "gap_during_prefill_max_s": max(during) if during else None,
    }


def run_parallel(
    model: Path,
    caps: list[int | str],
    *,
    tokens: int,
    rounds: int,
    ctx_size: int,
    settings_flags: tuple[str, ...],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Per cap: the streams together and the latencies (the module docstring says what)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    support = probe()
    if support.version is None:
        raise MoeflashError(f"the parallel benchmark needs a memory cgroup: {support.reason}")
    bias = eog_bias(model)
    argv = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--alias", "bench",
        "--parallel", str(SLOTS), "--ctx-size", str(ctx_size), "--no-warm-start", "--prompt-cache-ram", "0",
        *settings_flags,
    ]  # fmt: skip
    file_bytes = model.stat().st_size
    work = Path(tempfile.mkdtemp(prefix="moeflash-parallel-bench-"))
    results: list[dict[str, Any]] = []
    try:
        for cap in caps:
            cached = cap == ALL
            limit = 2 * file_bytes + (4 << 30) if cached else int(cap)
            flags = ["--mode", "streaming"] + (["--budget", "all", "--preload"] if cached else [])
            log = work / f"serve-{cap}.log"
            with MemoryCgroup(limit, support) as cgroup:
                server = BenchServer(cgroup, [*argv, *flags, "--state-dir", str(work / "state")], log)
                try:
                    server.wait_ready()
                except MoeflashError:
                    # a cap that cannot hold the slots' contexts: the server says so and exits
                    refusal = _last_error(log)
                    server.proc.kill()
                    server.proc.wait()
                    progress(f"cap {cap}: the server refused: {refusal}")
                    results.append({"cap": int(cap), "limit_bytes": limit, "refused": refusal})
                    continue
                try:
                    stream_chat(server.url, _prompt("warm-up", 12), 8, bias)  # not measured
                    runs, latencies = [], []
                    for r in range(rounds):
                        for n in STREAMS if r % 2 == 0 else tuple(reversed(STREAMS)):
                            runs.append(
                                {"round": r, **_together(server, n, tokens, bias, f"round {r} n {n}")}
                            )
                            progress(
                                f"cap {cap}: round {r}, {n} stream(s): {runs[-1]['tokens_per_s']:.2f} tok/s"
                            )
                        latencies.append({"round": r, **_latency(server, bias, f"round {r}")})
                        progress(f"cap {cap}: round {r}: latencies {latencies[-1]}")
                finally:
                    server.stop()
                results.append(
                    {
                        "cap": ALL if cached else int(cap),
                        "limit_bytes": limit,
                        "peak_bytes": cgroup.peak_bytes(),
                        "oom_kills": cgroup.oom_kills(),
                        "runs": runs,
                        "latencies": latencies,
                    }
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"tokens": tokens, "rounds": rounds, "ctx_size": ctx_size, "slots": SLOTS, "caps": results}


def _last_error(log: Path) -> str:
    """The server's last error line (its refusal at start-up)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if "error" in line.lower()]
    # the cgroup's file is this machine's: the report keeps the figures
    return re.sub(r" \(/[^)]*\)", "", lines[-1].strip()) if lines else "no error line in the log"


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per cap: median aggregate tokens/s of each stream count, their ratios to one stream, what
    the steps held, and the latency ratios."""
    rows = []
    for cap in data["caps"]:
        if "refused" in cap:
            rows.append({"cap": cap["cap"], "refused": cap["refused"]})
            continue
        row: dict[str, Any] = {"cap": cap["cap"], "peak_over_limit": cap["peak_bytes"] / cap["limit_bytes"]}
        for n in STREAMS:
            mine = [r for r in cap["runs"] if r["streams"] == n]
            row[f"tok_s_{n}"] = statistics.median(r["tokens_per_s"] for r in mine)
            row[f"shared_{n}"] = sum(r["shared_steps"] for r in mine) / max(1, sum(r["steps"] for r in mine))
            row[f"tokens_per_step_{n}"] = sum(r["step_tokens"] for r in mine) / max(
                1, sum(r["steps"] for r in mine)
            )
            row[f"bytes_per_token_{n}"] = statistics.median(r["bytes_read_per_token"] for r in mine)
        for n in STREAMS[1:]:
            row[f"ratio_{n}"] = row[f"tok_s_{n}"] / row["tok_s_1"]
        lat = cap["latencies"]
        row["short_ttft_ratio"] = _median([x["short_ttft_beside_s"] / x["short_ttft_alone_s"] for x in lat])
        row["long_ttft_ratio"] = _median([x["long_ttft_beside_s"] / x["long_ttft_alone_s"] for x in lat])
        row["gap_ratio"] = _median(
            [x["gap_during_prefill_s"] / x["gap_alone_s"] if x["gap_during_prefill_s"] else None for x in lat]
        )
        row["gap_max_ratio"] = _median(
            [
                x["gap_during_prefill_max_s"] / x["gap_alone_s"] if x["gap_during_prefill_s"] else None
                for x in lat
            ]
        )
        row["long_prompt_tokens"] = lat[0]["long_prompt_tokens"]
        rows.append(row)
    return rows


def _cap(cap: int | str) -> str:
    return "every expert cached" if cap == ALL else format_size(int(cap), unit="GiB", digits=2)


def markdown(data: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    """The report's tables."""
    env = data.get("environment", {})
    lines = [
        f"# Parallel requests: {data['model']['name']}",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {env.get('cpu_model', 'unknown CPU')}, {env.get('cpus', '?')} cores. "
        f"`moeflash serve --parallel "
        f"{data['slots']} --ctx-size {data['ctx_size']}`, streamed under a memory cgroup per cap; "
        f"{data['tokens']}-token greedy answers from prompts of their own, {data['rounds']} rounds with "
        "the stream counts alternated (server/bench/parallel.py). Aggregate tokens/s run from the first "
        "request sent to the last token of the last stream, prefill included; the model's own routing.",
        "",
        "| cap | tok/s 1 / 2 / 4 streams | 2 / 1 | 4 / 1 | steps shared (4 streams) | tokens a step "
        "(4) | bytes read a token 1 / 4 | peak / limit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {_cap(r['cap'])} | refused at start-up: {r['refused']} |||||||")
            continue
        lines.append(
            f"| {_cap(r['cap'])} | {r['tok_s_1']:.2f} / {r['tok_s_2']:.2f} / {r['tok_s_4']:.2f} | "
            f"{r['ratio_2']:.2f} | {r['ratio_4']:.2f} | {r['shared_4']:.2f} | {r['tokens_per_step_4']:.2f} | "
            f"{format_size(r['bytes_per_token_1'], unit='MiB', digits=1, bare=True)} / "
            f"{format_size(r['bytes_per_token_4'], unit='MiB', digits=1)} | "
            f"{r['peak_over_limit']:.2f} |"
        )

    long_tokens = next((r["long_prompt_tokens"] for r in rows if "refused" not in r), "?")

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines += [
        "",
        "| cap | short request's TTFT beside a stream / alone | "
        f"long prompt's ({long_tokens} tokens) TTFT beside / alone | "
        "running stream's mean gap meanwhile / alone (its longest) |",
        "|---|---|---|---|",
    ]
    for r in (r for r in rows if "refused" not in r):
        lines.append(
            f"| {_cap(r['cap'])} | {ratio(r['short_ttft_ratio'])} | {ratio(r['long_ttft_ratio'])} | "
            f"{ratio(r['gap_ratio'])} ({ratio(r['gap_max_ratio'])}) |"
        )
    lines += [
        "",
        "Targets (issue 53): every expert cached, 4 streams >= 1.5x one; under caps more streams never "
        "cut the total (>= 1.0x at 25%); a short request's TTFT beside a stream <= 2x alone; a 2,000-token "
        "prompt's <= 1.5x, the running stream's (mean) gap meanwhile <= 3x; peak memory never above the cap.",
        "",
    ]
    return "\n".join(lines)


def write_parallel_report(data: dict[str, Any], out: Path, command: str) -> list[Path]:
    """<out>.json and <out>.md; returns their paths."""
    return write_report(data, summarize(data), out, command, markdown)
