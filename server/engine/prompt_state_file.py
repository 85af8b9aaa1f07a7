"""A prompt state on flash: the file the prompt cache writes once and reads back at disk speed.

Layout: a header (magic, format, the StateKey digest, an XXH3-64 of the tokens and the state,
the token count, the state's bytes), the tokens (int32), zeros up to a 4 KiB boundary, then the
llama.cpp sequence state. The state starts on a page so that it is read with O_DIRECT straight
into page-aligned memory, no page cache in between (under a cgroup the page cache is charged to
the process), in chunks whose checksum is computed on a second thread while the next is read.
XXH3-64 (xxhash, many times faster than zlib's CRC-32, which bounded a restore below the disk's
rate) detects a torn or corrupted file; which model and context a state belongs to is the key
digest's business. A file is written to a temporary name, synced, then renamed: a crash leaves
the old file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import os
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

MAGIC = b"MFPC"
FORMAT = 3
SUFFIX = ".state"
_HEADER = struct.Struct("<4sI32sQIQ")
_PAGE = 4096
# a read, and how many are in flight: a queue of several keeps the disk busy
_CHUNK = 4 << 20
_READERS = 4


def _state_offset(n_tokens: int) -> int:
    return -(-(_HEADER.size + 4 * n_tokens) // _PAGE) * _PAGE


def file_bytes(n_tokens: int, size: int) -> int:
    """The bytes a state file of `n_tokens` tokens and a `size`-byte state takes."""
    return _state_offset(n_tokens) + size


def _tokens_bytes(tokens: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def write_state(directory: Path, name: str, digest: bytes, tokens: tuple[int, ...], view: memoryview) -> Path:
    """Write a state file `name` in `directory` (the state's bytes: `view`) atomically; returns its
    path (OSError if not)."""
    directory.mkdir(parents=True, exist_ok=True)
    head = _tokens_bytes(tokens)
    size = len(view)
    check = xxhash.xxh3_64(head)
    check.update(view)
    header = _HEADER.pack(MAGIC, FORMAT, digest, check.intdigest(), len(tokens), size)
    padding = b"\0" * (_state_offset(len(tokens)) - _HEADER.size - len(head))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(header + head + padding)
            fh.write(view)
            fh.flush()
            os.fsync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, directory / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return directory / name


def read_header(path: Path, digest: bytes) -> tuple[tuple[int, ...], int, int]:
    """(tokens, state bytes, checksum) of a state file; ValueError when it is not a whole state of
    the key whose digest is `digest`."""
    with path.open("rb") as fh:
        raw = fh.read(_HEADER.size)
        if len(raw) != _HEADER.size:
            raise ValueError("shorter than a state file's header")
        magic, fmt, key, check, n_tokens, size = _HEADER.unpack(raw)
        if magic != MAGIC or fmt != FORMAT:
            raise ValueError(f"not a prompt state of format {FORMAT}")
        if key != digest:
            raise ValueError("a state of another model or other context settings, refused")
        if os.fstat(fh.fileno()).st_size != file_bytes(n_tokens, size):
            raise ValueError("truncated (its size does not match its header)")
        body = fh.read(4 * n_tokens)
    return tuple(struct.unpack(f"<{n_tokens}i", body)), int(size), int(check)


def read_state(path: Path, digest: bytes, tokens: tuple[int, ...], size: int, into: memoryview) -> None:
    """Read the state of a file indexed as (`tokens`, `size`) into `into` (page-aligned memory of
    `size` bytes rounded up to whole pages: O_DIRECT reads whole pages), its checksum verified;
    ValueError when the file is not that state or is corrupt, OSError when it cannot be read.
    Memory faulted in already reads faster: zeroing fresh pages is slow on these VMs."""
    got_tokens, got_size, check = read_header(path, digest)
    if got_tokens != tokens or got_size != size:
        raise ValueError("it changed since it was indexed")
    if len(into) < -(-size // _PAGE) * _PAGE:
        raise ValueError(f"a {size}-byte state does not fit {len(into)} bytes")
    _read_into(path, into, _state_offset(len(tokens)), size, check, tokens)


def _read_into(
    path: Path, view: memoryview, offset: int, size: int, expected: int, tokens: tuple[int, ...]
) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)  # a file system without O_DIRECT (tmpfs)
    try:
        try:
            check = _read_chunks(fd, view, offset, size, tokens)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            os.close(fd)  # O_DIRECT opened but refused on read: read it buffered
            fd = os.open(path, os.O_RDONLY)
            check = _read_chunks(fd, view, offset, size, tokens)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if check != expected:
        raise ValueError("its checksum does not match (corrupt)")


def _read_chunks(fd: int, view: memoryview, offset: int, size: int, tokens: tuple[int, ...]) -> int:
    """Read the state in chunks, _READERS at a time (a deeper queue than one reader's), the
    checksum following them in order on its own thread (xxhash releases the GIL); returns it."""
    check = xxhash.xxh3_64(_tokens_bytes(tokens))
    spans = [(at, min(_CHUNK, size - at)) for at in range(0, size, _CHUNK)]

    def read(at: int, n: int) -> None:
        length = -(-n // _PAGE) * _PAGE
        got = os.preadv(fd, [view[at : at + length]], offset + at)
        if got < n:
            raise ValueError("truncated")

    with ThreadPoolExecutor(1, thread_name_prefix="moeflash-prompt-hash") as hasher:
        with ThreadPoolExecutor(_READERS, thread_name_prefix="moeflash-prompt-read") as readers:
            reads = [readers.submit(read, at, n) for at, n in spans]
            for (at, n), done in zip(spans, reads, strict=True):
                done.result()
                hasher.submit(check.update, view[at : at + n])
    return check.intdigest()
