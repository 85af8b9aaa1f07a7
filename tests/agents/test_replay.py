"""The agents' recorded follow-up requests (sequences/*.json), replayed against a real server.

Each sequence holds what one run of a pinned CLI (Codex CLI, Claude Code, opencode) sent after
its first request: the model's tool calls and their outputs sent back, Codex's
call-id-less outputs among them (sequences.py; `make agent-sequences` records them again). A
follow-up the server refuses is caught here without the CLI's randomness or its minutes.

Every check that can refuse a request (validation, the item and block rules, the template, the
grammar, the context length) runs before the 200 is sent, so each request is sent streamed and
the stream is closed at its first event: the prompts are 10-40k tokens, and their prefill, which
the agent tests run, would take minutes here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agents.harness import SERVED_ID
from tests.agents.sequences import load, without_call_id
from tests.servers import RunningServer, running_server

SEQUENCES = load()
# the CLIs with a recorded sequence: qwen-code sends no follow-up on the tiny model's weights (its
# one request is test_agents.py's)
AGENTS = {"codex", "claude-code", "opencode"}


@pytest.fixture(scope="module")
def server(tiny_model: Any) -> Iterator[RunningServer]:
    # as the agent tests serve: the long prompts fit, any model id (Claude Code's haiku requests)
    with running_server(Path(tiny_model("tiny-qwen3moe")), ctx_size=65536, alias=[SERVED_ID, "*"]) as served:
        yield served


def test_every_agent_has_a_sequence() -> None:
    assert {sequence["agent"] for sequence in SEQUENCES.values()} == AGENTS, sorted(SEQUENCES)
    assert all(sequence["requests"] for sequence in SEQUENCES.values())
    # what broke one Codex run in eight: outputs of its goal tools with no call_id
    assert without_call_id(SEQUENCES["codex-no-call-id"]["requests"]) > 0


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_replayed_sequence_is_taken(server: RunningServer, name: str) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for i, request in enumerate(SEQUENCES[name]["requests"]):
            body = {**request["body"], "stream": True}
            with client.stream("POST", request["path"], json=body) as response:
                if response.status_code != 200:
                    answer = response.read().decode(errors="replace")
                    pytest.fail(f"{name} request {i} ({request['path']}): {response.status_code} {answer}")
                first = next(line for line in response.iter_lines() if line.startswith("data: "))
                assert "error" not in json.loads(first.removeprefix("data: ")), (name, i, first)
    assert client.is_closed
    health = httpx.get(server.base_url + "/health", timeout=30)
    assert health.status_code == 200
