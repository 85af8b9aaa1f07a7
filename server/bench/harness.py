"""`moeflash bench suite`: moeflash against stock mmap and the disk's ceiling, side by side.

One invocation measures, on the same file: the disk ceiling (O_DIRECT random reads of one
expert's size at 1/2/4 readers, and sequential), the uncapped references (resident; streaming
with every expert cached), and under each memory cap the stock mmap load and moeflash (best
settings, then each lever alone). Capped systems are interleaved cap by cap, each in its own
process, with the page cache dropped before it where that is permitted. The ratios of
docs/benchmarks.md are computed from those figures (server/bench/ratios.py).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server import __version__
from server.bench.cgroup import MemoryCgroup, drop_page_cache, probe
from server.bench.disk import CeilingResult, random_reads, sequential_read
from server.bench.ratios import compute_ratios
from server.bench.results import BenchResult, Run
from server.bench.systems import System, SystemSet
from server.loading.model_files import split_files
from server.units import format_size

logger = logging.getLogger(__name__)

PROMPT_20 = (
    "Write a short story about a lighthouse keeper who discovers that the fog carries messages from the sea."
)


@dataclass
class BenchConfig:
    """What to measure."""

    model: Path
    caps: list[int]  # bytes
    decode_tokens: int = 32
    ctx_size: int = 1024
    ceiling_seconds: float = 8.0
    timeout_s: float = 1800.0
    expert_bytes_per_read: int = 0  # one expert slice; from the model when 0
    # model-settings flags given to `moeflash bench suite`, passed to every system's `generate`
    settings_flags: tuple[str, ...] = ()


def _source_commit() -> str | None:
    """The checkout's commit, "+local changes" when tracked files other than the reports (which a
    bench run writes) differ from it; None outside git."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[2])]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/reports"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0 or dirty.returncode != 0:
        return None
    return head.stdout.strip() + (" +local changes" if dirty.stdout.strip() else "")


def environment() -> dict[str, Any]:
    import llama_cpp

    env: dict[str, Any] = {
        # which code measured: reports are compared across commits
        "moeflash": __version__,
        "commit": _source_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "llama_cpp_python": llama_cpp.__version__,
    }
    try:
        env["mem_total_bytes"] = (
            int(
                next(
                    ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")
                ).split()[1]
            )
            * 1024
        )
        env["cpu_model"] = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    for dev in Path("/sys/block").iterdir() if Path("/sys/block").exists() else []:
        ra = dev / "queue" / "read_ahead_kb"
        if ra.exists() and not dev.name.startswith(("loop", "ram")):
            env.setdefault("read_ahead_kb", {})[dev.name] = int(ra.read_text())
    return env


def warm_page_cache(paths: list[Path], chunk: int = 8 << 20) -> None:
    """Read whole files once, so that a stock mmap load finds every page in RAM."""
    buf = bytearray(chunk)
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def run_system(
    system: System,
    cfg: BenchConfig,
    cap: int | None,
    progress: Callable[[str], None],
    repeat: int = 0,
    extra: tuple[str, ...] = (),
) -> Run:
    """One `moeflash generate --json` process, under `cap` unless the system runs uncapped (a
    reference run in a cap's rounds is recorded under the cap but runs without it)."""
    argv = [
        *system.argv(str(cfg.model), PROMPT_20, cfg.decode_tokens, cfg.ctx_size, cfg.settings_flags),
        *extra,
    ]
    dropped = drop_page_cache() is None
    run = Run(system.name, cap, ok=False, page_cache_dropped=dropped, repeat=repeat)
    nth = f" (run {repeat + 1} of {system.repeats})" if system.repeats > 1 else ""
    under = "" if cap is None else f" @ {format_size(cap, unit='GiB', digits=2)}"
    progress(f"{system.name}{nth}{under}")
    if system.warm_page_cache:
        progress(f"{system.name}: reading the model into the page cache first")
        warm_page_cache(split_files(cfg.model))
        run.page_cache_warmed = True
    t0 = time.monotonic()
    try:
        if cap is None or not system.capped:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=cfg.timeout_s, check=False)
        else:
            with MemoryCgroup(cap) as cg:
                proc = cg.run(argv, timeout=cfg.timeout_s)
                run.cgroup_peak_bytes = cg.peak_bytes()
                run.cgroup_stat = cg.stat()
    except subprocess.TimeoutExpired:
        run.error = f"timed out after {cfg.timeout_s:.0f} s"
        return run
    run.wall_s = time.monotonic() - t0
    if proc.returncode != 0:
        run.error = (proc.stderr or proc.stdout)[-2000:].strip() or f"exit status {proc.returncode}"
        return run
    run.report = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("model", "route_trace"):  # a committed report holds no path of this machine
        if isinstance(run.report.get(key), str):
            run.report[key] = _shown_path(run.report[key])
    run.ok = True
    return run


