"""The disk's ceiling on the model file itself: O_DIRECT reads of one expert's size at random
page-aligned offsets, from 1, 2 or 4 concurrent readers, and one sequential pass; and files
for a sequential pass on bytes no cache has served yet.

Readers are threads doing os.preadv into page-aligned anonymous buffers (the GIL is released
during the read), the same access pattern the streamer's lanes produce. Where O_DIRECT is
refused the result says so and buffered reads are measured instead.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_PAGE = 4096


@dataclass(frozen=True)
class CeilingResult:
    """Throughput of one access pattern."""

    pattern: str  # "random" | "sequential"
    readers: int
    read_bytes: int  # size of one read
    bytes_total: int
    seconds: float
    direct_io: bool

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_total / self.seconds if self.seconds > 0 else 0.0


def _open(path: Path) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError:
        return os.open(path, os.O_RDONLY), False


def random_reads(
    path: Path,
    read_bytes: int,
    readers: int,
    seconds: float,
    seed: int = 0,
    span: tuple[int, int] | None = None,
) -> CeilingResult:
    """`readers` threads reading `read_bytes` at random aligned offsets for about `seconds`."""
    size = os.path.getsize(path)
    length = (read_bytes + _PAGE - 1) // _PAGE * _PAGE
    lo, hi = span or (0, size)
    hi = max(lo + length, hi - length)
    fd, direct = _open(path)
    total = [0] * readers
    deadline = time.monotonic() + seconds

    def reader(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        buf = mmap.mmap(-1, length)
        try:
            while time.monotonic() < deadline:
                off = rng.randrange(lo, hi) // _PAGE * _PAGE
                total[i] += os.preadv(fd, [buf], off)
        finally:
            buf.close()

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(readers)]
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    return CeilingResult("random", readers, length, sum(total), time.monotonic() - t0, direct)


def sequential_read(path: Path, seconds: float, chunk: int = 8 << 20, start: int = 0) -> CeilingResult:
    """One reader streaming the file in `chunk`-byte reads from `start` for about `seconds`."""
    fd, direct = _open(path)
    size = os.path.getsize(path)
    buf = mmap.mmap(-1, chunk)
    total = 0
    off = start // _PAGE * _PAGE
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds and off < size:
            n = os.preadv(fd, [buf], off)
            if n <= 0:
                break
            total += n
            off += n
    finally:
        buf.close()
        os.close(fd)
    return CeilingResult("sequential", 1, chunk, total, time.monotonic() - t0, direct)


def write_unread(path: Path, size: int, chunk: int = 8 << 20) -> None:
    """Write `size` random bytes to `path` in `chunk`-byte writes, synced and dropped from the page
    cache, the way a prompt state is spilled to flash. Read once, later, they give the disk's rate
    on bytes no cache has served. On these VMs bytes read again come from the host's cache, and so
    do pages alike (the host deduplicates): a probe of either reads faster than the disk, hence
    random bytes throughout (the measurements are in the commit that made this probe)."""
    with path.open("wb") as fh:
        for at in range(0, size, chunk):
            fh.write(os.urandom(min(chunk, size - at)))
        fh.flush()
        os.fsync(fh.fileno())
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
