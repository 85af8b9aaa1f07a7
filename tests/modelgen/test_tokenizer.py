"""The synthetic vocabularies and chat templates, as llama.cpp and llama-cpp-python see them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import llama_cpp
import numpy as np
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from server.modelgen import preset
from server.modelgen.tokenizer import BYTE_TO_UNICODE, MERGES, TokenType, build_vocab, encode_bytes
from tests.conftest import TinyModelFactory

LoadLlama = Callable[..., llama_cpp.Llama]
FAMILY_PRESETS = {
    "chatml": "tiny-qwen3moe",
    "harmony": "tiny-gptoss",
    "mistral": "tiny-mixtral",
    "gemma4": "tiny-gemma4",
}

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Weather in Paris?"},
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_TURNS: list[dict[str, Any]] = [
    *CONVERSATION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
]

EXPECTED = {
    "chatml": (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "harmony": (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>"
        "<|start|>user<|message|>Hi<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant"
    ),
    "mistral": "<s>[INST] Be brief.\n\nHi [/INST] Hello!</s>[INST] Weather in Paris? [/INST]",
    "gemma4": (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n"
        "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    ),
}

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "héllo wörld — 你好, мир, مرحبا, 🚀🧪👩‍💻",
    "tabs\tnewlines\n\r\n  runs   of   spaces \u00a0nbsp \u200b zero-width e\u0301",
    "control \x00\x01\x1b[31m\x7f bytes",
    "looks special: <|im_end|> <|return|> </s> <s> [INST] <think>x</think> <tool_call>",
    "digits 1234567890 3.14159 0x1F",
]


@pytest.fixture(params=sorted(FAMILY_PRESETS))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def vocab_llm(
    family: str, tiny_model: TinyModelFactory, llama_factory: LoadLlama
) -> Iterator[llama_cpp.Llama]:
    yield llama_factory(tiny_model(FAMILY_PRESETS[family]), vocab_only=True)


def _formatter(llm: llama_cpp.Llama) -> Jinja2ChatFormatter:
    bos, eos = llm.token_bos(), llm.token_eos()
    return Jinja2ChatFormatter(
        template=llm.metadata["tokenizer.chat_template"],
        eos_token=llm._model.token_get_text(eos),
        bos_token=llm._model.token_get_text(bos),
    )


def _render(llm: llama_cpp.Llama, messages: list[dict[str, Any]], **kw: Any) -> str:
    prompt: str = _formatter(llm)(messages=messages, **kw).prompt  # type: ignore[arg-type]
    return prompt


def test_template_renders_a_conversation(family: str, vocab_llm: llama_cpp.Llama) -> None:
    assert _render(vocab_llm, CONVERSATION) == EXPECTED[family]


def test_rendered_prompt_uses_single_special_tokens(family: str, vocab_llm: llama_cpp.Llama) -> None:
    prompt = _render(vocab_llm, CONVERSATION)
    tokens = vocab_llm.tokenize(prompt.encode(), add_bos=False, special=True)
    markers = {"chatml": "<|im_start|>", "harmony": "<|start|>", "mistral": "</s>", "gemma4": "<|turn>"}
    marker = markers[family]
    marker_ids = vocab_llm.tokenize(marker.encode(), add_bos=False, special=True)
    assert len(marker_ids) == 1
    assert tokens.count(marker_ids[0]) == prompt.count(marker)
    assert vocab_llm.detokenize(tokens, special=True).decode() == prompt


@pytest.mark.parametrize("family", ["chatml", "harmony", "gemma4"])
def test_template_renders_tools_and_tool_turns(family: str, vocab_llm: llama_cpp.Llama) -> None:
    prompt = _render(vocab_llm, TOOL_TURNS, tools=TOOLS)
    if family == "chatml":
        assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
        assert (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
            in prompt
        )
        assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in prompt
        assert prompt.endswith("<|im_start|>assistant\n")
    elif family == "gemma4":
        assert '<|turn>system\nBe brief.<|tool>declaration:get_weather{"name": "get_weather"' in prompt
        # the call and its result share one model turn, which the model then continues
        assert prompt.endswith(
            '<|turn>model\n<|tool_call>call:get_weather{"city": "Paris"}<tool_call|>'
            '<|tool_response>response:get_weather{value:<|"|>sunny, 21 C<|"|>}<tool_response|>'
        )
    else:
        assert "namespace functions {\n\n// Current weather of a city\ntype get_weather = (_: {" in prompt
        assert (
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Paris"}<|call|>'
        ) in prompt
        assert (
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny, 21 C<|end|>"
            in prompt
        )
        assert prompt.endswith("<|start|>assistant")


def test_chatml_thinking_switch_and_history(tiny_model: TinyModelFactory, llama_factory: LoadLlama) -> None:
    llm = llama_factory(tiny_model("tiny-qwen3moe"), vocab_only=True)
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nb"},
    ]
    prompt = _render(llm, [*history, {"role": "user", "content": "c"}], enable_thinking=False)
    assert "<|im_start|>assistant\nb<|im_end|>" in prompt  # reasoning is not replayed
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_harmony_reasoning_channel(tiny_model: TinyModelFactory, llama_factory: LoadLlama) -> None:
    llm = llama_factory(tiny_model("tiny-gptoss"), vocab_only=True)
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "thinking": "old thoughts"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "thinking": "new thoughts"},
    ]
    prompt = _render(llm, messages, reasoning_effort="high")
    assert "Reasoning: high" in prompt
    assert "old thoughts" not in prompt  # only reasoning after the last user turn is kept
    assert "<|start|>assistant<|channel|>analysis<|message|>new thoughts<|end|>" in prompt
    assert "<|start|>assistant<|channel|>final<|message|>a2<|end|>" in prompt


def test_mistral_refuses_tool_role(tiny_model: TinyModelFactory, llama_factory: LoadLlama) -> None:
    llm = llama_factory(tiny_model("tiny-mixtral"), vocab_only=True)
    with pytest.raises(ValueError, match="only system, user and assistant roles"):
        _render(llm, TOOL_TURNS)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenize_detokenize_round_trips(text: str, vocab_llm: llama_cpp.Llama) -> None:
    tokens = vocab_llm.tokenize(text.encode(), add_bos=False, special=False)
    assert vocab_llm.detokenize(tokens).decode() == text


def test_random_unicode_round_trips(vocab_llm: llama_cpp.Llama) -> None:
    rng = np.random.default_rng(5)
    points = rng.integers(1, 0x30000, size=4000)
    text = "".join(chr(int(c)) for c in points if not 0xD800 <= c < 0xE000)  # no surrogates in UTF-8
    tokens = vocab_llm.tokenize(text.encode(), add_bos=False, special=False)
    assert vocab_llm.detokenize(tokens).decode() == text


def test_merges_shorten_common_text(vocab_llm: llama_cpp.Llama) -> None:
    text = " the model and the expert"
    assert len(vocab_llm.tokenize(text.encode(), add_bos=False)) < len(text.encode()) // 2


@pytest.mark.parametrize(
    ("family", "bos", "eos", "eog", "not_eog"),
    [
        ("chatml", "<|endoftext|>", "<|im_end|>", ["<|im_end|>", "<|endoftext|>"], ["<|im_start|>"]),
        (
            "harmony",
            "<|startoftext|>",
            "<|return|>",
            ["<|return|>", "<|call|>", "<|endoftext|>"],
            ["<|end|>"],
        ),
        ("mistral", "<s>", "</s>", ["</s>"], ["<s>"]),
        ("gemma4", "<bos>", "<eos>", ["<eos>", "<turn|>", "<|tool_response>"], ["<|turn>", "<bos>"]),
    ],
)
def test_special_token_roles(
    family: str, bos: str, eos: str, eog: list[str], not_eog: list[str], vocab_llm: llama_cpp.Llama
) -> None:
    def token(text: str) -> int:
        ids = vocab_llm.tokenize(text.encode(), add_bos=False, special=True)
        assert len(ids) == 1, text
        return int(ids[0])

    assert vocab_llm.token_bos() == token(bos)
    assert vocab_llm.token_eos() == token(eos)
    vocab = vocab_llm._model.vocab
    assert all(llama_cpp.llama_vocab_is_eog(vocab, token(t)) for t in eog)
    assert not any(llama_cpp.llama_vocab_is_eog(vocab, token(t)) for t in not_eog)


def test_add_bos_only_for_mistral_and_gemma(family: str, vocab_llm: llama_cpp.Llama) -> None:
    with_bos = vocab_llm.tokenize(b"x", add_bos=True)
    assert (with_bos[0] == vocab_llm.token_bos()) == (family in ("mistral", "gemma4"))


def test_chat_completion_runs_end_to_end(
    family: str, tiny_model: TinyModelFactory, llama_factory: LoadLlama
) -> None:
    llm = llama_factory(tiny_model(FAMILY_PRESETS[family]))
    assert llm.chat_format == "chat_template.default"
    messages: Any = CONVERSATION
    reply: Any = llm.create_chat_completion(messages, max_tokens=6, temperature=0.0)
    choice = reply["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    assert reply["usage"]["prompt_tokens"] == len(
        llm.tokenize(EXPECTED[family].encode(), add_bos=False, special=True)
    )


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "llama", "gemma4"])
def test_vocab_layout(arch: str) -> None:
    n_vocab = 151936 if arch == "qwen3moe" else 700
    vocab = build_vocab(arch, n_vocab)
    assert len(vocab.tokens) == len(vocab.token_types) == n_vocab
    assert len(set(vocab.tokens)) == n_vocab
    assert vocab.tokens[:256] == BYTE_TO_UNICODE
    known = set(vocab.tokens)
    for merge in MERGES:
        left, right = merge.split(" ")
        assert {left, right, left + right} <= known
    specials = [vocab.tokens[i] for i, t in enumerate(vocab.token_types) if t != TokenType.NORMAL]
    assert [s for s, _ in vocab.family.specials] == specials
    assert encode_bytes(" hi") == "Ġhi"
    assert preset("tiny-qwen3moe").n_vocab == 512
