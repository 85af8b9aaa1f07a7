"""The official openai client against a real server on a tiny synthetic model.

Random weights make the text gibberish: the tests assert on structure, determinism, grammar
validity and token counts, never on wording.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.servers import RunningServer, running_server

GREEDY: dict[str, Any] = {"temperature": 0.0}
MESSAGES: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "boolean"}},
            "required": ["unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["utc", "local"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(tiny_model: Any) -> Iterator[RunningServer]:
    with running_server(tiny_model("tiny-qwen3moe"), ctx_size=2048) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _no_eog(server: RunningServer) -> dict[str, int]:
    # forbid end-of-generation tokens so a request runs exactly to its token limit
    return {str(t): -100 for t in server.eog_tokens()}


def test_chat_non_stream(client: openai.OpenAI, server: RunningServer) -> None:
    result = client.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=8, **GREEDY)
    assert result.id.startswith("chatcmpl-")
    assert result.object == "chat.completion"
    assert result.model == server.model_id
    assert result.system_fingerprint and result.system_fingerprint.startswith("fp_moeflash-")
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = result.usage
    assert usage is not None
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 8 or choice.finish_reason == "stop"
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None


def test_chat_stream_matches_non_stream_and_reports_usage(
    client: openai.OpenAI, server: RunningServer
) -> None:
    kwargs: dict[str, Any] = {"model": server.model_id, "messages": MESSAGES, "max_tokens": 12, **GREEDY}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    first, *middle, last_choice_chunk, usage_chunk = chunks
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    assert all(c.id == first.id for c in chunks)
    assert all(c.choices[0].finish_reason is None for c in middle)
    text = "".join(c.choices[0].delta.content or "" for c in middle)
    assert text == whole.choices[0].message.content
    assert last_choice_chunk.choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and whole.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_include_usage_sends_no_usage_chunk(
    client: openai.OpenAI, server: RunningServer
) -> None:
    chunks = list(
        client.chat.completions.create(
            model=server.model_id, messages=MESSAGES, max_tokens=4, stream=True, **GREEDY
        )
    )
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_string_cuts_the_output(client: openai.OpenAI, server: RunningServer) -> None:
    common: dict[str, Any] = {
        "model": server.model_id,
        "messages": MESSAGES,
        "logit_bias": _no_eog(server),
        **GREEDY,
    }
    reference = client.chat.completions.create(max_tokens=24, **common).choices[0].message.content or ""
    stop = next(reference[i : i + 2] for i in range(4, len(reference) - 2) if reference[i : i + 2].strip())
    expected = reference[: reference.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(max_tokens=24, stop=[stop], stream=True, **common))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            result = client.chat.completions.create(max_tokens=24, stop=stop, **common)
            text, finish = result.choices[0].message.content or "", result.choices[0].finish_reason
        assert text == expected
        assert finish == "stop"


def test_seed_makes_sampling_deterministic(client: openai.OpenAI, server: RunningServer) -> None:
    def sample(seed: int) -> str:
        result = client.chat.completions.create(
            model=server.model_id,
            messages=MESSAGES,
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            logit_bias=_no_eog(server),
        )
        return result.choices[0].message.content or ""

    assert sample(1234) == sample(1234)
    assert len({sample(seed) for seed in range(5)}) > 1  # it is sampling, not greedy


def test_max_completion_tokens_is_exact(client: openai.OpenAI, server: RunningServer) -> None:
    result = client.chat.completions.create(
        model=server.model_id,
        messages=MESSAGES,
        max_completion_tokens=7,
        logit_bias=_no_eog(server),
        **GREEDY,
    )
    assert result.usage is not None
    assert result.usage.completion_tokens == 7
    assert result.choices[0].finish_reason == "length"


def test_logprobs_greedy_token_is_the_top_one(client: openai.OpenAI, server: RunningServer) -> None:
    result = client.chat.completions.create(
        model=server.model_id,
        messages=MESSAGES,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        logit_bias=_no_eog(server),
        **GREEDY,
    )
    content = result.choices[0].logprobs and result.choices[0].logprobs.content
    assert content and result.usage is not None
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])


def test_logit_bias_forces_a_token(client: openai.OpenAI, server: RunningServer) -> None:
    forced = server.model.llama.tokenize(b"z", add_bos=False)[0]
    result = client.chat.completions.create(
        model=server.model_id, messages=MESSAGES, max_tokens=5, logit_bias={str(forced): 100}, **GREEDY
    )
    assert result.choices[0].message.content == "z" * 5


def test_multi_turn_reuses_the_kv_cache(client: openai.OpenAI, server: RunningServer) -> None:
    first = client.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=6, **GREEDY)
    answer = first.choices[0].message.content or ""
    follow_up = [*MESSAGES, {"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model=server.model_id, messages=follow_up, max_tokens=4, **GREEDY)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def _valid_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"unit", "days"} and args["unit"] in ("c", "f") and isinstance(args["days"], bool)
    else:
        assert name == "get_time" and args == {"zone": args["zone"]} and args["zone"] in ("utc", "local")


def test_tool_choice_named(client: openai.OpenAI, server: RunningServer) -> None:
    result = client.chat.completions.create(
        model=server.model_id,
        messages=MESSAGES,
        tools=[WEATHER_TOOL, TIME_TOOL],
        max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        **GREEDY,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1
    assert calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_time"  # type: ignore[union-attr]
    _valid_call("get_time", calls[0].function.arguments)  # type: ignore[union-attr]


@pytest.mark.parametrize("parallel", [pytest.param(False, id="single"), pytest.param(True, id="parallel")])
def test_tool_choice_required(client: openai.OpenAI, server: RunningServer, parallel: bool) -> None:
    result = client.chat.completions.create(
        model=server.model_id,
        messages=MESSAGES,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=1500,
        seed=3,
        temperature=0.7,
    )
    calls = result.choices[0].message.tool_calls
    assert result.choices[0].finish_reason == "tool_calls"
    assert calls and (parallel or len(calls) == 1)
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        _valid_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "tool_choice",
    [
        pytest.param({"type": "function", "function": {"name": "get_weather"}}, id="named"),
        pytest.param("required", id="required"),
    ],
)
def test_tool_call_deltas_assembled_by_the_client(
    client: openai.OpenAI, server: RunningServer, tool_choice: Any
) -> None:
    kwargs: dict[str, Any] = {
        "model": server.model_id,
        "messages": MESSAGES,
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "max_tokens": 200,
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        **GREEDY,
    }
    with client.chat.completions.stream(**kwargs) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    whole = client.chat.completions.create(**kwargs)
    calls = final.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and len(deltas) > 1  # the arguments arrived in pieces
    expected = whole.choices[0].message.tool_calls
    assert expected is not None
    assert calls[0].function.name == expected[0].function.name  # type: ignore[union-attr]
    assert calls[0].function.arguments == expected[0].function.arguments  # type: ignore[union-attr]
    _valid_call(calls[0].function.name, calls[0].function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"


def test_unknown_fields_are_accepted_and_logged_once(
    client: openai.OpenAI, server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    base: dict[str, Any] = {"model": server.model_id, "messages": MESSAGES, "max_tokens": 2, **GREEDY}
    with caplog.at_level("WARNING", logger="server.http.serving"):
        for _ in range(3):
            result = client.chat.completions.create(extra_body={"frobnicate_level": 3}, **base)
            assert result.choices[0].finish_reason in ("stop", "length")
    warnings = [r for r in caplog.records if "frobnicate_level" in r.getMessage()]
    assert len(warnings) == 1


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, server: RunningServer) -> None:
    base: dict[str, Any] = {"model": server.model_id, "messages": MESSAGES, "max_tokens": 2, **GREEDY}
    plain = client.chat.completions.create(**base)
    # a variable the template does not use changes nothing; one that clashes is a 400
    unused = client.chat.completions.create(
        extra_body={"chat_template_kwargs": {"unused_flag": True}}, **base
    )
    assert plain.usage is not None and unused.usage is not None
    assert unused.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(extra_body={"chat_template_kwargs": {"messages": []}}, **base)


def test_tool_choice_auto_renders_tools_into_the_prompt(client: openai.OpenAI, server: RunningServer) -> None:
    # the model decides; with random weights it answers in text, but the template must see the tools
    base: dict[str, Any] = {"model": server.model_id, "messages": MESSAGES, "max_tokens": 4, **GREEDY}
    plain = client.chat.completions.create(**base)
    with_tools = client.chat.completions.create(tools=[WEATHER_TOOL], tool_choice="auto", **base)
    assert plain.usage is not None and with_tools.usage is not None
    if "tools" in (server.model.info.chat_template or ""):
        assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_calls_are_grammar_checked(
    client: openai.OpenAI, server: RunningServer, stream: bool
) -> None:
    opener = server.model.llama.tokenize(b"<tool_call>", add_bos=False, special=True)
    if len(opener) != 1 or "<tool_call>" not in (server.model.info.chat_template or ""):
        pytest.skip("the model's template has no single-token <tool_call>")
    # push the model into opening a call: from there on the lazy grammar must keep it valid
    kwargs: dict[str, Any] = {
        "model": server.model_id,
        "messages": MESSAGES,
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "max_tokens": 300,
        "logit_bias": {str(opener[0]): 100},
        **GREEDY,
    }
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            result = events.get_final_completion()
    else:
        result = client.chat.completions.create(**kwargs)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1
    _valid_call(calls[0].function.name, calls[0].function.arguments)  # type: ignore[union-attr]


class Verdict(BaseModel):
    ok: bool
    level: Literal["low", "mid", "high"]
    count: int = Field(ge=0)


def test_parse_with_a_pydantic_schema(client: openai.OpenAI, server: RunningServer) -> None:
    result = client.beta.chat.completions.parse(
        model=server.model_id, messages=MESSAGES, response_format=Verdict, max_tokens=200, **GREEDY
    )
    parsed = result.choices[0].message.parsed
    assert isinstance(parsed, Verdict)


def test_response_format_json_object_is_json(client: openai.OpenAI, server: RunningServer) -> None:
    forced_close = server.model.llama.tokenize(b"}", add_bos=False)[0]
    result = client.chat.completions.create(
        model=server.model_id,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=64,
        logit_bias={str(forced_close): 30},
        **GREEDY,
    )
    assert isinstance(json.loads(result.choices[0].message.content or ""), dict)


def test_legacy_completions(client: openai.OpenAI, server: RunningServer) -> None:
    whole = client.completions.create(model=server.model_id, prompt="once upon", max_tokens=6, **GREEDY)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].finish_reason in ("stop", "length")
    streamed = list(
        client.completions.create(
            model=server.model_id, prompt="once upon", max_tokens=6, stream=True, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    with_lp = client.completions.create(
        model=server.model_id, prompt="once upon", max_tokens=3, logprobs=2, **GREEDY
    )
    logprobs = with_lp.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert with_lp.usage is not None and len(logprobs.tokens) == with_lp.usage.completion_tokens
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)


def test_models_list_and_retrieve(client: openai.OpenAI, server: RunningServer) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.model_id]
    card = client.models.retrieve(server.model_id)
    assert card.id == server.model_id
    assert card.model_extra is not None and card.model_extra["context_length"] == 2048
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_timings_extension_is_opt_in(client: openai.OpenAI, server: RunningServer) -> None:
    base: dict[str, Any] = {"model": server.model_id, "messages": MESSAGES, "max_tokens": 3, **GREEDY}
    plain = client.chat.completions.create(**base)
    assert plain.model_extra is None or "timings" not in plain.model_extra
    flagged = client.chat.completions.create(extra_body={"timings": True}, **base)
    by_header = client.chat.completions.create(extra_headers={"X-Moeflash-Timings": "1"}, **base)
    for result in (flagged, by_header):
        assert result.model_extra is not None
        timings = result.model_extra["timings"]
        # the documented fields, at the scope named
        assert set(timings) == {
            "scope",
            "prompt_ms",
            "decode_ms",
            "tok_per_s",
            "flash_wait_ms",
            "compute_ms",
            "cache_ms",
            "helper_wait_ms",
            "hit_rate",
            "bytes_read",
            "prefetch_hits",
            "expert_memory_bytes",
            "budget_bytes",
        }
        assert timings["scope"] == "request"
        assert timings["prompt_ms"] >= 0 and timings["decode_ms"] >= 0
        # a resident model streams nothing: the streamer's numbers are absent, not invented
        assert timings["flash_wait_ms"] is None and timings["bytes_read"] is None
        assert timings["helper_wait_ms"] is None  # no RPC helper


def test_aliases_serve_the_model_under_the_names_clients_send(tiny_model: Any) -> None:
    """--alias is repeatable: the first is the model's id, every alias and the file stem are
    accepted and listed, the answer names the model as it was asked for, other names are 404."""
    path = tiny_model("tiny-qwen3moe")
    with running_server(path, ctx_size=512, alias=["gpt-4o-mini", "claude-x"]) as server:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
            assert server.model_id == "gpt-4o-mini"
            names = [m.id for m in c.models.list().data]
            assert names == ["gpt-4o-mini", "claude-x", path.name.removesuffix(".gguf")]
            for name in names:
                assert c.models.retrieve(name).id == name
                answer = c.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2, **GREEDY)
                assert answer.model == name
            with pytest.raises(openai.NotFoundError):
                c.chat.completions.create(model="gpt-5", messages=MESSAGES, max_tokens=2)
            with pytest.raises(openai.NotFoundError):
                c.models.retrieve("gpt-5")


@pytest.mark.parametrize("budget", ["all", "auto", "ALL"])
def test_serve_budget_words(tiny_model: Any, budget: str) -> None:
    """--budget all holds every expert (nothing is ever evicted); auto is the automatic budget."""
    from tests.models import expert_layer_bytes

    path = tiny_model("tiny-qwen3moe")
    with running_server(path, ctx_size=512, mode="streaming", budget=budget) as server:
        info = server.model.info
        assert info.mode == "streaming" and info.budget_bytes is not None
        if budget.lower() == "all":
            n_layer = 4  # tiny-qwen3moe
            assert info.budget_bytes == n_layer * expert_layer_bytes(path)
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
            card = c.models.retrieve(server.model_id)
            assert card.model_extra is not None and card.model_extra["budget_bytes"] == info.budget_bytes
            answer = c.chat.completions.create(
                model=server.model_id, messages=MESSAGES, max_tokens=3, **GREEDY
            )
            assert answer.choices[0].message.content is not None


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_chunks_carry_their_tokens_timings(tiny_model: Any, endpoint: str) -> None:
    """With timings on, a streamed chunk carries the decode step of the token in it (the chat page
    draws its bars from these as the answer streams); a streamed model splits it."""
    from tests.models import expert_layer_bytes

    path = tiny_model("tiny-qwen3moe")
    # a budget of one layer's experts: every token routes (with every expert cached, routing stops
    # being watched and the hit and prefetch counts are None)
    budget = str(expert_layer_bytes(path))
    with running_server(path, ctx_size=512, mode="streaming", budget=budget) as server:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
            common: dict[str, Any] = {
                "model": server.model_id,
                "max_tokens": 8,
                "stream": True,
                "extra_body": {"timings": True},
                "logit_bias": _no_eog(server),
                **GREEDY,
            }
            if endpoint == "chat":
                chunks = list(client.chat.completions.create(messages=MESSAGES, **common))
            else:
                chunks = list(client.completions.create(prompt="hello", **common))
    per_token = [c.model_extra["timings"] for c in chunks if c.model_extra and "timings" in c.model_extra]
    # every token after the first (whose step is the prompt) and the final aggregate
    assert len(per_token) >= 7, per_token
    for timing in per_token[:-1]:
        assert timing["scope"] == "token"
        assert timing["prompt_ms"] is None and timing["decode_ms"] > 0
        assert timing["compute_ms"] is not None and timing["flash_wait_ms"] is not None
        assert timing["bytes_read"] is not None and timing["prefetch_hits"] is not None
        assert timing["expert_memory_bytes"] > 0 and timing["budget_bytes"] == int(budget)
    assert per_token[-1]["prompt_ms"] is not None  # the final chunk's totals
    assert per_token[-1]["scope"] == "request" and set(per_token[-1]) == set(per_token[0])
