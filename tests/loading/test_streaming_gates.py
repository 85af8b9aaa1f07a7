"""Byte-identity gates: streaming must reproduce the resident model bit for bit.

Every gate decodes greedily with the resident reference (load mode MMAP, repacked layouts where
llama.cpp has them, no callback) and with the streamer under one setting,
and compares the tokens AND a sha256 of every logits row, and the tensors each side holds
repacked (llama.cpp's own log line for each, the streamer's record). Each lever of the streamer
(cache policy and size, reader mode, lanes, overlap, micro-batch size, flash attention,
architecture, expert sizes that differ by layer, split files, KV-cache reuse) has a gate here; the
negative control proves a gate fails when an expert is deliberately not loaded.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from gguf import GGUFReader

from server.errors import ModelLoadError
from server.loading.model_files import split_files
from server.loading.streaming import EXPERT_PATTERN, StreamingLlama, load_streaming_llama
from server.modelgen.spec import QType
from server.settings import Budget
from streaming_ext import Policy, Prefetch, Reader, StreamerConfig, StreamerStats
from tests.models import (
    LLAMA_DEFAULTS,
    expert_layer_bytes,
    greedy,
    last_logits,
    load_llama,
    load_llama_noting_repacks,
    noting_repacks,
)

PROMPT = [(7 * i + 40) % 300 for i in range(24)]
N_TOKENS = 10
ARCH_PRESETS = ["tiny-qwen3moe", "tiny-gptoss", "tiny-mixtral", "tiny-qwen2moe", "tiny-hyv3", "tiny-gemma4"]

Result = tuple[list[int], str]


class Reference(NamedTuple):
    """A resident run: its greedy result and the tensors llama.cpp repacked."""

    result: Result
    repacked: frozenset[str]


class Options(NamedTuple):
    """What a gate streams with: the streamer's levers, the budget, a preload."""

    config: StreamerConfig
    budget: Budget
    preload: bool


def options(budget: Budget = "auto", preload: bool = False, policy: str = "layer", **levers: Any) -> Options:
    return Options(StreamerConfig(policy=Policy[policy.upper()], **levers), budget, preload)


def streamed(path: Path, opts: Options, **kw: Any) -> StreamingLlama:
    """A streaming Llama with the same context settings as the resident reference."""
    settings = {**LLAMA_DEFAULTS, **kw}
    repack = "on" if settings.pop("use_extra_bufts") else "off"
    n_ctx = settings.pop("n_ctx")
    # the reference's flash attention, never the loader's automatic choice
    flash_attn = "on" if settings.pop("flash_attn", False) else "off"
    return load_streaming_llama(
        path,
        opts.config,
        budget=opts.budget,
        preload=opts.preload,
        n_ctx=n_ctx,
        flash_attn=flash_attn,
        repack=repack,
        **settings,
    )


@pytest.fixture(scope="module")
def reference() -> Iterator[Callable[..., Reference]]:
    """Resident greedy results, computed once per (model, prompt, n, context settings)."""
    cache: dict[str, Reference] = {}

    def run(path: Path, prompt: list[int] = PROMPT, n: int = N_TOKENS, **kw: Any) -> Reference:
        key = repr((str(path), prompt, n, sorted(kw.items())))
        if key not in cache:
            llm, repacked = load_llama_noting_repacks(path, **kw)
            try:
                cache[key] = Reference(greedy(llm, prompt, n), repacked)
            finally:
                llm.close()
        return cache[key]

    yield run


def streamed_repacked(llm: StreamingLlama, path: Path) -> frozenset[str]:
    """The tensors of `path` (every file of a split set) the streamer holds in a repacked layout."""
    names = (name for part in split_files(path) for name in _tensor_bytes(part))
    return frozenset(name for name in names if llm.streamer.tensor_repacked(name))


