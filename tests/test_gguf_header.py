"""The fast GGUF header reader, and the KV cache estimate built on it, against gguf and llama.cpp."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import pytest

from server.budget import kv_cache_bytes
from server.errors import ModelLoadError
from server.gguf_header import read_metadata
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


@pytest.mark.parametrize("swa_full", [True, False], ids=["swa-full", "swa-window"])
@pytest.mark.parametrize("name", TINY)
def test_kv_estimate_is_what_llama_cpp_allocates(
    name: str,
    swa_full: bool,
    tiny_model: TinyModelFactory,
    llama_factory: LoadLlama,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The auto budget subtracts the KV cache: llama.cpp's own log of its cache size (both caches
    of a sliding-window model) must match the estimate, per-layer widths and V padding included,
    with sliding-window caches as long as the context or cut to the window (as the server makes
    them: the window of 64 tokens plus a micro-batch of 128, padded to 256 cells)."""
    path = tiny_model(name)
    n_ctx, n_ubatch = 1024, 128  # n_ctx: a multiple of llama.cpp's 256-cell padding
    llama_factory(path, n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch, swa_full=swa_full, verbose=True)
    logged = re.findall(r"llama_kv_cache: size = +([\d.]+) MiB", capfd.readouterr().err)
    assert logged, "llama.cpp logged no KV cache size"
    estimate = kv_cache_bytes(read_metadata(path), n_ctx, None if swa_full else n_ubatch)
    assert estimate / 2**20 == pytest.approx(sum(float(x) for x in logged), abs=0.01 * len(logged))
    if name in ("tiny-gemma4", "tiny-gpt-oss") and not swa_full:
        assert estimate < kv_cache_bytes(read_metadata(path), n_ctx)


def test_kv_estimate_from_scalar_strings_and_nothing() -> None:
    # llama-cpp-python's metadata gives scalars as strings; a header without layers has no cache
    meta = {"general.architecture": "x", "x.block_count": "2", "x.embedding_length": "64"}
    assert kv_cache_bytes({**meta, "x.attention.head_count": "4"}, 16) == 16 * 2 * 4 * (16 + 16) * 2
    assert kv_cache_bytes({**meta, "x.attention.head_count": "4", "x.attention.head_count_kv": "1"}, 16) == (
        16 * 2 * 1 * (16 + 16) * 2
    )
    assert kv_cache_bytes({}, 1024) == 0
    # a scalar pattern is a period, which leaves open where its full layer is: every layer full
    swa = {**meta, "x.attention.head_count": "4", "x.attention.sliding_window": "8"}
    full = kv_cache_bytes(swa, 1024)
    assert kv_cache_bytes({**swa, "x.attention.sliding_window_pattern": "2"}, 1024, 32) == full
    assert kv_cache_bytes({**swa, "x.attention.sliding_window_pattern": [True, False]}, 1024, 32) == (
        full // 2 + full // 2 * 256 // 1024
    )
