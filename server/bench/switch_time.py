"""Switch time: what a request for model B costs while model A is loaded (serve --models-dir),
against B's cold start, both streamed under a memory cgroup cap.

    python -m server.bench.switch_time A.gguf B.gguf --cap-fraction 0.5 --rounds 3

Real `moeflash serve` processes (`--mode streaming`, the budget `auto` under the cap), each with
a fresh state directory. Cold start: a server of B alone, from its launch to the answer of a
one-token request (load, then prefill and one token), with the load (launch to /health 200) on
its own. Switch: a server of the directory of A and B with A loaded, then `rounds` requests
alternating B and A, each timed from sending it to its one-token answer (finish A's idle state,
release A, load B, prefill, one token). Prints one JSON object: the medians and the cgroup's peak
memory (RSS and page cache charged) of each server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from server.bench.cgroup import MemoryCgroup, probe

_PROMPT = [{"role": "user", "content": "Name three colours."}]
_READY_S = 1800.0


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(group: MemoryCgroup, state: Path, port: int, *args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "server.cli", "--log-level", "WARNING", "serve", *args]
    argv += ["--port", str(port), "--mode", "streaming", "--state-dir", str(state)]
    return group.popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_ready(proc: subprocess.Popen[str], url: str) -> None:
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the server did not get ready")


def _one_token(url: str, model: str) -> float:
    """Seconds from sending a one-token request for `model` to its answer."""
    body = {"model": model, "messages": _PROMPT, "max_tokens": 1, "temperature": 0}
    started = time.monotonic()
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=_READY_S)
    answer.raise_for_status()
    return time.monotonic() - started


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(a: Path, b: Path, cap_bytes: int, rounds: int) -> dict[str, Any]:
    """The figures of the module docstring for models `a` and `b`."""
    support = probe()
    if support.version is None:
        raise OSError(f"memory cgroups unavailable: {support.reason}")
    work = Path(tempfile.mkdtemp(prefix="moeflash-switch-"))
    try:
        directory = work / "models"
        directory.mkdir()
        for path in (a, b):
            os.link(path, directory / path.name)
        name_a, name_b = a.name.removesuffix(".gguf"), b.name.removesuffix(".gguf")

        with MemoryCgroup(cap_bytes, support) as group:
            port = _port()
            url = f"http://127.0.0.1:{port}"
            launched = time.monotonic()
            proc = _serve(group, work / "state-cold", port, "--model", str(directory / b.name))
            try:
                _wait_ready(proc, url)
                load_s = time.monotonic() - launched
                first_s = _one_token(url, name_b)
                cold = {
                    "load_s": load_s,
                    "first_token_s": first_s,
                    "launch_to_first_token_s": load_s + first_s,
                }
            finally:
                _stop(proc)
            cold["peak_bytes"] = group.peak_bytes()

        with MemoryCgroup(cap_bytes, support) as group:
            port = _port()
            url = f"http://127.0.0.1:{port}"
            proc = _serve(
                group,
                work / "state-switch",
                port,
                "--models-dir",
                str(directory),
                "--model",
                str(directory / a.name),
            )
            try:
                _wait_ready(proc, url)
                loaded_s = _one_token(url, name_a)
                to_b: list[float] = []
                to_a: list[float] = []
                for _ in range(rounds):
                    to_b.append(_one_token(url, name_b))
                    to_a.append(_one_token(url, name_a))
            finally:
                _stop(proc)
            switch = {
                "same_model_first_token_s": loaded_s,
                "switch_to_b_first_token_s": statistics.median(to_b),
                "switch_to_a_first_token_s": statistics.median(to_a),
                "rounds": rounds,
                "peak_bytes": group.peak_bytes(),
                "oom_kills": group.oom_kills(),
            }
        return {"a": str(a), "b": str(b), "cap_bytes": cap_bytes, "cold_b": cold, "switch": switch}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m server.bench.switch_time", description=__doc__.split("\n")[0]
    )
    parser.add_argument("a", type=Path, help="the model loaded first")
    parser.add_argument("b", type=Path, help="the model switched to")
    parser.add_argument("--cap-fraction", type=float, default=0.5, help="the cgroup cap, times B's file size")
    parser.add_argument("--rounds", type=int, default=3, help="switches to B (and back to A) measured")
    args = parser.parse_args(argv)
    cap = int(args.b.stat().st_size * args.cap_fraction)
    print(json.dumps(measure(args.a.resolve(), args.b.resolve(), cap, args.rounds), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
