"""The Ollama API (/api/...) driven by the official `ollama` Python library against a real server
on a tiny model.

Random weights make the text gibberish: the tests assert on shapes, on agreement with the OpenAI
routes (one engine path: the same prompt tokens and greedy text), and, where a model's own text
must be a tool call or a think block, on what the engine's generation is scripted to emit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from server.engine.generation import TextDelta
from server.engine.token_loop import Sequence
from tests.hub_server import fake_hub
from tests.servers import RunningServer, running_server, script_generation, serve_process

USER = [{"role": "user", "content": "hello there"}]
# greedy, and without Ollama's default repeat penalty: what the OpenAI route does at temperature 0
GREEDY: dict[str, Any] = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 8}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "unit": {"enum": ["c", "f"]}},
    "required": ["ok", "unit"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_model: Any) -> Iterator[RunningServer]:
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=1024) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[ollama.Client]:
    made = ollama.Client(host=server.base_url)
    yield made
    made.close()


def _script(monkeypatch: pytest.MonkeyPatch, *texts: str) -> None:
    """The engine's generation emits `texts` (then stops) instead of sampling the model."""

    def scripted(sequence: Sequence) -> None:
        for text in texts:
            sequence.emit(TextDelta(text))
        sequence.stats.completion_tokens = len(texts)
        sequence.stats.finish_reason = "stop"

    script_generation(monkeypatch, scripted)


def test_the_model_routes_describe_the_served_model(client: ollama.Client, server: RunningServer) -> None:
    listed = client.list().models
    assert [m.model for m in listed] == [f"{server.model_id}:latest"]
    details = listed[0].details
    assert details is not None and details.family == "qwen3moe" and details.format == "gguf"
    assert listed[0].size == server.model.info.file_size
    shown = client.show(f"{server.model_id}:latest")
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "qwen3moe"
    assert shown.template == server.model.info.chat_template
    assert shown.capabilities is not None and "completion" in shown.capabilities
    running = client.ps().models
    assert [m.model for m in running] == [f"{server.model_id}:latest"]
    assert running[0].context_length == 1024
    version = httpx.get(f"{server.base_url}/api/version").json()
    assert isinstance(version["version"], str) and version["version"]


def test_chat_whole_and_streamed_agree_with_the_openai_route(
    client: ollama.Client, server: RunningServer
) -> None:
    whole = client.chat(model=f"{server.model_id}:latest", messages=USER, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.eval_count is not None and 0 < whole.eval_count <= 8
    parts = list(client.chat(model=server.model_id, messages=USER, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].prompt_eval_count == whole.prompt_eval_count
    openai = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": server.model_id, "messages": USER, "temperature": 0, "max_tokens": 8},
        timeout=60,
    ).json()
    assert openai["choices"][0]["message"]["content"] == whole.message.content
    assert openai["usage"]["prompt_tokens"] == whole.prompt_eval_count


def test_generate_is_a_one_message_chat_and_raw_is_a_completion(
    client: ollama.Client, server: RunningServer
) -> None:
    chat = client.chat(model=server.model_id, messages=[{"role": "user", "content": "hi"}], options=GREEDY)
    templated = client.generate(model=server.model_id, prompt="hi", options=GREEDY)
    assert templated.response == chat.message.content
    assert templated.prompt_eval_count == chat.prompt_eval_count
    raw = client.generate(model=server.model_id, prompt="hi", raw=True, options=GREEDY)
    legacy = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": server.model_id, "prompt": "hi", "temperature": 0, "max_tokens": 8},
        timeout=60,
    ).json()
    assert raw.response == legacy["choices"][0]["text"]
    streamed = "".join(
        p.response or ""
        for p in client.generate(model=server.model_id, prompt="hi", options=GREEDY, stream=True)
    )
    assert streamed == templated.response


def test_format_json_and_a_schema_constrain_the_answer(client: ollama.Client, server: RunningServer) -> None:
    options = {"temperature": 0, "num_predict": 64}
    answer = client.chat(model=server.model_id, messages=USER, format=SCHEMA, options=options)
    value = json.loads(answer.message.content or "")
    assert set(value) == {"ok", "unit"} and isinstance(value["ok"], bool) and value["unit"] in ("c", "f")
    generated = client.generate(
        model=server.model_id, prompt="hi", format="json", options={"num_predict": 256}
    )
    if generated.done_reason == "stop":
        assert isinstance(json.loads(generated.response or ""), dict)
    else:
        assert (generated.response or "").lstrip().startswith("{")


