"""Every error status of docs/api.md, reached by a real request, with the OpenAI error body."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from server.engine.token_loop import TokenLoop
from server.loading.loader import LoadedModel, load_model
from server.settings import load_settings
from tests.servers import RunningServer, running_server, wait_for

KEY = "test-key-123"
USER: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_path(tiny_model: Any) -> Path:
    return Path(tiny_model("tiny-qwen3moe"))


@pytest.fixture(scope="module")
def server(model_path: Path) -> Iterator[RunningServer]:
    with running_server(
        model_path,
        ctx_size=512,
        api_key=KEY,
        max_body_bytes=4096,
        max_completion_tokens=100,
        max_prompt_tokens=200,
        max_json_schema_bytes=600,
    ) as s:
        yield s


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as client:
        yield client


def _chat(server: RunningServer, **fields: Any) -> dict[str, Any]:
    return {
        "model": server.model_id,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **fields,
    }


def assert_error(
    response: httpx.Response, status: int, code: str | None = None, param: str | None = None
) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    if param is not None:
        assert body["error"]["param"] == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        pytest.param({"n": 99}, "n", id="n-above-the-slots"),
        pytest.param({"temperature": 2.5}, "temperature", id="temperature-high"),
        pytest.param({"top_p": -0.1}, "top_p", id="top-p-negative"),
        pytest.param({"top_logprobs": 21, "logprobs": True}, "top_logprobs", id="top-logprobs-high"),
        pytest.param({"presence_penalty": 3}, "presence_penalty", id="penalty-high"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="max-tokens-zero"),
        pytest.param({"stop": ["a", "b", "c", "d", "e"]}, None, id="five-stops"),
        pytest.param({"logit_bias": {"abc": 1}}, "logit_bias", id="logit-bias-key"),
        pytest.param({"logit_bias": {"1": 101}}, None, id="logit-bias-value"),
        pytest.param({"messages": []}, "messages", id="no-messages"),
        pytest.param({"messages": [{"role": "wizard", "content": "x"}]}, None, id="bad-role"),
        pytest.param(
            {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, None, id="bad-part"
        ),
        pytest.param(
            {
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "tool_choice",
            id="unknown-tool",
        ),
        pytest.param(
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": 3}}},
                }
            },
            "response_format",
            id="bad-schema",
        ),
    ],
)
def test_bad_input_is_400(
    http: httpx.Client, server: RunningServer, fields: dict[str, Any], param: str | None
) -> None:
    response = http.post("/v1/chat/completions", json=_chat(server, **fields))
    assert_error(response, 400, param=param)


@pytest.mark.parametrize(
    "part",
    [
        pytest.param({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, id="image"),
        pytest.param({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, id="audio"),
    ],
)
def test_media_parts_are_refused_in_plain_words(
    http: httpx.Client, server: RunningServer, part: dict[str, Any]
) -> None:
    content = [{"type": "text", "text": "what is this?"}, part]
    response = http.post(
        "/v1/chat/completions", json=_chat(server, messages=[{"role": "user", "content": content}])
    )
    assert_error(response, 400, code="unsupported_content", param="messages.0.content.1")
    message = response.json()["error"]["message"]
    assert "text only" in message and part["type"] in message
    assert "validation" not in message and "Input should be" not in message


def test_max_tokens_over_the_cap_is_clamped(http: httpx.Client, server: RunningServer) -> None:
    """Clients with large defaults work: the server generates up to its cap (100 here) and says
    finish_reason "length" when it stops there."""
    word = server.model.llama.tokenize(b" word", add_bos=False)[0]
    forced = {"logit_bias": {str(word): 100}, "temperature": 0}  # never an end-of-generation token
    for fields in ({"max_tokens": 100_000}, {"max_completion_tokens": 4096, "max_tokens": None}):
        response = http.post("/v1/chat/completions", json=_chat(server, **fields, **forced))
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 100


def test_bad_input_is_400_for_streams_too(http: httpx.Client, server: RunningServer) -> None:
    response = http.post("/v1/chat/completions", json=_chat(server, stream=True, temperature=9))
    assert_error(response, 400, param="temperature")


def test_malformed_json_is_400(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions", content=b'{"model": ', headers={"Content-Type": "application/json"}
    )
    assert_error(response, 400, code="invalid_json")


def test_wrong_content_type_is_400(http: httpx.Client, server: RunningServer) -> None:
    body = json.dumps(_chat(server)).encode()
    response = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "text/plain"})
    assert_error(response, 400, code="unsupported_content_type")


def test_oversized_body_is_413(http: httpx.Client, server: RunningServer) -> None:
    big = _chat(server, messages=[{"role": "user", "content": "x" * 5000}])
    assert_error(http.post("/v1/chat/completions", json=big), 413)


def test_oversized_chunked_body_is_413(http: httpx.Client, server: RunningServer) -> None:
    data = json.dumps(_chat(server, messages=[{"role": "user", "content": "x" * 5000}])).encode()
    # no Content-Length: the cap is enforced while the body is read
    response = http.post(
        "/v1/chat/completions",
        content=iter([data[:2000], data[2000:]]),
        headers={"Content-Type": "application/json"},
    )
    assert_error(response, 413)


def test_unknown_model_is_404(http: httpx.Client, server: RunningServer) -> None:
    assert_error(
        http.post("/v1/chat/completions", json=_chat(server, model="gpt-9")), 404, code="model_not_found"
    )
    assert_error(http.get("/v1/models/gpt-9"), 404, code="model_not_found")


def test_unknown_route_is_404_and_wrong_method_is_405(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404)
    response = http.get("/v1/chat/completions")
    assert_error(response, 405)
    assert "POST" in response.headers["allow"]


def test_prompt_longer_than_the_context_is_400(http: httpx.Client, server: RunningServer) -> None:
    long = _chat(server, messages=[{"role": "user", "content": "word " * 700}])
    response = http.post("/v1/chat/completions", json=long)
    assert_error(response, 400, code="context_length_exceeded")
    # OpenAI's words, which litellm and LangChain recognise as a context-window error
    message = response.json()["error"]["message"]
    assert message.startswith("This model's maximum context length is 200 tokens (the server's prompt cap). ")
    assert "However, your messages resulted in" in message
    legacy = {"model": server.model_id, "prompt": "word " * 700}
    assert_error(http.post("/v1/completions", json=legacy), 400, code="context_length_exceeded")


def test_prompt_over_the_servers_cap_is_400(http: httpx.Client, server: RunningServer) -> None:
    # within the 512-token context, over the 200-token cap
    body = _chat(server, messages=[{"role": "user", "content": "word " * 90}])
    response = http.post("/v1/chat/completions", json=body)
    assert_error(response, 400, code="context_length_exceeded")
    assert "cap" in response.json()["error"]["message"]


def test_json_schema_over_the_size_cap_is_400(http: httpx.Client, server: RunningServer) -> None:
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(40)}}
    body = _chat(
        server, response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    )
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="response_format")
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = _chat(server, tools=[tool], tool_choice="required")
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="tools")


def test_the_chat_page_is_served_without_the_key(server: RunningServer) -> None:
    """The page is static; it asks for the key (or takes it from a pairing link) for its calls."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        page = client.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "Authorization" in page.text  # the page sends the key it holds
        # clients probe the server with HEAD / (Claude Code does): the page's headers, no body
        probe = client.head("/")
        assert probe.status_code == 200 and probe.content == b""
        assert probe.headers["content-type"] == page.headers["content-type"]
        assert_error(client.get("/v1/models"), 401, code="invalid_api_key")


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="missing"),
        pytest.param({"Authorization": "Bearer wrong"}, id="wrong"),
        pytest.param({"Authorization": f"Basic {KEY}"}, id="wrong-scheme"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/models", "/docs", "/openapi.json", "/metrics"])
def test_api_key_required_everywhere_but_health(
    server: RunningServer, headers: dict[str, str], path: str
) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        response = client.get(path, headers=headers)
        assert_error(response, 401, code="invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
        assert client.get("/health").status_code == 200


def test_the_right_key_opens_every_route(http: httpx.Client) -> None:
    for path in ("/v1/models", "/docs", "/openapi.json", "/metrics", "/"):
        assert http.get(path).status_code == 200, path


def test_disallowed_host_header_is_refused(http: httpx.Client) -> None:
    assert_error(http.get("/v1/models", headers={"Host": "evil.example:8000"}), 400, code="invalid_host")
    assert http.get("/v1/models", headers={"Host": "localhost"}).status_code == 200


def test_disallowed_origin_is_refused(http: httpx.Client, server: RunningServer) -> None:
    response = http.post(
        "/v1/chat/completions", json=_chat(server), headers={"Origin": "https://evil.example"}
    )
    assert_error(response, 403, code="forbidden_origin")
    assert "access-control-allow-origin" not in response.headers


def test_cors_allow_list(model_path: Path) -> None:
    allowed = "http://app.example"
    with running_server(model_path, ctx_size=256, cors_origins=[allowed]) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            preflight = client.options(
                "/v1/chat/completions",
                headers={
                    "Origin": allowed,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "content-type,authorization",
                },
            )
            assert preflight.status_code == 200
            assert preflight.headers["access-control-allow-origin"] == allowed
            # what the openai npm SDK sends from a browser (dangerouslyAllowBrowser)
            sdk_headers = (
                "authorization,content-type,x-stainless-os,x-stainless-lang,x-stainless-package-version,"
                "x-stainless-runtime,x-stainless-runtime-version,x-stainless-arch,x-stainless-retry-count,"
                "x-stainless-timeout,openai-organization,openai-project"
            )
            sdk = client.options(
                "/v1/chat/completions",
                headers={
                    "Origin": allowed,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": sdk_headers,
                },
            )
            assert sdk.status_code == 200, sdk.text
            allowed_headers = sdk.headers["access-control-allow-headers"].lower()
            assert all(h in allowed_headers for h in sdk_headers.split(","))
            ok = client.get("/v1/models", headers={"Origin": allowed})
            assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == allowed
            assert_error(client.get("/v1/models", headers={"Origin": "http://other.example"}), 403)


def test_health_and_requests_are_503_while_loading(model_path: Path) -> None:
    gate = threading.Event()
    _, model_settings = load_settings({"model": model_path, "ctx_size": 256})

    def slow_loader() -> LoadedModel:
        gate.wait(60)  # a long load: the server must already answer meanwhile
        return load_model(model_settings)

    with running_server(model_path, loader=slow_loader, wait_ready=False, ctx_size=256) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "loading"
            chat = client.post(
                "/v1/chat/completions", json={"model": "x", "messages": [{"role": "user", "content": "hi"}]}
            )
            assert_error(chat, 503, code="model_loading")
            assert int(chat.headers["retry-after"]) >= 0
            message = client.post("/v1/messages", json={"model": "x", "max_tokens": 2, "messages": USER})
            assert_anthropic_error(message, 503, "overloaded_error", code="model_loading")
            assert int(message.headers["retry-after"]) >= 0
            gate.set()
            wait_for(lambda: client.get("/health").status_code == 200, "the model to finish loading")


def test_failed_load_is_503(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with running_server(broken, wait_ready=False) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            wait_for(lambda: server.engine.load_error is not None, "the load to fail")
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
            assert_error(client.get("/v1/models"), 503, code="model_failed")


# ---------------------------------------------------------------------- Anthropic's routes

ANTHROPIC_PATHS = ["/v1/messages", "/v1/messages/count_tokens"]


def assert_anthropic_error(
    response: httpx.Response, status: int, type_: str, code: str | None = None
) -> dict[str, Any]:
    """Anthropic's envelope, {"type": "error", "error": {"type", "message", ...}}, with its type."""
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == type_
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    return body


def _message(server: RunningServer, **fields: Any) -> dict[str, Any]:
    return {"model": server.model_id, "max_tokens": 2, "messages": USER, **fields}


@pytest.mark.parametrize("path", ANTHROPIC_PATHS)
def test_anthropic_routes_take_the_key_as_bearer_or_x_api_key(server: RunningServer, path: str) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            refused = client.post(path, json=_message(server), headers=headers)
            assert_anthropic_error(refused, 401, "authentication_error", code="invalid_api_key")
            assert "x-api-key" in refused.json()["error"]["message"]
        for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
            assert client.post(path, json=_message(server), headers=headers).status_code == 200


def test_anthropic_errors_with_the_sdk(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0, timeout=60) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.count_tokens(model=server.model_id, messages=USER)
    with anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60) as client:
        assert client.messages.count_tokens(model=server.model_id, messages=USER).input_tokens > 0
        with pytest.raises(anthropic.NotFoundError) as not_found:
            client.messages.create(model="claude-haiku-4-5", max_tokens=2, messages=USER)
        assert isinstance(not_found.value.body, dict)
        assert not_found.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError) as bad_request:
            client.messages.create(model=server.model_id, max_tokens=2, messages=[])
        assert isinstance(bad_request.value.body, dict)
        assert bad_request.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ANTHROPIC_PATHS)
