"""This process's own memory cgroup: which version, and its directory (for its limit or children)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class OwnMemoryCgroup:
    """version 1: <V1_ROOT>/<path> has memory.limit_in_bytes; version 2: memory.max."""

    version: int
    path: Path

    @property
    def limit_file(self) -> Path:
        return self.path / ("memory.limit_in_bytes" if self.version == 1 else "memory.max")


def own_memory_cgroup() -> OwnMemoryCgroup | None:
    """From /proc/self/cgroup: the v1 memory controller's group if mounted, else the v2 group."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    v1 = next((rel for _, ctrl, rel in entries if "memory" in ctrl.split(",")), None)
    if v1 is not None and V1_ROOT.is_dir():
        return OwnMemoryCgroup(1, V1_ROOT / v1.lstrip("/"))
    v2 = next((rel for _, ctrl, rel in entries if ctrl == ""), None)
    if v2 is not None and (V2_ROOT / "cgroup.controllers").exists():
        return OwnMemoryCgroup(2, V2_ROOT / v2.lstrip("/"))
    return None
