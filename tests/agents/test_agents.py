"""Seven coding agents and agent libraries, unmodified and pinned, against a real server on the
demo model (tiny-qwen3moe): Codex CLI, Claude Code, opencode, qwen-code, aider, the OpenAI Agents
SDK (Responses and Chat Completions) and pydantic-ai.

Each is configured as README's "Pointing coding agents at the server" says, with a home of its
own and nothing that phones home (no telemetry, update checks, login or registry look-ups). A run
passes when the client ends in its own success (exit code 0, its result marked a success) and
the server refused none of its requests; the demo model's random weights make its text
gibberish, which is fine. Where a client can force a tool call, the call comes back as one. The
recorder around the real app shows what arrived: Codex's hosted (web_search) and namespace tools,
Claude Code's annotation-only schema property (a description and no type).

The CLIs come from tests/agents/package.json (with Node.js 22, the npm package `node`) and run
as clis.py says, aider from .venv/aider, the libraries from the dev set: `make setup-dev`
installs them, and a missing one fails its test.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from tests.agents import clis
from tests.agents.clis import AGENT_TIMEOUT_S, PROMPT
from tests.agents.harness import (
    AIDER_PYTHON,
    SERVED_ID,
    AgentServer,
    installed,
    offline_env,
    recorded_server,
    run_agent,
)

pytestmark = pytest.mark.slow

# flash attention on: without it, decoding after a 15k-token prompt takes ~0.5 s a token on two
# cores (with it, ~4 ms)
SERVER: dict[str, Any] = {"ctx_size": 65536, "flash_attn": "on"}


@pytest.fixture(scope="module")
def demo_model(tiny_model: Any) -> Path:
    return Path(tiny_model("tiny-qwen3moe"))


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """The agent's working directory: a small project of its own."""
    return clis.project(tmp_path / "work")


@pytest.fixture
def agent_server(demo_model: Path) -> Iterator[AgentServer]:
    with recorded_server(demo_model, alias=[SERVED_ID], **SERVER) as served:
        yield served