def test_anthropic_unknown_model_is_not_found_error(
    http: httpx.Client, server: RunningServer, path: str
) -> None:
    response = http.post(path, json=_message(server, model="claude-haiku-4-5"))
    assert_anthropic_error(response, 404, "not_found_error", code="model_not_found")


def test_anthropic_unknown_route_and_wrong_method(http: httpx.Client) -> None:
    assert_anthropic_error(http.post("/v1/messages/batches", json={}), 404, "not_found_error")
    for path in ANTHROPIC_PATHS:
        response = http.get(path)
        # Anthropic has no type of its own for a 405: its other 4xx are invalid_request_error
        assert_anthropic_error(response, 405, "invalid_request_error", code="method_not_allowed")
        assert "POST" in response.headers["allow"]
    assert_error(http.get("/v1/nothing"), 404)  # other routes keep the OpenAI envelope


@pytest.mark.parametrize("path", ANTHROPIC_PATHS)
def test_anthropic_body_too_large_is_request_too_large(
    http: httpx.Client, server: RunningServer, path: str
) -> None:
    big = _message(server, messages=[{"role": "user", "content": "x" * 5000}])
    assert_anthropic_error(http.post(path, json=big), 413, "request_too_large", code="body_too_large")
    data = json.dumps(big).encode()
    chunked = http.post(
        path, content=iter([data[:2000], data[2000:]]), headers={"Content-Type": "application/json"}
    )
    assert_anthropic_error(chunked, 413, "request_too_large", code="body_too_large")


