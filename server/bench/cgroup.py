"""Memory cgroups: run a command with its memory (RSS and page cache) capped and measured.

cgroup v1 (these Linux machines): a child of the current memory cgroup with
memory.limit_in_bytes; the peak (RSS + page cache charged) is memory.max_usage_in_bytes.
cgroup v2: a child with memory.max; the peak is memory.peak. The command joins the group
before it execs (a shell writes its own pid to cgroup.procs), so nothing it allocates escapes.
When no writable memory controller exists, `MemoryCgroup.probe()` says why and callers must
not report "capped" figures.
"""

from __future__ import annotations

import logging
import os
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from server.loading.memcg import own_memory_cgroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CgroupSupport:
    """Which cgroup version can cap memory here (None: none), and why not when it cannot."""

    version: int | None
    parent: Path | None
    reason: str


def probe() -> CgroupSupport:
    """Find a memory cgroup this process may create children in."""
    cg = own_memory_cgroup()
    if cg is None:
        return CgroupSupport(None, None, "no cgroup memory controller is mounted")
    if cg.version == 1:
        if os.access(cg.path, os.W_OK) and cg.limit_file.exists():
            return CgroupSupport(1, cg.path, f"cgroup v1 memory controller at {cg.path}")
        return CgroupSupport(None, None, f"cgroup v1 memory controller at {cg.path} is not writable")
    subtree = cg.path / "cgroup.subtree_control"
    controllers = subtree.read_text() if subtree.exists() else ""
    if "memory" in controllers.split() and os.access(cg.path, os.W_OK):
        return CgroupSupport(2, cg.path, f"cgroup v2 at {cg.path}")
    return CgroupSupport(None, None, f"cgroup v2 at {cg.path}: memory not delegated to children")


class MemoryCgroup:
    """A temporary child memory cgroup with a hard limit (a context manager)."""

    def __init__(self, limit_bytes: int, support: CgroupSupport | None = None) -> None:
        self.support = support or probe()
        if self.support.version is None or self.support.parent is None:
            raise OSError(f"cannot cap memory: {self.support.reason}")
        self.limit_bytes = limit_bytes
        self.path = self.support.parent / f"moeflash-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        limit_file = "memory.limit_in_bytes" if self.support.version == 1 else "memory.max"
        (self.path / limit_file).write_text(str(limit_bytes))

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _joining(self, argv: Sequence[str]) -> list[str]:
        procs = self.path / "cgroup.procs"
        return ["/bin/sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "moeflash-cgroup", *argv]

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run argv inside the group (it joins before exec), capturing its output."""
        return subprocess.run(
            self._joining(argv), env=env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start argv inside the group (it joins before exec); kwargs go to subprocess.Popen."""
        return subprocess.Popen(self._joining(argv), text=True, **kwargs)

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed for want of memory."""
        name = "memory.oom_control" if self.support.version == 1 else "memory.events"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def peak_bytes(self) -> int:
        """Peak memory charged to the group: RSS + page cache."""
        name = "memory.max_usage_in_bytes" if self.support.version == 1 else "memory.peak"
        return int((self.path / name).read_text())

    def stat(self) -> dict[str, int]:
        """memory.stat as a dict (cache, rss, pgmajfault, ...)."""
        out: dict[str, int] = {}
        for line in (self.path / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
        return out

    def close(self) -> None:
        """Remove the group (its processes have exited)."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not remove cgroup %s: %s", self.path, exc)


def drop_page_cache() -> str | None:
    """Drop the page cache (cold-cache runs); returns None, or why it could not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        return f"cannot drop the page cache: {exc}"
    return None
