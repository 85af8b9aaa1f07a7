"""The prompt-cache benchmark: an agent-like replay, with and without the prompt cache.

    moeflash bench prompt-cache --shape qwen30b-8l-shape --caps 0.5

Real `moeflash serve` processes under a memory cgroup, streamed chat completions over HTTP.
Three agents with long system prompts of their own (A, B, C: about 3,000, 2,250 and 1,900
tokens on Qwen's vocabulary) take turns the way coding agents do, each conversation growing by
its answers and a short question (`STEPS`); the server restarts (SIGTERM, then a new process on
the same state directory) in the middle. The replay runs twice, on fresh state directories: with
the prompt cache (the defaults) and without (`--prompt-cache-ram 0`, only the live KV cache is
reused). The page cache is dropped before every request, so a state read back comes from the
disk.

Per request: TTFT (request sent to the first content delta), prompt and cached tokens (usage),
and from /metrics the tokens restored, the bytes read back from flash with the time it took, and
the bytes of prompt states kept in RAM and on flash after it.
A request that resumes a conversation after another one's request or after the restart is
"resumed": its TTFT with the cache over its TTFT without (which prefilled it whole) is the
figure the target is written in (<= 0.2), and the restore's bytes per second over the disk's
sequential read rate just before the request, the other (>= 0.5). That rate is read on bytes
of the same history as a spilled state's (_DiskProbe): written and synced earlier in the run,
never read since. On these VMs bytes read again, or read soon after they were written, come
from the host's cache at 2-3x the disk's rate, and every cold prefill reads the model file again.
The cgroup's peak memory over the cap says the memory discipline.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server.bench.cgroup import MemoryCgroup, drop_page_cache, probe
from server.bench.disk import CeilingResult, sequential_read, write_unread
from server.bench.served import BenchServer, eog_bias, stream_chat, write_report
from server.errors import MoeflashError
from server.units import format_size

_RESTART = "restart"
# (agent, its next question) in order; _RESTART restarts the server
STEPS: tuple[tuple[str, str], ...] = (
    ("A", "Review the diff of the parser and list the risky changes."),
    ("A", "Which of them would break the tests?"),
    ("B", "Write a five-word title for this session."),
    ("A", "Propose a fix for the first one."),
    ("C", "Summarise what the team decided today."),
    ("B", "Now a one-line summary of it."),
    (_RESTART, ""),
    ("A", "After the restart: what is left to do?"),
    ("C", "And what should happen tomorrow?"),
    ("B", "A title for tomorrow's session, please."),
)
_TOPICS = ("parser", "scheduler", "cache", "network layer", "storage engine", "build system", "test suite")
_VERBS = ("review", "refactor", "document", "benchmark", "profile", "simplify", "harden")


def system_prompt(agent: str, rules: int) -> str:
    """An agent's long system prompt: numbered rules, different per agent."""
    seed = ord(agent)
    lines = [f"You are agent {agent}, a coding assistant working in a large repository. Follow these rules."]
    for i in range(rules):
        topic = _TOPICS[(i * 3 + seed) % len(_TOPICS)]
        verb = _VERBS[(i * 5 + seed) % len(_VERBS)]
        lines.append(
            f"Rule {i + 1}: before you {verb} the {topic}, read module {seed * 7 + i} and its tests, keep "
            f"the house style of file number {i * 13 % 97}, and say which functions you changed."
        )
    return "\n".join(lines)


# rules per agent: about 3,000, 2,250 and 1,900 prompt tokens on Qwen's vocabulary (94 per rule),
# the sizes of the agents' prompts in issue 40
_RULES = {"A": 32, "B": 24, "C": 20}


