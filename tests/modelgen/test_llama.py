"""Every architecture's synthetic model loads in the patched llama.cpp and decodes sensibly."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from server.modelgen import QType, generate_model, preset, preset_names
from tests.conftest import TinyModelFactory
from tests.models import RouteRecorder, greedy

TINY = [name for name in preset_names() if name.startswith("tiny-")]
PROMPT = "The experts stream from flash, token by token."
LoadLlama = Callable[..., llama_cpp.Llama]


def _prompt(llm: llama_cpp.Llama) -> list[int]:
    tokens: list[int] = llm.tokenize(PROMPT.encode(), add_bos=False)
    return tokens


@pytest.mark.parametrize("name", TINY)
def test_loads_and_decodes_deterministically(
    name: str, tiny_model: TinyModelFactory, llama_factory: LoadLlama
) -> None:
    path = tiny_model(name)
    first = llama_factory(path)
    assert first.n_vocab() == preset(name).n_vocab
    tokens_a, hash_a = greedy(first, _prompt(first), 16)
    second = llama_factory(path)
    tokens_b, hash_b = greedy(second, _prompt(second), 16)
    assert (tokens_a, hash_a) == (tokens_b, hash_b)
    # a well-conditioned random model wanders through the vocabulary instead of repeating a token
    assert len(set(tokens_a)) >= 4


@pytest.mark.parametrize("name", TINY)
def test_routing_varies_across_tokens_and_layers(
    name: str, tiny_model: TinyModelFactory, llama_factory: LoadLlama
) -> None:
    spec = preset(name)
    recorder = RouteRecorder(spec.n_expert_used)
    llm = llama_factory(tiny_model(name), cb_eval=recorder.callback)
    prompt = _prompt(llm)
    llm.eval(prompt)
    assert sorted(recorder.routes) == list(range(spec.n_layer))
    full_layers = [
        recorder.routes[il] for il in range(spec.n_layer - 1)
    ]  # the last layer sees only the last row
    for routes in full_layers:
        assert len(routes) == len(prompt)
        assert all(
            len(set(r)) == spec.n_expert_used and all(0 <= e < spec.n_expert for e in r) for r in routes
        )
        assert len(set(routes)) > len(prompt) // 2  # different tokens pick different experts
        used = Counter(e for r in routes for e in r)
        assert len(used) >= spec.n_expert * 3 // 4  # and most experts get work
    assert full_layers[0] != full_layers[1]  # layers route independently


@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-gptoss", "tiny-hyv3", "tiny-gemma4"])
def test_split_model_decodes_like_its_unsplit_twin(
    name: str, tiny_model: TinyModelFactory, llama_factory: LoadLlama
) -> None:
    whole = tiny_model(name)
    first_split = tiny_model(name, split_max_size=1_500_000)
    count = re.search(r"-00001-of-(\d{5})\.gguf$", first_split.name)
    assert count is not None and int(count.group(1)) >= 3
    a = llama_factory(whole)
    b = llama_factory(first_split)
    assert greedy(a, _prompt(a), 12) == greedy(b, _prompt(b), 12)


def test_seed_changes_the_model(tiny_model: TinyModelFactory, llama_factory: LoadLlama) -> None:
    a = llama_factory(tiny_model("tiny-qwen3moe"))
    b = llama_factory(tiny_model("tiny-qwen3moe", seed=1))
    assert greedy(a, _prompt(a), 4)[1] != greedy(b, _prompt(b), 4)[1]


def test_alignment_does_not_change_the_model(tiny_model: TinyModelFactory, llama_factory: LoadLlama) -> None:
    a = llama_factory(tiny_model("tiny-qwen3moe"))
    b = llama_factory(tiny_model("tiny-qwen3moe", alignment=4096))
    assert greedy(a, _prompt(a), 8) == greedy(b, _prompt(b), 8)


@pytest.mark.parametrize(
    ("name", "expert_qtype", "dense_qtype"),
    [
        ("tiny-qwen3moe", QType.F16, QType.F16),
        ("tiny-qwen3moe", QType.Q8_0, QType.Q4_0),
        ("tiny-gptoss", QType.Q4_0, QType.F16),
        ("tiny-mixtral", QType.Q8_0, QType.F16),
        ("tiny-qwen2moe", QType.Q4_0, QType.Q4_0),
        ("tiny-hyv3", QType.F16, QType.Q8_0),
        ("tiny-gemma4", QType.Q5_0, QType.F16),
    ],
)
def test_every_quant_type_loads(
    name: str, expert_qtype: QType, dense_qtype: QType, tiny_model: TinyModelFactory, llama_factory: LoadLlama
) -> None:
    llm = llama_factory(tiny_model(name, n_layer=2, expert_qtype=expert_qtype, dense_qtype=dense_qtype))
    tokens, _ = greedy(llm, _prompt(llm), 8)
    assert len(set(tokens)) > 1


def test_mmap_without_prefetch_decodes_identically(
    tiny_model: TinyModelFactory, llama_factory: LoadLlama
) -> None:
    path = tiny_model("tiny-gptoss")
    a = llama_factory(path)
    b = llama_factory(path, load_mode=llama_cpp.LLAMA_LOAD_MODE_MMAP_NO_PREFETCH)
    assert greedy(a, _prompt(a), 8) == greedy(b, _prompt(b), 8)


def test_real_shape_with_few_layers_loads(tmp_path: Path, llama_factory: LoadLlama) -> None:
    # the real vocabulary (151936 tokens) and head size, cut to 1 narrow layer to stay small (~45 MB)
    narrow: dict[str, Any] = {"n_layer": 1, "n_embd": 128, "n_head": 2, "n_head_kv": 1, "n_expert": 8}
    spec = dataclasses.replace(preset("qwen30b-shape"), **narrow)
    path = generate_model(spec, tmp_path / "q.gguf")[0]
    llm = llama_factory(path, load_mode=llama_cpp.LLAMA_LOAD_MODE_MMAP_NO_PREFETCH)
    assert llm.n_vocab() == 151936
    tokens, _ = greedy(llm, _prompt(llm), 3)
    assert all(0 <= t < 151936 for t in tokens)
