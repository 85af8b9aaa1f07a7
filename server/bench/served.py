"""A `moeflash serve` process under a benchmark's memory cgroup, the streamed chat request the
server benchmarks time, and their reports' files (server/bench/warm_start.py,
server/bench/prompt_cache.py)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from server.bench.cgroup import MemoryCgroup
from server.errors import MoeflashError

_READY_S = 600.0
POLL_S = 0.05


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class BenchServer:
    """A `moeflash serve` process in the cgroup, its log in a file."""

    def __init__(self, cgroup: MemoryCgroup, argv: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("a")
        self.started = time.monotonic()
        self.proc = cgroup.popen(
            [*argv, "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self) -> float:
        deadline = self.started + _READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MoeflashError(f"the server exited ({self.proc.returncode}); see {self._log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        raise MoeflashError(f"the server was not ready within {_READY_S:.0f} s; see {self._log.name}")

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise MoeflashError(f"{name} is not in /metrics")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        if self.proc.returncode not in (0, -signal.SIGTERM):
            raise MoeflashError(f"the server exited with {self.proc.returncode}; see {self._log.name}")


def stream_chat(
    url: str,
    messages: list[dict[str, str]],
    tokens: int,
    bias: dict[str, float],
    first: threading.Event | None = None,
) -> dict[str, Any]:
    """A streamed, greedy chat completion: when it was sent (time.monotonic), TTFT and time to the
    last token (s), each content chunk's arrival (s after sending), the text, its content chunks
    (n), the final timings and the usage. `first` is set when the first content arrives."""
    body = {
        "model": "bench",
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "timings": True,
        "logit_bias": bias,
    }
    sent = time.monotonic()
    arrivals: list[float] = []
    text, timings, usage, n = "", None, None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as response:
        if response.status_code != 200:
            raise MoeflashError(f"chat request failed: {response.status_code} {response.read()!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    arrivals.append(time.monotonic() - sent)
                    if first is not None:
                        first.set()
                    text += piece
                    n += 1
            timings = chunk.get("timings") or timings
            usage = chunk.get("usage") or usage
    done = time.monotonic()
    if not arrivals or usage is None:
        raise MoeflashError("the answer had no content or no usage")
    return {
        "sent": sent,
        "ttft_s": arrivals[0],
        "total_s": done - sent,
        "chunk_s": arrivals,
        "text": text,
        "n": n,
        "timings": timings or {},
        "usage": usage,
    }


def eog_bias(model: Path) -> dict[str, float]:
    """logit_bias keeping the model's end-of-generation tokens out (every answer runs `tokens`)."""
    from server.loading.gguf_header import read_metadata

    meta = read_metadata(model)
    ids = {meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")}
    return {str(int(i)): -100.0 for i in ids if i is not None}


def write_report(
    data: dict[str, Any],
    rows: list[dict[str, Any]],
    out: Path,
    command: str,
    markdown: Callable[[dict[str, Any], list[dict[str, Any]], str], str],
) -> list[Path]:
    """<out>.json (the data, its command and its summary rows) and <out>.md; returns their paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".json"), out.with_suffix(".md")]
    paths[0].write_text(json.dumps({"command": command, **data, "summary": rows}, indent=1) + "\n")
    paths[1].write_text(markdown(data, rows, command))
    return paths