class _DiskProbe:
    """The disk's sequential rate on bytes written and synced at the start of the run (a file per
    probe, `probe_bytes` each, server/bench/disk.py, write_unread) and read once, by the probe
    before a request: bytes of the same history as a state spilled to flash earlier in the run."""

    def __init__(self, directory: Path, count: int, probe_bytes: int) -> None:
        self.files = [directory / f"probe-{i}" for i in range(count)]
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for path in self.files:
                write_unread(path, probe_bytes)
        except OSError as exc:
            raise MoeflashError(
                f"cannot write {count} disk probes of {format_size(probe_bytes, unit='MiB', digits=0)} in "
                f"{directory}: {exc}"
            ) from exc

    def read(self) -> CeilingResult:
        path = self.files.pop(0)
        try:
            return sequential_read(path, float("inf"))
        finally:
            path.unlink()


@dataclass(frozen=True)
class Request:
    """One request of the replay on one server."""

    cache: bool
    step: int
    agent: str
    resumed: bool  # the agent's conversation resumes after another's request or the restart
    after_restart: bool
    prompt_tokens: int
    cached_tokens: int
    restored_tokens: int  # brought back from a kept state (not the live KV cache)
    read_bytes: int  # of it read from flash
    read_s: float
    disk_bytes_per_s: float  # the disk's sequential rate on a fresh file, just before the request
    ttft_s: float
    ram_bytes: int  # prompt states held in RAM after the request
    flash_bytes: int  # and on flash


def _replay(
    cgroup: MemoryCgroup,
    model: Path,
    argv: list[str],
    state: Path,
    log: Path,
    cache: bool,
    tokens: int,
    bias: dict[str, float],
    probe_disk: _DiskProbe,
    progress: Callable[[str], None],
) -> list[Request]:
    flags = ["--state-dir", str(state)] + ([] if cache else ["--prompt-cache-ram", "0"])
    server = BenchServer(cgroup, [*argv, *flags], log)
    server.wait_ready()
    talks = {agent: [{"role": "system", "content": system_prompt(agent, n)}] for agent, n in _RULES.items()}
    last, restarted, done = None, False, []
    try:
        for i, (agent, question) in enumerate(STEPS):
            if agent == _RESTART:
                server.stop()
                server = BenchServer(cgroup, [*argv, *flags], log)
                server.wait_ready()
                restarted, last = True, None
                continue
            talk = talks[agent]
            resumed = len(talk) > 1 and last != agent
            talk.append({"role": "user", "content": question})
            # the disk's rate now (shared machines move it), on bytes no cache has served
            disk = probe_disk.read()
            reason = drop_page_cache()
            if reason is not None:
                raise MoeflashError(reason)
            before = {
                k: server.metric(f"moeflash_prompt_cache_{k}")
                for k in ("restored_tokens_total", "read_bytes_total", "read_seconds_total")
            }
            got = stream_chat(server.url, talk, tokens, bias)
            after = {
                k: server.metric(f"moeflash_prompt_cache_{k}") for k in (*before, "ram_bytes", "flash_bytes")
            }
            talk.append({"role": "assistant", "content": got["text"]})
            usage = got["usage"]
            done.append(
                Request(
                    cache=cache,
                    step=i,
                    agent=agent,
                    resumed=resumed,
                    after_restart=restarted,
                    prompt_tokens=usage["prompt_tokens"],
                    cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                    restored_tokens=int(after["restored_tokens_total"] - before["restored_tokens_total"]),
                    read_bytes=int(after["read_bytes_total"] - before["read_bytes_total"]),
                    read_s=after["read_seconds_total"] - before["read_seconds_total"],
                    disk_bytes_per_s=disk.bytes_per_s,
                    ttft_s=got["ttft_s"],
                    ram_bytes=int(after["ram_bytes"]),
                    flash_bytes=int(after["flash_bytes"]),
                )
            )
            r = done[-1]
            progress(
                f"{'cache' if cache else 'no cache'}: step {i + 1} agent {agent}: TTFT {r.ttft_s:.2f} s, "
                f"{r.cached_tokens}/{r.prompt_tokens} cached, "
                f"{format_size(r.read_bytes, unit='MiB', digits=0)} from flash"
            )
            last = agent
    finally:
        server.stop()
    return done


