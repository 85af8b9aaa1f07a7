"""`serve --models-dir` reads its directory again when it changed: a model pulled (or copied) into
it after start is served without a restart, one deleted is gone (a 404 model_not_found), except
the loaded one while the engine holds it. Real servers, the `ollama` library, a pull through
/api/pull from a local server that answers as the Hub does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from tests.hub_server import fake_hub
from tests.servers import RunningServer, running_server

USER = [{"role": "user", "content": "hello there"}]


def _listed(server: RunningServer) -> list[str]:
    return [card["id"] for card in httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]]


def _ask(server: RunningServer, model: str) -> httpx.Response:
    body = {"model": model, "messages": USER, "temperature": 0, "max_tokens": 4}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def _add(model: Path, directory: Path, name: str) -> None:
    """Put `model` in the directory as a pull does: written aside, then renamed into place."""
    aside = directory / f"{name}.gguf.incomplete"
    os.link(model, aside)
    aside.rename(directory / f"{name}.gguf")


@pytest.fixture
def served(tiny_model: Any, tmp_path: Path) -> Iterator[tuple[RunningServer, Path]]:
    directory = tmp_path / "models"
    directory.mkdir()
    os.link(tiny_model("tiny-qwen3moe"), directory / "alpha.gguf")
    with running_server(None, models_dir=directory, ctx_size=512) as server:
        yield server, directory


def test_a_model_added_after_start_is_listed_and_served(
    served: tuple[RunningServer, Path], tiny_model: Any
) -> None:
    server, directory = served
    assert _listed(server) == ["alpha"]
    assert _ask(server, "beta").json()["error"]["code"] == "model_not_found"
    _add(tiny_model("tiny-qwen3moe", seed=1), directory, "beta")
    assert _listed(server) == ["alpha", "beta"]
    with ollama.Client(host=server.base_url) as client:
        assert [m.model for m in client.list().models] == ["alpha:latest", "beta:latest"]
    assert _ask(server, "beta").status_code == 200 and server.model_id == "beta"
    # named by a request before any listing: the request reads the directory
    _add(tiny_model("tiny-qwen3moe", seed=2), directory, "gamma")
    with ollama.Client(host=server.base_url) as client:
        answer = client.chat(model="gamma:latest", messages=USER, options={"num_predict": 2})
    assert answer.done and server.model_id == "gamma"


def test_a_file_that_is_no_model_yet_is_left_out_until_it_is(
    served: tuple[RunningServer, Path], tiny_model: Any
) -> None:
    server, directory = served
    broken = directory / "delta.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)  # a copy that has only begun
    assert _listed(server) == ["alpha"]  # left out, and the server stays up
    assert _ask(server, "delta").json()["error"]["code"] == "model_not_found"
    with broken.open("r+b") as out:  # the copy finishes in place: the directory itself is unchanged
        out.write(tiny_model("tiny-qwen3moe", seed=1).read_bytes())
    assert _listed(server) == ["alpha", "delta"]
    assert _ask(server, "delta").status_code == 200


def test_a_deleted_model_is_gone_unless_it_is_the_one_loaded(
    served: tuple[RunningServer, Path], tiny_model: Any
) -> None:
    server, directory = served
    _add(tiny_model("tiny-qwen3moe", seed=1), directory, "beta")
    assert _ask(server, "beta").status_code == 200 and server.model_id == "beta"
    (directory / "alpha.gguf").unlink()
    assert _listed(server) == ["beta"]
    missing = _ask(server, "alpha")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    # the loaded model's file deleted: its open file serves on while the engine holds it
    (directory / "beta.gguf").unlink()
    assert _listed(server) == ["beta"]
    assert _ask(server, "beta").status_code == 200
    _add(tiny_model("tiny-qwen3moe", seed=2), directory, "gamma")
    assert _ask(server, "gamma").status_code == 200  # switched from beta: now it is gone
    assert _listed(server) == ["gamma"]
    assert _ask(server, "beta").json()["error"]["code"] == "model_not_found"


def test_a_model_pulled_through_the_api_is_served_and_can_be_deleted(
    tiny_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = "moeflash-test/Tiny-GGUF"
    directory = tmp_path / "models"
    directory.mkdir()
    os.link(tiny_model("tiny-qwen3moe"), directory / "alpha.gguf")
    pulled = tiny_model("tiny-qwen3moe", seed=1)
    with fake_hub({repo: {"Tiny-Q8_0.gguf": pulled.read_bytes()}}) as hub:
        for name in [k for k in os.environ if k.startswith("HF_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("MOEFLASH_MODELS_DIR", str(directory))  # where /api/pull puts it
        with (
            running_server(None, models_dir=directory, ctx_size=512, allow_pull=True) as server,
            ollama.Client(host=server.base_url) as client,
        ):
            assert client.pull(f"hf.co/{repo}:q8_0").status == "success"
            assert [m.model for m in client.list().models] == ["Tiny-Q8_0:latest", "alpha:latest"]
            assert client.chat(model="Tiny-Q8_0", messages=USER, options={"num_predict": 2}).done
            with pytest.raises(ollama.ResponseError, match="being served"):
                client.delete("Tiny-Q8_0")  # the model loaded
            client.chat(model="alpha", messages=USER, options={"num_predict": 2})
            assert client.delete("Tiny-Q8_0").status == "success"
            assert [m.model for m in client.list().models] == ["alpha:latest"]
            with pytest.raises(ollama.ResponseError) as gone:
                client.chat(model="Tiny-Q8_0", messages=USER)
            assert gone.value.status_code == 404
