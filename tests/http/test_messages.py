"""POST /v1/messages driven by the official anthropic SDK against a real server on a tiny model.

Random weights make the text gibberish: the tests assert on structure, on agreement with the
chat-completions route (one engine path: same prompt tokens, same greedy text) and on token
counts, never on wording.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from server.engine.chat import ChatMessage, ChatTool
from server.engine.generation import TextDelta
from server.engine.token_loop import Sequence
from server.engine.tool_calls import OutPiece, ToolCallArgs, ToolCallStart
from server.errors import ExpertReadError
from server.http.messages import ContentBlocks, MessagesRequest, to_chat_request
from tests.servers import RunningServer, running_server, script_generation

# the SDK has no sampling parameters any more; clients send them as extra body fields
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0.0}}
SYSTEM = "be brief"
USER: list[Any] = [{"role": "user", "content": "hello there"}]

TIME_TOOL: dict[str, Any] = {
    "name": "get_time",
    "description": "the time in a zone",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["utc", "local"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "input_schema": {
        "type": "object",
        "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "boolean"}},
        "required": ["unit", "days"],
        "additionalProperties": False,
    },
}
FORCE_TIME: Any = {"type": "tool", "name": "get_time"}
# typed Any: the SDK's parameters are TypedDicts
TOOLS: Any = [WEATHER_TOOL, TIME_TOOL]
ONE_TOOL: Any = [TIME_TOOL]


@pytest.fixture(scope="module")
def server(tiny_model: Any) -> Iterator[RunningServer]:
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=1024) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _chat(server: RunningServer, messages: list[Any], **fields: Any) -> dict[str, Any]:
    """The same question on /v1/chat/completions (the reference for the mapping)."""
    body = {"model": server.model_id, "messages": messages, "temperature": 0.0, **fields}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _assert_same_prompt(message: anthropic.types.Message, chat: dict[str, Any]) -> None:
    """`message` answered right after `chat`: an identical prompt is all read from the KV cache but
    its last token (which is always decoded again), so this fails on any token of difference."""
    assert message.usage.input_tokens == 1, message.usage
    assert message.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"] - 1


def _prompt_tokens(usage: anthropic.types.Usage) -> int:
    # Anthropic's accounting: the prompt is what was computed plus what came from the cache
    assert usage.cache_creation_input_tokens == 0
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def _text(message: anthropic.types.Message) -> str:
    texts = [block.text for block in message.content if block.type == "text"]
    assert len(texts) == 1, message.content
    return texts[0]


def _valid_time_call(block: Any) -> None:
    assert block.type == "tool_use"
    assert block.id.startswith("toolu_")
    assert block.name == "get_time"
    assert isinstance(block.input, dict) and set(block.input) == {"zone"}
    assert block.input["zone"] in ("utc", "local")


def test_text_answer_is_the_chat_answer(client: anthropic.Anthropic, server: RunningServer) -> None:
    chat = _chat(server, [{"role": "system", "content": SYSTEM}, *USER], max_tokens=10)
    message = client.messages.create(
        model=server.model_id, max_tokens=10, system=SYSTEM, messages=USER, **GREEDY
    )
    assert message.id.startswith("msg_")
    assert message.type == "message" and message.role == "assistant"
    assert message.model == server.model_id
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None
    assert 0 < message.usage.output_tokens <= 10
    assert (message.usage.output_tokens == 10) == (message.stop_reason == "max_tokens")
    _assert_same_prompt(message, chat)
    assert _text(message) == chat["choices"][0]["message"]["content"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_stream_matches_the_whole_answer(client: anthropic.Anthropic, server: RunningServer) -> None:
    kwargs: dict[str, Any] = {"model": server.model_id, "max_tokens": 12, "messages": USER, **GREEDY}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == _text(whole) == _text(final)
    assert final.id.startswith("msg_") and final.id != whole.id
    assert final.model == whole.model
    assert final.stop_reason == whole.stop_reason
    assert final.stop_sequence is None
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert _prompt_tokens(final.usage) == _prompt_tokens(whole.usage)
    assert [block.type for block in final.content] == [block.type for block in whole.content]


def test_stream_event_order(client: anthropic.Anthropic, server: RunningServer) -> None:
    events = list(
        client.messages.create(model=server.model_id, max_tokens=6, messages=USER, stream=True, **GREEDY)
    )
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0]
    assert start.type == "message_start"
    assert start.message.content == [] and start.message.stop_reason is None
    assert start.message.usage.input_tokens > 0 and start.message.usage.output_tokens == 0
    # blocks are sequential: each starts, gets deltas for its own index, stops before the next
    open_index: int | None = None
    starts = 0
    for event in events[1:-2]:
        if event.type == "content_block_start":
            assert open_index is None and event.index == starts
            open_index, starts = event.index, starts + 1
        elif event.type == "content_block_delta":
            assert event.index == open_index
        else:
            assert event.type == "content_block_stop" and event.index == open_index
            open_index = None
    assert open_index is None and starts >= 1
    delta = events[-2]
    assert delta.type == "message_delta"
    assert delta.delta.stop_reason in ("end_turn", "max_tokens")
    assert 0 < delta.usage.output_tokens <= 6


def test_a_failure_after_the_stream_started_is_an_error_event(
    client: anthropic.Anthropic, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(sequence: Sequence) -> None:
        sequence.emit(TextDelta("partial"))
        raise ExpertReadError("the expert file ended early")

    script_generation(monkeypatch, failing)
    seen: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(model=server.model_id, max_tokens=8, messages=USER) as stream:
            seen.extend(stream.text_stream)
    assert seen == ["partial"]  # the 200 and the first text went out before the failure
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "api_error" and "ended early" in body["error"]["message"]


def test_stop_sequence_is_reported(client: anthropic.Anthropic, server: RunningServer) -> None:
    kwargs: dict[str, Any] = {"model": server.model_id, "max_tokens": 16, "messages": USER, **GREEDY}
    free = _text(client.messages.create(**kwargs))
    assert len(free) >= 6, "the greedy answer is too short to cut"
    stop = free[3:5]
    cut = free[: free.find(stop)]
    message = client.messages.create(stop_sequences=["never-generated-zz", stop], **kwargs)
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert _text(message) == cut
    with client.messages.stream(stop_sequences=[stop], **kwargs) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, _text(final)) == ("stop_sequence", stop, cut)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_forced_tool_use(client: anthropic.Anthropic, server: RunningServer, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": server.model_id,
        "max_tokens": 64,
        "messages": USER,
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": FORCE_TIME,
        **GREEDY,
    }
    if stream:
        with client.messages.stream(**kwargs) as events:
            input_deltas = [e for e in events if e.type == "content_block_delta"]
            message = events.get_final_message()
        assert len(input_deltas) > 1  # the input arrived in pieces
        assert all(e.delta.type == "input_json_delta" for e in input_deltas)
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    assert len(message.content) == 1  # no empty text block next to the call
    _valid_time_call(message.content[0])
    if stream:
        whole = client.messages.create(**kwargs)
        assert whole.content[0].type == "tool_use"
        assert message.content[0].input == whole.content[0].input  # type: ignore[union-attr]


def test_any_tool_choice_calls_one_of_the_tools(client: anthropic.Anthropic, server: RunningServer) -> None:
    message = client.messages.create(
        model=server.model_id,
        max_tokens=400,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0.7, "top_k": 40, "top_p": 0.9},
    )
    assert message.stop_reason == "tool_use"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1
    call = calls[0]
    if call.name == "get_time":
        _valid_time_call(call)
    else:
        assert call.name == "get_weather" and set(call.input) == {"unit", "days"}
        assert call.input["unit"] in ("c", "f") and isinstance(call.input["days"], bool)


def test_tool_call_cut_by_max_tokens(client: anthropic.Anthropic, server: RunningServer) -> None:
    kwargs: dict[str, Any] = {
        "model": server.model_id,
        "max_tokens": 3,
        "messages": USER,
        "tools": [TIME_TOOL],
        "tool_choice": FORCE_TIME,
        **GREEDY,
    }
    whole = client.messages.create(**kwargs)
    # incomplete arguments are no input: the call is left out rather than sent as broken JSON
    assert whole.stop_reason == "max_tokens"
    assert all(block.type != "tool_use" for block in whole.content)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    # a stream cannot take back what it sent: the partial call, and stop_reason says it was cut
    assert final.stop_reason == "max_tokens"
    assert [block.type for block in final.content] == ["tool_use"]


def test_tool_round_trip_maps_onto_chat_messages(client: anthropic.Anthropic, server: RunningServer) -> None:
    first = client.messages.create(
        model=server.model_id,
        max_tokens=64,
        messages=USER,
        tools=ONE_TOOL,
        tool_choice=FORCE_TIME,
        **GREEDY,
    )
    call = first.content[0]
    assert call.type == "tool_use"
    history: list[Any] = [
        *USER,
        {"role": "assistant", "content": [{"type": "text", "text": "checking"}, call.model_dump()]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "and now?"},
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "content": [{"type": "text", "text": "12:00"}],
                },
            ],
        },
    ]
    arguments = json.dumps(call.input)
    tool_call = {"id": call.id, "type": "function", "function": {"name": "get_time", "arguments": arguments}}
    chat_tool = {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": TIME_TOOL["description"],
            "parameters": TIME_TOOL["input_schema"],
        },
    }
    chat_messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        *USER,
        {"role": "assistant", "content": "checking", "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},  # results before the turn's text
        {"role": "user", "content": "and now?"},
    ]
    chat = _chat(server, chat_messages, max_tokens=4, tools=[chat_tool])
    answer = client.messages.create(
        model=server.model_id, max_tokens=4, system=SYSTEM, messages=history, tools=ONE_TOOL, **GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    _assert_same_prompt(answer, chat)

    # is_error reaches the template as an "Error: " prefix
    history[2]["content"][1] = {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": "boom",
        "is_error": True,
    }
    chat_messages[3]["content"] = "Error: boom"
    chat = _chat(server, chat_messages[1:], max_tokens=1)
    failed = client.messages.create(model=server.model_id, max_tokens=1, messages=history, **GREEDY)
    _assert_same_prompt(failed, chat)


def test_thinking_blocks_are_passed_back_as_reasoning(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    # accepted and rendered like the chat request (the tiny model's template drops reasoning from
    # the history; test_mapping_onto_chat_messages checks that it is passed on)
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "utc"}}
    history: list[Any] = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "the user wants the time", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                call,
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"}]},
    ]
    arguments = json.dumps(call["input"])
    tool_call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": arguments},
    }
    chat_messages: list[Any] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [tool_call],
            "reasoning_content": "the user wants the time",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "noon"},
    ]
    chat = _chat(server, chat_messages, max_tokens=1)
    message = client.messages.create(
        model=server.model_id, max_tokens=1, messages=history, thinking={"type": "disabled"}, **GREEDY
    )
    _assert_same_prompt(message, chat)


def test_system_as_string_or_blocks(client: anthropic.Anthropic, server: RunningServer) -> None:
    base: dict[str, Any] = {"model": server.model_id, "max_tokens": 6, "messages": USER, **GREEDY}
    plain = client.messages.create(**base)
    as_string = client.messages.create(system=SYSTEM, **base)
    as_blocks = client.messages.create(system=[{"type": "text", "text": SYSTEM}], **base)
    assert _prompt_tokens(as_string.usage) > _prompt_tokens(plain.usage)
    # the same prompt as the string's: all of it but the last token comes from the KV cache
    assert as_blocks.usage.input_tokens == 1
    assert _prompt_tokens(as_blocks.usage) == _prompt_tokens(as_string.usage)
    assert _text(as_string) == _text(as_blocks)


def test_image_block_is_refused_in_plain_words(client: anthropic.Anthropic, server: RunningServer) -> None:
    image: Any = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"},
    }
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model=server.model_id,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "what is this"}, image]}],
        )
    assert "text only" in caught.value.message
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "unsupported_content"
    assert body["error"]["param"] == "messages.0.content.1"


def test_unknown_model_is_not_found(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-opus-4-1", max_tokens=4, messages=USER)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and body["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        pytest.param({"temperature": 2.5}, "temperature", id="temperature-high"),
        pytest.param({"top_p": 1.5}, "top_p", id="top-p-high"),
        pytest.param({"top_k": -1}, "top_k", id="top-k-negative"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="max-tokens-zero"),
        pytest.param({"max_tokens": None}, "max_tokens", id="max-tokens-missing"),
        pytest.param({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences", id="five-stops"),
        pytest.param({"messages": []}, "messages", id="no-messages"),
        pytest.param({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role", id="system-role"),
        pytest.param(
            {"tool_choice": {"type": "tool", "name": "get_time"}}, "tool_choice", id="choice-no-tools"
        ),
        pytest.param(
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools.0.type",
            id="server-tool",
        ),
        pytest.param(
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
            "messages.0.content.0",
            id="result-in-assistant-turn",
        ),
    ],
)
def test_bad_requests_are_400s_in_both_envelopes(
    server: RunningServer, fields: dict[str, Any], param: str
) -> None:
    body = {"model": server.model_id, "max_tokens": 4, "messages": USER, **fields}
    body = {key: value for key, value in body.items() if value is not None}
    response = httpx.post(server.base_url + "/v1/messages", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and set(error) == {"type", "error"}
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param


def test_unknown_fields_are_accepted_and_logged_once(
    client: anthropic.Anthropic, server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="server.http.serving"):
        for _ in range(2):
            message = client.messages.create(
                model=server.model_id,
                max_tokens=2,
                messages=USER,
                metadata={"user_id": "u-1"},
                extra_body={"frobnicate_messages": 3},
            )
            assert message.stop_reason in ("end_turn", "max_tokens")
    assert len([r for r in caplog.records if "frobnicate_messages" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    "credentials",
    [
        # this SDK sends api_key as a Bearer token; older ones and curl examples send x-api-key
        pytest.param(lambda key: {"api_key": key}, id="api-key"),
        pytest.param(lambda key: {"default_headers": {"x-api-key": key}}, id="x-api-key-header"),
    ],
)
def test_api_key_on_messages(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch, credentials: Callable[[str], dict[str, Any]]
) -> None:
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    key = "messages-key"
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=512, api_key=key) as server:
        ask: dict[str, Any] = {"model": server.model_id, "max_tokens": 2, "messages": USER}
        with anthropic.Anthropic(base_url=server.base_url, max_retries=0, **credentials(key)) as good:
            assert good.messages.create(**ask).type == "message"
        with anthropic.Anthropic(base_url=server.base_url, max_retries=0, **credentials("wrong")) as bad:
            with pytest.raises(anthropic.AuthenticationError) as caught:
                bad.messages.create(**ask)
        body = caught.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["code"] == "invalid_api_key"
        # x-api-key is the Anthropic routes' convention: the OpenAI routes keep to Bearer
        chat = {"model": server.model_id, "max_tokens": 2, "messages": USER}
        refused = httpx.post(server.base_url + "/v1/chat/completions", json=chat, headers={"x-api-key": key})
        assert refused.status_code == 401 and set(refused.json()) == {"error"}


# ---------------------------------------------------------------------- block assembly


def _accumulate(events: list[tuple[str, dict[str, Any]]]) -> Any:
    """The SDK's own accumulation of our events (what get_final_message returns)."""
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_x",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 0},
        },
    }
    snapshot = accumulate_event(event=start, current_snapshot=None, json_bufs={})  # type: ignore[arg-type]
    json_bufs: dict[int, bytes] = {}
    for name, payload in events:
        assert payload["type"] == name
        snapshot = accumulate_event(event=payload, current_snapshot=snapshot, json_bufs=json_bufs)  # type: ignore[arg-type]
    return snapshot


