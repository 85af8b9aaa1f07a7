"""The server on a streamed model: the same answers as resident, the streamer's telemetry in the
timings extension and /metrics, and a failing read that fails one request, not the server."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.models import expert_layer_bytes
from tests.servers import running_server

BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Tell me about flash storage."}],
    "max_tokens": 12,
    "temperature": 0,
    "seed": 7,
}


def chat(base_url: str, model_id: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/chat/completions", json={**BODY, "model": model_id, **extra}, timeout=120
    )


def test_streamed_server_answers_like_the_resident_one(tiny_model: Callable[..., Path]) -> None:
    path = tiny_model("tiny-qwen3moe")
    with running_server(path, ctx_size=512, mode="resident") as server:
        expected = chat(server.base_url, server.model_id).json()["choices"][0]["message"]["content"]
    budget = str(expert_layer_bytes(path))
    with running_server(path, ctx_size=512, mode="streaming", budget=budget) as server:
        assert server.model.info.mode == "streaming"
        assert server.model.info.budget_bytes == int(budget)
        reply = chat(server.base_url, server.model_id, timings=True).json()
        assert reply["choices"][0]["message"]["content"] == expected
        timings = reply["timings"]
        assert timings["bytes_read"] > 0 and timings["flash_wait_ms"] is not None
        assert 0.0 <= timings["hit_rate"] <= 1.0
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        card = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]
    misses = re.search(r"^moeflash_streamer_misses_total (\S+)$", metrics, flags=re.M)
    assert misses and float(misses.group(1)) > 0
    # the budget now, as the streamer reports it (it follows memory pressure)
    gauge = re.search(r"^moeflash_streamer_budget_bytes (\S+)$", metrics, flags=re.M)
    assert gauge and float(gauge.group(1)) == int(budget)
    assert card["budget_bytes"] == int(budget)


def test_a_read_error_fails_the_request_and_the_server_recovers(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    path = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model("tiny-qwen3moe"), path)
    original = path.read_bytes()
    # no cache: every token reads its experts from the file
    with running_server(path, ctx_size=512, mode="streaming", cache_policy="none") as server:
        assert chat(server.base_url, server.model_id).status_code == 200
        os.truncate(path, len(original) // 2)
        failed = chat(server.base_url, server.model_id)
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert "ended early" in error["message"] or "changed size" in error["message"]
        path.write_bytes(original)
        again = chat(server.base_url, server.model_id)
        assert again.status_code == 200, again.text
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