def gate(path: Path, opts: Options, reference: Callable[..., Reference], **kw: Any) -> StreamerStats:
    """Assert streaming == resident for `opts`, kernels included; returns the streamer's counters.
    With repacked layouts (`--repack on`) unless told otherwise: the path where the streamer does
    the most; the other tests here run the default, plain layouts."""
    kw.setdefault("use_extra_bufts", True)
    prompt = kw.pop("prompt", PROMPT)
    expected = reference(path, prompt, N_TOKENS, **kw)
    # the streamer's weights, and any it leaves to llama.cpp (a tied output matrix's copy)
    llm, by_llama = noting_repacks(streamed, path, opts, **kw)
    try:
        got = greedy(llm, prompt, N_TOKENS)
        stats = llm.stats()
        repacked = streamed_repacked(llm, path) | by_llama
    finally:
        llm.close()
    assert repacked == expected.repacked, (
        f"repacked streamed, resident: {sorted(repacked ^ expected.repacked)}"
    )
    assert got[0] == expected.result[0], f"tokens differ with {opts}"
    assert got[1] == expected.result[1], f"logits differ with {opts}"
    assert stats.violations == 0 and stats.errors == 0
    return stats


def _tensor_bytes(path: Path) -> dict[str, int]:
    return {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}


def memory_bound(path: Path, budget: int) -> int:
    """The most expert memory a budget may hold in frames: a slice read in whole pages spans at
    most two pages more than its bytes, so a frame (every frame has the largest layer's span) is at
    most two pages per tensor more than the largest entry; the cache counts each entry at the
    largest entry's bytes, and there are two frames more than the budget holds entries."""
    reader = GGUFReader(path)
    entries: dict[str, list[int]] = {}
    for t in reader.tensors:
        if t.name.endswith("_exps.weight"):
            entries.setdefault(t.name.split(".")[1], []).append(int(t.n_bytes) // int(t.shape[-1]))
    largest = max(sum(e) for e in entries.values())
    frame = max(sum(e) + 2 * 4096 * len(e) for e in entries.values())
    return (budget // largest + 2) * frame


@pytest.fixture(scope="module")
def qwen(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("tiny-qwen3moe")


# ------------------------------------------------------------------------------------ cache
def test_gate_large_cache(qwen: Path, reference: Callable[..., Reference]) -> None:
    stats = gate(qwen, options(), reference)
    assert stats.evictions == 0 and stats.hits > 0, "a budget >= the model caches everything"
    assert reference(qwen, use_extra_bufts=True).repacked, (
        "Q4_0 experts have a repacked layout on every CPU the suite runs on"
    )
    assert stats.repacked_bytes > 0 and stats.repack_ns > 0


def test_gate_no_cache(qwen: Path, reference: Callable[..., Reference]) -> None:
    stats = gate(qwen, options(policy="none", prefetch=Prefetch.OFF), reference)
    assert stats.hits == 0 and stats.evictions > 0


# ------------------------------------------------------------------------------------ prefetch
@pytest.mark.parametrize(
    ("policy", "overlap", "prefetch"),
    [
        pytest.param("layer", False, Prefetch.ROUTER, id="layer-serial"),
        pytest.param("layer", True, Prefetch.ROUTER, id="layer-overlap"),
        pytest.param("lru", False, Prefetch.ROUTER, id="lru-serial"),
        pytest.param("none", True, Prefetch.ROUTER, id="none-overlap"),
        pytest.param("layer", False, Prefetch.HISTORY, id="history-serial"),
        pytest.param("none", True, Prefetch.HISTORY, id="history-none-overlap"),
        pytest.param("layer", False, Prefetch.OFF, id="off"),
    ],
)
def test_gate_prefetch(
    qwen: Path, reference: Callable[..., Reference], policy: str, overlap: bool, prefetch: Prefetch
) -> None:
    # the smallest budget: every prefetch must evict, and the running layer's experts stay pinned
    opts = options(budget=expert_layer_bytes(qwen), policy=policy, overlap=overlap, prefetch=prefetch)
    stats = gate(qwen, opts, reference)
    if prefetch == Prefetch.OFF:
        assert stats.prefetched == 0 and stats.prefetch_hits == 0
        return
    if prefetch == Prefetch.HISTORY:
        # a few tokens of history predict something; how well is the route-trace tests' business
        assert stats.prefetched > 0 and stats.prefetch_hits > 0
        if policy == "none":
            assert stats.hits == stats.prefetch_hits
        return
    # the next layer's router on this layer's input guesses most experts of a random-weight model
    assert stats.prefetched > 0 and stats.prefetch_hits > stats.prefetched // 2
    if policy == "none":
        # nothing is cached: every hit is a prefetched expert
        assert stats.hits == stats.prefetch_hits


def test_gate_prefetch_follows_gemma4s_router_input(
    tiny_model: Callable[..., Path], reference: Callable[..., Reference]
) -> None:
    """gemma4's router reads rms_norm(attn_out), scaled, times its own per-channel scale: the
    prediction must apply the next layer's scale, not reuse this layer's scaled input (60 of the
    108 experts read ahead were used that way on this model, 80 with the next layer's scale)."""
    path = tiny_model("tiny-gemma4")
    opts = options(budget=expert_layer_bytes(path), policy="none")
    stats = gate(path, opts, reference)
    assert stats.hits == stats.prefetch_hits
    assert stats.prefetch_hits >= 0.7 * stats.prefetched, (stats.prefetch_hits, stats.prefetched)


@pytest.mark.parametrize("policy", ["layer", "lru"])
def test_gate_cache_that_evicts_every_layer(
    qwen: Path, reference: Callable[..., Reference], policy: str
) -> None:
    opts = options(budget=expert_layer_bytes(qwen), policy=policy)
    stats = gate(qwen, opts, reference)
    assert stats.evictions > 0 and stats.misses > 0


# ------------------------------------------------------------------------------------ reader
@pytest.mark.parametrize(
    ("direct_io", "lanes", "overlap"),
    [
        pytest.param(True, 1, False, id="odirect-1lane-serial"),
        pytest.param(True, 4, True, id="odirect-4lanes-overlap"),
        pytest.param(False, 1, True, id="buffered-1lane-overlap"),
        pytest.param(False, 4, False, id="buffered-4lanes-serial"),
    ],
)
def test_gate_reader_modes(
    qwen: Path, reference: Callable[..., Reference], direct_io: bool, lanes: int, overlap: bool
) -> None:
    # a small cache keeps the reader busy on every token
    reader = Reader.DIRECT if direct_io else Reader.BUFFERED
    opts = options(budget=expert_layer_bytes(qwen), reader=reader, lanes=lanes, overlap=overlap)
    stats = gate(qwen, opts, reference)
    assert stats.bytes_read > 0
    assert stats.direct_io == int(direct_io)


# ------------------------------------------------------------------------------------ frames
@pytest.mark.parametrize(
    ("n_ff_exp", "overlap"),
    [
        pytest.param(128, False, id="4.5-page-slices"),
        pytest.param(512, True, id="18-page-slices-overlap"),
        # 576 KiB slices: a demand read is three chunks for the four lanes (mf_lanes.c, chunk_bytes)
        pytest.param(4096, True, id="chunked-slices-overlap"),
        pytest.param(4096, False, id="chunked-slices-serial"),
    ],
)
def test_gate_frames(
    tiny_model: Callable[..., Path], reference: Callable[..., Reference], n_ff_exp: int, overlap: bool
) -> None:
    # slices that start and end inside pages (the model's expert data is 32-byte aligned in the
    # file), read whole-page into frames by four lanes at once, large ones in chunks that share no
    # page; every route evicts, and the memory held stays within the budget's entries in frames
    path = tiny_model("tiny-qwen3moe", n_ff_exp=n_ff_exp)
    budget = expert_layer_bytes(path)
    stats = gate(path, options(budget=budget, overlap=overlap, lanes=4), reference)
    assert stats.evictions > 0 and stats.hold_all == 0
    assert 0 < stats.expert_memory_bytes <= memory_bound(path, budget), (stats.expert_memory_bytes, budget)


def test_dropped_cache_holds_no_memory(qwen: Path, reference: Callable[..., Reference]) -> None:
    """drop_cache gives the frames' pages back; the next request reads into fresh ones."""
    expected = reference(qwen).result
    llm = streamed(qwen, options(budget=2 * expert_layer_bytes(qwen)))
    try:
        first = greedy(llm, PROMPT, N_TOKENS)
        held = llm.stats().expert_memory_bytes
        llm.streamer.drop_cache()
        dropped = llm.stats()
        second = greedy(llm, PROMPT, N_TOKENS)
    finally:
        llm.close()
    assert first == expected and second == expected
    assert held > 0 and dropped.expert_memory_bytes == 0 and dropped.resident_bytes == 0
    assert dropped.frames_released > 0


@pytest.mark.parametrize("policy", ["layer", "lru"])
def test_gate_frames_under_stress(
    tiny_model: Callable[..., Path], reference: Callable[..., Reference], policy: str
) -> None:
    # slices of ~1.1 pages, 16 lanes, the smallest budget and prefetch: a frame handed to a new
    # entry while a read into it is in flight, or a slot left pointing at a frame given away, fails
    # the gate. LRU under one layer's budget evicts exactly the next layer's experts, which the
    # prefetch then admits again within the same route
    path = tiny_model("tiny-qwen3moe", n_ff_exp=32)
    opts = options(budget=expert_layer_bytes(path), policy=policy, lanes=16, prefetch=Prefetch.ROUTER)
    for prompt in (PROMPT, [(11 * i + 3) % 300 for i in range(5)]):
        stats = gate(path, opts, reference, prompt=prompt)
        assert stats.evictions > 0 and stats.prefetched > 0


# ------------------------------------------------------------------------------------ batch sizes
@pytest.mark.parametrize("n_ubatch", [1, 8, 512])
@pytest.mark.parametrize("layers", [1, 3], ids=["one-layer-budget", "three-layer-budget"])
def test_gate_micro_batches_long_prompt(
    qwen: Path, reference: Callable[..., Reference], n_ubatch: int, layers: int
) -> None:
    prompt = [(13 * i + 5) % 300 for i in range(600)]  # longer than one 512-token micro-batch
    opts = options(budget=layers * expert_layer_bytes(qwen), prefetch=Prefetch.ROUTER)
    settings = {"n_ctx": 1024, "n_batch": 512, "n_ubatch": n_ubatch}
    gate(qwen, opts, reference, prompt=prompt, **settings)
    if layers > 1:
        # room beside the running layer: the prompt's micro-batches read the next layer ahead
        # too, however long they are (the prompt alone, no decode step)
        llm = streamed(qwen, opts, **settings)
        try:
            llm.eval(prompt)
            stats = llm.stats()
        finally:
            llm.close()
        assert stats.prefetched > 0 and stats.prefetch_hits > 0


# ------------------------------------------------------------------------------------ multi-turn
def test_gate_multi_turn_kv_reuse(qwen: Path) -> None:
    """Turn 2 extends turn 1 without re-evaluating it (the KV cache is reused)."""

    def conversation(llm: Any) -> tuple[list[int], list[int]]:
        first, _ = greedy(llm, PROMPT, 6)
        llm.eval([first[-1]])
        n_before = llm.n_tokens
        llm.eval([50, 60, 70, 80])  # the user's next message, appended to the cached context
        assert llm.n_tokens == n_before + 4
        second = []
        for _ in range(6):
            token = int(last_logits(llm).argmax())
            second.append(token)
            llm.eval([token])
        return first, second

    resident = load_llama(qwen)
    try:
        expected = conversation(resident)
    finally:
        resident.close()
    llm = streamed(qwen, options(budget=expert_layer_bytes(qwen)))
    try:
        assert conversation(llm) == expected
    finally:
        llm.close()


# ------------------------------------------------------------------------------------ architectures
@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_gate_every_architecture(
    tiny_model: Callable[..., Path], reference: Callable[..., Reference], preset: str
) -> None:
    path = tiny_model(preset)
    gate(path, options(budget=expert_layer_bytes(path)), reference)
    gate(path, options(), reference)


@pytest.mark.parametrize("preset", ["tiny-gptoss", "tiny-gemma4"])
def test_gate_sliding_window_cache_cut_to_the_window(
    tiny_model: Callable[..., Path], reference: Callable[..., Reference], preset: str
) -> None:
    """The server creates sliding-window KV caches cut to the window (swa_full off): streamed and
    resident agree with a prompt four times the 64-token window, in micro-batches of 32."""
    path = tiny_model(preset)
    prompt = [(13 * i + 5) % 300 for i in range(256)]
    settings = {"n_ctx": 1024, "n_batch": 32, "n_ubatch": 32, "swa_full": False}
    gate(path, options(budget=expert_layer_bytes(path)), reference, prompt=prompt, **settings)


@pytest.mark.parametrize("preset", ["tiny-qwen3moe", "tiny-gptoss", "tiny-gemma4"])
def test_gate_flash_attention(
    tiny_model: Callable[..., Path], reference: Callable[..., Reference], preset: str
) -> None:
    """Flash attention (the loader's lever for long contexts): streamed and resident agree with it
    on, for a cache that evicts every layer, a sliding-window cache cut to the window and a prompt
    in micro-batches of 32."""
    path = tiny_model(preset)
    prompt = [(11 * i + 3) % 300 for i in range(160)]
    settings = {"n_ctx": 1024, "n_batch": 32, "n_ubatch": 32, "swa_full": False, "flash_attn": True}
    gate(path, options(budget=expert_layer_bytes(path)), reference, prompt=prompt, **settings)
    off = reference(path, prompt, N_TOKENS, **{**settings, "flash_attn": False}).result
    assert off[1] != reference(path, prompt, N_TOKENS, **settings).result[1], "flash attention was not on"


@pytest.mark.parametrize(
    ("preset", "experts", "down", "rest", "policy", "overlap"),
    [
        pytest.param("tiny-qwen3moe", "Q4_K", "Q6_K", None, "layer", False, id="qwen3moe-q4_k_m-serial"),
        pytest.param("tiny-qwen3moe", "Q4_K", "Q6_K", None, "lru", True, id="qwen3moe-q4_k_m-lru-overlap"),
        pytest.param("tiny-qwen3moe", "Q4_0", "F16", None, "layer", True, id="qwen3moe-q4_0-f16-overlap"),
        pytest.param("tiny-gptoss", "MXFP4", "Q8_0", None, "layer", True, id="gptoss-mxfp4-q8_0-overlap"),
        # Gemma-4's Q4_K_M: Q4_K gate_up, and a down width (704 there) no K-quant holds
        pytest.param("tiny-gemma4", "Q4_K", "Q8_0", "Q5_0", "layer", True, id="gemma4-q4_k_m-overlap"),
    ],
)
def test_gate_expert_sizes_differ_by_layer(
    tiny_model: Callable[..., Path],
    reference: Callable[..., Reference],
    preset: str,
    experts: str,
    down: str,
    rest: str | None,
    policy: str,
    overlap: bool,
) -> None:
    """Real Q4_K_M files store ffn_down_exps in Q6_K on half the layers: an expert's slices differ
    in type and size, and so do the layers' experts. Under a budget of one and a half of the
    largest layers, admitting a big layer's expert can take more than one small victim."""
    # K-quants pack 256 values per block: the tiny expert width grows to one block where the
    # down rows are K-quants too
    width = {"n_ff_exp": 256} if experts == "Q4_K" and rest is None else {}
    types = {"expert_qtype": QType[experts], "down_qtype": QType[down]}
    if rest is not None:
        types["down_qtype_rest"] = QType[rest]
    path = tiny_model(preset, **types, **width)
    sizes = _tensor_bytes(path)
    downs = {sizes[f"blk.{il}.ffn_down_exps.weight"] for il in range(4)}
    assert len(downs) == 2, "two down sizes across the layers"
    largest = expert_layer_bytes(path)
    all_experts = sum(n for name, n in sizes.items() if name.endswith("_exps.weight"))
    assert 4 * largest > all_experts, "the layers' experts are not all the largest size"
    opts = options(budget=largest * 3 // 2, policy=policy, overlap=overlap, lanes=4)
    stats = gate(path, opts, reference)
    assert stats.evictions > 0 and stats.misses > 0
    assert stats.resident_bytes <= largest * 3 // 2
    # entries of two sizes in frames of one: the memory stays within the budget's entries in frames
    assert 0 < stats.expert_memory_bytes <= memory_bound(path, largest * 3 // 2)


def test_entries_of_two_sizes_share_frames_without_releases(
    tiny_model: Callable[..., Path], reference: Callable[..., Reference]
) -> None:
    """Entries of two sizes (Q6_K down on half the layers) share frames of one size, so a load
    always finds a free frame with pages once the cache is full: decode gives no frame's pages
    back. Frames of one size per entry size released 2.2 frames per missed entry here (a TLB
    shootdown, then page faults on the read), and still one per eight with 64 frames kept free."""
    path = tiny_model(
        "tiny-qwen3moe",
        n_layer=8,
        n_expert=64,
        n_expert_used=8,
        expert_qtype=QType.Q4_K,
        down_qtype=QType.Q6_K,
        n_ff_exp=256,
    )
    opts = options(budget=2 * expert_layer_bytes(path))
    gate(path, opts, reference)
    # the budget given: under memory pressure (another process's cgroup stalling) the watch would
    # lower it, and a lower budget gives frames back
    llm = streamed(path, opts, follow_memory=False)
    try:
        assert "frames of" in llm.streamer.memory_note()
        llm.eval(PROMPT)
        before = llm.stats()
        for _ in range(60):
            llm.eval([int(last_logits(llm).argmax())])
        after = llm.stats()
    finally:
        llm.close()
    misses = after.misses - before.misses
    released = after.frames_released - before.frames_released
    assert misses > 100, "the budget must make decode miss"
    assert released == 0, (released, misses)


def test_gate_split_gguf(tiny_model: Callable[..., Path], reference: Callable[..., Reference]) -> None:
    whole = tiny_model("tiny-qwen3moe")
    first = tiny_model("tiny-qwen3moe", split_max_size=whole.stat().st_size // 3)
    assert "-00001-of-" in first.name
    expected = reference(whole).result
    assert reference(first).result == expected, "the split twin must decode like the whole file"
    gate(first, options(budget=expert_layer_bytes(first)), reference)


# ------------------------------------------------------------------------------------ embeddings
@pytest.mark.parametrize(
    ("preset", "tied", "dense_qtype"),
    [
        ("tiny-qwen3moe", False, QType.Q8_0),
        ("tiny-qwen3moe", True, QType.Q8_0),
        ("tiny-gemma4", True, QType.Q8_0),
        ("tiny-qwen3moe", True, QType.Q4_0),
        ("tiny-gemma4", True, QType.Q4_0),
    ],
    ids=["own-output", "tied", "gemma4-tied", "tied-repacked", "gemma4-tied-repacked"],
)
def test_gate_token_embeddings(
    tiny_model: Callable[..., Path],
    reference: Callable[..., Reference],
    preset: str,
    tied: bool,
    dense_qtype: QType,
) -> None:
    """A token reads one row of the embeddings: they stay mapped from the file (never read into
    memory) unless the model has no output.weight and multiplies by them every token. Then they
    are read once: gemma4 asks llama.cpp for its output matrix before the embeddings, and gets
    two tensors of the same bytes, which must share one copy. Unless the output copy is
    repacked (Q4_0 here, as llama.cpp repacks it resident): then the loader leaves both to
    llama.cpp, which maps the rows and repacks the copy, as in its resident load."""
    path = tiny_model(preset, tied_embeddings=tied, dense_qtype=dense_qtype)
    sizes = _tensor_bytes(path)
    embd = sizes["token_embd.weight"]
    assert embd > 0 and ("output.weight" not in sizes) == tied
    stats = gate(path, options(budget=expert_layer_bytes(path)), reference)
    assert stats.mapped_bytes == (0 if tied else embd)  # the streamer's own mapping (MF_ROWS)
    dense = sum(n for name, n in sizes.items() if not re.search(EXPERT_PATTERN, name))
    repacked_copy = tied and dense_qtype == QType.Q4_0  # left to llama.cpp: the rows stay mapped
    assert stats.dense_bytes == dense - (embd if repacked_copy else stats.mapped_bytes)


# ------------------------------------------------------------------------------------ negative control
def test_negative_control_unloaded_expert_fails_the_gate(
    qwen: Path, reference: Callable[..., Reference]
) -> None:
    """The gate is not vacuous: leaving one routed expert unread (zeros) changes the output."""
    expected = reference(qwen).result
    llm = streamed(qwen, options(skip_expert=1))
    try:
        got = greedy(llm, PROMPT, N_TOKENS)
        assert llm.stats().hits + llm.stats().misses > 0
    finally:
        llm.close()
    assert got != expected


def test_gate_preloaded_experts(qwen: Path, reference: Callable[..., Reference]) -> None:
    """--preload reads every expert at load; decoding then never misses."""
    expected = reference(qwen).result
    llm = streamed(qwen, options(budget="all", preload=True))
    try:
        loaded = llm.stats()
        assert loaded.bytes_read == loaded.resident_bytes == llm.streamer.expert_bytes
        got = greedy(llm, PROMPT, N_TOKENS)
        after = llm.stats()
    finally:
        llm.close()
    assert got == expected
    assert after.misses == 0 and after.evictions == 0
    assert after.bytes_read == loaded.bytes_read, "nothing is read after the preload"
    # holding every expert, all resident: nothing left to route, so nothing is watched
    assert loaded.hold_all == 1 and loaded.routing_off == 1 and after.routing_off == 1
    assert after.routes == 0 and after.expert_memory_bytes == 0, "held whole: the tensors, no frames"


# ------------------------------------------------------------------------------------ hold all
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_gate_hold_all_stops_routing_once_resident(
    qwen: Path, reference: Callable[..., Reference], overlap: bool
) -> None:
    """A budget holding every expert loads them on demand, then stops watching routing (no graph
    splits); dropping the cache makes it watch and read again. Output identical throughout."""
    expected = reference(qwen).result
    llm = streamed(qwen, options(budget="all", overlap=overlap))
    try:
        first = greedy(llm, PROMPT, N_TOKENS)
        stats = llm.stats()
        watched = [t.routed for t in llm.steps]
        llm.streamer.drop_cache()
        dropped = llm.stats()
        second = greedy(llm, PROMPT, N_TOKENS)
        again = llm.stats()
    finally:
        llm.close()
    assert first == expected and second == expected
    assert stats.hold_all == 1 and stats.expert_memory_bytes == 0 and stats.violations == 0
    # the prompt routes to every expert of the tiny model: watched first, not after
    assert stats.routing_off == 1 and stats.resident_bytes == stats.bytes_read
    assert watched[0] and not watched[-1], watched
    assert dropped.routing_off == 0 and dropped.resident_bytes == 0
    assert again.routing_off == 1 and again.bytes_read == 2 * stats.bytes_read and again.routes > stats.routes


def test_hold_all_asks_for_huge_pages(qwen: Path) -> None:
    """Expert memory asks for transparent huge pages: held whole, the tensors' own memory; under a
    budget that evicts, the frames' arena, while the tensors' own memory stays an untouched
    PROT_NONE reservation that asks for none."""
    if not Path("/sys/kernel/mm/transparent_hugepage").exists():
        pytest.skip("this kernel has no transparent huge pages")

    def mappings() -> list[tuple[int, set[str]]]:
        out, size = [], 0
        for line in Path("/proc/self/smaps").read_text().splitlines():
            if line.startswith("Size:"):
                size = int(line.split()[1]) * 1024
            elif line.startswith("VmFlags:"):
                out.append((size, set(line[8:].split())))
        return out

    def huge(maps: list[tuple[int, set[str]]]) -> int:
        return sum(size for size, flags in maps if "hg" in flags)

    def reserved(maps: list[tuple[int, set[str]]]) -> int:
        return sum(size for size, flags in maps if "rd" not in flags and "hg" not in flags)

    layer = expert_layer_bytes(qwen)
    grown: dict[bool, tuple[int, int]] = {}  # what the load added: huge-page bytes, reserved bytes
    dense = 0
    for whole in (False, True):
        before = mappings()
        llm = streamed(qwen, options(budget="all") if whole else options(budget=layer))
        try:
            after = mappings()
            stats, experts = llm.stats(), llm.streamer.expert_bytes
        finally:
            llm.close()
        assert stats.hold_all == int(whole) and stats.routing_off == 0
        dense = stats.dense_bytes  # the dense weights ask for huge pages too
        grown[whole] = (huge(after) - huge(before), reserved(after) - reserved(before))
    # held whole, the tensors' own memory asks for huge pages; under a budget, the frames' arena
    assert grown[True][0] >= dense + experts and grown[False][0] >= dense + layer
    # under a budget the tensors' own memory is a reservation: unreadable, asking for no huge pages
    assert grown[False][1] >= experts > grown[True][1]


def test_preload_needs_a_budget_for_every_expert(qwen: Path) -> None:
    with pytest.raises(ModelLoadError, match="preload needs a budget"):
        streamed(qwen, options(budget=expert_layer_bytes(qwen), preload=True))
