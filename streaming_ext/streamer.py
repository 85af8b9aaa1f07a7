"""The expert streamer as a Python object: configuration, life cycle, callback, counters.

The options (StreamerConfig), the counters (StreamerStats) and the enums (Policy, Prefetch, Reader)
are generated from the C header's declarations (streaming_ext/declarations.py): the struct handed
to C is filled field by declared field, so no field is named here. A Streamer is created for one
GGUF before the model loads; its two buffer types go into the model's tensor_buft_overrides and
its C callback into the context's cb_eval (see server/loading/streaming.py, which builds the
llama_cpp.Llama). Nothing here runs per graph node: the per-node path is entirely in C.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from streaming_ext._declared import CONFIG, Policy, RateClass, StreamerConfig, StreamerStats
from streaming_ext._lib import MfConfig, MfStats, StreamLib, load_library
from streaming_ext.batch import DecodeCall

logger = logging.getLogger(__name__)

_ERR_LEN = 512


class StreamerError(Exception):
    """The streamer refused a model or configuration, or a read failed. `code` is an errno."""

    def __init__(self, message: str, code: int = errno.EIO) -> None:
        super().__init__(message)
        self.code = code


def c_config(model_path: Path, config: StreamerConfig) -> MfConfig:
    """struct mf_config for `config`, field by declared field (the PATH field is the model's)."""
    values: dict[str, bytes | int | float] = {}
    for field in CONFIG:
        if field.kind == "PATH":
            values[field.name] = os.fsencode(model_path)
        else:
            values[field.name] = field.c_value(getattr(config, field.name))
    return MfConfig(**values)


class Streamer:
    """One expert streamer (the C mf_streamer) for one model file."""

    def __init__(
        self, model_path: str | os.PathLike[str], config: StreamerConfig, lib: StreamLib | None = None
    ):
        self.lib = lib or load_library()
        self.config = config
        self.model_path = Path(model_path)
        c = c_config(self.model_path, config)
        handle = ctypes.c_void_p()
        err = ctypes.create_string_buffer(_ERR_LEN)
        rc = self.lib.cdll.mf_streamer_new(ctypes.byref(c), ctypes.byref(handle), err, _ERR_LEN)
        if rc != 0:
            raise StreamerError(err.value.decode(errors="replace") or os.strerror(-rc), -rc)
        self._handle: int | None = handle.value
        # the raw C function pointer, wrapped once so llama_cpp can store it in its params
        import llama_cpp

        address = ctypes.cast(self.lib.cdll.mf_streamer_eval_cb, ctypes.c_void_p).value
        if address is None:
            raise StreamerError("mf_streamer_eval_cb has no address", errno.ENOSYS)
        self.eval_callback = llama_cpp.ggml_backend_sched_eval_callback(address)
        self.repack = False  # the weights' layouts (set_repack)

    @property
    def handle(self) -> int:
        """The mf_streamer pointer (the callback's user data)."""
        if self._handle is None:
            raise StreamerError("the streamer is closed", errno.EBADF)
        return self._handle

    @property
    def expert_buft(self) -> int:
        """ggml_backend_buffer_type_t of the expert tensors."""
        value: int = self.lib.cdll.mf_streamer_expert_buft(self.handle)
        return value

    @property
    def rows_buft(self) -> int:
        """ggml_backend_buffer_type_t of tensors a token reads one row of (mapped from the file)."""
        value: int = self.lib.cdll.mf_streamer_rows_buft(self.handle)
        return value

    @property
    def dense_buft(self) -> int:
        """ggml_backend_buffer_type_t of every other tensor."""
        value: int = self.lib.cdll.mf_streamer_dense_buft(self.handle)
        return value

    def set_budget(self, budget_bytes: int) -> None:
        """Set the expert budget (at least `layer_bytes`); required, before check_loaded. After
        it, move it between the floor and the budget check_loaded built the memory for (a smaller
        one evicts and gives pages back), between decode calls on the decode thread; StreamerError
        (code EBUSY) when the budget holds every expert."""
        rc = self.lib.cdll.mf_streamer_set_budget(self.handle, budget_bytes)
        if rc != 0:
            raise StreamerError(self.last_error() or os.strerror(-rc), -rc)

    def check_loaded(self) -> None:
        """After the model loaded: every expert tensor is streamed; builds the cache."""
        rc = self.lib.cdll.mf_streamer_check_loaded(self.handle)
        if rc != 0:
            raise StreamerError(self.last_error() or os.strerror(-rc), -rc)

    def memory_note(self) -> str:
        """Where resident experts live: frames (sizes, memory limit), or the tensors themselves."""
        raw: bytes = self.lib.cdll.mf_streamer_memory_note(self.handle)
        return raw.decode(errors="replace")

    def last_error(self) -> str:
        """Message of the last failed call."""
        raw: bytes = self.lib.cdll.mf_streamer_last_error(self.handle)
        return raw.decode(errors="replace")

    def take_error(self) -> StreamerError | None:
        """The first error recorded since the last call (e.g. a failed read), or None."""
        buf = ctypes.create_string_buffer(_ERR_LEN)
        rc = self.lib.cdll.mf_streamer_take_error(self.handle, buf, _ERR_LEN)
        if rc == 0:
            return None
        return StreamerError(buf.value.decode(errors="replace"), -rc)

    def begin_batch(self, call: DecodeCall) -> None:
        """The next llama_decode call: its routes' reads are then shared among its KV sequences
        (take_seq_bytes). Telemetry only: a call the C side has no memory to take has its reads
        counted as unmapped, and the decode goes on."""
        rc = self.lib.cdll.mf_streamer_begin_batch(self.handle, *call.c_args())
        if rc != 0 and rc != -errno.ENOMEM:
            raise StreamerError(f"cannot announce a decode call to the streamer: {os.strerror(-rc)}", -rc)

    def take_seq_bytes(self, n_seq: int) -> tuple[tuple[float, ...], float]:
        """The expert bytes read since the last call, by KV sequence (0 .. n_seq - 1; each read's
        bytes split evenly among the tokens that route its expert), and those of routes whose
        tokens were not announced; zeroes them."""
        by_seq = (ctypes.c_double * max(n_seq, 1))()
        unmapped = ctypes.c_double()
        self.lib.cdll.mf_streamer_take_seq_bytes(self.handle, by_seq, n_seq, ctypes.byref(unmapped))
        return tuple(by_seq[:n_seq]), unmapped.value

    def stats(self) -> StreamerStats:
        """The cumulative counters (a lock-free copy)."""
        raw = MfStats()
        self.lib.cdll.mf_streamer_get_stats(self.handle, ctypes.byref(raw))
        return StreamerStats(**{stat.name: int(getattr(raw, stat.name)) for stat in StreamerStats.declared()})

    def preload(self) -> None:
        """Read every expert now (the budget must hold them all)."""
        rc = self.lib.cdll.mf_streamer_preload(self.handle)
        if rc != 0:
            raise StreamerError(self.last_error() or os.strerror(-rc), -rc)

    def drop_cache(self) -> None:
        """Evict every expert (a cold cache for tests and benchmarks)."""
        self.lib.cdll.mf_streamer_drop_cache(self.handle)

    def hot_set(self) -> list[tuple[int, int, int]]:
        """The resident experts as (layer, expert, uses), hottest first (most routed, then most
        recently used; uses: how often it was routed, decayed, 0 under LRU); on the decode
        thread, between decode calls."""
        n_expert = self.n_expert
        # entries live in MoE layers only: at most n_moe_layers * n_expert of them
        cap = max(1, self.n_moe_layers * n_expert)
        ids, uses = (ctypes.c_int32 * cap)(), (ctypes.c_uint32 * cap)()
        n = int(self.lib.cdll.mf_streamer_hot_set(self.handle, ids, uses, cap))
        if n < 0:
            raise StreamerError(self.last_error() or os.strerror(-n), -n)
        return [(*divmod(int(ids[i]), n_expert), int(uses[i])) for i in range(min(n, cap))]

    def restore(self, layer: int, experts: dict[int, int]) -> int:
        """Read these experts of `layer` ({expert: uses}) into the budget's free room (evicting
        nothing), the cache then holding each as routed `uses` times lately; waits for the reads
        and returns how many were read. StreamerError for a layer without streamed experts or a
        failed read (taken: it fails no request). Decode thread, between decode calls."""
        want = (ctypes.c_uint8 * self.n_expert)()
        counts = (ctypes.c_uint32 * self.n_expert)()
        for e, n_uses in experts.items():
            if not 0 <= e < self.n_expert:
                raise StreamerError(f"expert {e} is out of range 0..{self.n_expert - 1}", errno.EINVAL)
            want[e] = 1
            counts[e] = min(max(n_uses, 0), 2**32 - 1)
        n = int(self.lib.cdll.mf_streamer_restore(self.handle, layer, want, counts))
        if n < 0:
            raise StreamerError(self.last_error() or os.strerror(-n), -n)
        return n

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's experts: the smallest budget accepted."""
        value: int = self.lib.cdll.mf_streamer_layer_bytes(self.handle)
        return value

    @property
    def expert_bytes(self) -> int:
        """Bytes of all expert tensors of the model."""
        value: int = self.lib.cdll.mf_streamer_expert_bytes(self.handle)
        return value

    @property
    def n_moe_layers(self) -> int:
        """Layers with experts."""
        value: int = self.lib.cdll.mf_streamer_n_moe_layers(self.handle)
        return value

    @property
    def n_expert(self) -> int:
        """Experts per layer."""
        value: int = self.lib.cdll.mf_streamer_n_expert(self.handle)
        return value

    def tensor_bytes(self, name: str) -> int:
        """Bytes of the named tensor in the model file, 0 when it has none."""
        value: int = self.lib.cdll.mf_streamer_tensor_bytes(self.handle, name.encode())
        return value

    def set_repack(self, on: bool) -> None:
        """Before the model loads: its weights in the CPU backend's repacked layouts where llama.cpp
        has them (as its use_extra_bufts gives a resident model), or in the file's."""
        rc = self.lib.cdll.mf_streamer_set_repack(self.handle, int(on))
        if rc != 0:
            raise StreamerError(f"mf_streamer_set_repack: {os.strerror(-rc)} (a model has loaded)", -rc)
        self.repack = on

    @property
    def cpu_buft(self) -> int:
        """llama.cpp's CPU buffer type (mf_cpu_buft): an override to it lets llama.cpp choose."""
        value: int = self.lib.cdll.mf_cpu_buft()
        return value

    def tensor_repacked(self, name: str) -> bool:
        """Whether the loaded model holds the file's tensor `name` in a repacked layout; KeyError
        when the file has no such tensor."""
        value: int = self.lib.cdll.mf_streamer_tensor_repacked(self.handle, name.encode())
        if value < 0:
            raise KeyError(name)
        return bool(value)

    def close(self) -> None:
        """Free the streamer; only after the model using its buffer types has been freed."""
        if self._handle is not None:
            self.lib.cdll.mf_streamer_free(self._handle)
            self._handle = None


class CachePolicy:
    """The streamer's cache policy on its own (mf_cache_*), for replaying routing traces."""

    def __init__(
        self,
        n_layer: int,
        n_expert: int,
        entry_bytes: list[int],
        budget_bytes: int,
        policy: Policy = Policy.LAYER,
        lib: StreamLib | None = None,
    ) -> None:
        if len(entry_bytes) != n_layer:
            raise ValueError("entry_bytes needs one value per layer")
        self.lib = lib or load_library()
        self.n_expert = n_expert
        arr = (ctypes.c_uint64 * n_layer)(*entry_bytes)
        handle = ctypes.c_void_p()
        rc = self.lib.cdll.mf_cache_new(
            n_layer, n_expert, arr, budget_bytes, int(policy), ctypes.byref(handle)
        )
        if rc != 0:
            raise StreamerError(f"cannot create a cache: {os.strerror(-rc)}", -rc)
        self._handle: int | None = handle.value
        self._want = (ctypes.c_uint8 * n_expert)()

    def route(self, layer: int, experts: list[int], tokens: Sequence[Sequence[int]] = ()) -> int:
        """One layer's routed experts; returns the number of misses. For a micro-batch, `experts`
        is the union and `tokens` each token's experts, which the policy learns from."""
        ctypes.memset(self._want, 0, self.n_expert)
        for e in experts:
            self._want[e] = 1
        routed = [t for t in tokens if t]
        if routed:
            # rows of k ids; a token with fewer repeats its first (a token's set ignores repeats)
            k = max(len(t) for t in routed)
            rows = [[*t] + [t[0]] * (k - len(t)) for t in routed]
            ids = (ctypes.c_int32 * (k * len(rows)))(*(e for row in rows for e in row))
            rc: int = self.lib.cdll.mf_cache_route(self._handle, layer, self._want, ids, len(rows), k)
        else:
            rc = self.lib.cdll.mf_cache_route(self._handle, layer, self._want, None, 1, 0)
        if rc < 0:
            raise StreamerError(f"route of layer {layer} failed: {os.strerror(-rc)}", -rc)
        return rc

    def prefetch(self, layer: int, experts: list[int]) -> list[int]:
        """Admit predicted experts of `layer` ahead of its routing, as the streamer's prefetch does
        (nothing pinned, counted or learned); returns those it would read."""
        ctypes.memset(self._want, 0, self.n_expert)
        for e in experts:
            self._want[e] = 1
        n = int(self.lib.cdll.mf_cache_prefetch(self._handle, layer, self._want))
        out = (ctypes.c_int32 * max(n, 1))()
        self.lib.cdll.mf_cache_loads(self._handle, out, n)
        return list(out[:n])

    def rate_class(self, layer: int, expert: int) -> RateClass:
        """The expert's class by its recent rate in its layer, as the prefetch gate judges a guess."""
        rc = int(self.lib.cdll.mf_cache_rate_class(self._handle, layer, expert))
        if rc < 0:
            raise StreamerError(f"no expert {expert} in layer {layer}: {os.strerror(-rc)}", -rc)
        return RateClass(rc)

    def counts(self) -> tuple[int, int, int]:
        """(hits, misses, evictions) so far."""
        h, m, e = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        self.lib.cdll.mf_cache_counts(self._handle, ctypes.byref(h), ctypes.byref(m), ctypes.byref(e))
        return h.value, m.value, e.value

    def close(self) -> None:
        """Free the C cache."""
        if self._handle is not None:
            self.lib.cdll.mf_cache_free(self._handle)
            self._handle = None