@pytest.mark.parametrize("path", ANTHROPIC_PATHS)
@pytest.mark.parametrize(
    ("content", "content_type", "code"),
    [
        pytest.param(b'{"model": ', "application/json", "invalid_json", id="malformed-json"),
        pytest.param(b"{}", "text/plain", "unsupported_content_type", id="content-type"),
        pytest.param(b'{"max_tokens": 2}', "application/json", "invalid_value", id="missing-fields"),
        pytest.param(b'{"model": 1, "messages": 2}', "application/json", "invalid_value", id="wrong-types"),
    ],
)
def test_anthropic_validation_errors_are_invalid_request_error(
    http: httpx.Client, path: str, content: bytes, content_type: str, code: str
) -> None:
    response = http.post(path, content=content, headers={"Content-Type": content_type})
    assert_anthropic_error(response, 400, "invalid_request_error", code=code)


def test_anthropic_prompt_over_the_cap_is_prompt_is_too_long(
    http: httpx.Client, server: RunningServer
) -> None:
    # within the 512-token context, over the 200-token cap: the cap is the maximum
    messages = [{"role": "user", "content": "word " * 90}]
    counted = http.post("/v1/messages/count_tokens", json={"model": server.model_id, "messages": messages})
    assert counted.status_code == 200, counted.text
    n_prompt = counted.json()["input_tokens"]
    assert n_prompt > 200
    for stream in (False, True):
        response = http.post("/v1/messages", json=_message(server, messages=messages, stream=stream))
        body = assert_anthropic_error(response, 400, "invalid_request_error", code="context_length_exceeded")
        assert body["error"]["message"] == f"prompt is too long: {n_prompt} tokens > 200 maximum"
    # the OpenAI routes keep OpenAI's words
    chat = http.post("/v1/chat/completions", json=_chat(server, messages=messages))
    assert_error(chat, 400, code="context_length_exceeded")
    assert chat.json()["error"]["message"].startswith("This model's maximum context length is 200 tokens")


