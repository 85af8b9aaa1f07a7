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

from server.http.openai.responses import ResponsesRequest, to_chat_request
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


# A Codex CLI-like tool list: its own functions, an MCP server and its sub-agents as namespaces,
# apply_patch as a freeform (custom) tool with a Lark grammar, and hosted tools
LOOKUP: dict[str, Any] = {
    "type": "function",
    "name": "lookup",
    "description": "look a customer up",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "active": {"type": "boolean"}},
        "required": ["id", "active"],
        "additionalProperties": False,
    },
}
CRM: dict[str, Any] = {"type": "namespace", "name": "crm", "description": "the CRM", "tools": [LOOKUP]}
MCP: dict[str, Any] = {
    "type": "namespace",
    "name": "mcp__files__",
    "description": "an MCP server",
    "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}],
}
APPLY_PATCH: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": "edit files with a patch",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'},
}
# a regex format is enforced: the forced call's input must match it
VERDICT: dict[str, Any] = {
    "type": "custom",
    "name": "verdict",
    "format": {"type": "grammar", "syntax": "regex", "definition": "(yes|no)"},
}
HOSTED: list[dict[str, Any]] = [
    {"type": "web_search", "external_web_access": False},
    {"type": "web_search_preview"},
    {"type": "image_generation", "output_format": "png"},
    {"type": "local_shell"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "mcp", "server_label": "x", "server_url": "https://example.invalid"},
    {"type": "computer_use_preview", "display_width": 8, "display_height": 8, "environment": "linux"},
    {"type": "tool_search", "execution": "client", "description": "find tools", "parameters": {}},
]
CODEX_TOOLS: list[dict[str, Any]] = [WEATHER, APPLY_PATCH, CRM, *HOSTED[:2], MCP, *HOSTED[2:]]


class Verdict(BaseModel):
    ok: bool
    level: Literal["low", "mid", "high"]


@pytest.fixture(scope="module")
def server(tiny_model: Any) -> Iterator[RunningServer]:
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=4096) as running:
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


