"""Fast tests of the server's pure logic: output splitting, tool-call parsing, settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from server.chat_template import reasoning_style
from server.errors import ConfigError
from server.gemma_calls import parse_call
from server.modelgen import templates
from server.reasoning import GemmaSplitter, HarmonySplitter, PlainSplitter, ThinkSplitter, make_splitter
from server.settings import load_settings, parse_size
from server.tools import GEMMA4_CALLS, HERMES_CALLS, ChatOutput, ToolCallArgs, ToolCallStart, call_syntax


def _feed_in_pieces(splitter: object, text: str, size: int) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for i in range(0, len(text), size):
        out.extend(splitter.feed(text[i : i + size]))  # type: ignore[attr-defined]
    out.extend(splitter.finish())  # type: ignore[attr-defined]
    return out


def _joined(pieces: list[tuple[str, str]]) -> dict[str, str]:
    joined: dict[str, str] = {}
    for kind, text in pieces:
        joined[kind] = joined.get(kind, "") + text
    return joined


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_think_blocks_go_to_reasoning_whatever_the_delta_size(size: int) -> None:
    text = "<think>step 1 < step 2</think>\n\nThe answer <is> 42."
    assert _joined(_feed_in_pieces(ThinkSplitter(), text, size)) == {
        "reasoning": "step 1 < step 2",
        "content": "The answer <is> 42.",
    }


def test_a_think_block_opened_by_the_prompt() -> None:
    splitter = make_splitter("think", "<|im_start|>assistant\n<think>\n")
    assert _joined(_feed_in_pieces(splitter, "hmm</think>yes", 2)) == {"reasoning": "hmm", "content": "yes"}


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_gemma_thought_channel_goes_to_reasoning(size: int) -> None:
    text = "<|channel>thought\nstep 1 <channel 2>\n<channel|>The answer <|channel is 42."
    assert _joined(_feed_in_pieces(GemmaSplitter(), text, size)) == {
        "reasoning": "step 1 <channel 2>\n",
        "content": "The answer <|channel is 42.",
    }


def test_gemma_prefilled_empty_thought_is_closed() -> None:
    # enable_thinking off: the template writes an empty thought channel; all output is content
    prompt = "<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    assert isinstance(make_splitter("gemma", prompt), GemmaSplitter)
    assert _joined(_feed_in_pieces(make_splitter("gemma", prompt), "Hello!", 2)) == {"content": "Hello!"}
    opened = make_splitter("gemma", "<|turn>model\n<|channel>thought\n")
    assert _joined(_feed_in_pieces(opened, "hmm<channel|>yes", 2)) == {"reasoning": "hmm", "content": "yes"}


def test_reasoning_style_and_call_syntax_of_each_template_family() -> None:
    assert reasoning_style(templates.CHATML) == "think"
    assert reasoning_style(templates.HARMONY) == "harmony"
    assert reasoning_style(templates.GEMMA4) == "gemma"
    assert reasoning_style(templates.MISTRAL) == "none"
    assert call_syntax(reasoning_style(templates.GEMMA4)) is GEMMA4_CALLS
    assert call_syntax(reasoning_style(templates.CHATML)) is HERMES_CALLS


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_harmony_channels(size: int) -> None:
    text = (
        "<|channel|>analysis<|message|>think hard<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    )
    assert _joined(_feed_in_pieces(HarmonySplitter(), text, size)) == {
        "reasoning": "think hard",
        "content": "Hello!",
    }


def test_harmony_tool_call_goes_to_its_arguments() -> None:
    text = (
        "<|channel|>analysis<|message|>need weather<|end|><|start|>assistant to=functions.get_weather"
        '<|channel|>commentary <|constrain|>json<|message|>{"unit": "c"}'
    )
    output = ChatOutput(HarmonySplitter())
    pieces = [p for i in range(0, len(text), 4) for p in output.feed(text[i : i + 4])] + output.finish()
    starts = [p for p in pieces if isinstance(p, ToolCallStart)]
    args = "".join(p.text for p in pieces if isinstance(p, ToolCallArgs))
    assert [s.name for s in starts] == ["get_weather"]
    assert json.loads(args) == {"unit": "c"}
    assert output.n_calls == 1


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param('{"note": "a\x05b"}', id="raw-control-character"),
        pytest.param('{"x": NaN}', id="nan"),
        pytest.param('{"x": 1e999}', id="infinity"),
        pytest.param('{"s": "\\ud800"}', id="lone-surrogate"),
        pytest.param('{"unit": "c"', id="unterminated"),
    ],
)
def test_harmony_arguments_a_strict_parser_refuses_stay_content(arguments: str) -> None:
    """Harmony's arguments have no grammar: what no strict parser takes never becomes a call."""
    text = (
        "<|channel|>analysis<|message|>go<|end|><|start|>assistant to=functions.get_weather"
        f"<|channel|>commentary <|constrain|>json<|message|>{arguments}"
    )
    output = ChatOutput(HarmonySplitter())
    pieces = [p for i in range(0, len(text), 3) for p in output.feed(text[i : i + 3])] + output.finish()
    assert not [p for p in pieces if isinstance(p, ToolCallStart | ToolCallArgs)]
    assert output.n_calls == 0
    assert _joined([p for p in pieces if isinstance(p, tuple)])["content"] == arguments


