"""The fast GGUF header reader, and the KV cache estimate built on it, against gguf and llama.cpp."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import pytest

from server.errors import ModelLoadError
from server.loading.gguf_header import read_metadata
from server.modelgen import preset_names
from tests.conftest import TinyModelFactory

TINY = [name for name in preset_names() if name.startswith("tiny-")]
LoadLlama = Callable[..., llama_cpp.Llama]


def _gguf_fields(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in gguf.GGUFReader(str(path)).fields.values():
        if f.name.startswith("GGUF."):
            continue
        value = f.contents()
        if not (isinstance(value, list) and value and isinstance(value[0], str)):
            out[f.name] = value
    return out


@pytest.mark.parametrize("name", ["tiny-gemma4", "tiny-gptoss"])
def test_header_matches_gguf_without_string_arrays(name: str, tiny_model: TinyModelFactory) -> None:
    path = tiny_model(name)
    meta = read_metadata(path)
    assert meta == _gguf_fields(path)
    assert "tokenizer.ggml.tokens" not in meta and meta["tokenizer.ggml.model"] == "gpt2"
    if name == "tiny-gemma4":
        assert meta["gemma4.attention.sliding_window_pattern"] == [True, True, True, False]
        assert meta["gemma4.attention.head_count_kv"] == [2, 2, 2, 1]


@pytest.mark.parametrize(
    ("cut", "message"),
    [(0, "bad magic"), (3, "bad magic"), (30, "truncated|unpack"), (200, "truncated|unpack")],
)
def test_a_broken_header_is_a_clear_error(
    tmp_path: Path, tiny_model: TinyModelFactory, cut: int, message: str
) -> None:
    data = tiny_model("tiny-gemma4").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:cut] if cut else b"GGML" + data[4:])
    with pytest.raises(ModelLoadError, match=rf"cannot read the GGUF header of {bad}: .*({message})"):
        read_metadata(bad)