def test_codex_tool_list_is_served(
    client: openai.OpenAI, server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Hosted tools are left out with one log line per type, however many requests send them."""
    kwargs: dict[str, Any] = {
        "model": server.model_id,
        "input": "fix the bug",
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "store": False,
        "max_output_tokens": 4,
    }
    with caplog.at_level("WARNING", logger="server.http.openai.responses"):
        for _ in range(2):
            response = client.responses.create(**kwargs)
            assert response.status in ("completed", "incomplete")
            assert [tool.type for tool in response.tools] == [tool["type"] for tool in CODEX_TOOLS]
        events = list(client.responses.create(stream=True, **kwargs))
    assert events[-1].type in ("response.completed", "response.incomplete")
    for hosted in HOSTED:
        lines = [r for r in caplog.records if f"ignoring {hosted['type']!r} tools" in r.getMessage()]
        assert len(lines) <= 1, hosted  # once per process: an earlier test may have logged it
    grammar = [r for r in caplog.records if "Lark grammar is shown" in r.getMessage()]
    assert len(grammar) <= 1


def _named(namespace: str | None) -> dict[str, Any]:
    choice = {"type": "function", "name": "lookup"}
    return choice if namespace is None else {**choice, "namespace": namespace}


@pytest.mark.parametrize(
    "choice",
    [
        pytest.param(_named("crm"), id="by-namespace"),
        pytest.param(_named(None), id="by-name"),
        pytest.param("required", id="required"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_forced_namespaced_call(
    client: openai.OpenAI, server: RunningServer, choice: Any, stream: bool
) -> None:
    """A call of a namespace's function comes back as the API returns it: name and namespace
    apart, which the SDK (and Codex) dispatch on: the SDK finds the strict tool and parses."""
    kwargs: dict[str, Any] = {
        "model": server.model_id,
        "input": "look customer 7 up",
        "tools": [CRM, *HOSTED],
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "max_output_tokens": 200,
        "temperature": 0,
    }
    if stream:
        with client.responses.stream(**kwargs) as events:
            seen = list(events)
            response = events.get_final_response()
        kinds = [e.type for e in seen]
        assert [e.sequence_number for e in seen] == list(range(len(seen)))
        added = next(e for e in seen if e.type == "response.output_item.added")
        assert added.item.type == "function_call"
        assert (added.item.name, added.item.namespace) == ("lookup", "crm")
        deltas = "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta")
        done = next(e for e in seen if e.type == "response.output_item.done")
        assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
        assert kinds[-1] == "response.completed"
    else:
        response = client.responses.parse(**kwargs)
    assert response.status == "completed"
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert (call.name, call.namespace) == ("lookup", "crm")
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"id", "active"} and isinstance(arguments["id"], int)
    assert call.parsed_arguments == arguments  # type: ignore[union-attr]
    if stream:
        assert deltas == call.arguments
        assert done.item.model_dump(exclude={"status"}) == call.model_dump(
            exclude={"status", "parsed_arguments"}
        )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_forced_custom_call(client: openai.OpenAI, server: RunningServer, stream: bool) -> None:
    """A freeform tool is called with one string, returned as a custom_tool_call's input; a regex
    format constrains it."""
    kwargs: dict[str, Any] = {
        "model": server.model_id,
        "input": "is it fixed?",
        "tools": [APPLY_PATCH, {"type": "namespace", "name": "checks", "tools": [VERDICT]}, CRM],
        "tool_choice": {"type": "custom", "name": "verdict"},
        "max_output_tokens": 60,
        "temperature": 0,
    }
    if stream:
        with client.responses.stream(**kwargs) as stream_events:
            events = list(stream_events)
            response = stream_events.get_final_response()
        kinds = [e.type for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "response.function_call_arguments.delta" not in kinds
        added = next(e for e in events if e.type == "response.output_item.added")
        assert added.item.type == "custom_tool_call" and added.item.input == ""
        delta = next(e for e in events if e.type == "response.custom_tool_call_input.delta")
        done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
        item_done = next(e for e in events if e.type == "response.output_item.done")
        assert kinds.index(delta.type) < kinds.index(done.type) < kinds.index(item_done.type)
        assert delta.delta == done.input == item_done.item.input  # type: ignore[union-attr]
        assert kinds[-1] == "response.completed"
    else:
        response = client.responses.create(**kwargs)
    assert response.status == "completed"
    calls = [item for item in response.output if item.type == "custom_tool_call"]
    assert len(calls) == 1 and (calls[0].name, calls[0].namespace) == ("verdict", "checks")
    assert calls[0].input in ("yes", "no") and calls[0].call_id.startswith("call_")
    assert not [item for item in response.output if item.type == "function_call"]


def test_history_with_namespaced_and_custom_calls(client: openai.OpenAI, server: RunningServer) -> None:
    """Earlier namespaced and custom calls and their outputs come back as input items (what
    Codex sends on its next turn)."""
    response = client.responses.create(
        model=server.model_id,
        input=[
            {"role": "user", "content": "look customer 7 up, then patch"},
            {
                "type": "function_call",
                "call_id": "c1",
                "namespace": "crm",
                "name": "lookup",
                "arguments": "{}",
            },
            {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "function_call_output", "call_id": "c1", "output": "Ada"},
            {
                "type": "custom_tool_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "ok"}],
            },
        ],
        tools=CODEX_TOOLS,
        max_output_tokens=4,
    )
    assert response.status in ("completed", "incomplete")


def test_tools_reach_the_engine_under_flat_names() -> None:
    """Unit: what the model is offered and shown of earlier calls, by the names it sees."""
    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "hi"},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "namespace": "crm",
                    "name": "lookup",
                    "arguments": "{}",
                },
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "namespace": "mcp__files__",
                    "name": "read",
                    "arguments": "{}",
                },
                {"type": "custom_tool_call", "call_id": "c3", "name": "apply_patch", "input": 'a "b"'},
            ],
            "tools": CODEX_TOOLS,
            "tool_choice": {"type": "function", "name": "read"},
        }
    )
    warned: set[str] = set()
    chat, _ = to_chat_request(body, warned, 16)
    assert [tool.name for tool in chat.tools] == [
        "get_weather",
        "apply_patch",
        "crm__lookup",
        "mcp__files__read",
    ]
    assert warned >= {f"tools.type.{tool['type']}" for tool in HOSTED}
    assert chat.tool_choice is not None and getattr(chat.tool_choice, "name", None) == "mcp__files__read"
    custom = chat.tools[1].parameters
    assert custom is not None and custom["required"] == ["input"]
    assert "*** Begin Patch" in custom["properties"]["input"]["description"]
    crm = chat.tools[2]
    assert crm.description == "the CRM\nlook a customer up" and crm.parameters == LOOKUP["parameters"]
    calls = chat.messages[1].tool_calls
    assert [(c.id, c.name) for c in calls] == [
        ("c1", "crm__lookup"),
        ("c2", "mcp__files__read"),
        ("c3", "apply_patch"),
    ]
    assert json.loads(calls[2].arguments) == {"input": 'a "b"'}


@pytest.mark.parametrize(
    ("tools", "words"),
    [
        pytest.param(["web_search"], "tools.0 is not an object", id="not-object"),
        pytest.param([WEATHER, {"name": "x"}], 'tools.1 has no "type"', id="no-type"),
        pytest.param(
            [{"type": "namespace", "name": "crm"}], "tools.0.tools: Field required", id="ns-no-tools"
        ),
        pytest.param(
            [{**CRM, "tools": LOOKUP}], "tools.0.tools: Input should be a valid list", id="ns-tools-object"
        ),
        pytest.param([{**CRM, "name": "a b"}], "tools.0.name: String should match", id="ns-bad-name"),
        pytest.param([{**CRM, "tools": [7]}], "tools.0.tools.0 is not an object", id="ns-inner-not-object"),
        pytest.param(
            [{**CRM, "tools": [{"type": "web_search"}]}],
            "tools.0.tools.0 is a 'web_search' tool: a namespace holds function and custom tools",
            id="ns-hosted-inside",
        ),
        pytest.param(
            [{**CRM, "tools": [{"type": "function"}]}], "tools.0.tools.0.name: Field required", id="ns-fn"
        ),
        pytest.param(
            [CRM, {**LOOKUP, "name": "crm__lookup"}], "the tool name 'crm__lookup' is taken twice", id="clash"
        ),
        pytest.param([{**APPLY_PATCH, "format": "lark"}], "tools.0.format", id="custom-format"),
    ],
)
def test_bad_tool_entries_say_why(
    client: openai.OpenAI, server: RunningServer, tools: list[Any], words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=server.model_id, input="hi", tools=tools, max_output_tokens=4)
    assert words in str(raised.value)
    assert raised.value.body["param"] is not None  # type: ignore[index]
    # the server is still up and answering
    assert client.responses.create(model=server.model_id, input="hi", max_output_tokens=2).status