def run_prompt_cache(
    model: Path,
    caps: list[int],
    *,
    tokens: int,
    ctx_size: int,
    settings_flags: tuple[str, ...],
    progress: Callable[[str], None],
    probe_bytes: int = 256 << 20,
) -> dict[str, Any]:
    """The replay with and without the prompt cache per cap (the module docstring says what); the
    disk probe before each request reads `probe_bytes`, more than a state, so that it measures the
    disk's sustained rate rather than a short read's latency."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    support = probe()
    if support.version is None:
        raise MoeflashError(f"the prompt-cache benchmark needs a memory cgroup: {support.reason}")
    bias = eog_bias(model)
    argv = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--alias", "bench",
        "--mode", "streaming", "--ctx-size", str(ctx_size), "--no-warm-start", *settings_flags,
    ]  # fmt: skip
    drop_page_cache()
    disk = sequential_read(model, 5.0)
    work = Path(tempfile.mkdtemp(prefix="moeflash-prompt-cache-bench-"))
    results: list[dict[str, Any]] = []
    try:
        for cap in caps:
            requests: list[Request] = []
            asked = sum(agent != _RESTART for agent, _q in STEPS)
            progress(f"writing {2 * asked} disk probes of {format_size(probe_bytes, unit='MiB', digits=0)}")
            probe_disk = _DiskProbe(work / f"cap{cap}-probes", 2 * asked, probe_bytes)
            with MemoryCgroup(cap, support) as cgroup:
                for cache in (True, False):
                    state = work / f"cap{cap}-{'cache' if cache else 'none'}"
                    requests += _replay(
                        cgroup,
                        model,
                        argv,
                        state,
                        work / "serve.log",
                        cache,
                        tokens,
                        bias,
                        probe_disk,
                        progress,
                    )
                results.append(
                    {
                        "cap_bytes": cap,
                        "peak_bytes": cgroup.peak_bytes(),
                        "oom_kills": cgroup.oom_kills(),
                        "requests": [asdict(r) for r in requests],
                    }
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "tokens": tokens,
        "ctx_size": ctx_size,
        "disk_bytes_per_s": disk.bytes_per_s,
        "disk_direct_io": disk.direct_io,
        "probe_bytes": probe_bytes,
        "caps": results,
    }


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per cap and step: TTFT with and without the cache, their ratio, the restore's speed."""
    rows = []
    for cap in data["caps"]:
        with_cache = [r for r in cap["requests"] if r["cache"]]
        without = {r["step"]: r for r in cap["requests"] if not r["cache"]}
        for r in with_cache:
            cold = without[r["step"]]
            speed = r["read_bytes"] / r["read_s"] if r["read_s"] > 0 else None
            rows.append(
                {
                    "cap_bytes": cap["cap_bytes"],
                    **{k: r[k] for k in ("step", "agent", "resumed", "after_restart", "prompt_tokens")},
                    "cached_tokens": r["cached_tokens"],
                    "cold_cached_tokens": cold["cached_tokens"],
                    "ttft_s": r["ttft_s"],
                    "cold_ttft_s": cold["ttft_s"],
                    "ttft_ratio": r["ttft_s"] / cold["ttft_s"],
                    "read_bytes": r["read_bytes"],
                    "read_bytes_per_s": speed,
                    "disk_bytes_per_s": r["disk_bytes_per_s"],
                    "read_over_disk": speed / r["disk_bytes_per_s"] if speed else None,
                    "ram_bytes": r["ram_bytes"],
                    "flash_bytes": r["flash_bytes"],
                }
            )
    return rows