def _shown_path(path: str) -> str:
    """`path` relative to the working directory (the checkout, for `make bench`) when under it."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(Path.cwd())) if resolved.is_relative_to(Path.cwd()) else path


def measure_ceiling(
    cfg: BenchConfig, slice_bytes: int, progress: Callable[[str], None], probe: int = 0
) -> list[CeilingResult]:
    """O_DIRECT random reads of one expert slice at 1/2/4 readers, and sequential.

    Each pattern reads its own quarter of the file: a virtual disk's host may cache what an earlier
    pattern read (dropping the guest's page cache does not reach it), and the 4-reader probe over
    the whole file measured 876-1005 MB/s in some runs and 1929 MB/s in one that followed reads
    of the same file. A later probe (`probe`, from 0) reads the same quarters at other random
    offsets: it meets the host's cache as the systems run next to it do.
    """
    quarter = cfg.model.stat().st_size // 4
    out = []
    for i, readers in enumerate((1, 2, 4)):
        size = format_size(slice_bytes, unit="MiB", digits=2)
        progress(f"disk ceiling (probe {probe + 1}): random {size} reads, {readers} reader(s)")
        drop_page_cache()
        span = (i * quarter, (i + 1) * quarter)
        seed = probe * 10 + readers
        out.append(random_reads(cfg.model, slice_bytes, readers, cfg.ceiling_seconds, seed=seed, span=span))
    progress(f"disk ceiling (probe {probe + 1}): sequential")
    drop_page_cache()
    out.append(sequential_read(cfg.model, cfg.ceiling_seconds, start=3 * quarter))
    return out


def _in_rounds(
    systems: list[System], cfg: BenchConfig, cap: int | None, progress: Callable[[str], None]
) -> list[Run]:
    """Every system once, then again in rounds those measured several times (System.repeats).

    A system measured twice is measured again after the others, not right after itself; every
    other round runs in reverse order, so that a drift of the machine's speed during the rounds
    favours neither side of the paired ratios (ratios.py).
    """
    runs: list[Run] = []
    for repeat in range(max((s.repeats for s in systems), default=0)):
        for system in systems if repeat % 2 == 0 else systems[::-1]:
            if repeat < system.repeats:
                runs.append(run_system(system, cfg, cap, progress, repeat, _flash_attn_as(system, runs)))
    return runs


def _flash_attn_as(system: System, runs: list[Run]) -> tuple[str, ...]:
    """The --flash-attn of the last successful run of the system `system` follows (none yet: its own)."""
    if system.flash_attn_as is None:
        return ()
    for run in reversed(runs):
        if run.system == system.flash_attn_as and run.ok:
            on = ((run.report.get("memory") or {}).get("context") or {}).get("flash_attn")
            return () if on is None else ("--flash-attn", "on" if on else "off")
    return ()


def run_bench(
    cfg: BenchConfig, systems: SystemSet, model_info: dict[str, Any], progress: Callable[[str], None]
) -> BenchResult:
    """Measure everything; refuses to report capped figures when no cgroup could cap.

    The disk ceiling is probed before the uncapped runs, before each cap's runs and after the
    last ones (docs/benchmarks.md: interleaved with the systems). This disk's rate drifts between probes
    (one report: 791 to 1418 MB/s; another's single-reader probe 1827 MB/s from the host's
    cache), so each cap is judged against the probes just before and after its own runs.
    """
    support = probe()
    if cfg.caps and support.version is None:
        raise OSError(f"cannot cap memory here ({support.reason}): capped figures would be meaningless")
    cache_note = drop_page_cache()
    slice_bytes = int(model_info["bytes_per_expert_slice"])
    ceiling: list[dict[str, Any]] = []

    def probe_disk(before_cap: int | None, label: str) -> None:
        n = len({c["probe"] for c in ceiling})
        for c in measure_ceiling(cfg, slice_bytes, progress, n):
            ceiling.append(
                asdict(c)
                | {"bytes_per_s": c.bytes_per_s, "probe": n, "before_cap_bytes": before_cap, "label": label}
            )

    probe_disk(None, "before the uncapped runs")
    runs = _in_rounds(systems.uncapped, cfg, None, progress)
    for cap in cfg.caps:
        probe_disk(cap, f"before the {format_size(cap, unit='GiB', digits=2)} runs")
        runs += _in_rounds(systems.capped, cfg, cap, progress)
    probe_disk(None, "after the last runs")
    result = BenchResult(
        model=model_info,
        environment=environment(),
        cgroup=support.reason,
        page_cache=(
            "dropped before every run (then the model file read back in for the resident reference)"
            if cache_note is None
            else f"NOT dropped: {cache_note}"
        ),
        ceiling=ceiling,
        runs=runs,
    )

    result.ratios = compute_ratios(result)
    return result


def disk_room_ok(path: Path, need: int) -> tuple[bool, int]:
    """Whether `need` bytes plus the 15 GB the machine must keep free fit next to `path`."""
    free = shutil.disk_usage(path).free
    return free >= need + 15 * 10**9, free