def test_blocks_thinking_text_and_calls_in_order() -> None:
    blocks = ContentBlocks()
    pieces: list[OutPiece] = [
        ("reasoning", "let me "),
        ("reasoning", "see"),
        ("content", ""),
        ("content", "Sure."),
        ToolCallStart(0, "call_abc", "get_time"),
        ToolCallArgs(0, '{"zone": '),
        ToolCallArgs(0, '"utc"}'),
        ToolCallStart(1, "call_def", "get_time"),
        ToolCallArgs(1, '{"zone": "loc'),
    ]
    events = blocks.feed(pieces[:3]) + blocks.feed(pieces[3:]) + blocks.finish()
    names = [name for name, _ in events]
    assert names.count("content_block_start") == names.count("content_block_stop") == 4
    # a thinking block ends with its (empty) signature, as Anthropic's streams do
    assert events[names.index("content_block_stop") - 1][1]["delta"]["type"] == "signature_delta"
    final = _accumulate(events)
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert final.content[0].thinking == "let me see" and final.content[0].signature == ""
    assert final.content[1].text == "Sure."
    assert final.content[2].id == "toolu_abc" and final.content[2].input == {"zone": "utc"}
    # the whole answer: the unfinished call is left out; only complete calls count
    assert blocks.complete_calls() == 1
    assert [block.to_json() for block in blocks.content()] == [
        {"type": "thinking", "thinking": "let me see", "signature": ""},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_time", "input": {"zone": "utc"}},
    ]


