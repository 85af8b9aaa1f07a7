"""moeflash's expert streamer: the C library libmoeflash_stream and its thin ctypes binding.

The library is built by `make ext` into streaming_ext/lib/. MOEFLASH_STREAM_LIB names another
build to load instead (the test suite uses it for the ASan+UBSan build).
"""

from streaming_ext._lib import StreamLib, StreamLibError, library_path, load_library
from streaming_ext.routes import RouteRecord, RouteTracer
from streaming_ext.streamer import (
    CachePolicy,
    Policy,
    Prefetch,
    Reader,
    Streamer,
    StreamerConfig,
    StreamerError,
    StreamerStats,
)

__all__ = [
    "CachePolicy",
    "Policy",
    "Prefetch",
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
