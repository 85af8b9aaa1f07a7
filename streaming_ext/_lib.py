"""Locating and loading libmoeflash_stream through ctypes."""

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
    except OSError as exc:
        raise StreamLibError(f"cannot load {lib_path}: {exc}; rebuild it with `make ext`") from exc
    for name in ("mf_version", "mf_ggml_version", "mf_ggml_commit"):
        fn = getattr(cdll, name)
        fn.argtypes = []
        fn.restype = ctypes.c_char_p
    cdll.mf_patched_build.argtypes = []
    cdll.mf_patched_build.restype = ctypes.c_int
    lib = StreamLib(cdll=cdll, path=lib_path)
    if not lib.patched_build():
        raise StreamLibError(f"{lib_path} is linked against an unpatched llama.cpp; run `make setup`")
    logger.debug("loaded %s (version %s, ggml %s)", lib_path, lib.version(), lib.ggml_version())
    return lib
