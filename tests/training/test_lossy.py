"""The lossy options measured on the trained model (server/training/measure.py, LOSSY_OPTIONS).

Fewer experts per token is gated against its own resident twin (the same override, every expert
resident); dropping uncached experts (skip_below) has no resident twin, so its tests check that it
drops only what it says and that the rest of the path is untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from server.errors import ConfigError, ModelLoadError
from server.loading.streaming import load_streaming_llama
from server.modelgen.spec import QType
from server.training import measure
from streaming_ext import Policy, StreamerConfig
from tests.models import expert_layer_bytes

SETTINGS: dict[str, Any] = {
    "n_ctx": 128, "n_batch": 1, "n_ubatch": 1, "logits_all": True, "n_threads": 1, "n_threads_batch": 1,
    "verbose": False,
}  # fmt: skip


def _ids(tiny_run: Path, n: int = 48) -> list[int]:
    return np.fromfile(tiny_run / "heldout.bin", dtype=np.uint16)[:n].astype(int).tolist()


def _scores(llm: llama_cpp.Llama, ids: list[int]) -> np.ndarray:
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids)], dtype=np.float32).copy()


def _streamed(path: Path, skip_below: float = 0.0, **kwargs: Any) -> Any:
    config = StreamerConfig(policy=Policy.LAYER, skip_below=skip_below)
    budget = expert_layer_bytes(path)
    return load_streaming_llama(
        path, config, budget=budget, follow_memory=False, flash_attn="off", **SETTINGS, **kwargs
    )


def test_fewer_experts_streamed_match_their_resident_twin(
    tiny_run: Path, tiny_gguf: Callable[[QType], Path]
) -> None:
    path = tiny_gguf(QType.Q8_0)
    ids = _ids(tiny_run)
    one = measure.LossyOption("top-k 1", top_k=1).llama_kwargs(path)
    resident = llama_cpp.Llama(
        str(path), devices=[], use_extra_bufts=False, flash_attn=False, **SETTINGS, **one
    )
    try:
        twin = _scores(resident, ids)
    finally:
        resident.close()
    llm = _streamed(path, **one)
    try:
        streamed = _scores(llm, ids)
        misses = llm.stats().misses
    finally:
        llm.close()
    assert misses > 0, "the budget of one layer's experts must make experts be read again"
    assert streamed.tobytes() == twin.tobytes()
    exact = _streamed(path)
    try:
        assert not np.array_equal(_scores(exact, ids), streamed), "the override must change the routing"
    finally:
        exact.close()


def test_skipping_drops_uncached_experts_and_reads_less(
    tiny_run: Path, tiny_gguf: Callable[[QType], Path]
) -> None:
    path = tiny_gguf(QType.Q8_0)
    ids = _ids(tiny_run)
    runs = {}
    # TINY routes 2 of 8 experts: the second's weight is below 0.5, so 0.5 drops it whenever
    # it is not in the cache; the first is never dropped
    for skip in (0.0, 0.5):
        llm = _streamed(path, skip_below=skip)
        try:
            runs[skip] = (_scores(llm, ids), llm.stats())
        finally:
            llm.close()
    (exact, s0), (lossy, s1) = runs[0.0], runs[0.5]
    assert s0.skipped == 0 and s1.skipped > 0
    assert s1.bytes_read < s0.bytes_read
    assert s1.violations == 0 and s1.errors == 0
    assert np.isfinite(lossy).all()
    assert not np.array_equal(exact, lossy)


@pytest.mark.parametrize("skip_below", [-0.1, 1.0, float("nan")])
def test_a_skip_threshold_outside_zero_to_one_is_refused(
    tiny_gguf: Callable[[QType], Path], skip_below: float
) -> None:
    with pytest.raises((ConfigError, ModelLoadError), match="skip_below"):
        _streamed(tiny_gguf(QType.Q8_0), skip_below=skip_below)