def test_blocks_empty_answer_has_one_empty_text_block() -> None:
    blocks = ContentBlocks()
    events = blocks.feed([("content", "")]) + blocks.finish()
    assert [name for name, _ in events] == ["content_block_start", "content_block_stop"]
    assert [block.to_json() for block in blocks.content()] == [{"type": "text", "text": ""}]
    assert _accumulate(events).content[0].text == ""


def test_mapping_onto_chat_messages() -> None:
    request = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 7,
            "system": [{"type": "text", "text": "rules", "cache_control": {"type": "ephemeral"}}],
            "stop_sequences": ["END"],
            "tools": [TIME_TOOL],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "think", "signature": "s"},
                        {"type": "text", "text": "calling"},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "utc"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "and?"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "down",
                            "is_error": True,
                        },
                    ],
                },
            ],
        }
    )
    chat = to_chat_request(request, set())
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0] == ChatMessage("system", "rules")
    assistant, result, user = chat.messages[2:]
    assert assistant.reasoning == "think" and assistant.content == "calling"
    assert len(assistant.tool_calls) == 1 and assistant.tool_calls[0].id == "toolu_1"
    assert assistant.tool_calls[0].name == "get_time"
    assert json.loads(assistant.tool_calls[0].arguments) == {"zone": "utc"}
    assert result.tool_call_id == "toolu_1" and result.content == "Error: down"
    assert user == ChatMessage("user", "and?")
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.sampling.max_tokens == 7 and chat.sampling.stop == ("END",)
    assert chat.tools == (ChatTool("get_time", TIME_TOOL["description"], TIME_TOOL["input_schema"]),)