def test_a_tool_call_comes_back_whole_with_object_arguments(
    client: ollama.Client, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    _script(monkeypatch, call[:20], call[20:])
    whole = client.chat(model=server.model_id, messages=USER, tools=[WEATHER])
    calls = whole.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].function.name == "get_weather" and calls[0].function.arguments == {"city": "Oslo"}
    assert whole.done_reason == "stop"
    parts = list(client.chat(model=server.model_id, messages=USER, tools=[WEATHER], stream=True))
    streamed = [c for p in parts for c in p.message.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [("get_weather", {"city": "Oslo"})]
    # the call and its result go back into the conversation
    history = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"},
    ]
    _script(monkeypatch, "It is sunny.")
    after = client.chat(model=server.model_id, messages=history, tools=[WEATHER])
    assert after.message.content == "It is sunny."
    assert after.prompt_eval_count is not None and after.prompt_eval_count > (whole.prompt_eval_count or 0)


def test_thinking_is_its_own_field_unless_think_is_false(
    client: ollama.Client, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _script(monkeypatch, "<think>", "let me see", "</think>", "the answer")
    thought = client.chat(model=server.model_id, messages=USER, think=True)
    assert thought.message.thinking == "let me see"
    assert thought.message.content == "the answer"
    quiet = client.chat(model=server.model_id, messages=USER, think=False)
    assert quiet.message.thinking is None and quiet.message.content == "the answer"


def test_an_empty_request_loads_and_keep_alive_zero_unloads(
    client: ollama.Client, server: RunningServer
) -> None:
    name = server.model_id
    loaded = client.chat(model=name, messages=[])
    assert loaded.done and loaded.done_reason == "load"
    for zero in (0, "0", "0s", "0m"):
        unloaded = client.generate(model=name, keep_alive=zero)
        assert unloaded.done and unloaded.done_reason == "unload"
        assert client.ps().models == []  # an idle model is released at once
    assert client.generate(model=name, keep_alive="5m").done_reason == "load"
    assert [m.model for m in client.ps().models] == [f"{name}:latest"]
    # the last one keeps the model loaded for the tests after this one
    for keep_alive in ("10m", "1h30m", 300, "2.5s", "-1"):
        kept = client.chat(model=name, messages=USER, keep_alive=keep_alive, options={"num_predict": 2})
        assert kept.done


@pytest.mark.parametrize(
    ("route", "body", "status", "words"),
    [
        pytest.param(
            "/api/chat", {"model": "nope", "messages": USER}, 404, "does not exist", id="unknown-model"
        ),
        pytest.param(
            "/api/chat",
            {"model": "M", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            400,
            "text only",
            id="images",
        ),
        pytest.param(
            "/api/chat",
            {"model": "M", "messages": USER, "options": {"temperature": 9}},
            400,
            "temperature",
            id="bound",
        ),
        pytest.param(
            "/api/generate", {"model": "M", "prompt": "x", "suffix": "y"}, 400, "suffix", id="suffix"
        ),
        pytest.param(
            "/api/generate", {"model": "M", "prompt": "x", "context": [1, 2]}, 400, "/api/chat", id="context"
        ),
        pytest.param("/api/show", {"model": "nope"}, 404, "does not exist", id="show-unknown"),
        pytest.param(
            "/api/chat",
            {"model": "M", "messages": USER, "keep_alive": "for ever"},
            400,
            "keep_alive",
            id="duration",
        ),
        pytest.param("/api/pull", {"model": "a/b"}, 403, "--allow-pull", id="pull-closed"),
    ],
)
def test_refusals_are_ollama_errors(
    server: RunningServer, route: str, body: dict[str, Any], status: int, words: str
) -> None:
    body = json.loads(json.dumps(body).replace('"M"', json.dumps(server.model_id)))
    answer = httpx.post(f"{server.base_url}{route}", json=body, timeout=60)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert isinstance(error, str) and words in error


def test_the_client_raises_the_error_it_gets(client: ollama.Client, server: RunningServer) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="nope", messages=USER)
    assert caught.value.status_code == 404 and "nope" in caught.value.error
    with pytest.raises(ollama.ResponseError) as closed:
        client.delete(server.model_id)
    assert closed.value.status_code == 403


@pytest.mark.parametrize(
    ("content", "status"),
    [
        pytest.param(b"{not json", 400, id="malformed"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, 400, id="deep"),
        pytest.param(b'{"model": "x", "messages": []}' + b" " * (5 << 20), 413, id="huge"),
        pytest.param(b'{"model": 7, "messages": "no"}', 400, id="wrong-types"),
    ],
)
def test_bad_bodies_get_an_answer_and_the_server_stays_up(
    server: RunningServer, content: bytes, status: int
) -> None:
    for route in ("/api/chat", "/api/generate", "/api/show"):
        answer = httpx.post(
            f"{server.base_url}{route}",
            content=content,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert answer.status_code == status, answer.text
        assert isinstance(answer.json()["error"], str)
    assert httpx.get(f"{server.base_url}/api/version").status_code == 200


def test_the_api_routes_follow_the_key_rules(tiny_model: Any) -> None:
    key = "sk-ollama-test"
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=512, api_key=key) as keyed:
        refused = httpx.get(f"{keyed.base_url}/api/tags")
        assert refused.status_code == 401 and isinstance(refused.json()["error"], str)
        anonymous = ollama.Client(host=keyed.base_url)
        with pytest.raises(ollama.ResponseError) as caught:
            anonymous.list()
        anonymous.close()
        assert caught.value.status_code == 401
        client = ollama.Client(host=keyed.base_url, headers={"Authorization": f"Bearer {key}"})
        try:
            assert [m.model for m in client.list().models] == [f"{keyed.model_id}:latest"]
            answer = client.chat(model=keyed.model_id, messages=USER, options={"num_predict": 2})
            assert answer.done
        finally:
            client.close()


def test_pull_and_delete_with_allow_pull(tiny_model: Any, tmp_path: Path) -> None:
    model = tiny_model("tiny-qwen3moe")
    repo = "moeflash-test/Tiny-GGUF"
    models = tmp_path / "models"
    models.mkdir()
    served = models / "served.gguf"
    os.link(model, served)  # the directory served is the one pulled into (MOEFLASH_MODELS_DIR)
    with fake_hub({repo: {"Tiny-Q8_0.gguf": model.read_bytes(), "README.md": b"# Tiny\n"}}) as hub:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1", MOEFLASH_MODELS_DIR=str(models))
        with serve_process(served, "--allow-pull", log_level="WARNING", env=env) as (_, port):
            client = ollama.Client(host=f"http://127.0.0.1:{port}")
            try:
                progress = list(client.pull(f"hf.co/{repo}:q8_0", stream=True))
                assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
                size = model.stat().st_size
                files = [p for p in progress if p.digest is not None]
                assert files and files[-1].completed == files[-1].total == size
                assert files[-1].digest == f"sha256:{hashlib.sha256(model.read_bytes()).hexdigest()}"
                assert (models / "Tiny-Q8_0.gguf").read_bytes() == model.read_bytes()
                with pytest.raises(ollama.ResponseError) as missing:
                    client.pull(f"{repo}:Q2_K")
                assert missing.value.status_code == 400 and "no model matching" in missing.value.error
                assert client.delete("Tiny-Q8_0:latest").status == "success"
                assert not (models / "Tiny-Q8_0.gguf").exists()
                with pytest.raises(ollama.ResponseError) as gone:
                    client.delete("Tiny-Q8_0")
                assert gone.value.status_code == 404
                with pytest.raises(ollama.ResponseError) as refused:
                    client.delete("served")
                assert refused.value.status_code == 400 and "being served" in refused.value.error
                assert served.exists()
            finally:
                client.close()


def test_the_ollama_npm_library_in_node(server: RunningServer) -> None:
    js = Path(__file__).resolve().parents[1] / "js"
    assert (js / "node_modules" / "ollama").is_dir(), "make setup-dev installs tests/js (npm ci)"
    run = subprocess.run(
        ["node", str(js / "ollama-node.mjs"), server.base_url, server.model_id],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["models"] == [f"{server.model_id}:latest"]
    assert got["wholeDone"] and got["lastDone"]
    assert got["streamed"] == got["whole"]
    assert isinstance(json.loads(got["shaped"])["ok"], bool)
