"""Pooling devices through llama.cpp's RPC backend (docs/devices.md).

A helper device runs `moeflash worker` (worker.py): llama.cpp's RPC server from the pinned,
patched build, within the memory it is given. The main server probes each helper (hello.py: is
it there, free, and the same build) before registering it with ggml as a device (devices.py);
llama.cpp then places the last layers on the helpers, whole, and the main server streams the
experts of the layers it keeps.
"""