@pytest.mark.parametrize(
    ("body", "is_call"),
    [
        pytest.param('{"name": "f", "arguments": "{\\"a\\": 1}"}', True, id="arguments-as-a-json-string"),
        pytest.param('{"name": "f", "arguments": "not json"}', False, id="arguments-string-not-json"),
        pytest.param('{"name": "f", "arguments": {"x": Infinity}}', False, id="infinity"),
        pytest.param('{"name": "f", "arguments": {"x": 1e400}}', False, id="overflow"),
    ],
)
def test_hermes_arguments_are_strict_json(body: str, is_call: bool) -> None:
    output = ChatOutput(PlainSplitter(), parse_tools=True)
    pieces = output.feed(f"<tool_call>{body}</tool_call>") + output.finish()
    args = "".join(p.text for p in pieces if isinstance(p, ToolCallArgs))
    assert output.n_calls == int(is_call)
    if is_call:
        assert json.loads(args) == {"a": 1}
    else:
        assert pieces == [("content", f"<tool_call>{body}</tool_call>")]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_gemma4_tool_calls_are_parsed_out_of_the_content(size: int) -> None:
    q = '<|"|>'
    text = (
        "<|channel>thought\nneed weather<channel|>Checking."
        f"<|tool_call>call:get_weather{{city:{q}Paris, FR{q},days:[1,2],"
        "opts:{metric:true,note:None}}<tool_call|>"
        '<|tool_call>call:g{"a": "b"}<tool_call|>'
        f"<|tool_call>call:broken{{city:{q}Paris}}<tool_call|>"
    )
    output = ChatOutput(GemmaSplitter(), parse_tools=True, syntax=GEMMA4_CALLS)
    pieces = [p for i in range(0, len(text), size) for p in output.feed(text[i : i + size])]
    pieces += output.finish()
    starts = [p for p in pieces if isinstance(p, ToolCallStart)]
    args = [
        json.loads("".join(p.text for p in pieces if isinstance(p, ToolCallArgs) and p.index == s.index))
        for s in starts
    ]
    assert [s.name for s in starts] == ["get_weather", "g"]
    assert args == [{"city": "Paris, FR", "days": [1, 2], "opts": {"metric": True, "note": None}}, {"a": "b"}]
    assert _joined([p for p in pieces if isinstance(p, tuple)]) == {
        "reasoning": "need weather",
        # a call that does not parse stays visible as text rather than being lost
        "content": f"Checking.<|tool_call>call:broken{{city:{q}Paris}}<tool_call|>",
    }


REAL_GEMMA4_TEMPLATE = (
    Path(__file__).resolve().parent.parent
    / "vendor/llama.cpp/llama-cpp-python/vendor/llama.cpp/models/templates/google-gemma-4-31B-it.jinja"
)


def test_real_gemma4_template_renders_like_ours_and_its_calls_parse() -> None:
    """Gemma 4's own template (in the pinned llama.cpp sources the build extracts) renders a
    conversation as the synthetic one does, and a call in its notation reads back."""
    if not REAL_GEMMA4_TEMPLATE.exists():
        pytest.skip("the pinned llama.cpp sources are not extracted (make setup)")
    real_source = REAL_GEMMA4_TEMPLATE.read_text()
    real, ours = (
        Jinja2ChatFormatter(template=t, eos_token="<eos>", bos_token="<bos>")
        for t in (real_source, templates.GEMMA4)
    )
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    assert real(messages=chat).prompt == ours(messages=chat).prompt  # type: ignore[arg-type]
    assert reasoning_style(real_source) == "gemma"
    arguments = {"city": "Paris, FR", "days": [1, 2], "metric": True, "opts": {"unit": "c", "n": 2.5}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    history = [*chat, {"role": "assistant", "content": None, "tool_calls": [call]}]
    prompt = real(messages=history).prompt  # type: ignore[arg-type]
    body = prompt.split(GEMMA4_CALLS.open)[1].split(GEMMA4_CALLS.close)[0]
    assert body.startswith('call:get_weather{city:<|"|>')
    assert parse_call(body) == ("get_weather", arguments)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("call:f{}", ("f", {})),
        ("call:f", ("f", {})),
        ('call:ns.f-2{n:-1.5e1,s:<|"|>a:{b}<|"|>}', ("ns.f-2", {"n": -15.0, "s": "a:{b}"})),
        ("call:f{a:}", None),
        ("call:f[1]", None),
        ("call:f{a:1} trailing", None),
        ('call:f{a:<|"|>open}', None),
        ('{"name": "f"}', None),
    ],
)
def test_gemma4_call_notation(body: str, expected: object) -> None:
    assert parse_call(body) == expected


