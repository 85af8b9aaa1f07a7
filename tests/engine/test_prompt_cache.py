"""Prompt-cache gates: a restored prefix gives what prefilling the same tokens in the same
micro-batches gives, byte for byte (tokens and every logits row), resident and streamed, with and
without flash attention, on a sliding-window model too; and its states outlive the process."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import mmap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from server.engine.generation import GenerationRequest, GenerationStats, SamplingParams
from server.engine.prompt_cache import (
    PromptCache,
    StateKey,
    Window,
    _Arena,
    _State,
    model_identity,
    state_directory,
)
from server.engine.token_loop import generate
from server.loading.budget import prompt_cache_bytes
from server.loading.measured import MeasuredLlama
from server.loading.resident import load_resident_llama
from server.loading.streaming import load_streaming_llama
from streaming_ext import StreamerConfig
from tests.models import expert_layer_bytes

N_BATCH = 32
N_TOKENS = 6
A = tuple(5 + (i * 37) % 200 for i in range(400))
B = tuple(9 + (i * 13) % 120 for i in range(200))

Outcome = tuple[list[int], str, int]  # tokens, sha256 of every logits row, cached tokens


def load(path: Path, mode: str, flash_attn: bool, n_ctx: int = 1024) -> MeasuredLlama:
    settings: dict[str, Any] = {
        "n_ctx": n_ctx,
        "n_batch": N_BATCH,
        "n_ubatch": N_BATCH,
        "swa_full": False,
        "n_threads": 2,
        "n_threads_batch": 2,
        "flash_attn": "on" if flash_attn else "off",
    }
    if mode == "streaming":
        return load_streaming_llama(path, StreamerConfig(), budget=expert_layer_bytes(path), **settings)
    return load_resident_llama(path, **settings)


def new_cache(llama: MeasuredLlama, path: Path, state_dir: Path | None, ram: int = 64 << 20) -> PromptCache:
    key = StateKey.of(llama, model_identity(path))
    return PromptCache(
        key,
        ram_bytes=ram,
        flash_bytes=1 << 30,
        directory=None if state_dir is None else state_directory(state_dir, path, key),
        window=Window.of(llama),
    )


def run(llama: MeasuredLlama, prompt: tuple[int, ...], cache: PromptCache | None = None) -> Outcome:
    """Greedy decoding of `prompt` through the token loop; the logits rows it sampled from."""
    digest = hashlib.sha256()
    tokens: list[int] = []

    def seen(token: int, _: object) -> None:
        row = np.ctypeslib.as_array(llama._ctx.get_logits_ith(-1), shape=(llama.n_vocab(),))
        digest.update(row.tobytes())
        tokens.append(token)

    stats = GenerationStats()
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    generate(llama, GenerationRequest(prompt, params), stats, lambda _: None, lambda: False, seen, cache)
    return tokens, digest.hexdigest(), stats.cached_tokens


def prefill(llama: MeasuredLlama, tokens: tuple[int, ...]) -> None:
    """Prefill `tokens` into slot 0 in micro-batches of n_batch from the start, as the token loop
    does, for the token loop to reuse."""
    llama.eval(list(tokens))
    llama.slots[0].tokens[:] = tokens


@pytest.fixture(scope="module")
def models(tiny_model: Callable[..., Path]) -> dict[str, Path]:
    return {"qwen": tiny_model("tiny-qwen3moe"), "gemma": tiny_model("tiny-gemma4")}


MATRIX = [
    pytest.param(preset, mode, flash, id=f"{preset}-{mode}-fa-{'on' if flash else 'off'}")
    for preset in ("qwen", "gemma")
    for mode in ("resident", "streaming")
    for flash in (False, True)
]


# tiny-gemma4: a 64-token window in a ring of 256 cells; a state restores as it was decoded where
# the window starts at a multiple of the ring: at 64 and 320 tokens (prompt_cache.Window)
CHECKPOINT = 320


@pytest.mark.parametrize(("preset", "mode", "flash"), MATRIX)
def test_restored_conversation_equals_a_prefill(
    models: dict[str, Path], preset: str, mode: str, flash: bool
) -> None:
    """A, then another client's B, then A continued. qwen: A's whole state comes back from the
    cache and the continuation equals the one a context that never saw B gives (A's KV still
    live there). gemma: the checkpoint of A's prompt comes back (the ring has wrapped since), and
    the continuation equals a fresh context's that prefilled the same micro-batches up to it."""
    path = models[preset]
    llama = load(path, mode, flash)
    try:
        cache = new_cache(llama, path, None)
        first = run(llama, A, cache)
        run(llama, B, cache)
        follow = A + tuple(first[0]) + (17, 18, 19)
        got = run(llama, follow, cache)
    finally:
        llama.close()
    windowed = preset == "gemma"
    assert cache.hits == 1 and got[2] == (CHECKPOINT if windowed else len(A) + N_TOKENS - 1)
    reference = load(path, mode, flash)
    try:
        if windowed:
            prefill(reference, follow[:CHECKPOINT])
        else:
            assert run(reference, A) == first
        expected = run(reference, follow)
    finally:
        reference.close()
    assert got == expected


