"""Locating and loading libmoeflash_stream through ctypes, with every signature declared."""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from streaming_ext._declared import DIGEST, STATS
from streaming_ext.declarations import read_declarations

logger = logging.getLogger(__name__)

LIB_ENV = "MOEFLASH_STREAM_LIB"
_LIB_NAME = "libmoeflash_stream.so"


class StreamLibError(RuntimeError):
    """The streamer's C library is missing, unloadable, or built against an unpatched llama.cpp."""


class MfConfig(ctypes.Structure):
    """struct mf_config (moeflash_stream.h), field for field; the budget is set apart."""

    _fields_ = [
        ("model_path", ctypes.c_char_p),
        ("n_lanes", ctypes.c_int32),
        ("reader", ctypes.c_int32),
        ("overlap", ctypes.c_int32),
        ("policy", ctypes.c_int32),
        ("prefetch", ctypes.c_int32),
        ("fault_errno", ctypes.c_int32),
        ("fault_after_bytes", ctypes.c_uint64),
        ("skip_expert", ctypes.c_int32),
        ("skip_below", ctypes.c_float),
    ]


class MfStats(ctypes.Structure):
    """struct mf_stats (moeflash_stream.h): every declared counter, a uint64_t, in C order."""

    _fields_ = [(stat.name, ctypes.c_uint64) for stat in STATS]


class MfRouteRecord(ctypes.Structure):
    """struct mf_route_record (moeflash_stream.h): one routed expert, as a route tracer records it."""

    _fields_ = [
        ("turn", ctypes.c_int32),
        ("phase", ctypes.c_int32),
        ("step", ctypes.c_int32),
        ("layer", ctypes.c_int32),
        ("slot", ctypes.c_int32),
        ("expert", ctypes.c_int32),
        ("weight", ctypes.c_float),
    ]


# the ctypes structs shared with C, by the name the library's layout functions use (mf_<name>_*)
SHARED_STRUCTS: tuple[tuple[str, type[ctypes.Structure]], ...] = (
    ("config", MfConfig),
    ("stats", MfStats),
    ("route_record", MfRouteRecord),
)


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
        "mf_streamer_set_predictor": ([vp, vp, vp], None),
        "mf_streamer_drop_cache": ([vp], None),
        "mf_streamer_preload": ([vp], ctypes.c_int),
        "mf_streamer_hot_set": ([vp, ctypes.POINTER(i32), ctypes.POINTER(ctypes.c_uint32), i32], i32),
        "mf_streamer_restore": (
            [vp, i32, ctypes.POINTER(ctypes.c_uint8), ctypes.POINTER(ctypes.c_uint32)],
            i32,
        ),
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
        "mf_cache_route": (
            [vp, i32, ctypes.POINTER(ctypes.c_uint8), ctypes.POINTER(i32), i32, i32],
            ctypes.c_int,
        ),
        "mf_cache_prefetch": ([vp, i32, ctypes.POINTER(ctypes.c_uint8)], i32),
        "mf_cache_loads": ([vp, ctypes.POINTER(i32), i32], i32),
        "mf_cache_rate_class": ([vp, i32, i32], i32),
        "mf_cache_counts": ([vp, ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u64)], None),
        "mf_route_trace_new": ([i32, i32, i32, ctypes.POINTER(vp)], ctypes.c_int),
        "mf_route_trace_free": ([vp], None),
        "mf_route_trace_set_replay": ([vp, i32, ctypes.c_int64, ctypes.POINTER(i32)], ctypes.c_int),
        "mf_route_trace_set_recording": ([vp, i32], None),
        "mf_route_trace_chain": ([vp, vp, vp], None),
        "mf_route_trace_begin_phase": ([vp, i32], None),
        "mf_route_trace_begin_batch": ([vp, ctypes.c_int64], None),
        "mf_route_trace_eval_cb": ([vp, c_bool, vp], c_bool),
        "mf_route_trace_n_recorded": ([vp], ctypes.c_int64),
        "mf_route_trace_take_recorded": ([vp, ctypes.POINTER(MfRouteRecord), ctypes.c_int64], ctypes.c_int64),
        "mf_route_trace_take_error": ([vp, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int),
        "mf_route_trace_predict": ([vp, i32, ctypes.POINTER(ctypes.c_uint8)], i32),
        "mf_route_trace_set_predict_error": ([vp, ctypes.c_float, u64], ctypes.c_int),
    }
    for struct, _ in SHARED_STRUCTS:
        sigs[f"mf_{struct}_size"] = ([], ctypes.c_size_t)
        sigs[f"mf_{struct}_n_fields"] = ([], i32)
        sigs[f"mf_{struct}_offset"] = ([ctypes.c_char_p], ctypes.c_int64)
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(cdll, name)
        fn.argtypes = argtypes
        fn.restype = restype


def layout_mismatches(cdll: ctypes.CDLL, name: str, struct: type[ctypes.Structure]) -> list[str]:
    """How the ctypes `struct` differs from the C struct mf_<name> as the library reports it.

    An empty list means the same size, the same number of fields and every field at the same
    offset (C's structs have no padding, so this also covers the field sizes).
    """
    problems: list[str] = []
    c_size = int(getattr(cdll, f"mf_{name}_size")())
    if ctypes.sizeof(struct) != c_size:
        problems.append(f"mf_{name} is {c_size} bytes in C, {ctypes.sizeof(struct)} in ctypes")
    fields = [field[0] for field in struct._fields_]
    c_count = int(getattr(cdll, f"mf_{name}_n_fields")())
    if len(fields) != c_count:
        problems.append(f"mf_{name} has {c_count} fields in C, {len(fields)} in ctypes")
    for field in fields:
        c_offset = int(getattr(cdll, f"mf_{name}_offset")(field.encode()))
        offset = int(getattr(struct, field).offset)
        if c_offset != offset:
            where = "missing in C" if c_offset < 0 else f"at offset {c_offset} in C"
            problems.append(f"mf_{name}.{field} is {where}, at {offset} in ctypes")
    return problems


def load_library(path: Path | None = None) -> StreamLib:
    """Load the streamer library (after llama_cpp, whose libraries it links against).

    Raises StreamLibError with the reason and the fix when it cannot be loaded, or when its
    structs' layout differs from the ctypes declarations here (a stale build).
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
    problems = [p for name, struct in SHARED_STRUCTS for p in layout_mismatches(cdll, name, struct)]
    declared = read_declarations(cdll).digest()
    if declared != DIGEST:
        problems.append(f"its counters and enums (digest {declared}) differ from _declared.py's ({DIGEST})")
    if problems:
        detail = "; ".join(problems)
        raise StreamLibError(
            f"{lib_path} does not match streaming_ext/_lib.py ({detail}): rebuild it with `make ext`"
        )
    logger.debug("loaded %s (version %s, ggml %s)", lib_path, lib.version(), lib.ggml_version())
    return lib