def test_hermes_tool_calls_are_parsed_out_of_the_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    output = ChatOutput(PlainSplitter(), parse_tools=True)
    pieces = [p for i in range(0, len(text), 3) for p in output.feed(text[i : i + 3])] + output.finish()
    content = "".join(p[1] for p in pieces if isinstance(p, tuple))
    starts = [p for p in pieces if isinstance(p, ToolCallStart)]
    assert content == "Let me check.\n"
    assert [s.name for s in starts] == ["f", "g"] and [s.index for s in starts] == [0, 1]
    args = {
        s.index: "".join(p.text for p in pieces if isinstance(p, ToolCallArgs) and p.index == s.index)
        for s in starts
    }
    assert json.loads(args[0]) == {"a": 1} and json.loads(args[1]) == {}


def test_a_broken_tool_call_stays_content() -> None:
    output = ChatOutput(PlainSplitter(), parse_tools=True)
    pieces = output.feed("<tool_call>not json</tool_call>") + output.finish()
    assert pieces == [("content", "<tool_call>not json</tool_call>")]
    assert output.n_calls == 0


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_stream_their_arguments(size: int, parallel: bool) -> None:
    calls = [
        {"name": "get_weather", "arguments": {"unit": "c", "note": 'a \\"}{[ b'}},
        {"name": "get_time", "arguments": {"zone": {"nested": [1, {"x": "}"}]}}},
    ]
    text = json.dumps(calls if parallel else calls[0], indent=1)
    output = ChatOutput(PlainSplitter(), mode="required", parallel=parallel)
    chunks = [output.feed(text[i : i + size]) for i in range(0, len(text), size)] + [output.finish()]
    pieces = [p for chunk in chunks for p in chunk]
    starts = [p for p in pieces if isinstance(p, ToolCallStart)]
    expected = calls if parallel else calls[:1]
    assert [s.name for s in starts] == [c["name"] for c in expected]
    assert output.n_calls == len(expected)
    for start in starts:
        args = "".join(p.text for p in pieces if isinstance(p, ToolCallArgs) and p.index == start.index)
        assert json.loads(args) == expected[start.index]["arguments"]
    if size == 1:  # the arguments really arrive piece by piece
        assert sum(isinstance(p, ToolCallArgs) for p in pieces) > 2 * len(expected)
    assert not any(isinstance(p, tuple) for p in pieces)  # no stray content


def test_required_output_cut_short_keeps_what_streamed() -> None:
    output = ChatOutput(PlainSplitter(), mode="required")
    pieces = output.feed('{"name": "f", "arguments": {"a": ') + output.finish()
    assert isinstance(pieces[0], ToolCallStart) and pieces[0].name == "f"
    assert "".join(p.text for p in pieces if isinstance(p, ToolCallArgs)) == '{"a": '


@pytest.mark.parametrize(
    ("text", "size"),
    [("123", 123), ("4k", 4096), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("2g", 2 << 30)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_settings_precedence_cli_over_env_over_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "moeflash.toml"
    config.write_text('[server]\nport = 9001\nhost = "0.0.0.0"\nmax_queue = 3\n[model]\nctx_size = 1024\n')
    monkeypatch.setenv("MOEFLASH_PORT", "9002")
    monkeypatch.setenv("MOEFLASH_CORS_ORIGINS", "http://a.example, http://b.example")
    server, model = load_settings({"port": "9003", "max_queue": None}, config)
    assert server.port == 9003  # CLI
    assert server.cors_origins == ["http://a.example", "http://b.example"]  # env
    assert server.host == "0.0.0.0" and server.max_queue == 3  # TOML
    assert model.ctx_size == 1024
    server, _ = load_settings({}, config)
    assert server.port == 9002


def test_shipped_config_file_is_valid() -> None:
    config = Path(__file__).resolve().parents[1] / "configs" / "default.toml"
    server, model = load_settings({}, config)
    default_server, default_model = load_settings({})
    assert server.model_dump() == default_server.model_dump()
    assert model.model_dump() == default_model.model_dump()


@pytest.mark.parametrize(
    "cli",
    [
        pytest.param({"port": "70000"}, id="port"),
        pytest.param({"ctx_size": "1"}, id="ctx"),
        pytest.param({"budget": "lots"}, id="budget"),
        pytest.param({"queue_full_status": "500"}, id="status"),
    ],
)
def test_bad_settings_are_a_config_error(cli: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        load_settings(cli)


def test_api_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    server, _ = load_settings({"api_key_file": key_file})
    assert server.resolved_api_key() == "s3cret"
    key_file.write_text("")
    with pytest.raises(ConfigError):
        server.resolved_api_key()