@pytest.mark.parametrize(("preset", "mode", "flash"), MATRIX)
def test_branch_restores_a_prefix(models: dict[str, Path], preset: str, mode: str, flash: bool) -> None:
    """A branch off A's prompt after B: a full-attention state is cut back to the branch point; a
    sliding-window one cannot be, so the checkpoint of A's prompt is restored whole. Either equals
    a fresh context that prefilled the same tokens in the same micro-batches."""
    path = models[preset]
    branch = A[:395] + tuple(7 + (i * 11) % 150 for i in range(40))
    llama = load(path, mode, flash)
    try:
        cache = new_cache(llama, path, None)
        run(llama, A, cache)
        run(llama, B, cache)
        got = run(llama, branch, cache)
    finally:
        llama.close()
    windowed = preset == "gemma"
    assert cache.hits == 1 and got[2] == (CHECKPOINT if windowed else 395)
    reference = load(path, mode, flash)
    try:
        # the micro-batches A's prompt was prefilled in, then cut back to the branch point
        prefill(reference, A[:CHECKPOINT] if windowed else A)
        expected = run(reference, branch)
    finally:
        reference.close()
    assert got == expected


def test_a_sub_agent_sharing_the_system_prompt_keeps_the_conversation(models: dict[str, Path]) -> None:
    """A prompt sharing most of a long conversation's prefix but throwing away 1,024 of its tokens
    keeps them first: the conversation resumes restored, not prefilled."""
    path = models["qwen"]
    system = A * 3  # over half of the conversation: only the 1,024-token rule keeps it
    conversation = system + tuple(11 + (i * 7) % 180 for i in range(1100))
    sub_agent = system + (3, 4, 5)
    llama = load(path, "resident", False, n_ctx=4096)
    try:
        cache = new_cache(llama, path, None)
        run(llama, conversation, cache)
        assert run(llama, sub_agent, cache)[2] == len(system)  # from the live KV cache
        resumed = run(llama, conversation + (6,), cache)
    finally:
        llama.close()
    assert cache.hits == 1 and resumed[2] == len(conversation)


@pytest.mark.parametrize("preset", ["qwen", "gemma"])
def test_the_automatic_ram_bound_holds_a_full_context(models: dict[str, Path], preset: str) -> None:
    """--prompt-cache-ram auto is one full context's state: a context filled to its last token fits."""
    llama = load(models[preset], "resident", False)
    try:
        llama.eval([(13 * i + 5) % 300 for i in range(llama.n_ctx() - 1)])
        size = int(llama_cpp.llama_state_seq_get_size(llama._ctx.ctx, 0))
        assert llama.memory is not None
        assert size <= prompt_cache_bytes("auto", llama.memory.context)
    finally:
        llama.close()


def test_states_outlive_the_process(models: dict[str, Path], tmp_path: Path) -> None:
    """Closing spills the live state and the RAM states to flash; a new cache over the same
    directory restores from there, to the same bytes. A RAM bound of one state spills the other
    at eviction."""
    path = models["qwen"]
    llama = load(path, "resident", False)
    try:
        cache = new_cache(llama, path, tmp_path)
        first = run(llama, A, cache)
        run(llama, B, cache)
        follow = A + tuple(first[0]) + (17, 18, 19)
        expected = run(llama, follow, cache)
        assert cache.hits == 1
        cache.close(llama)
        assert cache.stats().flash_bytes > 0
    finally:
        llama.close()
    llama = load(path, "resident", False)
    try:
        one_state = cache.stats().ram_bytes or 16 << 20
        again = new_cache(llama, path, tmp_path, ram=one_state)
        assert again.stats().states == 2  # A continued and B (A's own state is a prefix of the first)
        # the state kept at close holds all of the continued prompt: it is restored but its last token
        got = run(llama, follow, again)
        assert got[:2] == expected[:2] and got[2] == len(follow) - 1
        assert run(llama, B + (3,), again)[2] == len(B)
        assert again.hits == 2
    finally:
        llama.close()


