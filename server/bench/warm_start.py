"""The warm-start benchmark: the first answer after a restart, with and without the last run's
hot set read back (server/lifecycle/hot_set.py).

    moeflash bench warm-start --shape qwen30b-shape --caps 0.25

Real `moeflash serve` processes under a memory cgroup, a streamed chat conversation over HTTP.
Each round:

1. A server answers the conversation's first turn (`_FIRST`) and is stopped with SIGTERM, which
   saves its hot set.
2. For each schedule, the server restarts twice, in alternating order, once warm-started from a
   copy of that hot set and once with `--no-warm-start`, and answers one request:
   - "next turn, after read-back": the first turn, its answer and a follow-up question, as a chat
     client sends it, once read-back is done (`moeflash_warm_start_pending_experts` is 0; the cold
     server gets it once ready, since it has nothing to do meanwhile). Its prompt is long, and a
     long prompt routes most of every layer's experts, far more than the budget holds: warm start
     can save at most the budget's share of its reads;
   - "new question, after read-back": a new conversation's short question, where the answer's
     tokens, not the prompt, do most of the routing;
   - "new question, at once": the same, sent the moment /health says ready, during read-back:
     warm start must not make it slower (read-back yields to it, a chunk at most).

From the client: TTFT (request sent to the first content delta) and the time to the last of
`tokens` tokens (end-of-generation tokens are biased away); from the response's timings: the
hit rate and the expert bytes read. Both servers must give the same text (the byte-identity
promise). The report gives the median of each figure and the warm/cold ratio per schedule.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server.bench.cgroup import MemoryCgroup, probe
from server.bench.served import POLL_S, BenchServer, eog_bias, stream_chat, write_report
from server.errors import MoeflashError
from server.units import format_size

_SYSTEM = "You are a concise assistant running on a phone."
_FIRST = "Why do mixture-of-experts models route each token to only a few experts?"
_NEXT = "And what does that mean for running one from flash storage?"
_NEW = "Name three uses of a phone's flash storage."
# schedule: (the request's conversation, "next" or "new"; whether it waits for read-back)
SCHEDULES = {
    "next turn, after read-back": ("next", True),
    "new question, after read-back": ("new", True),
    "new question, at once": ("new", False),
}


@dataclass(frozen=True)
class Answer:
    """One restarted server's answer to the next turn."""

    schedule: str
    warm: bool
    round: int
    ready_s: float  # server start to /health ready
    read_back_s: float | None  # ready to read-back done (warm, after read-back)
    restored: int  # experts read back before the request was sent
    ttft_s: float
    total_s: float  # request sent to the last token
    tokens: int
    hit_rate: float | None
    bytes_read: int | None
    text: str


