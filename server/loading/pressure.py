"""The expert budget follows memory pressure.

A phone's free memory moves under the server: other apps start, and the low-memory killer picks
the biggest process. A `MemoryWatch` polls how much more this process may take (its headroom)
from a thread of its own and proposes an expert budget; the decode thread applies it between
llama_decode calls (`MeasuredLlama.follow_memory`: before each decode, and while the engine is
idle), so the cache gives memory back before the next reads would need more, and takes it again
once the pressure is gone.

The headroom comes from the tightest source there is:
- the process's memory cgroup, when it has a limit: the limit less the working set (usage less
  inactive file pages, which the kernel reclaims before it kills anything);
- else MemAvailable (/proc/meminfo): Android apps have no cgroup of their own.
PSI (/proc/pressure/memory, where readable) adds stalls: tasks waiting on memory for over
`STALL_SHARE` of the last 10 s count as a shortage whatever the headroom says.

The band looks ahead: the cache fills up to its budget, so what counts is the headroom left once
it has, the headroom less the budget not yet filled. With m = the margin of the budget
(budget.margin_bytes of the limit), a headroom ahead under m / 2, or a stall, shrinks the budget
at once to leave m free; one over 2 m for `calm_polls` polls in a row grows it (never past the
budget of the load) to leave m free. A move smaller than one expert's frame is not made, and the
budget never goes under one layer's experts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.loading.budget import cgroup_limit, margin_bytes, meminfo_bytes
from server.loading.memcg import own_memory_cgroup
from server.units import format_size
from streaming_ext import Streamer, StreamerError

logger = logging.getLogger(__name__)

STALL_SHARE = 10.0  # percent of the last 10 s ("some avg10") that counts as a shortage
_PSI = Path("/proc/pressure/memory")


@dataclass(frozen=True)
class Headroom:
    """How much more the process may take now, and from which source."""

    free_bytes: int
    limit_bytes: int  # what the headroom is counted against (the cgroup limit, or MemTotal)
    source: str
    stalled: bool = False  # PSI: tasks stall on memory


def _read_int(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None


def _stat_value(path: Path, keys: tuple[str, ...]) -> int:
    """The first of `keys` found in a memory.stat file (0 when none is)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(" ", 1) for line in lines if " " in line)
    for key in keys:
        if key in values and values[key].strip().isdigit():
            return int(values[key])
    return 0


def _stalled() -> bool:
    """PSI "some avg10" over STALL_SHARE (False where PSI is missing or unreadable)."""
    try:
        for line in _PSI.read_text().splitlines():
            if line.startswith("some "):
                fields = dict(item.split("=", 1) for item in line.split()[1:] if "=" in item)
                return float(fields.get("avg10", "0")) > STALL_SHARE
    except (OSError, ValueError):
        return False
    return False


def read_headroom() -> Headroom:
    """The headroom from the process's cgroup when it has a limit, else from MemAvailable."""
    stalled = _stalled()
    cg = own_memory_cgroup()
    limited = cgroup_limit(cg)
    if cg is not None and limited is not None:
        usage = _read_int(cg.path / ("memory.usage_in_bytes" if cg.version == 1 else "memory.current"))
        if usage is not None:
            inactive = _stat_value(cg.path / "memory.stat", ("total_inactive_file", "inactive_file"))
            limit, source = limited
            return Headroom(limit - max(0, usage - inactive), limit, source, stalled)
    available = meminfo_bytes("/proc/meminfo", "MemAvailable")
    total = meminfo_bytes("/proc/meminfo", "MemTotal")
    if available is None or total is None:
        raise OSError("cannot read MemAvailable and MemTotal from /proc/meminfo")
    return Headroom(available, total, "MemAvailable (/proc/meminfo)", stalled)


class BudgetBand:
    """The rule of the module docstring: the budget to move to, or None to stay."""

    def __init__(self, *, floor: int, ceiling: int, step: int, calm_polls: int = 3) -> None:
        self.floor = floor
        self.ceiling = ceiling
        self.step = max(1, step)
        self.calm_polls = calm_polls
        self._calm = 0

    def propose(self, budget: int, expert_memory: int, room: Headroom) -> int | None:
        """`budget` is the budget now, `expert_memory` what the cache holds now (it takes up to
        the budget as it fills)."""
        m = margin_bytes(room.limit_bytes)
        ahead = room.free_bytes - max(0, budget - expert_memory)
        # the budget that, filled, would leave m free with the rest of the process as it is
        fit = expert_memory + room.free_bytes - m
        if ahead < m // 2 or room.stalled:
            self._calm = 0
            # a stall with room to spare still gives back a step: the kernel is reclaiming
            return self._move(budget, min(fit, budget - self.step) if room.stalled else fit)
        if ahead > 2 * m:
            self._calm += 1
            return self._move(budget, fit) if self._calm >= self.calm_polls else None
        self._calm = 0
        return None

    def _move(self, budget: int, want: int) -> int | None:
        want = max(self.floor, min(self.ceiling, want))
        return want if abs(want - budget) >= self.step else None


class MemoryWatch:
    """Polls the headroom every `interval_s` on a thread of its own and keeps the latest proposal
    for `apply`, which the decode thread calls between decode calls."""

    def __init__(
        self,
        streamer: Streamer,
        band: BudgetBand,
        *,
        interval_s: float = 0.5,
        read: Callable[[], Headroom] = read_headroom,
    ) -> None:
        self._streamer = streamer
        self._band = band
        self._interval_s = interval_s
        self._read = read
        self._lock = threading.Lock()
        self._proposal: tuple[int, Headroom] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="moeflash-memory-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop polling (idempotent); `apply` does nothing afterwards."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            self._proposal = None

    def poll(self) -> None:
        """One look at the headroom: a new proposal replaces any not yet applied."""
        try:
            room = self._read()
        except OSError as exc:
            logger.warning("memory watch: %s; the expert budget stays as it is", exc)
            return
        stats = self._streamer.stats()
        budget = self._band.propose(stats.budget_bytes, stats.expert_memory_bytes, room)
        with self._lock:
            self._proposal = None if budget is None else (budget, room)

    def _poll_loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.poll()

    def apply(self) -> None:
        """Move the budget to the latest proposal (decode thread, between decode calls)."""
        with self._lock:
            proposal, self._proposal = self._proposal, None
        if proposal is None or self._stop.is_set():
            return
        budget, room = proposal
        before = self._streamer.stats().budget_bytes
        if budget == before:
            return
        try:
            self._streamer.set_budget(budget)
        except StreamerError as exc:
            logger.warning("memory watch: the expert budget cannot move to %s: %s", format_size(budget), exc)
            return
        logger.info(
            "expert budget %s -> %s: %s has %s free%s",
            format_size(before),
            format_size(budget),
            room.source,
            format_size(room.free_bytes),
            " and memory stalls" if room.stalled else "",
        )
