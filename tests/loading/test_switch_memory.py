"""`serve --models-dir` switching between two streamed models 20 times under a cgroup cap: the
server's RSS does not grow from switch to switch (each switch releases the model it leaves), no
process of the group is OOM-killed, and every answer is its model's.

Skips with the reason when this machine cannot create a memory cgroup (server/bench/cgroup.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.bench.cgroup import MemoryCgroup, probe
from tests.commands import REPO
from tests.servers import free_port, wait_for

SWITCHES = 20
CAP_BYTES = 1536 << 20  # the server (Python, FastAPI, llama.cpp) and two tiny streamed models
# what RSS may vary by between switches without growing: allocator noise, not a model's weights
SLACK_BYTES = 48 << 20
MESSAGES = [{"role": "user", "content": "hello there"}]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.slow
def test_switching_never_leaks_memory(tiny_model: Any, tmp_path: Path) -> None:
    support = probe()
    if support.version is None:
        pytest.skip(f"memory cgroups unavailable: {support.reason}")
    names = ("alpha", "beta")
    for seed, name in enumerate(names):
        os.link(tiny_model("tiny-qwen3moe", seed=seed), tmp_path / f"{name}.gguf")
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "server.cli",
        "--log-level",
        "WARNING",
        "serve",
        "--models-dir",
        str(tmp_path),
    ]
    argv += ["--port", str(port), "--mode", "streaming", "--budget", "all", "--ctx-size", "512"]
    argv += ["--state-dir", str(tmp_path / "state"), "--prompt-cache-ram", "0"]
    with MemoryCgroup(CAP_BYTES, support) as group:
        proc = group.popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                assert proc.poll() is None, "the server exited"
                try:
                    return httpx.get(f"{url}/health", timeout=5).status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(ready, "the server to be ready")
            answers: dict[str, set[str]] = {name: set() for name in names}
            rss: list[int] = []
            for i in range(SWITCHES + 1):
                name = names[i % 2]
                body = {"model": name, "messages": MESSAGES, "temperature": 0, "max_tokens": 4}
                answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
                assert answer.status_code == 200, answer.text
                answers[name].add(answer.json()["choices"][0]["message"]["content"])
                rss.append(_rss(proc.pid))
            assert all(len(seen) == 1 for seen in answers.values()), answers  # each model answers alike
            assert answers["alpha"] != answers["beta"]
            # after both models have been loaded once, a switch releases what it leaves
            settled = max(rss[1:3])
            assert max(rss[3:]) <= settled + SLACK_BYTES, [r >> 20 for r in rss]
            assert group.oom_kills() == 0
        finally:
            proc.kill()
            proc.wait(timeout=60)
