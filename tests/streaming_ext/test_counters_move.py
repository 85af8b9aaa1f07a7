"""A run that exercises the streamer moves every counter the header declares (MF_STATS_FIELDS).

A counter added to the list but never stored, one whose storage stopped being copied out, or one
the code stopped counting reads 0 here and fails the test, which names it. CANNOT_MOVE names the
counters this run cannot move, each with its reason; a counter on it that does move fails too,
so the list stays true.

The run: a tiny model streamed under one layer's budget (every route evicts), O_DIRECT reads,
router prefetch, repacked layouts and a lossy skip_below, decoding a prompt and a few tokens;
then its hot set is saved, the cache dropped and the hot set restored (warm start); then the same
model under a budget that holds every expert, which stops watching routing once all are resident.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from server.loading.streaming import StreamingLlama, load_streaming_llama
from server.settings import Budget
from streaming_ext import Policy, Prefetch, Reader, StreamerConfig, StreamerStats
from tests.models import expert_layer_bytes, greedy

# (counter, why this run cannot move it)
CANNOT_MOVE: tuple[tuple[str, str], ...] = (
    ("violations", "an expert matmul that finds its routed slice absent is a bug: it must stay 0"),
    ("errors", "a clean run fails nothing (tests/loading/test_streaming_errors.py injects faults)"),
)
PROMPT = [(7 * i + 40) % 300 for i in range(24)]


def _streamed(path: Path, config: StreamerConfig, budget: Budget, repack: str = "off") -> StreamingLlama:
    return load_streaming_llama(
        path, config, budget=budget, follow_memory=False, n_ctx=256, n_threads=2, repack=repack
    )


def _run(path: Path) -> list[StreamerStats]:
    """The counters after each step of the run (module docstring)."""
    samples: list[StreamerStats] = []
    levers = StreamerConfig(
        reader=Reader.DIRECT, policy=Policy.LAYER, prefetch=Prefetch.ROUTER, overlap=True, skip_below=0.3
    )
    llm = _streamed(path, levers, expert_layer_bytes(path), repack="on")
    try:
        samples.append(llm.stats())
        greedy(llm, PROMPT, 8)
        samples.append(llm.stats())
        hot = llm.streamer.hot_set()
        llm.streamer.drop_cache()
        samples.append(llm.stats())
        for layer in sorted({layer for layer, _, _ in hot}):
            llm.streamer.restore(layer, {e: uses for lay, e, uses in hot if lay == layer})
        samples.append(llm.stats())
    finally:
        llm.close()
    llm = _streamed(path, StreamerConfig(), "all")
    try:
        greedy(llm, PROMPT, 4)
        samples.append(llm.stats())
    finally:
        llm.close()
    return samples


def test_a_streamer_run_moves_every_declared_counter(tiny_model: Callable[..., Path]) -> None:
    # its own output matrix: the token embeddings are mapped from the file (mapped_bytes)
    samples = _run(tiny_model("tiny-qwen3moe", tied_embeddings=False))
    declared = [s.name for s in StreamerStats.declared()]
    cannot = {name for name, _ in CANNOT_MOVE}
    assert cannot <= set(declared), "CANNOT_MOVE names a counter the header no longer declares"
    moved = {name for name in declared if any(getattr(sample, name) != 0 for sample in samples)}
    still = [name for name in declared if name not in moved and name not in cannot]
    assert not still, (
        f"declared counters this run never moved: {still} (count them in C, make this run exercise "
        f"them, or name them in CANNOT_MOVE with the reason); last sample {samples[-1]}"
    )
    assert not moved & cannot, f"these moved: take them off CANNOT_MOVE: {moved & cannot}"
