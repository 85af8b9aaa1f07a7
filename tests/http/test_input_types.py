"""Every input item and content block type of the pinned SDKs, sent to a real server.

The types are read from the installed `openai` and `anthropic` packages at test time (their
`ResponseInputItemParam`, `ToolParam`, `ContentBlockParam` and the beta `BetaContentBlockParam`
unions), so a type a newer SDK adds fails here until the server has a rule for it. Each member's
minimal valid value, and one value per alternative of the unions inside it, goes in a request
after a user message; what comes back is what the type's rule says (server/http/openai/responses/items.py,
server/http/messages/mapping.py, docs/api.md): 200 with every text of the value in the rendered
prompt, 200 and one log line naming a dropped type, or a 400 naming the item. The minimal values
are also sent streamed, and the server answers a plain request after all of them.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic.types
import anthropic.types.beta
import httpx
import openai.types.responses
import pytest

from server.engine.chat import ChatMessage
from server.engine.chat_template import ChatTemplate
from server.http.messages.protocol import (
    ASSISTANT_BLOCKS,
    DROPPED_BLOCKS,
    SERVER_TOOL_RESULTS,
    known_block_types,
)
from server.http.openai.responses import ResponsesRequest
from server.http.openai.responses import to_chat_request as responses_chat
from server.http.openai.responses.protocol import DROPPED_ITEMS, REFUSED_ITEMS, known_item_types
from tests.http.sdk_types import markers as markers_of
from tests.http.sdk_types import members, minimal, type_tag, variants
from tests.servers import RunningServer, running_server

# keys whose strings no model reads: ids, signatures, opaque or binary data, citations
OPAQUE = frozenset(
    {
        "id",
        "call_id",
        "tool_use_id",
        "approval_request_id",
        "file_id",
        "container_id",
        "encrypted_content",
        "signature",
        "fingerprint",
        "status",
        "annotations",
        "logprobs",
        "data",
        "cache_control",
        "citations",
        "caller",
        "media_type",
    }
)
QUESTION = {"role": "user", "content": "What happened?"}


@dataclass
class Seen:
    """What the server did with the requests: the prompts it rendered, the messages it rendered
    them from, and its warnings."""

    prompts: list[str] = field(default_factory=list)
    messages: list[list[ChatMessage]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def rendered(self, marker: str) -> bool:
        """Whether `marker` reached the last prompt (reasoning: the template's messages, since
        this model's template leaves earlier reasoning out, as Qwen3's does)."""
        if marker in self.prompts[-1]:
            return True
        return any(marker in (m.reasoning or "") for m in self.messages[-1])


class _Warnings(logging.Handler):
    def __init__(self, seen: Seen) -> None:
        super().__init__(logging.WARNING)
        self.seen = seen

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.warnings.append(record.getMessage())


@pytest.fixture(scope="module")
def served(tiny_model: Any) -> Iterator[tuple[RunningServer, Seen]]:
    seen = Seen()
    render = ChatTemplate.render

    def spied(template: ChatTemplate, messages: Any, *args: Any, **kwargs: Any) -> str:
        prompt = render(template, messages, *args, **kwargs)
        seen.messages.append(list(messages))
        seen.prompts.append(prompt)
        return prompt

    handler = _Warnings(seen)
    logging.getLogger("server").addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ChatTemplate, "render", spied)
            with running_server(Path(tiny_model("tiny-qwen3moe"))) as server:
                yield server, seen
    finally:
        logging.getLogger("server").removeHandler(handler)


def _post(server: RunningServer, path: str, body: dict[str, Any], stream: bool) -> tuple[int, Any]:
    """The status and the JSON body (a stream: its last data event) of one request."""
    body = {**body, "stream": stream}
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        if not stream:
            response = client.post(path, json=body)
            return response.status_code, response.json()
        with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return response.status_code, json.loads(response.read())
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return 200, json.loads(events[-1])


def _has_media(value: Any, kinds: frozenset[str]) -> bool:
    """Whether a value holds a part of one of `kinds` anywhere, or a document that is not
    text (refused: the model takes text only)."""
    if isinstance(value, list):
        return any(_has_media(v, kinds) for v in value)
    if not isinstance(value, dict):
        return False
    kind = value.get("type")
    if kind in kinds:
        return True
    if kind == "document" and value.get("source", {}).get("type") not in ("text", "content"):
        return True
    return any(_has_media(v, kinds) for v in value.values())


OPENAI_MEDIA = frozenset({"input_image", "input_audio", "input_file", "computer_screenshot"})
ANTHROPIC_MEDIA = frozenset({"image"})
OFFERED_TOOL_KINDS = ("function", "custom", "namespace")


def _check(
    seen: Seen,
    status: int,
    answer: Any,
    value: dict[str, Any],
    member: Any,
    refused: str | None,
    dropped: str | None,
) -> None:
    """The answer to a request carrying `value` follows its rule: refused (a 400 whose param names
    `refused`), dropped (a warning naming `dropped`), or rendered (every text of it in the prompt)."""
    where = json.dumps(value)[:300]
    if refused is not None:
        assert status == 400, (where, answer)
        error = answer["error"]
        assert str(error["param"]).startswith(refused), (where, error)
        assert "str" not in str(error["param"]).split("."), error  # no union branch in the place
        return
    assert status == 200, (where, answer)
    if dropped is not None:
        assert any(repr(dropped) in w and "dropping" in w for w in seen.warnings), (where, seen.warnings)
        return
    skip = OPAQUE | {"result"} if value.get("type") == "image_generation_call" else OPAQUE
    texts = markers_of(value, member.__name__ + ".", skip)
    missing = [text for text in texts if not seen.rendered(text)]
    assert not missing, (where, missing, seen.prompts[-1][-1500:])


# ---------------------------------------------------------------------- OpenAI Responses

RESPONSES_ITEMS = members(openai.types.responses.ResponseInputItemParam)
RESPONSES_TOOLS = members(openai.types.responses.ToolParam)


def test_every_responses_item_type_has_a_rule() -> None:
    tags = {type_tag(member) or "item_reference" for member in RESPONSES_ITEMS}
    assert tags - known_item_types() == set(), (
        "input item types with no rule: update items.py and docs/api.md"
    )


@pytest.mark.parametrize("member", RESPONSES_ITEMS, ids=lambda m: m.__name__)
def test_responses_item(served: tuple[RunningServer, Seen], member: Any) -> None:
    server, seen = served
    tag = type_tag(member) or "item_reference"
    for value in variants(member):
        for stream in (False, True) if value == minimal(member) else (False,):
            # reasoning belongs to the assistant turn after it
            after = [{"role": "assistant", "content": "Done."}] if tag == "reasoning" else []
            body = {"model": server.model_id, "input": [QUESTION, value, *after], "max_output_tokens": 2}
            status, answer = _post(server, "/v1/responses", body, stream)
            if stream and status == 200:
                assert answer["type"] in ("response.completed", "response.incomplete"), answer
            if tag in ("additional_tools", "tool_search_output"):
                assert status == 200, (value, answer)
                for tool in value["tools"]:
                    _offered_or_ignored(seen, tool)
                continue
            media = _has_media(value, OPENAI_MEDIA)
            refused = "input.1" if tag in REFUSED_ITEMS or tag == "item_reference" or media else None
            _check(seen, status, answer, value, member, refused, tag if tag in DROPPED_ITEMS else None)


def _offered_or_ignored(seen: Seen, tool: dict[str, Any]) -> None:
    """A function, custom or namespace tool is offered (its name in the prompt); a hosted one is
    left out with one log line."""
    if tool["type"] in OFFERED_TOOL_KINDS:
        assert tool["name"] in seen.prompts[-1], tool
    else:
        assert any(repr(tool["type"]) in w and "ignoring" in w for w in seen.warnings), (tool, seen.warnings)


@pytest.mark.parametrize("member", RESPONSES_TOOLS, ids=lambda m: m.__name__)
def test_responses_tool(served: tuple[RunningServer, Seen], member: Any) -> None:
    """A function, custom or namespace tool is offered (its name in the prompt); a hosted one is
    left out with one log line."""
    server, seen = served
    tool = minimal(member)
    body = {"model": server.model_id, "input": "hi", "tools": [tool], "max_output_tokens": 2}
    status, answer = _post(server, "/v1/responses", body, False)
    assert status == 200, (tool, answer)
    _offered_or_ignored(seen, tool)


# ---------------------------------------------------------------------- Anthropic Messages

MESSAGES_BLOCKS = members(anthropic.types.ContentBlockParam) + members(
    anthropic.types.beta.BetaContentBlockParam
)


def test_every_messages_block_type_has_a_rule() -> None:
    tags = {type_tag(member) for member in MESSAGES_BLOCKS}
    assert None not in tags
    assert tags - known_block_types() == set(), (
        "content block types with no rule: update mapping.py and docs/api.md"
    )


def _conversation(tag: str, block: dict[str, Any]) -> list[dict[str, Any]]:
    """Where the block goes: calls and reasoning in an assistant turn, a server tool's result
    after its call in the assistant's turn (as Anthropic returns them), the rest in a user turn."""
    if tag in ASSISTANT_BLOCKS:
        return [QUESTION, {"role": "assistant", "content": [block]}, {"role": "user", "content": "go on"}]
    if tag in SERVER_TOOL_RESULTS:
        call = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}
        turn = {"role": "assistant", "content": [call, block]}
        return [QUESTION, turn, {"role": "user", "content": "go on"}]
    return [QUESTION, {"role": "assistant", "content": "Let me see."}, {"role": "user", "content": [block]}]