@pytest.mark.parametrize(
    ("status", "type_"),
    [pytest.param(429, "rate_limit_error", id="429"), pytest.param(503, "overloaded_error", id="503")],
)
def test_anthropic_queue_full(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, status: int, type_: str
) -> None:
    gate = threading.Event()
    real_step = TokenLoop.step

    def held(loop: TokenLoop) -> Any:
        gate.wait(60)  # the running job holds the model until the test has its refusal
        return real_step(loop)

    monkeypatch.setattr(TokenLoop, "step", held)
    with running_server(
        model_path, ctx_size=256, parallel=1, max_queue=0, queue_full_status=status
    ) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            with client.stream("POST", "/v1/messages", json=_message(server, stream=True)) as running:
                assert running.status_code == 200
                wait_for(lambda: server.engine.running_jobs, "the first job to run")
                refused = httpx.post(server.base_url + "/v1/messages", json=_message(server), timeout=30)
                assert_anthropic_error(refused, status, type_, code="queue_full")
                assert int(refused.headers["retry-after"]) >= 0
                gate.set()
                events = [line for line in running.iter_lines() if line.startswith("event: ")]
            assert events[-1] == "event: message_stop"


# ---------------------------------------------------------------------- --alias '*'

ASKED = "claude-haiku-4-5-20251001"


