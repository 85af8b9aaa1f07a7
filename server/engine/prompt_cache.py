"""The prompt cache: the KV state of recent prompt prefixes, restored instead of prefilled again.

DESIGN (llama-server's prompt cache, server_prompt_cache, per slot)
- The context holds one live sequence per slot (server/loading/measured.py `Slot`: its tokens).
  A prompt decoded in a slot reuses its longest common prefix with the slot's live tokens or with
  a kept state, whichever is longer; a kept state is put back into the slot's sequence with
  llama_state_seq_set_data, cut to that prefix, and only the rest is prefilled. The KV rows come
  back as they were computed, into the slot's own KV stream from its first cell, as decoding puts
  them, so a restored prefix gives what prefilling the same tokens in the same micro-batches
  gives (the gates check it).
- A state is kept (llama_state_seq_get_data) when a prompt would throw away more than half of a
  slot's live tokens (another client's prompt, a side request) or 1024 of them, and when the
  server stops. A sliding-window cache has dropped what fell out of the window, so its states are only
  restored whole, and only where they continue bit for bit (Window): the prefill stops once at
  such a point near the prompt's end to keep a checkpoint.
- States live in RAM up to `ram_bytes` (a term of the memory budget, taken from the expert
  cache), in one mapping of that size faulted in at start (_Arena): a state read back from flash
  lands in memory faulted in already, which reads faster than fresh pages. The least recently
  used state is evicted first and written to flash once, under `directory`, up to `flash_bytes`
  (least recently used files deleted first). At start the
  directory's files are indexed (headers only); a file is read back when a prompt needs it.
- A state is valid for one StateKey: the model files' content, the kernels (flash attention, the
  repacked layouts, the llama.cpp build), KV types, the context's sizes and KV streams. Files
  (server/engine/prompt_state_file.py) live in a directory named by the key's digest and carry
  it with a checksum of their payload: a file for another key, a truncated or corrupt one is
  ignored with a warning, never restored.
All methods run on the engine's worker thread (they drive the context); `stats` is read anywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import mmap
import os
import struct
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import llama_cpp

from server import __version__
from server.engine import prompt_state_file as state_file
from server.loading.context import flash_attn_on
from server.loading.model_files import split_files

if TYPE_CHECKING:
    from llama_cpp import Llama

    from server.loading.measured import MeasuredLlama, Slot

logger = logging.getLogger(__name__)

# a live sequence shorter than this is not worth a state
MIN_TOKENS = 32
# a prompt that throws away this many live tokens keeps them first, even if they are under half of
# the live sequence (sub-agents sharing a long system prompt with the main conversation)
_KEEP_DROPPED = 1024
# model identity: the first bytes (the GGUF header) and this many samples spread over each file
_HEAD_BYTES = 1 << 20
_SAMPLES = 32
_SAMPLE_BYTES = 64 << 10


def model_identity(path: Path) -> str:
    """A sha256 of the model files' content: sizes, the first MiB and 32 samples of 64 KiB spread
    over each file. Another file of the same shape (another seed, another fine-tune) differs in
    every tensor, so in the samples; hashing tens of GB at every start is not an option."""
    digest = hashlib.sha256()
    for part in split_files(path):
        size = part.stat().st_size
        digest.update(f"{part.name}:{size}".encode())
        with part.open("rb") as fh:
            digest.update(fh.read(_HEAD_BYTES))
            for i in range(_SAMPLES):
                fh.seek(size * i // _SAMPLES)
                digest.update(fh.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _llama_build_stamp() -> str:
    """What vendor/llama.cpp/build.sh wrote beside the environment it installed llama.cpp into
    ("" when it was installed otherwise)."""
    with contextlib.suppress(OSError):
        return (Path(sys.prefix) / ".moeflash-llama-stamp").read_text().strip()
    return ""


@dataclass(frozen=True)
class StateKey:
    """What a saved state is valid for: the same model content, kernels and context settings."""

    model: str  # model_identity
    flash_attn: bool
    repack: bool  # the repacked weight layouts: other kernels, other KV rows
    kv_streams: int  # llama.cpp refuses a state saved with another stream count
    type_k: int
    type_v: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    swa_full: bool

    @classmethod
    def of(cls, llama: Llama, model: str) -> StateKey:
        params = llama.context_params
        return cls(
            model=model,
            flash_attn=flash_attn_on(llama),
            repack=bool(llama.model_params.use_extra_bufts),
            kv_streams=int(params.n_seq_max),  # a KV stream a slot (context.llama_params)
            type_k=int(params.type_k),
            type_v=int(params.type_v),
            n_ctx=llama.n_ctx(),
            n_batch=int(params.n_batch),
            n_ubatch=int(params.n_ubatch),
            swa_full=bool(params.swa_full),
        )

    def digest(self) -> bytes:
        fields = {
            **asdict(self),
            "format": state_file.FORMAT,
            "llama_state": llama_cpp.LLAMA_STATE_SEQ_VERSION,
            # another build may compute the same prompt's KV rows otherwise: the patched
            # llama.cpp's build stamp (vendor/llama.cpp/build.sh: the pin, patches, CMake options)
            "build": [__version__, llama_cpp.__version__, _llama_build_stamp()],
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()


def window_kept(llama: Llama, slot: Slot, n_past: int) -> bool:
    """Whether the KV cache still holds what a token at position n_past attends to. A sliding-
    window cache cut to the window (swa_full off) drops positions that fall out of it as decoding
    goes on, so a prefix that ends far behind the last position has lost its window (llama.cpp's
    server checks the same)."""
    if not sliding_window(llama) or llama._ctx.memory is None:
        return True
    n_swa = int(llama_cpp.llama_model_n_swa(llama._model.model))
    pos_min = int(llama_cpp.llama_memory_seq_pos_min(llama._ctx.memory, slot.seq_id))
    return 0 <= pos_min <= max(0, n_past - n_swa)


def sliding_window(llama: Llama) -> bool:
    """Whether the context has sliding-window layers cut to the window (states restore whole only)."""
    return int(llama_cpp.llama_model_n_swa(llama._model.model)) > 0 and not llama.context_params.swa_full


@dataclass(frozen=True)
class Window:
    """A sliding-window cache cut to the window: `n_swa` positions, in a ring of `ring` cells per
    KV stream (None when the ring holds the whole context and never wraps).

    Decoding one sequence puts position p in cell p % ring of its slot's stream. A saved state
    holds the window's cells only, and llama.cpp puts them back from cell 0 in their order: the
    same cells as decoding gave them only when the window starts at a multiple of the ring, and
    attention sums the cells in their order, so only such a state continues bit for bit as its
    prefill did (`restorable`). A live sequence cut back stays in place only within the ring lap
    it ends in (`cut_in_place`)."""

    n_swa: int
    ring: int | None

    @classmethod
    def of(cls, llama: MeasuredLlama) -> Window | None:
        if not sliding_window(llama):
            return None
        n_swa = int(llama_cpp.llama_model_n_swa(llama._model.model))
        # llama_kv_cache_iswa, per KV stream: the window plus a micro-batch, in whole 256-cell
        # pages, at most the stream's cells
        window = n_swa + int(llama.context_params.n_ubatch)
        cells = int(llama_cpp.llama_n_ctx_seq(llama._ctx.ctx))
        ring = -(-min(cells, window) // 256) * 256
        return cls(n_swa, ring if ring < cells else None)

    def restorable(self, n: int) -> bool:
        return n <= self.n_swa or self.ring is None or (n - self.n_swa) % self.ring == 0

    def cut_in_place(self, n: int, length: int) -> bool:
        return n == length or self.ring is None or n // self.ring == (length - 1) // self.ring


def common_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...]) -> int:
    """The length of the common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def live_prefix(llama: Llama, slot: Slot, tokens: tuple[int, ...]) -> int:
    """How much of `tokens` the slot's live sequence can give: their common prefix, never the last
    token (its logits pick the next one), 0 when its window is gone."""
    n = min(common_prefix(slot.tokens, tokens), len(tokens) - 1)
    return n if n > 0 and window_kept(llama, slot, n) else 0


