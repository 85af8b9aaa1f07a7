"""Every tiny preset's chat template, architecture and reasoning style through the real server,
plus SSE keep-alives and /metrics."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.loading.loader import load_model
from server.settings import load_settings
from tests.servers import RunningServer, running_server, wait_for

PRESETS = ["tiny-qwen3moe", "tiny-gptoss", "tiny-mixtral", "tiny-qwen2moe", "tiny-hyv3", "tiny-gemma4"]


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_chats_whole_and_streamed(tiny_model: Any, preset: str) -> None:
    path = Path(tiny_model(preset))
    with running_server(path, ctx_size=2048) as server:
        with openai.OpenAI(
            base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60
        ) as client:
            messages: list[Any] = [
                {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "again"}],
                },
            ]
            kwargs: dict[str, Any] = {
                "model": server.model_id,
                "messages": messages,
                "max_tokens": 16,
                "temperature": 0,
            }
            whole = client.chat.completions.create(**kwargs)
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
        message = whole.choices[0].message
        streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        streamed_reasoning = "".join(
            (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
        )
        assert streamed_content == (message.content or "")
        assert streamed_reasoning == ((message.model_extra or {}).get("reasoning_content") or "")
        assert whole.usage is not None and whole.usage.prompt_tokens > 0
        assert server.model.info.architecture != "unknown"


def test_harmony_output_is_parsed_with_control_tokens_visible(tiny_model: Any) -> None:
    # gpt-oss output carries its channel markup as control tokens: they must reach the parser
    with running_server(Path(tiny_model("tiny-gptoss")), ctx_size=1024) as server:
        from server.engine.chat_template import ChatTemplate

        template = ChatTemplate(server.model.llama, server.model.info.chat_template)
        assert template.style == "harmony"
        channel = server.model.llama.tokenize(b"<|channel|>", add_bos=False, special=True)
        assert len(channel) == 1
        body = {
            "model": server.model_id,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "temperature": 0,
            # every token is <|channel|>: all of it is header markup, none of it content
            "logit_bias": {str(channel[0]): 100},
        }
        result = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).json()
        assert result["usage"]["completion_tokens"] == 6
        assert result["choices"][0]["message"]["content"] == ""
        assert "<|channel|>" not in json.dumps(result)
        # reasoning_effort reaches the harmony template's system message
        usage = {
            effort: httpx.post(
                server.base_url + "/v1/chat/completions",
                json={**body, "max_tokens": 1, "reasoning_effort": effort},
                timeout=60,
            ).json()["usage"]["prompt_tokens"]
            for effort in ("low", "medium")
        }
        assert usage["low"] != usage["medium"]


@pytest.fixture(scope="module")
def slow_queue_server(tiny_model: Any) -> Iterator[RunningServer]:
    with running_server(
        # one slot: a second request waits in the queue, where only keep-alives flow
        Path(tiny_model("tiny-qwen3moe")),
        ctx_size=16384,
        parallel=1,
        keepalive_s=0.05,
        max_completion_tokens=12000,
    ) as server:
        yield server


def test_sse_keepalives_are_comment_lines(slow_queue_server: RunningServer) -> None:
    server = slow_queue_server
    no_eog = {str(t): -100 for t in server.eog_tokens()}
    long = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 12000,
        "temperature": 0,
        "logit_bias": no_eog,
        "stream": True,
    }
    short = {**long, "max_tokens": 3}
    with (
        httpx.Client(base_url=server.base_url, timeout=120) as a,
        httpx.Client(base_url=server.base_url, timeout=120) as b,
    ):
        with a.stream("POST", "/v1/chat/completions", json=long) as first:
            assert first.status_code == 200
            wait_for(lambda: server.engine.running_jobs, "the long job to run")
            # the second stream waits in the queue: only keep-alives flow until its turn
            with b.stream("POST", "/v1/chat/completions", json=short) as second:
                raw = ""
                for text in second.iter_text():
                    raw += text
                    if raw.count(": ping") >= 2 and not first.is_closed:
                        first.close()  # the long job is cancelled: the second one runs now
    events = [e for e in raw.split("\n\n") if e]
    assert all(e == ": ping" or e.startswith("data: ") for e in events), events[:5]
    data = [e[6:] for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert all(isinstance(json.loads(d), dict) for d in data[:-1])
    assert sum(e == ": ping" for e in events) >= 2


def test_metrics_count_requests_and_tokens(tiny_model: Any) -> None:
    with running_server(Path(tiny_model("tiny-qwen3moe")), ctx_size=512) as server:
        body = {"model": server.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for _ in range(2):
            assert (
                httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
            )
        assert (
            httpx.post(
                server.base_url + "/v1/chat/completions", json={**body, "n": 99}, timeout=60
            ).status_code
            == 400
        )
        text = httpx.get(server.base_url + "/metrics", timeout=30).text

    def value(name: str) -> float:
        match = re.search(rf"^{name} (\S+)$", text, flags=re.M)
        assert match, name
        return float(match.group(1))

    assert value('moeflash_requests_total{route="/v1/chat/completions",status="200"}') == 2
    assert value('moeflash_requests_total{route="/v1/chat/completions",status="400"}') == 1
    assert 2 <= value("moeflash_completion_tokens_total") <= 6
    assert value("moeflash_prompt_tokens_total") > 0
    assert value("moeflash_queue_depth") == 0
    assert value("moeflash_streamer_hits_total") == 0  # resident: nothing streamed
    assert value("process_resident_memory_bytes") > 0
    assert value("moeflash_tokens_per_second") > 0


def test_a_model_that_cannot_load_is_a_clear_error(tmp_path: Path) -> None:
    from server.errors import ModelLoadError

    missing = tmp_path / "none.gguf"
    _, settings = load_settings({"model": missing})
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(settings)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"nope" * 10)
    _, settings = load_settings({"model": not_gguf})
    with pytest.raises(ModelLoadError, match="bad magic"):
        load_model(settings)
