"""moeflash's expert streamer: the C library libmoeflash_stream and its thin ctypes binding.

The library is built by `make ext` into streaming_ext/lib/. MOEFLASH_STREAM_LIB names another
build to load instead (the test suite uses it for the ASan+UBSan build).
"""

from streaming_ext._lib import StreamLib, StreamLibError, library_path, load_library

__all__ = ["StreamLib", "StreamLibError", "library_path", "load_library"]