def test_unknown_model_ids_are_404_on_every_route_by_default(
    http: httpx.Client, server: RunningServer
) -> None:
    responses = {"model": ASKED, "input": "hi", "max_output_tokens": 16}
    assert_error(http.post("/v1/responses", json=responses), 404, code="model_not_found")
    legacy = {"model": ASKED, "prompt": "hi", "max_tokens": 2}
    assert_error(http.post("/v1/completions", json=legacy), 404, code="model_not_found")
    assert_anthropic_error(
        http.post("/v1/messages", json=_message(server, model=ASKED)), 404, "not_found_error"
    )


def test_alias_star_serves_any_model_id(model_path: Path) -> None:
    with running_server(model_path, ctx_size=512, alias=["my-model", "*"]) as server:
        assert server.model_id == "my-model"
        base = server.base_url
        with openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            # '*' is a rule, not a name: the listed ids are the alias and the file stem
            assert [m.id for m in client.models.list()] == ["my-model", model_path.stem]
            assert client.models.retrieve(ASKED).id == ASKED
            chat = client.chat.completions.create(model=ASKED, messages=USER, max_tokens=2)
            assert chat.model == ASKED
            chunks = list(
                client.chat.completions.create(model=ASKED, messages=USER, max_tokens=2, stream=True)
            )
            assert {chunk.model for chunk in chunks} == {ASKED}
            assert client.completions.create(model=ASKED, prompt="hi", max_tokens=2).model == ASKED
            assert client.responses.create(model=ASKED, input="hi", max_output_tokens=16).model == ASKED
        with anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60) as claude:
            assert claude.messages.create(model=ASKED, max_tokens=2, messages=USER).model == ASKED
            with claude.messages.stream(model=ASKED, max_tokens=2, messages=USER) as stream:
                assert stream.get_final_message().model == ASKED
            assert claude.messages.count_tokens(model=ASKED, messages=USER).input_tokens > 0
