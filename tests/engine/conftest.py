"""Fixtures of the engine tests."""

from __future__ import annotations

from typing import Any

import pytest
from llama_cpp import Llama


@pytest.fixture(scope="module")
def vocab_llama(tiny_model: Any) -> Llama:
    """The demo model's vocabulary and weights, for what compiles grammars against a vocabulary."""
    return Llama(str(tiny_model("tiny-qwen3moe")), n_ctx=64, verbose=False)
