"""Locating and loading libmoeflash_stream through ctypes.

No function signature is written here, nor a field of mf_config, mf_stats or mf_route_record: the
ctypes structs of those three and every function's argtypes and restype come from
streaming_ext/_declared.py, which `make ext` generates from the library's own report of its
header's declarations (the docstring of streaming_ext/declarations.py says how each is declared
once). load_library refuses a library whose declarations or struct layouts differ from that
module's and these structs (a stale build).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from streaming_ext._declared import CONFIG, DIGEST, FUNCTIONS, RECORD, STATS
from streaming_ext.declarations import ctype, declare_functions, read_declarations

logger = logging.getLogger(__name__)

LIB_ENV = "MOEFLASH_STREAM_LIB"
_LIB_NAME = "libmoeflash_stream.so"


class StreamLibError(RuntimeError):
    """The streamer's C library is missing, unloadable, or built against an unpatched llama.cpp."""


class MfConfig(ctypes.Structure):
    """struct mf_config (MF_CONFIG_FIELDS), field for field; the budget is set apart."""

    _fields_ = [(field.name, ctype(field.c_type, {})) for field in CONFIG]


class MfStats(ctypes.Structure):
    """struct mf_stats (moeflash_stream.h): every declared counter, a uint64_t, in C order."""

    _fields_ = [(stat.name, ctypes.c_uint64) for stat in STATS]


class MfRouteRecord(ctypes.Structure):
    """struct mf_route_record (MF_ROUTE_RECORD_FIELDS): one routed expert, as a route tracer records it."""

    _fields_ = [(field.name, ctype(field.c_type, {})) for field in RECORD]


# the ctypes structs shared with C by their C names: the types the functions' pointers point to
C_STRUCTS: tuple[tuple[str, type[ctypes.Structure]], ...] = (
    ("mf_config", MfConfig),
    ("mf_stats", MfStats),
    ("mf_route_record", MfRouteRecord),
)
# the same by the name the library's layout functions use (mf_<name>_*), whose layouts load_library checks
SHARED_STRUCTS: tuple[tuple[str, type[ctypes.Structure]], ...] = tuple(
    (c_name.removeprefix("mf_"), struct) for c_name, struct in C_STRUCTS
)


def library_path() -> Path:
    """The library to load: $MOEFLASH_STREAM_LIB if set, else the one `make ext` builds."""
    override = os.environ.get(LIB_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parent / "lib" / _LIB_NAME


@dataclass(frozen=True)
class StreamLib:
    """A loaded libmoeflash_stream with its function signatures declared (FUNCTIONS)."""

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

    def repacked_bytes(self, name: str, ggml_type: int, shape: tuple[int, ...]) -> int:
        """The bytes of a weight (its name in the file, ggml type, shape ne0, ne1[, ne2]) that
        llama.cpp and the streamer keep in the CPU backend's repacked layout on this CPU, 0 when
        none (anonymous memory beside a resident model's mapped file)."""
        ne = (*shape, 1, 1)[:3]
        value: int = self.cdll.mf_repacked_bytes(name.encode(), ggml_type, *ne)
        return value

    def _str(self, name: str) -> str:
        raw: bytes = getattr(self.cdll, name)()
        return raw.decode()


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
        declare_functions(cdll, FUNCTIONS, dict(C_STRUCTS))
    except (OSError, AttributeError) as exc:
        raise StreamLibError(f"cannot load {lib_path}: {exc}; rebuild it with `make ext`") from exc
    lib = StreamLib(cdll=cdll, path=lib_path)
    if not lib.patched_build():
        raise StreamLibError(f"{lib_path} is linked against an unpatched llama.cpp; run `make setup`")
    problems = [p for name, struct in SHARED_STRUCTS for p in layout_mismatches(cdll, name, struct)]
    declared = read_declarations(cdll).digest()
    if declared != DIGEST:
        problems.append(
            f"its declarations (counters, enums, config fields, functions; digest {declared}) differ "
            f"from _declared.py's ({DIGEST})"
        )
    if problems:
        detail = "; ".join(problems)
        raise StreamLibError(
            f"{lib_path} does not match streaming_ext/_lib.py ({detail}): rebuild it with `make ext`"
        )
    logger.debug("loaded %s (version %s, ggml %s)", lib_path, lib.version(), lib.ggml_version())
    return lib
