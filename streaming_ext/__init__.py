"""moeflash's expert streamer: the C library libmoeflash_stream and its thin ctypes binding.

The library is built by `make ext` into streaming_ext/lib/, with streaming_ext/_declared.py (its
counters, enums, options and function signatures as Python, generated from the header by
streaming_ext/declarations.py).
MOEFLASH_STREAM_LIB names another build to load instead (the test suite uses it for the ASan+UBSan build).
"""

try:
    from streaming_ext._declared import (
        Policy,
        Prefetch,
        RateClass,
        Reader,
        RouteRecord,
        StreamerConfig,
        StreamerStats,
    )
except ModuleNotFoundError as exc:  # a checkout that was never built
    raise ImportError("streaming_ext/_declared.py is missing: run `make ext` (or `make setup`)") from exc
from streaming_ext._lib import StreamLib, StreamLibError, library_path, load_library
from streaming_ext.routes import RouteTracer
from streaming_ext.streamer import CachePolicy, Streamer, StreamerError

__all__ = [
    "CachePolicy",
    "Policy",
    "Prefetch",
    "RateClass",
    "Reader",
    "RouteRecord",
    "RouteTracer",
    "StreamLib",
    "StreamLibError",
    "Streamer",
    "StreamerConfig",
    "StreamerError",
    "StreamerStats",
    "library_path",
    "load_library",
]
