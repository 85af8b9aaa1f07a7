"""Agent request sequences: recorded from the real CLIs, scrubbed, replayed by test_replay.py.

A sequence is the API requests one agent run sent after its first (the follow-ups, which carry
the model's tool calls and their outputs back), as JSON: {"agent", "requests": [{"path",
"body"}]}. Before it is written, everything of the machine and the moment is scrubbed: the run's
directories, the repository's path and the server's port become fixed stand-ins, dates and times
(epoch seconds and milliseconds too) fixed ones, and every id (call ids, response ids, session
ids) a stand-in numbered in order of first appearance, so a call and its output still match.

`make agent-sequences` records them again (tests/agents/record.py); the files live in
tests/agents/sequences/.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.agents.harness import Exchange, Recorder

SEQUENCES = Path(__file__).resolve().parent / "sequences"
API_PATHS = ("/v1/responses", "/v1/messages", "/v1/chat/completions")
# keys whose string values are ids: scrubbed to stand-ins that keep equal ids equal
ID_KEYS = frozenset(
    {
        "id",
        "call_id",
        "tool_use_id",
        "tool_call_id",
        "previous_response_id",
        "prompt_cache_key",
        "session_id",
        "user_id",
        "conversation_id",
    }
)
_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?)?\b")
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_LONG_DATE = re.compile(
    rf"\b(?:(?:Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day,? )?(?:{_MONTHS}) \d{{1,2}},? \d{{4}}\b"
)
_CLOCK = re.compile(r"\b\d{2}:\d{2}:\d{2}\b")
# a moment as seconds or milliseconds since the epoch (2020-2033)
_EPOCH = re.compile(r"\b1[6-9]\d{8}(?:\d{3})?\b")
_EPOCH_STAND_IN = {10: "1767225600", 13: "1767225600000"}
_UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


@dataclass
class Scrubber:
    """Replaces machine paths, the port, dates and ids in a request body (see the module doc)."""

    paths: dict[str, str]  # a path of this machine -> its stand-in, longest first
    port: int
    ids: dict[str, str] = field(default_factory=dict)

    def _id(self, value: str) -> str:
        if value not in self.ids:
            self.ids[value] = f"id_{len(self.ids) + 1}"
        return self.ids[value]

    def text(self, value: str) -> str:
        for path, stand_in in sorted(self.paths.items(), key=lambda kv: -len(kv[0])):
            value = value.replace(path, stand_in)
        value = value.replace(f"127.0.0.1:{self.port}", "127.0.0.1:8000")
        value = _DATE.sub("2026-01-01", value)
        value = _LONG_DATE.sub("January 1, 2026", value)
        value = _CLOCK.sub("12:00:00", value)
        value = _EPOCH.sub(lambda m: _EPOCH_STAND_IN[len(m.group(0))], value)
        return _UUID.sub(lambda m: self._id(m.group(0)), value)

    def value(self, value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: self.value(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v, key) for v in value]
        if isinstance(value, str):
            return self._id(value) if key in ID_KEYS else self.text(value)
        if isinstance(value, int) and not isinstance(value, bool) and _EPOCH.fullmatch(str(value)):
            return int(_EPOCH_STAND_IN[len(str(value))])
        return value


def api_requests(exchanges: list[Exchange]) -> list[dict[str, Any]]:
    """The API requests among `exchanges`, as {"path", "body"}."""
    return [
        {"path": e.path, "body": e.body()}
        for e in exchanges
        if e.method == "POST" and e.path in API_PATHS and isinstance(e.body(), dict)
    ]


def follow_ups(recorder: Recorder) -> list[dict[str, Any]]:
    """The API requests of a run after its first, as {"path", "body"}."""
    return api_requests(recorder.exchanges)[1:]


def carries_tool_results(requests: list[dict[str, Any]]) -> bool:
    """Whether any of these requests sends a tool's result back (a chat tool message, a Responses
    function_call_output, a Messages tool_result block)."""

    def results(body: dict[str, Any]) -> bool:
        items = body.get("input") if isinstance(body.get("input"), list) else body.get("messages")
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, dict):
                continue
            if item.get("role") == "tool" or str(item.get("type", "")).endswith("_output"):
                return True
            content = item.get("content")
            if isinstance(content, list) and any(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in content
            ):
                return True
        return False

    return any(results(request["body"]) for request in requests)


def without_call_id(requests: list[dict[str, Any]]) -> int:
    """How many function_call_output items of these requests have no call_id (Codex's goal tools)."""
    return sum(
        1
        for request in requests
        for item in (request["body"].get("input") if isinstance(request["body"].get("input"), list) else [])
        if isinstance(item, dict) and item.get("type") == "function_call_output" and not item.get("call_id")
    )


def write(name: str, agent: str, requests: list[dict[str, Any]], scrubber: Scrubber) -> Path:
    out = SEQUENCES / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    body = {"agent": agent, "requests": [scrubber.value(r) for r in requests]}
    out.write_text(json.dumps(body, indent=1, ensure_ascii=False) + "\n")
    return out


def load() -> dict[str, dict[str, Any]]:
    """Every committed sequence, by file stem."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(SEQUENCES.glob("*.json"))}
