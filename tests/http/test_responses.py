"""The Responses API (POST /v1/responses) through the official openai SDK's `client.responses`.

Random weights make the text gibberish: the tests assert on structure, event order, agreement
between streamed and whole answers, and that grammar-forced calls and schemas parse.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel

from tests.servers import RunningServer, running_server

WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "boolean"}},
        "required": ["unit", "days"],
        "additionalProperties": False,
    },
}


class Verdict(BaseModel):
    ok: bool
    level: Literal["low", "mid", "high"]


@pytest.fixture(scope="module")
def server(tiny_model: Any) -> Iterator[RunningServer]:
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=1024) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_text_answer_whole_and_streamed_agree(client: openai.OpenAI, server: RunningServer) -> None:
    kwargs: dict[str, Any] = {
        "model": server.model_id,
        "instructions": "be brief",
        "input": "hello there",
        "max_output_tokens": 12,
        "temperature": 0,
    }
    whole = client.responses.create(**kwargs)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete")
    assert whole.usage is not None and whole.usage.input_tokens > 0
    assert 0 < whole.usage.output_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    if whole.status == "incomplete":
        assert whole.incomplete_details is not None
        assert whole.incomplete_details.reason == "max_output_tokens"
    messages = [item for item in whole.output if item.type == "message"]
    assert len(messages) == 1 and messages[0].content[0].type == "output_text"

    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response." + ("completed" if whole.status == "completed" else "incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added")
    assert kinds.index("response.content_part.added") < kinds.index("response.output_text.delta")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text
    assert [e.type for e in events if e.type.endswith(".done")] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_forced_function_call(client: openai.OpenAI, server: RunningServer, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": server.model_id,
        "input": "weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 200,
        "temperature": 0,
    }
    if stream:
        with client.responses.stream(**kwargs) as events:
            deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            response = events.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    assert response.status == "completed"
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_")
    arguments = json.loads(calls[0].arguments)
    assert set(arguments) == {"unit", "days"} and arguments["unit"] in ("c", "f")
    if stream:
        assert deltas == calls[0].arguments


def test_parse_with_a_pydantic_text_format(client: openai.OpenAI, server: RunningServer) -> None:
    response = client.responses.parse(
        model=server.model_id, input="judge it", text_format=Verdict, max_output_tokens=100, temperature=0
    )
    assert isinstance(response.output_parsed, Verdict)


def test_conversation_as_input_items(client: openai.OpenAI, server: RunningServer) -> None:
    """A whole tool round trip sent back statelessly: message, function_call, function_call_output."""
    response = client.responses.create(
        model=server.model_id,
        instructions="you report the weather",
        input=[
            {"role": "user", "content": "weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"unit": "c"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
            {"role": "user", "content": [{"type": "input_text", "text": "and tomorrow?"}]},
        ],
        tools=[WEATHER],
        max_output_tokens=4,
    )
    assert response.status in ("completed", "incomplete")
    assert response.usage is not None and response.usage.input_tokens > 20


@pytest.mark.parametrize(
    ("extra", "error", "words"),
    [
        pytest.param(
            {"previous_response_id": "resp_1"}, openai.BadRequestError, "keeps no responses", id="stored"
        ),
        pytest.param(
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]},
            openai.BadRequestError,
            "text only",
            id="image",
        ),
        pytest.param(
            {"tools": [{"type": "web_search"}]}, openai.BadRequestError, "function tools only", id="tool"
        ),
        pytest.param({"model": "gpt-9"}, openai.NotFoundError, "does not exist", id="model"),
        pytest.param(
            {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]}]},
            openai.BadRequestError,
            "no message to answer",
            id="only-reasoning",
        ),
        pytest.param({"temperature": 3}, openai.BadRequestError, "temperature", id="bounds"),
    ],
)
def test_refusals_say_why(
    client: openai.OpenAI, server: RunningServer, extra: dict[str, Any], error: type[Exception], words: str
) -> None:
    kwargs: dict[str, Any] = {"model": server.model_id, "input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises(error) as raised:
        client.responses.create(**kwargs)
    assert words in str(raised.value)