def markdown(data: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    """The report's tables."""
    disk = data["disk_bytes_per_s"]
    lines = [
        f"# Prompt cache: {data['model']['name']}",
        "",
        f"Command: `{command}`",
        "",
        "An agent-like replay (server/bench/prompt_cache.py): three agents with long system prompts "
        "take turns, each conversation growing by its answers, and `moeflash serve` restarts in the "
        f"middle; {data['tokens']} tokens per answer, the page cache dropped before every request. "
        "With the prompt cache (the defaults) and without it (`--prompt-cache-ram 0`), under a memory "
        f"cgroup. The disk read the model file sequentially at {disk / 1e9:.2f} GB/s at the start "
        f"({'O_DIRECT' if data['disk_direct_io'] else 'buffered'}). Before each request it reads a "
        f"{format_size(data['probe_bytes'], unit='MiB', digits=0)} file once, written and synced at "
        "the start of the cap's runs and never read since, as a state spilled to flash earlier in the "
        "run is: a restore's rate is compared with that. Bytes read again, or soon after they were "
        "written, come from the host's cache at up to 2-3x the disk's rate, and every cold prefill "
        "reads the model file again. A resumed request continues its agent's conversation after "
        "another agent's request or the restart.",
        "",
        "| cap | step | agent | resumed | prompt | cached with / without | TTFT with / without (s) | "
        "with / without | read back | GB/s | disk GB/s | of the disk's | kept in RAM / on flash |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speed = f"{r['read_bytes_per_s'] / 1e9:.2f}" if r["read_bytes_per_s"] else "-"
        share = f"{r['read_over_disk']:.2f}" if r["read_over_disk"] else "-"
        resumed = ("after the restart" if r["after_restart"] else "yes") if r["resumed"] else "no"
        lines.append(
            f"| {format_size(r['cap_bytes'], unit='GiB', digits=2)} | {r['step'] + 1} | {r['agent']} | "
            f"{resumed} | {r['prompt_tokens']} | {r['cached_tokens']} / {r['cold_cached_tokens']} | "
            f"{r['ttft_s']:.2f} / {r['cold_ttft_s']:.2f} | {r['ttft_ratio']:.3f} | "
            f"{format_size(r['read_bytes'], unit='MiB', digits=0)} | {speed} | "
            f"{r['disk_bytes_per_s'] / 1e9:.2f} | {share} | "
            f"{format_size(r['ram_bytes'], unit='MiB', digits=0, bare=True)} / "
            f"{format_size(r['flash_bytes'], unit='MiB', digits=0)} |"
        )
    lines += [
        "",
        "| cap | resumed: TTFT with / without, median (worst) | restore / disk rate, median (worst) "
        "| peak memory / cap | OOM kills |",
        "|---|---|---|---|---|",
    ]
    for cap in data["caps"]:
        mine = [r for r in rows if r["cap_bytes"] == cap["cap_bytes"] and r["resumed"]]
        ratios = [r["ttft_ratio"] for r in mine]
        shares = [r["read_over_disk"] for r in mine if r["read_over_disk"]]
        shown = f"{statistics.median(shares):.2f} ({min(shares):.2f})" if shares else "no read from flash"
        lines.append(
            f"| {format_size(cap['cap_bytes'], unit='GiB', digits=2)} | "
            f"{statistics.median(ratios):.3f} ({max(ratios):.3f}) | {shown} | "
            f"{cap['peak_bytes'] / cap['cap_bytes']:.3f} | {cap['oom_kills']} |"
        )
    lines += [
        "",
        "Targets (issue 40): a resumed request's TTFT <= 0.2 of its cold prefill; a restore from flash "
        ">= 0.5 of the disk's sequential rate; peak memory <= 1.1 of the cap.",
        "",
    ]
    return "\n".join(lines)


def write_prompt_cache_report(data: dict[str, Any], out: Path, command: str) -> list[Path]:
    """<out>.json and <out>.md; returns their paths."""
    return write_report(data, summarize(data), out, command, markdown)