def test_the_kernels_and_the_kv_streams_are_in_the_key(models: dict[str, Path]) -> None:
    """A state computed with other kernels (the repacked layouts on or off) or saved from a
    context with another KV stream count is never restored: each is another key."""
    path = models["qwen"]
    digests = set()
    for repack, parallel in (("on", 1), ("off", 1), ("on", 2)):
        llama = load_resident_llama(path, n_ctx=256, repack=repack, parallel=parallel)
        try:
            key = StateKey.of(llama, model_identity(path))
            assert key.repack is (repack == "on") and key.kv_streams == parallel
            digests.add(StateKey(**{**dataclasses.asdict(key), "n_ctx": 256}).digest())
        finally:
            llama.close()
    assert len(digests) == 3


def test_foreign_and_corrupt_states_are_ignored(
    models: dict[str, Path], tiny_model: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A state from a model of the same preset but another seed is refused, a corrupt one is
    ignored: both with a warning, and the prompt is prefilled as if there were none."""
    path = models["qwen"]
    other = tiny_model("tiny-qwen3moe", seed=2)
    llama = load(other, "resident", False)
    try:
        cache = new_cache(llama, other, tmp_path)
        run(llama, A, cache)
        cache.close(llama)
    finally:
        llama.close()
    llama = load(path, "resident", False)
    try:
        ours = new_cache(llama, path, tmp_path)
        assert ours.directory is not None and cache.directory is not None
        assert ours.directory != cache.directory, "another model's states live elsewhere"
        ours.directory.mkdir(parents=True)
        (foreign,) = cache.directory.iterdir()
        (ours.directory / foreign.name).write_bytes(foreign.read_bytes())
        with caplog.at_level(logging.WARNING):
            refused = new_cache(llama, path, tmp_path)
        assert refused.stats().states == 0
        assert "another model" in caplog.text
        fresh = run(llama, A, refused)
        refused.close(llama)
    finally:
        llama.close()
    (saved,) = (p for p in ours.directory.iterdir() if p.name != foreign.name)
    raw = bytearray(saved.read_bytes())
    raw[-100] ^= 0xFF
    saved.write_bytes(bytes(raw))
    llama = load(path, "resident", False)
    try:
        corrupt = new_cache(llama, path, tmp_path)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            got = run(llama, A + (1,), corrupt)
        assert "checksum" in caplog.text and got[2] == 0 and corrupt.hits == 0
        assert run(llama, A, corrupt)[:2] == fresh[:2]
    finally:
        llama.close()


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.INFO, logger="server.engine.prompt_cache")
    yield


def test_the_arena_places_states_in_gaps_and_moves_them_down_intact() -> None:
    page = mmap.PAGESIZE
    arena = _Arena(8 * page)
    # a state of 2 pages at page 0, one of 3 pages less a byte at page 4 (overlaps its move down)
    first = _State((1,), 2 * page, 0, at=0)
    second = _State((2,), 3 * page - 1, 0, at=4 * page)
    payload = {id(s): bytes([7 + i]) * s.size for i, s in enumerate((first, second))}
    for state in (first, second):
        assert state.at is not None
        arena.view(state.at, state.size)[:] = payload[id(state)]
    assert arena.place(2 * page, [first, second]) == 2 * page  # the gap between them
    assert arena.place(page, [first, second]) == 2 * page
    # 3 pages: no gap holds them (2 between, 1 after), so the second state moves down to page 2
    assert arena.place(3 * page, [first, second]) == 5 * page
    assert (first.at, second.at) == (0, 2 * page)
    for state in (first, second):
        assert state.at is not None
        assert bytes(arena.view(state.at, state.size)) == payload[id(state)]
    with pytest.raises(RuntimeError):
        arena.place(4 * page, [first, second])  # the caller makes room first (_make_room)
    arena.map.close()
