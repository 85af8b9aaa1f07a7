"""Warm start: the expert cache's hot set, kept across restarts of the server.

After a restart the first answers would pay for a cold cache: every expert they route is read
from flash while they wait. So the server keeps the cache's hot set, the resident experts ranked
by the streamer (most routed, then most recently used: `Streamer.hot_set`) with how often each
was routed lately, in a small JSON file under the state directory, one per model file. It is
written atomically on shutdown and, while the cache changes, every `save_every_s` seconds (so a
kill loses at most that much), and read back after the next load:

- The hottest entries the budget holds are read back in file order (layer by layer, experts
  ascending), a chunk of at most `_CHUNK_BYTES` per call, on the engine's worker thread between
  requests only: a request that arrives waits for at most the chunk being read, never for the
  rest. Reads go into the budget's free room and evict nothing, so what requests have routed
  since the start stays; the cache then holds each entry as routed at its layer's last visit,
  as often as it was before, so its policy keeps the hot experts as it kept them before the
  restart (as never-routed entries they would be the first evicted).
- When memory pressure has shrunk the budget (server/loading/pressure.py) and it grows back, the
  hot set is read back the same way into the room regained: a save never drops hot entries just
  because the budget is smaller now.
- The file names the model files it belongs to (path, sizes, modification times): a file for
  another model, or one that cannot be read, is ignored with a warning and replaced at the next
  save. Read-back never changes output: which experts are resident does not (the byte-identity
  gates, tests/c/test_stream_identity.c among them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.loading.model_files import split_files
from server.units import format_size
from streaming_ext import Streamer, StreamerError

logger = logging.getLogger(__name__)

# the most a read-back call reads: what a request arriving during it waits for at worst (about
# 10-20 ms at the 1-2 GB/s of these machines' disks and of phone flash)
_CHUNK_BYTES = 16 << 20
# the file's format; another number is not read
_FORMAT = 2

# an entry of a hot set: layer, expert, and how often the cache saw it routed lately
Entry = tuple[int, int, int]


@dataclass(frozen=True)
class ModelFiles:
    """The model a hot set belongs to: its files' names, sizes and modification times, and the
    layers streamed here when RPC helpers hold the rest (0: every layer; server/rpc)."""

    path: Path
    files: tuple[tuple[str, int, int], ...]
    layers: int = 0

    @classmethod
    def of(cls, path: Path, layers: int = 0) -> ModelFiles:
        stats = [(part, part.stat()) for part in split_files(path)]
        return cls(path, tuple((part.name, st.st_size, st.st_mtime_ns) for part, st in stats), layers)

    def state_file(self, state_dir: Path) -> Path:
        """Where this model's hot set lives: its stem and a hash of its files (and of the layers
        streamed, when helpers hold some: another split keeps another hot set)."""
        key: list[object] = [str(self.path), self.files, *([self.layers] if self.layers else [])]
        digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
        stem = self.path.name.removesuffix(".gguf")
        return state_dir / "hot-sets" / f"{stem}-{digest}.json"


def read_hot_set(path: Path, model: ModelFiles, n_expert: int) -> list[Entry]:
    """The (layer, expert, uses) entries saved for `model`, hottest first; [] when there is none
    or it cannot be used (a warning says why)."""
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        logger.warning("warm start: ignoring %s, which cannot be read: %s", path, exc)
        return []
    problem = _check(data, model, n_expert)
    if problem:
        logger.warning("warm start: ignoring %s: %s", path, problem)
        return []
    return [(int(layer), int(expert), int(uses)) for layer, expert, uses in data["experts"]]


def _check(data: Any, model: ModelFiles, n_expert: int) -> str | None:
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return f"not a hot set of format {_FORMAT}"
    if data.get("files") != [list(f) for f in model.files]:
        return "it belongs to other model files (names, sizes or times differ)"
    if data.get("n_expert") != n_expert:
        return f"it is for {data.get('n_expert')} experts per layer, the model has {n_expert}"
    if data.get("layers", 0) != model.layers:
        return f"it is for {data.get('layers', 0) or 'all'} layers streamed here, not {model.layers or 'all'}"
    experts = data.get("experts")
    if not isinstance(experts, list):
        return "no expert list"
    for entry in experts:
        if (
            not isinstance(entry, list)
            or len(entry) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in entry)
            or entry[0] < 0
            or not 0 <= entry[1] < n_expert
            or not 0 <= entry[2] < 2**32
        ):
            return f"a bad entry {entry!r}"
    return None


def write_hot_set(path: Path, model: ModelFiles, n_expert: int, entries: list[Entry]) -> None:
    """Replace the file atomically (a crash leaves the old one or the new one, never half)."""
    data = {
        "format": _FORMAT,
        "model": str(model.path),
        "files": [list(f) for f in model.files],
        "n_expert": n_expert,
        "layers": model.layers,
        "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "experts": [list(e) for e in entries],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class WarmStart:
    """Saves a streamed model's hot set and reads the last one back; owned by the engine's worker
    thread (the decode thread), which calls `idle` between requests and `close` at shutdown."""

    def __init__(
        self,
        streamer: Streamer,
        model_path: Path,
        state_dir: Path,
        *,
        save_every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._streamer = streamer
        self._model = ModelFiles.of(model_path, streamer.config.layers)
        self.path = self._model.state_file(state_dir)
        self._n_expert = streamer.n_expert
        self._save_every_s = save_every_s
        self._clock = clock
        self._saved_at = clock()
        self._saved_mark = self._mark()
        self._save_failed = False
        # the cache counts every entry at the largest layer's entry (one frame size)
        self._entry_bytes = -(-streamer.layer_bytes // self._n_expert)
        # the budget chosen at load: the most the cache holds, and the most a hot set keeps
        self._budget_seen = streamer.stats().budget_bytes
        self._most = self._budget_seen // self._entry_bytes
        # the hot set as last saved or read: what read-back reads, after a restart or once the
        # memory watch grows the budget back
        self._known = read_hot_set(self.path, self._model, self._n_expert)[: self._most]
        self._pending = self._plan("the last run's hot set")
        self._started = clock()
        self._read = 0

    def _plan(self, why: str) -> list[tuple[int, dict[int, int]]]:
        """The hottest known entries the budget holds and the cache lacks, in file order, as
        (layer, {expert: uses}) chunks."""
        fit = self._streamer.stats().budget_bytes // self._entry_bytes
        resident = {(layer, e) for layer, e, _ in self._streamer.hot_set()}
        top = [entry for entry in self._known[:fit] if entry[:2] not in resident]
        chosen = sorted({(layer, e): uses for layer, e, uses in reversed(top)}.items())
        per_call = max(1, _CHUNK_BYTES // self._entry_bytes)
        chunks: list[tuple[int, dict[int, int]]] = []
        for (layer, expert), uses in chosen:
            if chunks and chunks[-1][0] == layer and len(chunks[-1][1]) < per_call:
                chunks[-1][1][expert] = uses
            else:
                chunks.append((layer, {expert: uses}))
        if chosen:
            logger.info(
                "warm start: reading back %d experts (%s) of %s, between requests",
                len(chosen),
                format_size(len(chosen) * self._entry_bytes),
                why,
            )
        return chunks

    @property
    def reading(self) -> bool:
        """Whether entries of the last hot set remain to be read back."""
        return bool(self._pending)

    @property
    def pending_experts(self) -> int:
        """Entries of the last hot set not read back yet (/metrics; read from any thread)."""
        return sum(len(chunk) for _, chunk in list(self._pending))

    def idle(self) -> bool:
        """Between requests: save the hot set when due; once the budget has grown back (memory
        pressure shrank it, server/loading/pressure.py), plan to read back what it holds again;
        then read back one chunk. True while chunks remain (the engine then comes back at once,
        unless a request waits)."""
        self.save_if_due()
        budget = self._streamer.stats().budget_bytes
        if budget > self._budget_seen and not self._pending:
            self._started, self._read = self._clock(), 0
            self._pending = self._plan(f"the hot set, the budget back up to {format_size(budget)}")
        self._budget_seen = budget
        if not self._pending:
            return False
        layer, experts = self._pending.pop(0)
        try:
            self._read += self._streamer.restore(layer, experts)
        except StreamerError as exc:
            logger.warning("warm start stopped, %d experts read back: %s", self._read, exc)
            self._pending.clear()
            return False
        if not self._pending:
            logger.info(
                "warm start: %d experts read back in %.1f s", self._read, self._clock() - self._started
            )
        return bool(self._pending)

    def save_if_due(self) -> None:
        """Save when `save_every_s` has passed and the cache changed since the last save."""
        if self._clock() - self._saved_at >= self._save_every_s and self._mark() != self._saved_mark:
            self.save()

    def save(self) -> None:
        """Write the hot set now: the resident entries, then those of the last hot set that are not
        resident, as many as the budget chosen at load holds. So a restart during read-back keeps
        what was not read yet, and a budget that memory pressure shrank does not shrink the hot
        set. A failure is logged once, not raised."""
        entries = self._streamer.hot_set()
        resident = {(layer, e) for layer, e, _ in entries}
        entries += [entry for entry in self._known if entry[:2] not in resident]
        entries = entries[: self._most]
        self._known = entries
        self._saved_at = self._clock()
        self._saved_mark = self._mark()
        try:
            write_hot_set(self.path, self._model, self._n_expert, entries)
        except OSError as exc:
            if not self._save_failed:
                logger.warning("warm start: cannot save the hot set to %s: %s", self.path, exc)
            self._save_failed = True
            return
        self._save_failed = False

    def close(self) -> None:
        """At shutdown, before the model is freed: the last save."""
        self.save()

    def _mark(self) -> tuple[int, int]:
        # the cache's contents change with every read: routed misses, prefetches, read-back
        s = self._streamer.stats()
        return s.misses + s.prefetched, s.restored