@pytest.mark.parametrize("member", MESSAGES_BLOCKS, ids=lambda m: m.__name__)
def test_messages_block(served: tuple[RunningServer, Seen], member: Any) -> None:
    server, seen = served
    tag = type_tag(member)
    assert tag is not None
    for value in variants(member):
        for stream in (False, True) if value == minimal(member) else (False,):
            body = {"model": server.model_id, "max_tokens": 2, "messages": _conversation(tag, value)}
            status, answer = _post(server, "/v1/messages", body, stream)
            if stream and status == 200:
                assert answer["type"] == "message_stop", answer
            turn = 1 if tag in ASSISTANT_BLOCKS or tag in SERVER_TOOL_RESULTS else 2
            refused = f"messages.{turn}.content" if _has_media(value, ANTHROPIC_MEDIA) else None
            empty_compaction = tag == "compaction" and not value.get("content")
            dropped = tag if tag in DROPPED_BLOCKS or empty_compaction else None
            _check(seen, status, answer, value, member, refused, dropped)


def test_the_server_answers_after_every_type(served: tuple[RunningServer, Seen]) -> None:
    server, _ = served
    status, answer = _post(server, "/v1/responses", {"model": server.model_id, "input": "hi"}, False)
    assert status == 200, answer


# ---------------------------------------------------------------------- the rules in detail


