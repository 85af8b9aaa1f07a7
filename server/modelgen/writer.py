"""Streaming the planned files to disk: checks first, then temp files, then an atomic rename.

Order of events in `generate_model`: validate everything and plan the exact layout; refuse if
a target exists (without overwrite) or the filesystem lacks room; write each file under a
hidden temporary name in the target directory; rename them all into place only after every
byte is written. A failure or Ctrl-C removes the temporaries, so a final name never holds a
partial model.

Generation (numpy, main thread) overlaps with disk writes (a writer thread; both release the
GIL for the bulk of their work), with a bounded queue of chunks, so peak RSS stays at tens of
MB whatever the model size.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from server.errors import ModelGenError
from server.modelgen.gguf_format import pad_to
from server.modelgen.layout import GGUF_SUFFIX, Layout, PlannedFile, plan_layout
from server.modelgen.quant import tensor_chunks
from server.modelgen.spec import ModelSpec
from server.units import format_size

logger = logging.getLogger(__name__)

# free space to keep beyond the model itself: filesystem metadata, other writers, the
# headroom a nearly full filesystem needs to stay usable
DISK_MARGIN_BYTES = 64 << 20
DISK_MARGIN_FRACTION = 0.01

# chunks queued for the writer thread (each up to quant.CHUNK_BYTES)
_QUEUE_DEPTH = 3

DiskFree = Callable[[Path], int]


def disk_free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process can still write on the filesystem holding `directory`."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def estimate_size(spec: ModelSpec) -> int:
    """Exact size in bytes of the unsplit GGUF file `generate_model(spec, ...)` writes."""
    return plan_layout(spec, Path("model" + GGUF_SUFFIX)).total_size


def generate_model(
    spec: ModelSpec,
    out: Path,
    *,
    seed: int = 0,
    split_max_size: int | None = None,
    progress: bool = False,
    overwrite: bool = False,
    disk_free: DiskFree | None = None,
) -> list[Path]:
    """Write a random-weight GGUF for `spec` to `out` (a `.gguf` path); return the files written.

    With `split_max_size` (bytes per file) the model is written as a gguf-split set
    `<stem>-00001-of-0000N.gguf`, ... unless it fits in one file; llama.cpp loads a set from its
    first file. The same (spec, seed) always gives the same bytes, and a tensor's bytes do not
    depend on splitting. `disk_free(directory) -> bytes` replaces the statvfs probe (tests).
    Raises ModelGenError, before writing anything, on invalid input, an existing target
    (unless `overwrite`), or too little free space.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ModelGenError(f"seed must be a non-negative integer (got {seed!r})")
    out = Path(out)
    if not out.name.endswith(GGUF_SUFFIX) or out.name == GGUF_SUFFIX:
        raise ModelGenError(f"output file name must end in {GGUF_SUFFIX}: {out}")
    directory = out.parent
    if not directory.is_dir():
        raise ModelGenError(f"output directory does not exist: {directory}")

    layout = plan_layout(spec, out, split_max_size)
    _check_targets(layout.paths, overwrite)
    _check_room(directory, layout.total_size, disk_free or disk_free_bytes)

    logger.debug("writing %s: %d file(s), %d bytes", out, len(layout.files), layout.total_size)
    _write_all(layout, seed, progress)
    logger.debug("wrote %s (%d file(s), %d bytes)", layout.paths[0], len(layout.files), layout.total_size)
    return layout.paths


def _check_targets(paths: list[Path], overwrite: bool) -> None:
    for path in paths:
        if path.is_dir():
            raise ModelGenError(f"output path is a directory: {path}")
        if (path.exists() or path.is_symlink()) and not overwrite:
            raise ModelGenError(f"{path} already exists; pass --force (overwrite=True) to replace it")


def _check_room(directory: Path, size: int, disk_free: DiskFree) -> None:
    margin = DISK_MARGIN_BYTES + int(size * DISK_MARGIN_FRACTION)
    free = disk_free(directory)
    if free < size + margin:
        raise ModelGenError(
            f"not enough free disk space in {directory}: the model needs {format_size(size)} "
            f"(+ {format_size(margin)} margin), only {format_size(free)} free"
        )


def _write_all(layout: Layout, seed: int, progress: bool) -> None:
    temps: list[Path] = []
    bar = tqdm(
        total=layout.total_size,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=layout.paths[0].name,
        file=sys.stderr,
        disable=not progress,
    )
    try:
        with bar, _writer_thread() as sink:
            for planned in layout.files:
                temp = _temp_name(planned.path)
                temps.append(temp)
                _write_file(planned, temp, seed, layout.spec.alignment, sink, bar.update)
        for temp, planned in zip(temps, layout.files, strict=True):
            os.replace(temp, planned.path)
        temps.clear()
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)


def _temp_name(final: Path) -> Path:
    # hidden, in the target directory (same filesystem, so the final rename is atomic)
    return final.with_name(f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")


def _write_file(
    planned: PlannedFile, temp: Path, seed: int, align: int, sink: _Sink, advance: Callable[[int], object]
) -> None:
    # O_EXCL: never write through someone else's file; 0o666 & ~umask like any new file
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "wb") as f:
        try:
            sink.put(f, planned.header)
            advance(len(planned.header))
            for t in planned.tensors:
                written = 0
                for chunk in tensor_chunks(t, seed):
                    sink.put(f, chunk)
                    written += chunk.nbytes
                    advance(chunk.nbytes)
                padding = pad_to(written, align) - written
                if padding:
                    sink.put(f, bytes(padding))
                    advance(padding)
            sink.drain()
        except BaseException:
            # the writer thread must let go of `f` before it is closed
            sink.discard()
            raise
        if f.tell() != planned.size:
            raise ModelGenError(
                f"internal error: {planned.path.name} is {f.tell()} bytes, planned {planned.size}"
            )


class _Sink:
    """The writer thread's inbox: (file, bytes) items in order; errors surface on the next put/drain."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[BinaryIO, memoryview] | threading.Event | None] = queue.Queue(
            maxsize=_QUEUE_DEPTH
        )
        self._error: Exception | None = None
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._run, name="modelgen-writer", daemon=True)
        self._thread.start()

    def put(self, f: BinaryIO, data: bytes | np.ndarray) -> None:
        self._raise_if_failed()
        self._queue.put((f, memoryview(data) if isinstance(data, bytes) else data.data))

    def drain(self) -> None:
        """Block until everything queued so far is written."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()
        self._raise_if_failed()

    def discard(self) -> None:
        """Drop everything still queued and wait until the thread is idle (after a failure)."""
        self._abort.set()
        done = threading.Event()
        self._queue.put(done)
        done.wait()

    def close(self, abort: bool) -> None:
        if abort:
            self._abort.set()
        self._queue.put(None)
        self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise ModelGenError(f"writing the model failed: {self._error}") from self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self._error is not None or self._abort.is_set():
                continue  # keep draining so the producer never blocks on a dead writer
            f, data = item
            try:
                f.write(data)
            except Exception as exc:  # reported to the producer; the thread must keep draining
                self._error = exc


@contextmanager
def _writer_thread() -> Iterator[_Sink]:
    sink = _Sink()
    try:
        yield sink
    except BaseException:
        sink.close(abort=True)
        raise
    sink.close(abort=False)