def untyped_properties(schema: Any, path: str = "") -> list[str]:
    """Paths of the properties in `schema` that carry annotations only (no type, no combinator)."""
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    typing_keys = {"type", "anyOf", "oneOf", "allOf", "$ref", "enum", "const", "not"}
    for name, sub in (schema.get("properties") or {}).items():
        if isinstance(sub, dict) and sub and not typing_keys & sub.keys():
            found.append(f"{path}.{name}")
        found += untyped_properties(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        found += untyped_properties(schema.get(key), f"{path}.{key}")
    for key in ("anyOf", "oneOf", "allOf"):
        for i, sub in enumerate(schema.get(key) or []):
            found += untyped_properties(sub, f"{path}.{key}[{i}]")
    return found


def test_codex_cli(agent_server: AgentServer, work: Path, tmp_path: Path) -> None:
    """`codex exec` with a custom model provider on the Responses API and its default tools."""
    run = clis.codex(agent_server.base_url, work, tmp_path)
    recorder = agent_server.recorder
    assert run.returncode == 0, run.tail() + "\n" + recorder.report()
    recorder.assert_no_error()
    turns = recorder.posts("/v1/responses")
    tools = next((turn.body()["tools"] for turn in turns if turn.body().get("tools")), None)
    assert tools, recorder.report()
    kinds = {tool["type"] for tool in tools}
    assert "web_search" in kinds, f"Codex sent no hosted tool: {sorted(kinds)}"
    namespaces = [tool for tool in tools if tool["type"] == "namespace"]
    assert namespaces and all(ns.get("tools") for ns in namespaces), f"no namespace tool: {sorted(kinds)}"
    assert all(b"response.completed" in turn.tail for turn in turns), recorder.report()


def test_claude_code(demo_model: Path, work: Path, tmp_path: Path) -> None:
    """`claude -p` with ANTHROPIC_BASE_URL at the server and its default tools; served with
    `--alias '*'` for the side requests Claude Code sends to a haiku model."""
    with recorded_server(demo_model, alias=[SERVED_ID, "*"], **SERVER) as served:
        run = clis.claude_code(served.base_url, work, tmp_path)
    recorder = served.recorder
    assert run.returncode == 0, run.tail() + "\n" + recorder.report()
    result = json.loads(run.stdout)
    assert result["is_error"] is False and result["subtype"] == "success", run.tail()
    recorder.assert_no_error()
    turns = recorder.posts("/v1/messages")
    tools = next((turn.body()["tools"] for turn in turns if turn.body().get("tools")), None)
    assert tools, recorder.report()
    names = {tool["name"] for tool in tools}
    assert {"Bash", "Read", "Edit", "Write"} <= names, f"not Claude Code's default tools: {sorted(names)}"
    untyped = [f"{tool['name']}{path}" for tool in tools for path in untyped_properties(tool["input_schema"])]
    assert untyped, "no annotation-only schema property arrived (Claude Code's Workflow tool has one)"


def test_opencode(agent_server: AgentServer, work: Path, tmp_path: Path) -> None:
    """`opencode run` with a custom OpenAI-compatible provider in OPENCODE_CONFIG_CONTENT."""
    run = clis.opencode(agent_server.base_url, work, tmp_path)
    recorder = agent_server.recorder
    assert run.returncode == 0, run.tail() + "\n" + recorder.report()
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    errors = [event for event in events if event.get("type") == "error"]
    assert not errors, run.tail()
    recorder.assert_no_error()
    turns = recorder.posts("/v1/chat/completions")
    assert any(turn.body().get("tools") for turn in turns), recorder.report()


def test_qwen_code(agent_server: AgentServer, work: Path, tmp_path: Path) -> None:
    """`qwen` (headless) with OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL."""
    run = clis.qwen_code(agent_server.base_url, work, tmp_path)
    recorder = agent_server.recorder
    # the demo model's random weights can keep calling tools until the session's turn limit: qwen
    # then exits 53 (FatalTurnLimitedError) after every turn ran against the server
    turn_limit = run.returncode == clis.QWEN_TURN_LIMIT and "FatalTurnLimitedError" in run.stderr
    assert run.returncode == 0 or turn_limit, run.tail() + "\n" + recorder.report()
    if not turn_limit:
        result = json.loads(run.stdout)[-1]
        assert result["type"] == "result" and result["is_error"] is False, run.tail()
    recorder.assert_no_error()
    turns = recorder.posts("/v1/chat/completions")
    assert any(turn.body().get("tools") for turn in turns), recorder.report()
    assert not turn_limit or len(turns) >= 4, recorder.report()


def test_aider(agent_server: AgentServer, work: Path, tmp_path: Path) -> None:
    """aider (its own venv) with --openai-api-base at the server, one message, no git."""
    python = installed(AIDER_PYTHON)
    model = f"openai/{SERVED_ID}"
    # aider reads a model's context size from here instead of downloading litellm's price list
    metadata = tmp_path / "model-metadata.json"
    metadata.write_text(
        json.dumps(
            {
                model: {
                    "max_input_tokens": 16384,
                    "max_output_tokens": 4096,
                    "input_cost_per_token": 0,
                    "output_cost_per_token": 0,
                    "litellm_provider": "openai",
                    "mode": "chat",
                }
            }
        )
    )
    env = offline_env(tmp_path, LITELLM_LOCAL_MODEL_COST_MAP="True")
    run = run_agent(
        [
            str(python),
            "-m",
            "aider",
            "--model",
            model,
            "--openai-api-base",
            f"{agent_server.base_url}/v1",
            "--openai-api-key",
            "unused",
            "--model-metadata-file",
            str(metadata),
            "--no-git",
            "--yes-always",
            "--no-check-update",
            "--analytics-disable",
            "--no-show-release-notes",
            "--no-show-model-warnings",
            "--no-pretty",
            "--no-fancy-input",
            "--message",
            PROMPT,
            "hello.py",
        ],
        env,
        work,
        AGENT_TIMEOUT_S,
    )
    recorder = agent_server.recorder
    assert run.returncode == 0, run.tail() + "\n" + recorder.report()
    recorder.assert_no_error()
    turns = recorder.posts("/v1/chat/completions")
    assert turns and all(b"[DONE]" in turn.tail for turn in turns), recorder.report()


class Weather(BaseModel):
    # enums: a random model's free string can run past any max_tokens before its quote comes
    city: Literal["Rome", "Paris", "Oslo"]
    unit: Literal["celsius", "fahrenheit"]


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_sdk(agent_server: AgentServer, api: str) -> None:
    """The OpenAI Agents SDK's Runner on both model classes: a forced tool call comes back as a
    call the SDK runs, and a plain streamed run ends."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        ToolCallItem,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK uploads traces to OpenAI unless told not to

    @function_tool
    def get_weather(city: Literal["Rome", "Paris", "Oslo"]) -> str:
        """Get the weather for a city."""
        return f"sunny in {city}"

    async def scenario() -> None:
        async with AsyncOpenAI(
            base_url=f"{agent_server.base_url}/v1", api_key="unused", max_retries=0
        ) as client:
            model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
            model = model_class(model=SERVED_ID, openai_client=client)
            agent = Agent(
                name="weather",
                instructions="Answer with the weather tool.",
                model=model,
                tools=[get_weather],
                model_settings=ModelSettings(tool_choice="get_weather"),
                tool_use_behavior="stop_on_first_tool",
            )
            result = await Runner.run(agent, "What is the weather in Rome?", max_turns=2)
            calls = [item for item in result.new_items if isinstance(item, ToolCallItem)]
            assert calls and getattr(calls[0].raw_item, "name", None) == "get_weather", result.new_items
            assert str(result.final_output).startswith("sunny in")

            chatter = Agent(name="chatter", instructions="Be brief.", model=model)
            streamed = Runner.run_streamed(chatter, PROMPT, max_turns=1)
            async for _ in streamed.stream_events():
                pass
            assert isinstance(streamed.final_output, str)

    asyncio.run(scenario())
    agent_server.recorder.assert_no_error()


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai(agent_server: AgentServer, api: str) -> None:
    """pydantic-ai's Agent with a structured output: its output tool is forced (tool_choice
    required), and the call's arguments validate as the output type."""
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def scenario() -> Weather:
        async with AsyncOpenAI(
            base_url=f"{agent_server.base_url}/v1", api_key="unused", max_retries=0
        ) as client:
            provider = OpenAIProvider(openai_client=client)
            model = (
                OpenAIChatModel(SERVED_ID, provider=provider)
                if api == "chat"
                else OpenAIResponsesModel(SERVED_ID, provider=provider)
            )
            agent = Agent(model, output_type=Weather)
            result = await agent.run("What is the weather in Rome, in celsius?")
            return result.output

    assert isinstance(asyncio.run(scenario()), Weather)
    recorder = agent_server.recorder
    recorder.assert_no_error()
    first = recorder.exchanges[0].body()
    assert first["tool_choice"] == "required", first.get("tool_choice")