def test_a_mid_conversation_system_message_is_served(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    # Claude Code sends one after the first user turn, as Anthropic's API now allows
    messages: Any = [
        {"role": "user", "content": "q"},
        {"role": "system", "content": [{"type": "text", "text": "be brief"}, {"type": "text", "text": "!"}]},
    ]
    chat = to_chat_request(
        MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": messages}), set()
    )
    assert chat.messages == (ChatMessage("user", "q"), ChatMessage("system", "be brief!"))
    answer = client.messages.create(model=server.model_id, max_tokens=4, messages=messages)
    assert answer.type == "message" and answer.usage.input_tokens > 0
    tool_use = {"type": "tool_use", "id": "toolu_9", "name": "get_time", "input": {}}
    bad: Any = [{"role": "user", "content": "q"}, {"role": "system", "content": [tool_use]}]
    with pytest.raises(anthropic.BadRequestError, match="cannot be in a system turn"):
        client.messages.create(model=server.model_id, max_tokens=4, messages=bad)


# ---------------------------------------------------------------------- count_tokens


def _counted(client: anthropic.Anthropic, **fields: Any) -> int:
    count = client.messages.count_tokens(**fields)
    assert isinstance(count.input_tokens, int) and count.input_tokens > 0
    return count.input_tokens


def test_count_tokens_is_the_prompt_messages_serves(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    fields: dict[str, Any] = {
        "model": server.model_id,
        "system": [{"type": "text", "text": SYSTEM}],
        "messages": [
            {"role": "user", "content": "what time is it in the count_tokens test?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "a zone", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_9", "name": "get_time", "input": {"zone": "utc"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "9"}]},
        ],
        "tools": TOOLS,
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "disabled"},
    }
    counted = _counted(client, **fields)
    message = client.messages.create(max_tokens=2, **fields, **GREEDY)
    assert _prompt_tokens(message.usage) == counted
    # the stream's message_start counts the whole prompt (nothing of it from the cache yet)
    events = client.messages.create(max_tokens=2, stream=True, **fields, **GREEDY)
    start = next(iter(events))
    events.close()
    assert start.type == "message_start" and start.message.usage.input_tokens == counted
    # every field that reaches the template counts: tools, system, the turns
    assert _counted(client, **{**fields, "tools": ONE_TOOL}) < counted
    assert _counted(client, **{**fields, "system": "x"}) < counted
    assert _counted(client, model=server.model_id, messages=fields["messages"][:1]) < counted


