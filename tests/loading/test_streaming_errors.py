"""Bad input to the streamer is a clear, typed error before any generation, never a crash; a read
error during generation fails that request and leaves the model usable."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from server.errors import ConfigError, ExpertReadError, ModelLoadError
from server.loading.streaming import StreamingLlama, load_streaming_llama
from server.settings import load_settings
from streaming_ext import Policy, StreamerConfig
from tests.models import greedy

PROMPT = list(range(40, 60))


def load(path: Path, budget: Any = "auto", **levers: Any) -> StreamingLlama:
    return load_streaming_llama(path, StreamerConfig(**levers), budget=budget, n_ctx=256, n_threads=2)


@pytest.fixture
def model_copy(tiny_model: Callable[..., Path], tmp_path: Path) -> Path:
    """A private copy of the tiny model that a test may damage."""
    dst = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model("tiny-qwen3moe"), dst)
    return dst


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nope.gguf")


def test_directory_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ModelLoadError, match="not a regular file|does not exist"):
        load(tmp_path / "dir.gguf")


def test_corrupt_header(model_copy: Path) -> None:
    with open(model_copy, "r+b") as f:
        f.write(b"GGUX")
    with pytest.raises(ModelLoadError, match="not a valid GGUF"):
        load(model_copy)


def test_truncated_file(model_copy: Path) -> None:
    os.truncate(model_copy, model_copy.stat().st_size * 2 // 3)
    with pytest.raises(ModelLoadError, match="truncated"):
        load(model_copy)


def test_unknown_architecture(model_copy: Path) -> None:
    data = model_copy.read_bytes()
    # rename the architecture everywhere in the header (its keys are prefixed with it)
    head = 1 << 16
    model_copy.write_bytes(data[:head].replace(b"qwen3moe", b"qwen9moe") + data[head:])
    with pytest.raises(ModelLoadError, match="could not load"):
        load(model_copy)


def test_model_without_experts(tmp_path: Path) -> None:
    path = tmp_path / "dense.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="not a Mixture-of-Experts model"):
        load(path)


def test_budget_below_one_layer(tiny_model: Callable[..., Path]) -> None:
    with pytest.raises(ConfigError, match="smaller than one layer's experts"):
        load(tiny_model("tiny-qwen3moe"), budget=4096)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param({"lanes": 0}, "lanes", id="no-lanes"),
        pytest.param({"lanes": 99}, "lanes", id="too-many-lanes"),
    ],
)
def test_bad_options(tiny_model: Callable[..., Path], options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(tiny_model("tiny-qwen3moe"), **options)


def test_unknown_cache_policy_is_refused_by_the_settings() -> None:
    with pytest.raises(ConfigError, match="cache_policy"):
        load_settings({"cache_policy": "mru"})


# n_ff_exp 4096: 576 KiB slices, read in chunks of 256 KiB, so the read that fails is a slice's
# second chunk while its others are read on
@pytest.mark.parametrize("width", [{}, {"n_ff_exp": 4096}], ids=["whole-slices", "chunked-slices"])
def test_io_error_fails_the_request_not_the_process(
    tiny_model: Callable[..., Path], width: dict[str, int]
) -> None:
    llm = load(
        tiny_model("tiny-qwen3moe", **width),
        policy=Policy.NONE,
        fault_errno=errno.EIO,
        fault_after_bytes=300_000,
    )
    try:
        with pytest.raises(ExpertReadError, match="Input/output error"):
            greedy(llm, PROMPT, 20)
        assert llm.stats().errors > 0
    finally:
        llm.close()


def test_file_that_shrinks_while_open(model_copy: Path) -> None:
    original = model_copy.read_bytes()
    llm = load(model_copy, policy=Policy.NONE)  # every token reads its experts again
    try:
        expected = greedy(llm, PROMPT, 4)
        os.truncate(model_copy, len(original) // 2)
        with pytest.raises(ExpertReadError, match="ended early|changed size"):
            greedy(llm, PROMPT, 4)
        # the file comes back: the same model object serves the next request correctly
        model_copy.write_bytes(original)
        assert greedy(llm, PROMPT, 4) == expected
    finally:
        llm.close()
