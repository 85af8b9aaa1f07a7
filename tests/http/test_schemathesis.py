"""Schemathesis against /openapi.json: no generated request makes the server answer 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.servers import RunningServer, running_server

KEY = "schema-key"
# examples per operation: enough to hit bounds, nulls and wrong types, fast on 2 cores
EXAMPLES = 25


@pytest.fixture(scope="module")
def server(tiny_model: Any) -> Iterator[RunningServer]:
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=512, api_key=KEY, max_completion_tokens=8) as s:
        yield s


@pytest.mark.slow
def test_no_generated_request_gets_a_5xx(server: RunningServer) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json", headers=headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    failures: list[str] = []
    for operation in operations:

        @settings(
            max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            if isinstance(case.body, dict) and "model" in case.body:
                # the served id, so generated requests get past the 404 and into generation
                case.body["model"] = server.model_id
            response = case.call(base_url=server.base_url, headers=headers, timeout=60)
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text}"
                )
            elif response.status_code >= 400:
                # the Anthropic routes' envelope also has "type": "error"
                envelope = {"type", "error"} if case.path.startswith("/v1/messages") else {"error"}
                assert set(response.json()) == envelope, response.text

        check()
    assert not failures, "\n".join(failures[:5])
