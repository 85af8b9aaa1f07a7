"""`serve --models-dir`: every model of a directory served, one loaded at a time, a request for
another switching to it; real servers, real clients.

The two models are one preset with different seeds (different weights, the same tokenizer and
template): a request served on the wrong one would answer another greedy text, so each answer is
compared with what a server of that model alone answers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from server.errors import ConfigError
from server.settings import load_settings
from tests.servers import RunningServer, running_server

NAMES = ("alpha", "beta")
MESSAGES = [{"role": "user", "content": "hello there"}]


def _ask(base_url: str, model: str) -> str:
    body = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": 8}
    answer = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["message"]["content"])


@pytest.fixture(scope="module")
def models_dir(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("served")
    for seed, name in enumerate(NAMES):
        os.link(tiny_model("tiny-qwen3moe", seed=seed), directory / f"{name}.gguf")  # no copy: a link
    (directory / "notes.txt").write_text("not a model")
    return directory


@pytest.fixture(scope="module")
def alone(models_dir: Path) -> dict[str, str]:
    """Each model's greedy answer from a server of that model alone."""
    answers: dict[str, str] = {}
    for name in NAMES:
        with running_server(models_dir / f"{name}.gguf", ctx_size=512) as server:
            answers[name] = _ask(server.base_url, name)
    assert answers["alpha"] != answers["beta"], "the seeds must tell the models apart"
    return answers


@pytest.fixture(scope="module")
def server(models_dir: Path) -> Iterator[RunningServer]:
    with running_server(None, models_dir=models_dir, ctx_size=512) as running:
        yield running


def test_every_model_of_the_directory_is_listed(server: RunningServer) -> None:
    cards = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == list(NAMES)
    assert all(c["architecture"] == "qwen3moe" and c["context_length"] == 512 for c in cards)
    one = httpx.get(f"{server.base_url}/v1/models/beta")
    assert one.status_code == 200 and one.json()["id"] == "beta"
    with ollama.Client(host=server.base_url) as client:
        assert [m.model for m in client.list().models] == ["alpha:latest", "beta:latest"]
        assert client.show("beta").details is not None


def test_an_unknown_model_is_a_404(server: RunningServer) -> None:
    for route, body in (
        ("/v1/chat/completions", {"model": "gamma", "messages": MESSAGES}),
        ("/v1/completions", {"model": "gamma", "prompt": "hi"}),
    ):
        answer = httpx.post(f"{server.base_url}{route}", json=body, timeout=30)
        assert answer.status_code == 404
        assert answer.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.base_url}/v1/models/gamma").status_code == 404


def test_each_request_is_served_on_the_model_it_names(server: RunningServer, alone: dict[str, str]) -> None:
    before = server_switches(server)
    for name in ("beta", "alpha", "alpha", "beta", "alpha"):
        assert _ask(server.base_url, name) == alone[name]
        assert server.model.info.id == name
    assert server_switches(server) - before >= 3
    # the other APIs take the same path
    with ollama.Client(host=server.base_url) as client:
        options = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 8}
        assert (
            client.chat(model="beta:latest", messages=MESSAGES, options=options).message.content
            == alone["beta"]
        )


def test_interleaved_requests_are_each_served_on_their_model(
    server: RunningServer, alone: dict[str, str]
) -> None:
    order = ["alpha", "beta"] * 3

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:

            async def ask(name: str) -> str:
                body = {"model": name, "messages": MESSAGES, "temperature": 0, "max_tokens": 8}
                answer = await client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                return str(answer.json()["choices"][0]["message"]["content"])

            return await asyncio.gather(*(ask(name) for name in order))

    assert asyncio.run(run()) == [alone[name] for name in order]


def server_switches(server: RunningServer) -> int:
    switch = server.switch
    assert switch is not None
    return switch.switches


def test_what_a_directory_cannot_serve_is_refused(tmp_path: Path) -> None:
    from server.lifecycle.served import served_engine

    server_settings, model_settings = load_settings({"alias": ["x"]})
    with pytest.raises(ConfigError, match="--alias names one model"):
        served_engine(server_settings, model_settings, tmp_path)
    server_settings, model_settings = load_settings({})
    with pytest.raises(ConfigError, match="does not exist"):
        served_engine(server_settings, model_settings, tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="no GGUF model"):
        served_engine(server_settings, model_settings, tmp_path)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    server_settings, model_settings = load_settings({"model": tmp_path / "m.gguf"})
    with pytest.raises(ConfigError, match="has the name of a model"):
        served_engine(server_settings, model_settings, tmp_path / "dir")
