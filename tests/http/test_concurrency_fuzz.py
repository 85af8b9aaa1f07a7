"""Fuzzed concurrency: random mixes of routes, streamed and not, grammars, n > 1, clients that
leave at random points, on three slots and a small queue, against a streamed model whose budget
evicts. No 5xx, no hang, no slot left in use, and the token loop's journal replayed on the
resident model gives every request's tokens again, bit for bit."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.engine.generation import GenerationStats
from server.engine.token_loop import JournalEntry, TokenLoop
from server.loading.loader import load_model
from server.settings import load_settings
from tests.models import expert_layer_bytes
from tests.servers import RunningServer, running_server, wait_for

REQUESTS = 40
SETTINGS: dict[str, Any] = {
    "ctx_size": 1024,
    "n_batch": 32,
    "parallel": 3,
    "flash_attn": "on",
    "prompt_cache_ram": 0,
    "max_queue": 4,
    "retry_after_s": 1,
}
RETRIES = 60
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _request(rng: random.Random, model: str) -> tuple[str, dict[str, Any], bool]:
    """A random request: its path, body and whether it streams."""
    words = " ".join(
        rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(rng.randint(2, 60))
    )
    sampling: dict[str, Any] = (
        {"temperature": 0.0} if rng.random() < 0.5 else {"temperature": 0.8, "seed": rng.randint(0, 99)}
    )
    tokens = rng.randint(4, 40)
    stream = rng.random() < 0.6
    kind = rng.choice(["chat", "chat", "json", "n", "completions", "responses", "messages", "ollama"])
    messages = [{"role": "user", "content": words}]
    if kind in ("chat", "json", "n"):
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": tokens, "stream": stream}
        if kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
        if kind == "n":
            body["n"] = 2
        return "/v1/chat/completions", {**body, **sampling}, stream
    if kind == "completions":
        return (
            "/v1/completions",
            {"model": model, "prompt": words, "max_tokens": tokens, "stream": stream, **sampling},
            stream,
        )
    if kind == "responses":
        body = {"model": model, "input": words, "max_output_tokens": max(16, tokens), "stream": stream}
        return "/v1/responses", {**body, "temperature": sampling["temperature"]}, stream
    if kind == "messages":
        body = {"model": model, "messages": messages, "max_tokens": tokens, "stream": stream}
        return "/v1/messages", {**body, "temperature": sampling["temperature"]}, stream
    options = {"num_predict": tokens, **sampling}
    return "/api/chat", {"model": model, "messages": messages, "stream": stream, "options": options}, stream


def _send_once(
    client: httpx.Client, rng: random.Random, path: str, body: dict[str, Any], stream: bool
) -> int:
    """Send one request; the client leaves at a random point in a third of them. Returns the
    status; a refusal must say when to come back, and a 200 stream read to its end must not carry
    an error."""
    leave_after = rng.randint(1, 6) if rng.random() < 0.33 else None
    if not stream:
        timeout = httpx.Timeout(120, read=rng.uniform(0.02, 0.3)) if leave_after else None
        try:
            response = client.post(path, json=body, timeout=timeout or 120)
        except httpx.ReadTimeout:
            return 200  # the client left
        assert response.status_code in (200, 429), response.text
        assert response.status_code == 200 or "retry-after" in response.headers
        return response.status_code
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            assert response.status_code == 429, response.read()
            assert "retry-after" in response.headers
            return 429
        for i, line in enumerate(response.iter_lines()):
            if leave_after is not None and i >= leave_after:
                return 200  # the client left mid-stream
            payload = line.removeprefix("data: ")
            if payload.startswith("{"):
                event = json.loads(payload)
                assert "error" not in event and event.get("type") != "error", line
    return 200


def _send(server: RunningServer, seed: int) -> int:
    """One random request, sent again after each refusal as a client honouring Retry-After would
    (a refused client that came straight back would spend its requests on refusals, the more so
    the slower the machine). Returns how many times it was refused before it was taken."""
    rng = random.Random(seed)
    path, body, stream = _request(rng, server.model_id)
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for refusals in range(RETRIES):
            if _send_once(client, rng, path, body, stream) == 200:
                return refusals
            time.sleep(SETTINGS["retry_after_s"])
    raise AssertionError(f"refused {RETRIES} times: {path} {body}")


def _replay(path: Path, journal: list[JournalEntry]) -> dict[int, tuple[tuple[int, ...], str | None]]:
    """The journal's starts, cancellations and plans on the resident model: each request's tokens."""
    _, settings = load_settings({"model": path, "mode": "resident", **SETTINGS})
    model = load_model(settings)
    loop = TokenLoop(model.llama)
    loop.replay = {e.step: {p.index: p.n_tokens for p in e.plan} for e in journal if e.kind == "step"}
    ended: dict[int, tuple[tuple[int, ...], str | None]] = {}
    cancels = {e.index: e.step for e in journal if e.kind == "cancel"}
    starts = [e for e in journal if e.kind == "start"]
    try:
        i = 0
        while i < len(starts) or loop.running:
            while i < len(starts) and starts[i].step == loop.steps:
                at = cancels.get(starts[i].index)
                request = starts[i].request
                assert request is not None

                def cancelled(at: int | None = at) -> bool:
                    return at is not None and loop.steps >= at

                loop.start(request, GenerationStats(), lambda _: None, cancelled)
                i += 1
            for seq in loop.step():
                ended[seq.index] = (tuple(seq.sampled), seq.stats.finish_reason)
    finally:
        loop.close()
        model.close()
    return ended


@pytest.mark.parametrize("seed", [1, 2])
def test_random_mixes_of_requests_and_departures(tiny_model: Callable[..., Path], seed: int) -> None:
    path = tiny_model("tiny-qwen3moe")
    budget = expert_layer_bytes(path)
    with running_server(path, mode="streaming", budget=budget, journal=True, **SETTINGS) as server:
        # seven places (three slots, four waiting), n=2 takes two: six clients are refused at times
        with ThreadPoolExecutor(max_workers=6) as pool:
            refusals = list(pool.map(lambda i: _send(server, seed * 1000 + i), range(REQUESTS)))
        wait_for(lambda: not server.engine.busy, "every request to end")
        metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
        assert "moeflash_slots_in_use 0.0" in metrics
        print(f"{sum(refusals)} refusals for {REQUESTS} requests")
        journal = list(server.engine.journal or [])
        streamer = server.engine.totals()
        assert streamer is not None and streamer.streamer is not None and streamer.streamer.evictions > 0
    live = {e.index: (e.tokens, e.finish) for e in journal if e.kind == "end"}
    assert len(live) == sum(e.kind == "start" for e in journal)
    assert any(finish == "cancelled" for _, finish in live.values())
    assert _replay(path, journal) == live