def cut_live(llama: Llama, slot: Slot, n: int) -> int:
    """Cut the slot's live sequence to its first `n` tokens (0: empty it); returns what it holds."""
    memory = llama._ctx.memory
    assert memory is not None
    if n > 0 and llama_cpp.llama_memory_seq_rm(memory, slot.seq_id, n, -1):
        del slot.tokens[n:]
        return n
    llama_cpp.llama_memory_seq_rm(memory, slot.seq_id, -1, -1)
    slot.tokens.clear()
    return 0


def reuse_live(llama: Llama, slot: Slot, tokens: tuple[int, ...]) -> int:
    """Without a prompt cache: keep the slot's share of `tokens`; returns its length."""
    return cut_live(llama, slot, live_prefix(llama, slot, tokens))


@dataclass
class _State:
    """One kept state: its tokens, its bytes in RAM (at an offset of the arena) and/or its file
    on flash."""

    tokens: tuple[int, ...]
    size: int  # bytes of the llama.cpp state
    used: int  # LRU clock
    at: int | None = None
    path: Path | None = None


class _Arena:
    """The prompt cache's RAM: one anonymous mapping of its bound, faulted in once, at start. A
    state read back from flash into pages faulted in already reads faster (zeroing fresh pages
    is slow on these VMs, and a restore after a restart would fault every page it reads), and the
    RAM term the budget counted is held from the start instead of reached later. States lie at
    page-aligned offsets (O_DIRECT reads whole pages)."""

    def __init__(self, size: int) -> None:
        self.size = size // mmap.PAGESIZE * mmap.PAGESIZE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        self.map = mmap.mmap(-1, max(self.size, mmap.PAGESIZE), flags=flags)
        self._base = ctypes.addressof(ctypes.c_uint8.from_buffer(self.map))

    @staticmethod
    def pages(size: int) -> int:
        """`size` bytes in whole pages."""
        return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE

    def view(self, at: int, size: int) -> memoryview:
        return memoryview(self.map)[at : at + size]

    def array(self, at: int, size: int) -> ctypes.Array[ctypes.c_uint8]:
        """The bytes at `at` as a ctypes array, for llama.cpp's state calls."""
        return (ctypes.c_uint8 * size).from_buffer(self.map, at)

    def place(self, size: int, states: list[_State]) -> int:
        """The offset of `size` free bytes, given the states in RAM (the caller made room for
        them); when the free pages lie between states, the states move to the arena's start."""
        need = self.pages(size)
        held = sorted((s for s in states if s.at is not None), key=lambda s: s.at or 0)
        free = 0
        for state in held:
            assert state.at is not None
            if state.at - free >= need:
                return free
            free = state.at + self.pages(state.size)
        if self.size - free >= need:
            return free
        free = 0
        for state in held:  # in offset order, each moves down (memmove: the ranges may overlap)
            assert state.at is not None
            if state.at != free:
                ctypes.memmove(self._base + free, self._base + state.at, state.size)
                state.at = free
            free += self.pages(state.size)
        if self.size - free < need:
            raise RuntimeError("the prompt cache placed more states than its RAM holds")
        return free