def run_warm_start(
    model: Path,
    caps: list[int],
    *,
    rounds: int,
    tokens: int,
    ctx_size: int,
    settings_flags: tuple[str, ...],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Every round's answers per cap (the module docstring says what is run)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll otherwise
    support = probe()
    if support.version is None:
        raise MoeflashError(f"the warm-start benchmark needs a memory cgroup: {support.reason}")
    bias = eog_bias(model)
    argv = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--alias", "bench",
        "--mode", "streaming", "--ctx-size", str(ctx_size), *settings_flags,
    ]  # fmt: skip
    first = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _FIRST}]
    work = Path(tempfile.mkdtemp(prefix="moeflash-warm-bench-"))
    results: list[dict[str, Any]] = []
    try:
        for cap in caps:
            answers: list[Answer] = []
            with MemoryCgroup(cap, support) as cgroup:
                for r in range(rounds):
                    state = work / f"cap{cap}-round{r}"
                    server = BenchServer(cgroup, [*argv, "--state-dir", str(state)], work / "serve.log")
                    server.wait_ready()
                    opening = stream_chat(server.url, first, tokens, bias)
                    server.stop()
                    asked = {
                        "next": [
                            *first,
                            {"role": "assistant", "content": opening["text"]},
                            {"role": "user", "content": _NEXT},
                        ],
                        "new": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _NEW}],
                    }
                    for schedule, (conversation, after) in SCHEDULES.items():
                        for warm in (r % 2 == 0, r % 2 != 0):
                            answers.append(
                                _restart(
                                    cgroup,
                                    argv,
                                    state,
                                    work,
                                    schedule,
                                    after,
                                    warm,
                                    r,
                                    asked[conversation],
                                    tokens,
                                    bias,
                                )
                            )
                            a = answers[-1]
                            progress(
                                f"cap {format_size(cap, unit='GiB', digits=2)}, "
                                f"round {r + 1}/{rounds}, {schedule}, "
                                f"{'warm' if warm else 'cold'}: TTFT {a.ttft_s:.2f} s, {tokens} tokens "
                                f"{a.total_s:.2f} s, {a.restored} restored"
                            )
                oom = cgroup.oom_kills()
            results.append({"cap_bytes": cap, "oom_kills": oom, "answers": [asdict(a) for a in answers]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"rounds": rounds, "tokens": tokens, "ctx_size": ctx_size, "caps": results}


def _restart(
    cgroup: MemoryCgroup,
    argv: list[str],
    state: Path,
    work: Path,
    schedule: str,
    after_read_back: bool,
    warm: bool,
    round_: int,
    messages: list[dict[str, str]],
    tokens: int,
    bias: dict[str, float],
) -> Answer:
    """One restart on a copy of the round's state (the run's own save must not feed the next)."""
    copy = work / "restart-state"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(state, copy)
    flags = ["--state-dir", str(copy), "--hot-set-save-s", "86400"] + ([] if warm else ["--no-warm-start"])
    server = BenchServer(cgroup, [*argv, *flags], work / "serve.log")
    try:
        ready_s = server.wait_ready()
        read_back_s = None
        if after_read_back and warm:
            while server.metric("moeflash_warm_start_pending_experts") > 0:
                time.sleep(POLL_S)
            read_back_s = time.monotonic() - server.started - ready_s
        restored = int(server.metric("moeflash_streamer_restored_total"))
        got = stream_chat(server.url, messages, tokens, bias)
    finally:
        server.stop()
    t = got["timings"]
    return Answer(
        schedule=schedule,
        warm=warm,
        round=round_,
        ready_s=ready_s,
        read_back_s=read_back_s,
        restored=restored,
        ttft_s=got["ttft_s"],
        total_s=got["total_s"],
        tokens=got["n"],
        hit_rate=t.get("hit_rate"),
        bytes_read=t.get("bytes_read"),
        text=got["text"],
    )


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per cap and schedule: medians warm and cold, the ratios, whether the texts agree."""
    rows = []
    for cap in data["caps"]:
        for schedule in SCHEDULES:
            picked = [a for a in cap["answers"] if a["schedule"] == schedule]
            row: dict[str, Any] = {"cap_bytes": cap["cap_bytes"], "schedule": schedule}
            for side, warm in (("warm", True), ("cold", False)):
                mine = [a for a in picked if a["warm"] is warm]
                for key in ("ttft_s", "total_s", "hit_rate", "bytes_read", "restored"):
                    values = [a[key] for a in mine if a[key] is not None]
                    row[f"{side}_{key}"] = statistics.median(values) if values else None
                backs = [a["read_back_s"] for a in mine if a["read_back_s"] is not None]
                row[f"{side}_read_back_s"] = statistics.median(backs) if backs else None
            row["ttft_cold_over_warm"] = row["cold_ttft_s"] / row["warm_ttft_s"]
            row["total_cold_over_warm"] = row["cold_total_s"] / row["warm_total_s"]
            row["same_text"] = len({a["text"] for a in picked}) == 1
            rows.append(row)
    return rows


def markdown(data: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    """The report's tables."""
    lines = [
        f"# Warm start: {data['model']['name']}",
        "",
        f"Command: `{command}`",
        "",
        "The first answer after a restart of `moeflash serve` under a memory cgroup, warm-started from "
        "the last run's hot set or cold (`--no-warm-start`), streamed over HTTP: "
        f"{data['tokens']} tokens, {data['rounds']} rounds, warm and cold alternated. The hot set is "
        'what a first server left after the conversation\'s first turn. "next turn" asks the '
        "conversation's next turn (the first turn, its answer and a follow-up: a long prompt); "
        '"new question" a new conversation\'s short question; "after read-back" sends it once '
        'read-back is done, "at once" the moment the server is ready (server/bench/warm_start.py). '
        "Medians; a ratio above 1 is warm start's gain.",
        "",
        "| cap | request | TTFT warm / cold (s) | cold / warm | "
        f"{data['tokens']} tokens warm / cold (s) | cold / warm | "
        "read per answer warm / cold | experts read back first | read-back (s) | same text |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        read = (
            f"{format_size(r['warm_bytes_read'], unit='GB', digits=2, bare=True)} / "
            f"{format_size(r['cold_bytes_read'], unit='GB', digits=2)}"
            if r["warm_bytes_read"] is not None and r["cold_bytes_read"] is not None
            else "n/a"
        )
        back = f"{r['warm_read_back_s']:.1f}" if r["warm_read_back_s"] is not None else "during the answer"
        lines.append(
            f"| {format_size(r['cap_bytes'], unit='GiB', digits=2)} | {r['schedule']} | "
            f"{r['warm_ttft_s']:.2f} / {r['cold_ttft_s']:.2f} | {r['ttft_cold_over_warm']:.2f}x | "
            f"{r['warm_total_s']:.2f} / {r['cold_total_s']:.2f} | {r['total_cold_over_warm']:.2f}x | "
            f"{read} | {r['warm_restored']:.0f} | {back} | {'yes' if r['same_text'] else 'NO'} |"
        )
    lines += [
        "",
        '"experts read back first" counts those read back before the request was sent; "read per '
        'answer" is the expert bytes the answer itself read (prompt, decode and prefetch), from the '
        "response's timings. OOM kills: "
        + ", ".join(
            f"{c['oom_kills']} at {format_size(c['cap_bytes'], unit='GiB', digits=2)}" for c in data["caps"]
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


def write_warm_report(data: dict[str, Any], out: Path, command: str) -> list[Path]:
    """<out>.json and <out>.md; returns their paths."""
    return write_report(data, summarize(data), out, command, markdown)
