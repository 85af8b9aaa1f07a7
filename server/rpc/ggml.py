"""ctypes bindings of the few ggml functions the RPC helper and its main server call: ggml's
device registry (libggml) and the RPC backend (libggml-rpc, patch 0012), both from the
llama-cpp-python build this process imports. llama_cpp is imported first, so the libraries are
the ones it loaded."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type


@dataclass(frozen=True)
class Ggml:
    """The two libraries, their functions typed."""

    base: ctypes.CDLL
    rpc: ctypes.CDLL

    @classmethod
    def load(cls) -> Ggml:
        import llama_cpp

        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        base = ctypes.CDLL(str(lib_dir / "libggml.so"))
        rpc = ctypes.CDLL(str(lib_dir / "libggml-rpc.so"))
        p, size, text = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        for name, restype, argtypes in (
            ("ggml_backend_dev_count", size, []),
            ("ggml_backend_dev_get", p, [size]),
            ("ggml_backend_dev_by_type", p, [ctypes.c_int]),
            ("ggml_backend_dev_description", text, [p]),
            ("ggml_backend_dev_memory", None, [p, ctypes.POINTER(size), ctypes.POINTER(size)]),
            ("ggml_backend_register", None, [p]),
            ("ggml_backend_reg_dev_count", size, [p]),
            ("ggml_backend_reg_dev_get", p, [p, size]),
        ):
            fn = getattr(base, name)
            fn.restype, fn.argtypes = restype, argtypes
        rpc.ggml_backend_rpc_add_server.restype = p
        rpc.ggml_backend_rpc_add_server.argtypes = [text]
        rpc.ggml_backend_rpc_lost.restype = ctypes.c_bool
        rpc.ggml_backend_rpc_lost.argtypes = [text]
        rpc.ggml_backend_rpc_wait_ns.restype = ctypes.c_uint64
        rpc.ggml_backend_rpc_wait_ns.argtypes = [text]
        rpc.ggml_backend_rpc_start_server_limited.restype = None
        rpc.ggml_backend_rpc_start_server_limited.argtypes = [text, text, size, size, p, size, size, text]
        return cls(base, rpc)

    def devices(self) -> list[int]:
        """Every registered device (ggml_backend_dev_t addresses)."""
        return [int(self.base.ggml_backend_dev_get(i)) for i in range(self.base.ggml_backend_dev_count())]

    def description(self, device: int) -> str:
        raw: bytes | None = self.base.ggml_backend_dev_description(device)
        return (raw or b"").decode("utf-8", "replace")

    def memory(self, device: int) -> tuple[int, int]:
        """(free, total) bytes the device reports."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.base.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def lost(self, endpoint: str) -> bool:
        """Whether ggml's connection to the helper at `endpoint` failed (patch 0014): a decode that
        ran meanwhile computed garbage."""
        return bool(self.rpc.ggml_backend_rpc_lost(endpoint.encode()))

    def wait_ns(self, endpoint: str) -> int:
        """Nanoseconds this process has waited on the helper at `endpoint` (its answers and
        synchronizations: the link and the helper's compute) since ggml connected to it."""
        return int(self.rpc.ggml_backend_rpc_wait_ns(endpoint.encode()))

    def add_rpc_server(self, endpoint: str) -> list[int]:
        """Register the helper at `endpoint` (ggml connects to it: probe it first) and return its
        devices; a helper this process registered before is not registered twice."""
        reg = self.rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            return []
        devices = [
            int(self.base.ggml_backend_reg_dev_get(reg, i))
            for i in range(self.base.ggml_backend_reg_dev_count(reg))
        ]
        if not set(devices) & set(self.devices()):
            self.base.ggml_backend_register(reg)
        return devices

    def start_rpc_server(
        self, endpoint: str, cache_dir: Path | None, threads: int, memory: int, cache_max: int, build: str
    ) -> None:
        """Serve the CPU device at `endpoint` until accepting fails (a signal): patch 0012's server,
        within `memory` bytes of buffers and `cache_max` bytes of tensor cache (None: no cache)."""
        cpu = self.base.ggml_backend_dev_by_type(DEVICE_TYPE_CPU)
        devices = (ctypes.c_void_p * 1)(cpu)
        self.rpc.ggml_backend_rpc_start_server_limited(
            endpoint.encode(),
            None if cache_dir is None else str(cache_dir).encode(),
            threads,
            1,
            devices,
            memory,
            cache_max,
            build.encode(),
        )
