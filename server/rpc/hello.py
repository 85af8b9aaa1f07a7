"""The HELLO of llama.cpp's RPC protocol, spoken before ggml connects to a helper.

ggml's RPC client aborts the process when it cannot connect or the handshake fails, so the main
server asks first, with timeouts: is the helper there, is it free (it serves one main server at
a time), and does it run this very build (the patch set: vendor/llama.cpp/build.sh writes its
identity beside the installed package; patch 0012 has the server answer it in HELLO).

The wire format (ggml-rpc.cpp): a request is | command (1 byte) | size (u64) | payload |, an
answer | size (u64) | payload |, little-endian. HELLO's payload is the client's transport
capabilities (24 bytes, zero: plain TCP); the answer is major, minor, patch, a pad byte, the
server's capabilities (24 bytes) and, with patch 0012, its build (64 bytes, NUL-padded), or major
0 and "busy".
"""

from __future__ import annotations

import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.errors import ConfigError, HelperError

RPC_CMD_HELLO = 14
CONN_CAPS_BYTES = 24
BUILD_BYTES = 64
ANSWER_BYTES = 4 + CONN_CAPS_BYTES + BUILD_BYTES
STOCK_ANSWER_BYTES = 4 + CONN_CAPS_BYTES
BUSY = "busy"
BUILD_FILE = ".moeflash-llama-patchset"


@dataclass(frozen=True)
class Hello:
    """A helper's answer: its protocol version and build."""

    version: tuple[int, int, int]
    build: str


def this_build() -> str:
    """The patch set of the llama.cpp build this process runs (written by build.sh)."""
    path = Path(sys.prefix) / BUILD_FILE
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"{path} is missing: build llama.cpp with `make llama` (vendor/llama.cpp/build.sh)"
        ) from exc


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT"; ConfigError otherwise."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"an RPC helper is HOST:PORT, got {endpoint!r}")
    return host, int(port)


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def hello(endpoint: str, timeout_s: float = 5.0) -> Hello:
    """Say HELLO to the helper at `endpoint` and close. HelperError, naming it, when it cannot be
    reached or answers as something else than a free moeflash helper."""
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(struct.pack("<BQ", RPC_CMD_HELLO, CONN_CAPS_BYTES) + bytes(CONN_CAPS_BYTES))
            head = _read(sock, 8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            answer = _read(sock, size) if size in (ANSWER_BYTES, STOCK_ANSWER_BYTES) else b""
    except TimeoutError as exc:
        raise HelperError(f"RPC helper {endpoint} did not answer within {timeout_s:g} s") from exc
    except OSError as exc:
        raise HelperError(f"RPC helper {endpoint} cannot be reached: {exc.strerror or exc}") from exc
    if size is None:
        raise HelperError(f"RPC helper {endpoint} closed the connection without answering")
    if size == STOCK_ANSWER_BYTES and len(answer) == size:
        major, minor, patch = answer[:3]
        raise HelperError(
            f"{endpoint} runs llama.cpp's RPC server {major}.{minor}.{patch} without moeflash's patches: "
            "start `moeflash worker` there"
        )
    if len(answer) != ANSWER_BYTES:
        raise HelperError(f"{endpoint} does not answer as an RPC helper ({size} bytes to HELLO)")
    build = answer[4 + CONN_CAPS_BYTES :].split(b"\0", 1)[0].decode("utf-8", "replace")
    if answer[0] == 0 and build == BUSY:
        raise HelperError(f"RPC helper {endpoint} is serving another main server (it serves one at a time)")
    return Hello(version=(answer[0], answer[1], answer[2]), build=build)


def wait_for_helper(endpoint: str, alive: Callable[[], bool], timeout_s: float = 120.0) -> Hello:
    """`hello` until the helper starting at `endpoint` answers; HelperError once `alive()` is
    false (its process ended) or after `timeout_s`, with the last reason."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return hello(endpoint, timeout_s=2)
        except HelperError as exc:
            if not alive() or time.monotonic() > deadline:
                raise HelperError(f"RPC helper {endpoint} did not come up: {exc}") from exc
            time.sleep(0.2)


def check_helper(endpoint: str, timeout_s: float = 5.0) -> Hello:
    """`hello`, and HelperError unless the helper runs this process's build."""
    answer = hello(endpoint, timeout_s)
    ours = this_build()
    if answer.build != ours:
        raise HelperError(
            f"RPC helper {endpoint} runs another build ({answer.build or 'unnamed'}; this one is {ours}): "
            "run the same moeflash on both devices"
        )
    return answer
