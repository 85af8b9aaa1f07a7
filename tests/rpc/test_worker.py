"""`moeflash worker` as a main server meets it: the memory it reports and holds to, one main
server at a time, the tensor cache, the address it listens on (patch 0012); and the devices a
load names (patch 0013): a helper registered for an earlier load and gone since is not used."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from server.errors import HelperError
from server.rpc.hello import ANSWER_BYTES, CONN_CAPS_BYTES, RPC_CMD_HELLO, hello
from tests.rpc.helpers import helper, helper_memory, run_split

MIB = 2**20


def test_the_helper_reports_its_memory_limit(tmp_path: Path) -> None:
    with helper(tmp_path, memory="300M") as (endpoint, _, _):
        assert helper_memory(endpoint) == (300 * MIB, 300 * MIB)


def test_a_second_main_server_is_refused_at_once(tmp_path: Path) -> None:
    with helper(tmp_path) as (endpoint, log, _):
        host, port = endpoint.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as first:
            first.sendall(struct.pack("<BQ", RPC_CMD_HELLO, CONN_CAPS_BYTES) + bytes(CONN_CAPS_BYTES))
            answer = b""
            while len(answer) < 8 + ANSWER_BYTES and (chunk := first.recv(200)):
                answer += chunk
            assert answer[8] == 7, answer  # served: protocol 7, not "busy"
            started = time.monotonic()
            with pytest.raises(HelperError, match="serving another main server"):
                hello(endpoint, timeout_s=10)
            assert time.monotonic() - started < 5
        # the first one gone, the next is served
        deadline = time.monotonic() + 10
        while True:
            try:
                hello(endpoint)
                break
            except HelperError:
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.1)


def test_layers_past_the_memory_limit_are_refused_not_crashed(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    path = tiny_model("tiny-qwen3moe")
    with helper(tmp_path, memory="1M") as (endpoint, log, _):
        settings = {"model": str(path), "mode": "streaming", "rpc": endpoint, "rpc_layers": "2", "threads": 2}
        failed = run_split({**settings, "ctx_size": 512, "parallel": 1}, check=False)
        assert failed["returncode"] == 2, failed["log"][-3000:]  # a clear error, not an abort
        assert "may not fit their --memory" in failed["log"], failed["log"][-3000:]
        assert "Refused" in log.read_text()
        hello(endpoint)  # still up and free


def test_a_non_loopback_address_needs_insecure_lan(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "server.cli", "worker", "--host", "0.0.0.0", "--state-dir", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "no authentication" in done.stderr and "--insecure-lan" in done.stderr


def test_the_tensor_cache_stays_within_its_bound_and_serves_a_restart(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    # experts of 12 MiB a tensor: over ggml's 10 MiB threshold, so the helper caches them
    path = tiny_model("tiny-qwen3moe", n_embd=1024, n_ff_exp=768, n_expert=32)
    cache = tmp_path / "rpc-cache"
    settings = {"model": str(path), "mode": "streaming", "rpc_layers": "2", "ctx_size": 512, "parallel": 1}
    with helper(tmp_path, memory="1G", extra=("--cache-max", "40M")) as (endpoint, _, _):
        first = run_split({**settings, "rpc": endpoint})
        files = {f.name: f.stat().st_mtime_ns for f in cache.iterdir()}
        assert files and sum(f.stat().st_size for f in cache.iterdir()) <= 40 * MIB
    with helper(tmp_path, memory="1G", extra=("--cache-max", "40M")) as (endpoint, log, _):
        assert "local cache" in log.read_text()
        again = run_split({**settings, "rpc": endpoint})
        used = {f.name for f in cache.iterdir() if f.stat().st_mtime_ns != files.get(f.name)}
    assert (again["tokens"], again["digest"]) == (first["tokens"], first["digest"])
    assert used & set(files), "the restarted main server's weights did not come from the cache"


def test_a_helper_gone_since_an_earlier_load_is_not_used(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    path = tiny_model("tiny-qwen3moe")
    script = """
import json, sys
from server.loading.loader import load_model
from server.settings import load_settings
base = json.loads(sys.argv[1])
_, with_helper = load_settings({**base, "rpc": sys.argv[2], "rpc_layers": "2"})
load_model(with_helper).close()
print("loaded", flush=True)
input()  # the helper is killed meanwhile
_, alone = load_settings(base)
model = load_model(alone)
print(model.llama.tokenize(b"ok"))
model.close()
"""
    base = {"model": str(path), "mode": "streaming", "ctx_size": 512, "parallel": 1}
    with helper(tmp_path) as (endpoint, _, _):
        proc = subprocess.Popen(
            [sys.executable, "-c", script, json.dumps(base), endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        loaded = proc.stdout.readline()
    # the helper is gone now
    out, err = proc.communicate("\n", timeout=300)
    assert loaded.strip() == "loaded" and proc.returncode == 0, err[-3000:]
    assert out.strip().startswith("[")