@dataclass(frozen=True)
class PromptCacheStats:
    """What the prompt cache did and holds (for /metrics)."""

    hits: int  # prompts that restored a kept state
    restored_tokens: int  # tokens those restores brought back
    ram_bytes: int
    flash_bytes: int
    states: int
    read_bytes: int  # states read back from flash, and the time it took (checksum included)
    read_ns: int
    written_bytes: int  # states written to flash


class PromptCache:
    """Keeps prompt states of one loaded model (module docstring). `directory` None: RAM only."""

    def __init__(
        self,
        key: StateKey,
        *,
        ram_bytes: int,
        flash_bytes: int,
        directory: Path | None,
        window: Window | None,
    ) -> None:
        self.key = key
        self._digest = key.digest()
        self.ram_limit = ram_bytes
        self._arena = _Arena(ram_bytes)
        self.flash_limit = flash_bytes if directory is not None else 0
        self.directory = directory
        self.window = window  # a sliding-window model's states restore whole only
        self._states: list[_State] = []
        self._clock = 0
        self.hits = 0
        self.restored_tokens = 0
        self.read_bytes = 0
        self.read_ns = 0
        self.written_bytes = 0
        if directory is not None and self.flash_limit > 0:
            self._index()

    # -- the token loop's calls --------------------------------------------------------

    def prefix(self, llama: MeasuredLlama, slot: Slot, tokens: tuple[int, ...]) -> int:
        """Make the slot hold the longest prefix of `tokens` it can have without decoding (its
        live sequence's, or a kept state's), never the last token (its logits pick the next one);
        returns its length. The live sequence is kept first when this throws most of it away."""
        n_live = live_prefix(llama, slot, tokens)
        if self.window is not None and not self.window.cut_in_place(n_live, len(slot.tokens)):
            n_live = 0  # its cells would move: what follows would not be what a prefill gives
        best, n_best = self._best(tokens, len(tokens) - 1)
        # of the live sequence only its first n_live tokens stay (restored or kept)
        self.keep_if_dropped(llama, slot, n_live)
        if best is not None and n_best > n_live and self._restore(llama, slot, best, n_best):
            self.hits += 1
            self.restored_tokens += n_best
            return n_best
        return cut_live(llama, slot, n_live)

    def copy_live(self, llama: MeasuredLlama, source: Slot, target: Slot, n: int) -> int:
        """Make `target` hold the first `n` tokens of `source`'s live sequence through this cache's
        RAM (so the copy stays inside the memory budget): the source kept as a state unless one
        holds it already, restored into the target's KV stream from its first cell, where decoding
        puts them, and cut to `n`. Returns the tokens the target holds (its own, unchanged, when
        the state has no room)."""
        self._keep(llama, source)
        state, n_state = self._best(tuple(source.tokens[:n]), n)
        if state is None or n_state < n or not self._restore(llama, target, state, n):
            return len(target.tokens)
        return n

    def keep_if_dropped(self, llama: Llama, slot: Slot, n_kept: int) -> None:
        """Keep the slot's live sequence as a state when only its first `n_kept` tokens stay and
        that throws most of it away."""
        live = slot.tokens
        dropped = len(live) - n_kept
        if len(live) >= MIN_TOKENS and (2 * n_kept < len(live) or dropped >= _KEEP_DROPPED):
            self._keep(llama, slot)

    def checkpoint_at(self, start: int, end: int) -> int | None:
        """Where a sliding-window model's prefill of positions [start, end) stops for a
        checkpoint: the last restorable length before the prompt's last token; None elsewhere."""
        window = self.window
        if window is None:
            return None
        for n in range(end - 1, start, -1):
            if n >= MIN_TOKENS and window.restorable(n):
                return n
        return None

    def checkpoint(self, llama: Llama, slot: Slot) -> None:
        """Keep the slot's live sequence as a state (at checkpoint_at)."""
        self._keep(llama, slot)

    def close(self, llama: MeasuredLlama) -> None:
        """At shutdown: keep every slot's live sequence, then write every state not yet on flash."""
        try:
            for slot in llama.slots:
                if len(slot.tokens) >= MIN_TOKENS:
                    self._keep(llama, slot)
            for state in sorted(self._states, key=lambda s: s.used):
                if state.path is None and state.at is not None:
                    self._spill(state)
        except OSError as exc:
            logger.warning("prompt cache: cannot write the states to %s: %s", self.directory, exc)
        for state in self._states:
            state.at = None
        with contextlib.suppress(BufferError):  # a view still held: the mapping goes with it
            self._arena.map.close()

    def stats(self) -> PromptCacheStats:
        states = list(self._states)
        return PromptCacheStats(
            hits=self.hits,
            restored_tokens=self.restored_tokens,
            ram_bytes=sum(s.size for s in states if s.at is not None),
            flash_bytes=sum(
                state_file.file_bytes(len(s.tokens), s.size) for s in states if s.path is not None
            ),
            states=len(states),
            read_bytes=self.read_bytes,
            read_ns=self.read_ns,
            written_bytes=self.written_bytes,
        )

    # -- choosing, keeping, restoring --------------------------------------------------

    def _best(self, tokens: tuple[int, ...], cap: int) -> tuple[_State | None, int]:
        best: _State | None = None
        n_best = 0
        for state in self._states:
            if self._arena.pages(state.size) > self._arena.size:
                continue  # kept by a run with more RAM for it: it cannot be read back into this one
            n = min(common_prefix(state.tokens, tokens), cap)
            if self.window is not None and n != len(state.tokens):
                continue  # a sliding-window state cannot be cut back
            if n > n_best:
                best, n_best = state, n
        return best, n_best

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _keep(self, llama: Llama, slot: Slot) -> None:
        """Copy the slot's live sequence into RAM as a state, unless one holds it already or it
        cannot be restored as it was decoded."""
        tokens = tuple(slot.tokens)
        if self.window is not None and not self.window.restorable(len(tokens)):
            return
        for state in self._states:
            if state.tokens == tokens or (self.window is None and state.tokens[: len(tokens)] == tokens):
                state.used = self._tick()
                return
        ctx = llama._ctx.ctx
        size = int(llama_cpp.llama_state_seq_get_size(ctx, slot.seq_id))
        if self._arena.pages(size) > self._arena.size:
            logger.debug("prompt cache: a %d-token state (%d bytes) exceeds its RAM bound", len(tokens), size)
            return
        self._make_room(size)
        at = self._arena.place(size, self._states)
        got = llama_cpp.llama_state_seq_get_data(ctx, self._arena.array(at, size), size, slot.seq_id)
        if got != size:
            logger.warning("prompt cache: llama.cpp copied %d of a %d-byte state", got, size)
            return
        if self.window is None:
            # a state that can be cut back holds every shorter state of the same prefix
            for state in [s for s in self._states if tokens[: len(s.tokens)] == s.tokens]:
                self._drop(state)
        self._states.append(_State(tokens, size, self._tick(), at=at))
        logger.debug("prompt cache: kept a %d-token state (%d bytes)", len(tokens), size)

    def _restore(self, llama: MeasuredLlama, slot: Slot, state: _State, n: int) -> bool:
        """Put `state` back into the slot's sequence and cut it to `n` tokens; False (the slot
        empty) if it cannot be."""
        if state not in self._states:
            return False  # evicted to make room for the live sequence, with no flash to go to
        if state.at is None:
            self._make_room(state.size)
            if not self._read(state, self._arena.place(state.size, self._states)):
                self._drop(state)
                return False
        assert state.at is not None
        ctx = llama._ctx.ctx
        cut_live(llama, slot, 0)
        if not any(other.tokens for other in llama.slots):
            # an empty memory: the state's cells go in from the first one, as they were decoded
            llama_cpp.llama_memory_clear(llama._ctx.memory, True)
        array = self._arena.array(state.at, state.size)
        got = llama_cpp.llama_state_seq_set_data(ctx, array, state.size, slot.seq_id)
        if got != state.size:
            logger.warning("prompt cache: llama.cpp refused a %d-token state; dropped", len(state.tokens))
            cut_live(llama, slot, 0)
            self._drop(state)
            return False
        slot.tokens[:] = state.tokens
        if n < len(state.tokens):
            cut_live(llama, slot, n)
        state.used = self._tick()
        if state.path is not None:
            with contextlib.suppress(OSError):  # the flash copy's LRU order survives a restart
                os.utime(state.path)
        return True

    def _make_room(self, size: int) -> None:
        """Evict the least recently used states from RAM (to flash) until `size` more bytes fit."""
        in_ram = sorted((s for s in self._states if s.at is not None), key=lambda s: s.used)
        held = sum(self._arena.pages(s.size) for s in in_ram)
        for state in in_ram:
            if held + self._arena.pages(size) <= self._arena.size:
                break
            held -= self._arena.pages(state.size)
            if state.path is None and self.flash_limit > 0:
                try:
                    self._spill(state)
                except OSError as exc:
                    logger.warning("prompt cache: cannot write a state to %s: %s", self.directory, exc)
            state.at = None
            if state.path is None:
                self._states.remove(state)

    def _drop(self, state: _State) -> None:
        state.at = None
        if state in self._states:
            self._states.remove(state)
        if state.path is not None:
            state.path.unlink(missing_ok=True)

    # -- flash -------------------------------------------------------------------------

    def _spill(self, state: _State) -> None:
        """Write `state` to its file once, then keep the files within the bound."""
        assert self.directory is not None and state.at is not None
        size = state_file.file_bytes(len(state.tokens), state.size)
        if size > self.flash_limit:
            return
        name = hashlib.sha256(str(state.tokens).encode()).hexdigest()[:24] + state_file.SUFFIX
        with self._arena.view(state.at, state.size) as view:
            state.path = state_file.write_state(self.directory, name, self._digest, state.tokens, view)
        self.written_bytes += size
        self._bound_flash(keep=state)

    def _bound_flash(self, keep: _State | None) -> None:
        on_flash = sorted((s for s in self._states if s.path is not None), key=lambda s: s.used)
        held = sum(state_file.file_bytes(len(s.tokens), s.size) for s in on_flash)
        for state in on_flash:
            if held <= self.flash_limit:
                break
            if state is keep:
                continue
            held -= state_file.file_bytes(len(state.tokens), state.size)
            assert state.path is not None
            state.path.unlink(missing_ok=True)
            state.path = None
            if state.at is None:
                self._states.remove(state)

    def _index(self) -> None:
        """The states on flash from earlier runs, oldest use first (file times)."""
        assert self.directory is not None
        found: list[tuple[int, _State]] = []
        for path in self.directory.glob("*" + state_file.SUFFIX) if self.directory.is_dir() else []:
            try:
                tokens, size, _ = state_file.read_header(path, self._digest)
                mtime = path.stat().st_mtime_ns
            except (OSError, ValueError, struct.error) as exc:
                logger.warning("prompt cache: ignoring %s: %s", path, exc)
                continue
            found.append((mtime, _State(tokens, size, 0, path=path)))
        for _, state in sorted(found, key=lambda f: f[0]):
            state.used = self._tick()
            self._states.append(state)
        self._bound_flash(keep=None)  # the bound may be smaller than last run's
        if found:
            logger.info("prompt cache: %d states on flash in %s", len(found), self.directory)

    def _read(self, state: _State, at: int) -> bool:
        """Read the state's file into the arena at `at`, its checksum verified; False (with a
        warning) if it cannot be."""
        if state.path is None:
            return False
        start = time.monotonic_ns()
        try:
            with self._arena.view(at, self._arena.pages(state.size)) as view:
                state_file.read_state(state.path, self._digest, state.tokens, state.size, view)
        except (OSError, ValueError, struct.error) as exc:
            logger.warning("prompt cache: ignoring %s: %s", state.path, exc)
            return False
        self.read_bytes += state.size
        self.read_ns += time.monotonic_ns() - start
        state.at = at
        return True


def state_directory(state_dir: Path, path: Path, key: StateKey) -> Path:
    """Where a model's prompt states live: its stem and its key's digest."""
    stem = path.name.removesuffix(".gguf")
    return state_dir / "prompt-cache" / f"{stem}-{key.digest().hex()[:16]}"