def test_count_tokens_refuses_what_messages_refuses(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    image: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model=server.model_id, messages=[{"role": "user", "content": [image]}])
    assert "text only" in caught.value.message
    with pytest.raises(anthropic.NotFoundError) as not_found:
        client.messages.count_tokens(model="claude-haiku-4-5", messages=USER)
    body = not_found.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and body["error"]["code"] == "model_not_found"


def _deep_schema(depth: int) -> bytes:
    """A request whose tool schema nests `depth` objects (2 x depth JSON levels), as text: too
    deep for json.dumps here."""
    schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth
    tool = '{"name": "t", "input_schema": ' + schema + "}"
    return (
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [' + tool.encode() + b"]}"
    )


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"[]", id="array"),
        pytest.param(b'{"model": ', id="truncated"),
        pytest.param(b'{"model": "m", "messages": "hi"}', id="messages-string"),
        pytest.param(b'{"model": "m", "messages": []}', id="no-messages"),
        pytest.param(json.dumps({"messages": USER}).encode(), id="no-model"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep-json"),
        pytest.param(
            json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": [{"type": "nope"}]}]}
            ).encode(),
            id="unknown-block",
        ),
        pytest.param(
            json.dumps({"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}).encode(),
            id="lone-surrogate",
        ),
        pytest.param(_deep_schema(5000), id="deep-schema"),
    ],
)
def test_count_tokens_malformed_input_is_4xx_and_the_server_stays_up(
    server: RunningServer, body: bytes
) -> None:
    # "m" is not the model's name: each body is refused before or at the model check
    response = httpx.post(
        server.base_url + "/v1/messages/count_tokens",
        content=body.replace(b'"m"', json.dumps(server.model_id).encode()),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert 400 <= response.status_code < 500, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def test_deep_json_is_refused_in_plain_words(server: RunningServer) -> None:
    response = httpx.post(
        server.base_url + "/v1/messages/count_tokens",
        content=_deep_schema(5000).replace(b'"m"', json.dumps(server.model_id).encode()),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the request body is JSON nested too deeply to parse"
    # as deep as the parser takes: valid, so counted (a tool's schema is part of the prompt)
    response = httpx.post(
        server.base_url + "/v1/messages/count_tokens",
        content=_deep_schema(450).replace(b'"m"', json.dumps(server.model_id).encode()),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["input_tokens"] > 450


def test_count_tokens_of_a_long_conversation(client: anthropic.Anthropic, server: RunningServer) -> None:
    # longer than the context: counting is not serving, so it is counted, not refused
    turns: list[Any] = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 50}
        for i in range(41)
    ]
    assert _counted(client, model=server.model_id, messages=turns) > server.model.info.n_ctx


# ---------------------------------------------------------------------- cache_control

EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}


