"""The CPU backend's repacked layouts: what the memory budget counts is what llama.cpp repacks.

A resident model's repacked weights are anonymous memory beside its mapped file; the loader counts
them with the streamer library's rule (`mf_repacked_bytes`, the one its buffer types follow), so
the rule must name exactly the tensors llama.cpp itself repacks (its log line for each), on every
architecture and type mix the gates use. The streamed side's choice is checked by every gate
(tests/loading/test_streaming_gates.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from server.loading.budget import repacked_bytes
from server.loading.gguf_header import read_tensor_sizes
from server.modelgen.spec import QType
from tests.models import load_llama_noting_repacks


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("tiny-qwen3moe", {}),
        ("tiny-qwen3moe", {"tied_embeddings": True, "dense_qtype": QType.Q4_0}),
        (
            "tiny-qwen3moe",
            {
                "expert_qtype": QType.Q4_K,
                "down_qtype": QType.Q6_K,
                "dense_qtype": QType.Q4_K,
                "n_ff_exp": 256,
            },
        ),
        ("tiny-gptoss", {}),
        ("tiny-gemma4", {"tied_embeddings": True}),
        ("tiny-hyv3", {}),
    ],
    ids=["qwen3moe", "qwen3moe-q4_0-tied", "qwen3moe-q4_k_m", "gptoss", "gemma4-tied", "hyv3"],
)
def test_the_budget_counts_what_llama_cpp_repacks(
    tiny_model: Callable[..., Path], preset: str, overrides: dict[str, object]
) -> None:
    path = tiny_model(preset, **overrides)
    llm, names = load_llama_noting_repacks(path, use_extra_bufts=True)
    llm.close()
    sizes = read_tensor_sizes(path)
    if overrides.get("expert_qtype") != QType.Q4_K:
        assert names, "Q4_0 and MXFP4 matrices are repacked on x86 AVX2 and on aarch64"
    # a tensor's size in the table includes its alignment padding (under 32 bytes)
    expected = sum(sizes[name] for name in names)
    assert expected - 32 * len(names) <= repacked_bytes(path) <= expected