def _chat(input_items: list[dict[str, Any]], **fields: Any) -> Any:
    body = ResponsesRequest.model_validate({"model": "m", "input": input_items, **fields})
    chat, _ = responses_chat(body, set(), 16)
    return chat


def test_an_output_without_call_id_answers_the_earliest_open_call_of_its_name() -> None:
    """Codex's goal tools send their outputs with name and namespace and no call_id."""
    call = {"type": "function_call", "name": "goal_objective", "namespace": "agent", "arguments": "{}"}
    output = {"type": "function_call_output", "name": "goal_objective", "namespace": "agent"}
    chat = _chat(
        [
            QUESTION,
            {**call, "call_id": "c1"},
            {**call, "call_id": "c2"},
            {**output, "output": "first"},
            {**output, "output": "second"},
            {**output, "output": "orphan"},
            {"type": "function_call_output", "name": "never_called", "output": "stray"},
        ]
    )
    results = [m for m in chat.messages if m.role == "tool"]
    assert [(m.content, m.tool_call_id) for m in results] == [
        ("first", "c1"),
        ("second", "c2"),
        ("orphan", None),
        ("stray", None),
    ]
    assert [m.name for m in results] == ["agent__goal_objective"] * 3 + ["never_called"]


def test_a_configuration_update_sets_the_format_and_effort() -> None:
    update = {
        "type": "configuration_update",
        "reasoning": {"effort": "high"},
        "text": {"format": {"type": "json_object"}},
    }
    chat = _chat([QUESTION, update], reasoning={"effort": "low"})
    assert chat.template_kwargs == {"reasoning_effort": "high"}
    assert chat.output_format is not None and chat.output_format.type == "json_object"


def test_a_plain_text_file_part_is_text() -> None:
    data = "data:text/plain;base64," + base64.b64encode(b"the file's words").decode()
    chat = _chat(
        [{"role": "user", "content": [{"type": "input_file", "file_data": data, "filename": "a.txt"}]}]
    )
    assert chat.messages[-1].content == "the file's words"


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        pytest.param(
            "/v1/responses",
            {"input": [QUESTION, {"type": "function_call", "call_id": "c1", "name": "f"}]},
            "input.1.arguments",
            "input.1.arguments: Field required",
            id="responses-missing-field",
        ),
        pytest.param(
            "/v1/responses",
            {"input": [QUESTION, {"type": "no_such_item"}]},
            "input.1",
            "input.1: unknown input item type 'no_such_item'",
            id="responses-unknown-type",
        ),
        pytest.param(
            "/v1/responses",
            {"input": [QUESTION, {"type": "item_reference", "id": "msg_1"}]},
            "input.1",
            "input.1: this server stores no responses",
            id="responses-item-reference",
        ),
        pytest.param(
            "/v1/messages",
            {
                "max_tokens": 2,
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}
                ],
            },
            "messages.0.content.0.name",
            "messages.0.content.0.name: Field required",
            id="messages-missing-field",
        ),
        pytest.param(
            "/v1/messages",
            {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "no_such_block"}]}]},
            "messages.0.content.0",
            "messages.0.content.0: unknown content block type 'no_such_block'",
            id="messages-unknown-type",
        ),
        pytest.param(
            "/api/chat",
            {"messages": [{"content": "hi"}], "stream": False},
            "messages.0.role",
            "messages.0.role: Field required",
            id="ollama-missing-field",
        ),
    ],
)
def test_a_refusal_names_the_item_and_field(
    served: tuple[RunningServer, Seen], path: str, body: dict[str, Any], param: str, message: str
) -> None:
    server, _ = served
    response = httpx.post(server.base_url + path, json={"model": server.model_id, **body}, timeout=60)
    assert response.status_code == 400, response.text
    answer = response.json()
    text = answer["error"] if path.startswith("/api/") else answer["error"]["message"]
    assert text.startswith(message), text
    assert "more problems" not in text and ".str" not in text and "list[" not in text, text
    if path.startswith("/v1/messages"):
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    if not path.startswith("/api/"):
        assert answer["error"]["param"] == param