def _marked(value: Any) -> Any:
    """`value` with cache_control on every dict that has a "type" or a "name" (blocks, tools)."""
    if isinstance(value, list):
        return [_marked(item) for item in value]
    if isinstance(value, dict):
        out = {
            key: (item if key in ("input", "input_schema") else _marked(item)) for key, item in value.items()
        }
        return {**out, "cache_control": EPHEMERAL} if "type" in value or "name" in value else out
    return value


def test_cache_control_is_accepted_everywhere_and_changes_nothing(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    fields: dict[str, Any] = {
        "model": server.model_id,
        "system": [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "and kind"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "the caching test"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "toolu_c", "name": "get_time", "input": {"zone": "utc"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_c",
                        "content": [{"type": "text", "text": "noon"}],
                    },
                    {"type": "tool_result", "tool_use_id": "toolu_c", "content": "again", "is_error": True},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
        "tools": TOOLS,
    }
    marked = _marked(fields)
    assert json.dumps(marked).count("cache_control") == 11  # 2 system, 7 content, 2 tools
    assert _counted(client, **marked) == _counted(client, **fields)
    plain = client.messages.create(max_tokens=3, **fields, **GREEDY)
    cached = client.messages.create(max_tokens=3, **marked, **GREEDY)
    # the same prompt: all of it but the last token is read from the KV cache
    assert cached.usage.input_tokens == 1
    assert _prompt_tokens(cached.usage) == _prompt_tokens(plain.usage)
    assert _text(cached) == _text(plain)


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            id="image",
        ),
        pytest.param(
            {
                "type": "document",
                "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"},
            },
            id="document",
        ),
    ],
)
def test_cache_control_on_media_blocks_is_not_what_refuses_them(
    client: anthropic.Anthropic, server: RunningServer, block: dict[str, Any]
) -> None:
    content: Any = [{"type": "text", "text": "look"}, {**block, "cache_control": EPHEMERAL}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model=server.model_id, max_tokens=2, messages=[{"role": "user", "content": content}]
        )
    body = caught.value.body
    assert isinstance(body, dict) and body["error"]["code"] == "unsupported_content"
    assert body["error"]["param"].startswith("messages.0.content.1")  # the document's: .source


# ---------------------------------------------------------------------- context overflow


def test_context_overflow_is_anthropics_prompt_is_too_long(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    messages: Any = [{"role": "user", "content": "word " * 1500}]
    n_prompt = _counted(client, model=server.model_id, messages=messages)
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model=server.model_id, max_tokens=4, messages=messages, stream=stream)
        body = caught.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        # Claude Code compacts its conversation on exactly these words (N > M, M the longest prompt)
        n_ctx = server.model.info.n_ctx
        assert body["error"]["message"] == f"prompt is too long: {n_prompt} tokens > {n_ctx - 1} maximum"
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
