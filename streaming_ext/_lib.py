"""Locating and loading libmoeflash_stream through ctypes, with every signature declared."""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

LIB_ENV = "MOEFLASH_STREAM_LIB"
_LIB_NAME = "libmoeflash_stream.so"


class StreamLibError(RuntimeError):
    """The streamer's C library is missing, unloadable, or built against an unpatched llama.cpp."""


class MfConfig(ctypes.Structure):
    """struct mf_config (moeflash_stream.h)."""

    _fields_ = [
        ("model_path", ctypes.c_char_p),
        ("budget_bytes", ctypes.c_uint64),
        ("n_lanes", ctypes.c_int32),
        ("reader", ctypes.c_int32),
        ("overlap", ctypes.c_int32),
        ("policy", ctypes.c_int32),
        ("fault_errno", ctypes.c_int32),
        ("fault_after_bytes", ctypes.c_uint64),
        ("skip_expert", ctypes.c_int32),
        ("no_prefetch", ctypes.c_int32),
    ]


STAT_FIELDS = (
    "routes",
    "hits",
    "misses",
    "evictions",
    "bytes_read",
    "reads",
    "wait_ns",
    "manage_ns",
    "read_ns",
    "dense_bytes",
    "resident_bytes",
    "violations",
    "errors",
    "direct_io",
    "prefetched",
    "prefetch_used",
    "mapped_bytes",
    "hold_all",
    "routing_off",
    "memory_bytes",
    "frames_released",
)


class MfStats(ctypes.Structure):
    """struct mf_stats (moeflash_stream.h): cumulative counters."""

    _fields_ = [(name, ctypes.c_uint64) for name in STAT_FIELDS]


def library_path() -> Path:
    """The library to load: $MOEFLASH_STREAM_LIB if set, else the one `make ext` builds."""
    override = os.environ.get(LIB_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parent / "lib" / _LIB_NAME


@dataclass(frozen=True)
class StreamLib:
    """A loaded libmoeflash_stream with its function signatures declared."""

    cdll: ctypes.CDLL
    path: Path

    def version(self) -> str:
        """The library's own version string."""
        return self._str("mf_version")

    def ggml_version(self) -> str:
        """Version of the ggml the library is linked against."""
        return self._str("mf_ggml_version")

    def ggml_commit(self) -> str:
        """Commit of the ggml the library is linked against."""
        return self._str("mf_ggml_commit")

    def patched_build(self) -> bool:
        """True when linked against moeflash's patched llama.cpp build."""
        return bool(self.cdll.mf_patched_build())

    def _str(self, name: str) -> str:
        raw: bytes = getattr(self.cdll, name)()
        return raw.decode()


def _declare(cdll: ctypes.CDLL) -> None:
    vp, u64, i32, c_bool = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32, ctypes.c_bool
    sigs: dict[str, tuple[list[type], type | None]] = {
        "mf_version": ([], ctypes.c_char_p),
        "mf_ggml_version": ([], ctypes.c_char_p),
        "mf_ggml_commit": ([], ctypes.c_char_p),
        "mf_patched_build": ([], ctypes.c_int),
        "mf_streamer_new": (
            [ctypes.POINTER(MfConfig), ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_size_t],
            ctypes.c_int,
        ),
        "mf_streamer_free": ([vp], None),
        "mf_streamer_set_budget": ([vp, u64], ctypes.c_int),
        "mf_streamer_expert_buft": ([vp], vp),
        "mf_streamer_dense_buft": ([vp], vp),
        "mf_streamer_rows_buft": ([vp], vp),
        "mf_streamer_check_loaded": ([vp], ctypes.c_int),
        "mf_streamer_eval_cb": ([vp, c_bool, vp], c_bool),
        "mf_streamer_get_stats": ([vp, ctypes.POINTER(MfStats)], None),
        "mf_streamer_take_error": ([vp, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int),
        "mf_streamer_last_error": ([vp], ctypes.c_char_p),
        "mf_streamer_drop_cache": ([vp], None),
        "mf_streamer_preload": ([vp], ctypes.c_int),
        "mf_streamer_layer_bytes": ([vp], u64),
        "mf_streamer_expert_bytes": ([vp], u64),
        "mf_streamer_n_moe_layers": ([vp], i32),
        "mf_streamer_n_expert": ([vp], i32),
        "mf_streamer_tensor_bytes": ([vp, ctypes.c_char_p], u64),
        "mf_streamer_memory_note": ([vp], ctypes.c_char_p),
        "mf_cache_new": (
            [i32, i32, ctypes.POINTER(u64), u64, i32, ctypes.POINTER(vp)],
            ctypes.c_int,
        ),
        "mf_cache_free": ([vp], None),
        "mf_cache_route": ([vp, i32, ctypes.POINTER(ctypes.c_uint8)], ctypes.c_int),
        "mf_cache_counts": ([vp, ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u64)], None),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(cdll, name)
        fn.argtypes = argtypes
        fn.restype = restype


def load_library(path: Path | None = None) -> StreamLib:
    """Load the streamer library (after llama_cpp, whose libraries it links against).

    Raises StreamLibError with the reason and the fix when it cannot be loaded.
    """
    # llama_cpp must be imported first: it loads libllama/libggml, which this library links to
    import llama_cpp  # noqa: F401

    lib_path = path or library_path()
    if not lib_path.is_file():
        raise StreamLibError(f"{lib_path} does not exist: run `make ext` (or `make setup`) to build it")
    try:
        cdll = ctypes.CDLL(str(lib_path))
        _declare(cdll)
    except (OSError, AttributeError) as exc:
        raise StreamLibError(f"cannot load {lib_path}: {exc}; rebuild it with `make ext`") from exc
    lib = StreamLib(cdll=cdll, path=lib_path)
    if not lib.patched_build():
        raise StreamLibError(f"{lib_path} is linked against an unpatched llama.cpp; run `make setup`")
    logger.debug("loaded %s (version %s, ggml %s)", lib_path, lib.version(), lib.ggml_version())
    return lib
