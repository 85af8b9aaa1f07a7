"""keep_alive: an idle model is released (its memory given back) when its keep_alive runs out or
an empty Ollama request says 0, and the next request loads it again; real servers, the `ollama`
Python library.

What is checked: the process's RSS drops by the model's memory on an unload and the reloaded
model answers byte for byte as before; a request that comes while the model is being released
waits and is served; /health, /v1/models, /api/tags and /api/show answer throughout; /api/ps
lists the model only while it is loaded, with when it expires; a duration releases the model
once it has been idle that long, a negative one never, and --keep-alive is the default of
requests that say nothing (by default: never).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from server.engine.worker import EngineState
from server.settings import ServerSettings
from server.units import parse_duration
from tests.servers import RunningServer, running_server, serve_process, wait_for

USER = [{"role": "user", "content": "hello there"}]
GREEDY: dict[str, Any] = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 8}
# the unload test's context: its KV cache (4 layers x K and V x 2 heads x 64 x 32768 tokens x 2
# bytes = 64 MiB) is most of what the model holds, and all of it goes on an unload
BIG_CTX = 32768
KV_BYTES = 4 * 2 * 2 * 64 * BIG_CTX * 2


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _expires(client: ollama.Client) -> datetime:
    (running,) = client.ps().models
    assert running.expires_at is not None
    return running.expires_at


@pytest.fixture
def server(tiny_model: Any) -> Iterator[RunningServer]:
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=512) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[ollama.Client]:
    made = ollama.Client(host=server.base_url)
    yield made
    made.close()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        pytest.param("300", 300.0, id="seconds"),
        pytest.param(300, 300.0, id="number"),
        pytest.param("5m", 300.0, id="minutes"),
        pytest.param("1h30m", 5400.0, id="compound"),
        pytest.param("2.5s", 2.5, id="fraction"),
        pytest.param("300ms", 0.3, id="millis"),
        pytest.param("-1", -1.0, id="never"),
        pytest.param("-5m", -300.0, id="negative"),
        pytest.param("0", 0.0, id="zero"),
    ],
)
def test_durations_read_as_ollama_reads_them(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["for ever", "5 m", "m5", "1d", "nan", "inf", "", "--1"])
def test_what_is_not_a_duration_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_the_server_keeps_its_model_for_ever_unless_told() -> None:
    assert ServerSettings().keep_alive < 0
    assert ServerSettings(keep_alive="10m").keep_alive == 600.0  # type: ignore[arg-type]


@pytest.mark.slow
def test_an_unload_gives_the_memory_back_and_the_next_request_reloads(
    tiny_model: Any, tmp_path: Path
) -> None:
    model = tiny_model("tiny-qwen3moe")
    extra = (
        "--ctx-size",
        str(BIG_CTX),
        "--mode",
        "streaming",
        "--budget",
        "all",
        "--state-dir",
        str(tmp_path),
    )
    with serve_process(model, *extra, log_level="WARNING") as (proc, port):
        url = f"http://127.0.0.1:{port}"
        name = model.stem
        with ollama.Client(host=url) as client:
            before = client.chat(model=name, messages=USER, options=GREEDY).message.content
            loaded_rss = _rss(proc.pid)
            assert [m.model for m in client.ps().models] == [f"{name}:latest"]
            assert client.generate(model=name, keep_alive=0).done_reason == "unload"
            assert client.ps().models == []
            released_rss = _rss(proc.pid)
            assert released_rss < loaded_rss - KV_BYTES // 2, (loaded_rss >> 20, released_rss >> 20)
            # released, the server still answers and lists the model
            health = httpx.get(f"{url}/health", timeout=30)
            assert health.status_code == 200 and health.json() == {"status": "ok", "model": "released"}
            cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
            assert [c["id"] for c in cards] == [name] and cards[0]["context_length"] == BIG_CTX
            assert [m.model for m in client.list().models] == [f"{name}:latest"]
            assert client.show(name).modelinfo is not None
            assert client.ps().models == []  # none of these loaded it
            after = client.chat(model=name, messages=USER, options=GREEDY).message.content
            assert after == before
            assert [m.model for m in client.ps().models] == [f"{name}:latest"]
            assert _rss(proc.pid) > released_rss + KV_BYTES // 2


def test_a_request_during_an_unload_is_served(
    server: RunningServer, client: ollama.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = server.model_id
    before = client.chat(model=name, messages=USER, options=GREEDY).message.content
    engine = server.engine
    release = engine.release
    gate, releasing = threading.Event(), threading.Event()

    def held_release(timeout_s: float = 30.0) -> None:
        releasing.set()
        gate.wait(60)
        release(timeout_s)

    monkeypatch.setattr(engine, "release", held_release)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        unloading = pool.submit(client.generate, model=name, keep_alive=0)
        assert releasing.wait(60)
        asked = pool.submit(client.chat, model=name, messages=USER, options=GREEDY)
        # the request waits for the release, then for the reload; meanwhile the server answers
        for _ in range(3):
            assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
            assert httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"] == name
        assert not asked.done()
        gate.set()
        assert unloading.result(60).done_reason == "unload"
        assert asked.result(120).message.content == before
    assert engine.state is EngineState.READY and engine.loads == 2  # the first load, the reload


def test_interleaved_unloads_lose_no_request(server: RunningServer, client: ollama.Client) -> None:
    name = server.model_id
    before = client.chat(model=name, messages=USER, options=GREEDY).message.content
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        asked = []
        for _ in range(4):
            asked.append(pool.submit(client.chat, model=name, messages=USER, options=GREEDY))
            asked.append(pool.submit(client.generate, model=name, keep_alive="0s"))
        answers = [future.result(120) for future in asked]
    assert [a.message.content for a in answers[::2]] == [before] * 4
    assert all(a.done_reason == "unload" for a in answers[1::2])
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200


def test_a_duration_releases_the_idle_model_and_negative_never(
    server: RunningServer, client: ollama.Client
) -> None:
    name = server.model_id
    engine = server.engine
    client.chat(model=name, messages=USER, options={"num_predict": 2}, keep_alive=-1)
    assert _expires(client) > datetime.now(UTC) + timedelta(days=365 * 100)
    asked = datetime.now(UTC)
    client.chat(model=name, messages=USER, options={"num_predict": 2}, keep_alive="5s")
    assert asked < _expires(client) <= datetime.now(UTC) + timedelta(seconds=5)
    wait_for(lambda: engine.state is EngineState.RELEASED, "the idle model to be released")
    assert client.ps().models == []
    # an empty request loads it again, and one without keep_alive takes the server's: never
    assert client.chat(model=name, messages=[], keep_alive="10m").done_reason == "load"
    assert timedelta(minutes=9) < _expires(client) - datetime.now(UTC) <= timedelta(minutes=10)
    answer = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": name, "messages": USER, "max_tokens": 2},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert _expires(client).year > 2300


def test_the_servers_keep_alive_applies_to_every_api(tiny_model: Any) -> None:
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=512, keep_alive="300ms") as server:
        engine = server.engine
        name = server.model_id
        wait_for(lambda: engine.state is EngineState.RELEASED, "the model to be released after loading")
        for _ in range(2):
            answer = httpx.post(
                f"{server.base_url}/v1/chat/completions",
                json={"model": name, "messages": USER, "max_tokens": 2},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            wait_for(lambda: engine.state is EngineState.RELEASED, "the model to be released again")
        assert engine.loads == 3


def test_with_a_directory_an_unload_releases_the_loaded_model_only(tiny_model: Any, tmp_path: Path) -> None:
    for seed, name in enumerate(("alpha", "beta")):
        os.link(tiny_model("tiny-qwen3moe", seed=seed), tmp_path / f"{name}.gguf")
    with (
        running_server(None, models_dir=tmp_path, ctx_size=512) as server,
        ollama.Client(host=server.base_url) as client,
    ):
        alpha = client.chat(model="alpha", messages=USER, options=GREEDY).message.content
        assert client.generate(model="beta", keep_alive=0).done_reason == "unload"  # not loaded: nothing
        assert [m.model for m in client.ps().models] == ["alpha:latest"]
        assert client.generate(model="alpha:latest", keep_alive=0).done_reason == "unload"
        assert client.ps().models == []
        assert [c["id"] for c in httpx.get(f"{server.base_url}/v1/models").json()["data"]] == [
            "alpha",
            "beta",
        ]
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        # from released, a request for the other model loads it; one for the first comes back the same
        client.chat(model="beta", messages=USER, options={"num_predict": 2})
        assert [m.model for m in client.ps().models] == ["beta:latest"]
        assert client.chat(model="alpha", messages=USER, options=GREEDY).message.content == alpha
