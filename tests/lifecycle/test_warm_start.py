"""Warm start (server/lifecycle/hot_set.py): the hot set saved by one server is read back by the
next, between requests, into the budget's free room; output stays byte-identical and the first
answer reads less from flash. Also: the file's checks, and that a request waiting is served
before the next chunk of read-back."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.engine.generation import GenerationRequest, SamplingParams
from server.engine.worker import Engine, Finished
from server.lifecycle.hot_set import ModelFiles, WarmStart, read_hot_set, write_hot_set
from server.loading.loader import LoadedModel, load_model
from server.settings import load_settings
from streaming_ext import Streamer, StreamerConfig
from tests.servers import running_server, wait_for

PROMPT = "Warm start keeps the experts a conversation routes, " * 6


def _model(tiny_model: Any) -> Path:
    return Path(tiny_model("tiny-qwen3moe", n_layer=6))


def _layer_bytes(model: Path) -> int:
    streamer = Streamer(model, StreamerConfig())
    try:
        return streamer.layer_bytes
    finally:
        streamer.close()


def _complete(base_url: str) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "timings": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    values = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} not in /metrics"
    return float(values[0])


def test_the_next_server_reads_the_hot_set_back(tiny_model: Any, tmp_path: Path) -> None:
    """A server's hot set, saved at shutdown, is read back by the next one before its first
    request: that request gives the same text and reads fewer experts than a cold start's."""
    model = _model(tiny_model)
    # four of the six layers' experts: the request evicts, and the hot set it leaves fills the
    # next server's budget
    settings = {
        "mode": "streaming",
        "ctx_size": 512,
        "state_dir": tmp_path,
        "budget": 4 * _layer_bytes(model),
    }
    settings["alias"] = ["tiny"]
    with running_server(model, **settings, warm_start=False) as cold:
        reference = _complete(cold.base_url)
    assert not list(tmp_path.rglob("*.json")), "a server without warm start wrote a hot set"

    with running_server(model, **settings) as first:
        assert _complete(first.base_url)["choices"][0]["text"] == reference["choices"][0]["text"]
        warm = first.model.warm_start
        assert warm is not None and not warm.reading  # nothing saved yet: nothing to read back
        path = warm.path
    saved = json.loads(path.read_text())
    assert saved["files"] == [list(f) for f in ModelFiles.of(model).files]
    assert 0 < len(saved["experts"]) <= 4 * 16

    with running_server(model, **settings) as second:
        warm = second.model.warm_start
        assert warm is not None
        wait_for(lambda: not warm.reading, "the hot set to be read back")
        restored = _metric(second.base_url, "moeflash_streamer_restored_total")
        assert restored == len(saved["experts"])
        got = _complete(second.base_url)
    assert got["choices"][0]["text"] == reference["choices"][0]["text"]
    assert got["timings"]["hit_rate"] > reference["timings"]["hit_rate"], (
        got["timings"],
        reference["timings"],
    )
    assert got["timings"]["bytes_read"] < reference["timings"]["bytes_read"]


def test_a_saved_hot_set_for_other_files_or_broken_is_ignored(
    tiny_model: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _model(tiny_model)
    files = ModelFiles.of(model)
    path = files.state_file(tmp_path)
    write_hot_set(path, files, 16, [(0, 3, 7), (1, 15, 2), (0, 2, 0)])
    assert read_hot_set(path, files, 16) == [(0, 3, 7), (1, 15, 2), (0, 2, 0)]
    assert [p.name for p in path.parent.iterdir()] == [path.name], "a temporary file was left"

    caplog.set_level(logging.WARNING, logger="server.lifecycle.hot_set")
    assert read_hot_set(path, files, 8) == []  # the experts per layer differ
    other = ModelFiles(files.path, ((files.files[0][0], files.files[0][1] + 1, files.files[0][2]),))
    assert read_hot_set(path, other, 16) == []
    assert other.state_file(tmp_path) != path, "another file under the same name shares the hot set"
    # the model split with an RPC helper streams fewer layers: a hot set of its own
    split = ModelFiles.of(model, layers=2)
    assert read_hot_set(path, split, 16) == [] and split.state_file(tmp_path) != path
    saved = json.loads(path.read_text())
    for broken in (
        "{",
        json.dumps({**saved, "format": 1}),
        json.dumps({**saved, "experts": [[0, 16, 1]]}),  # expert out of range
        json.dumps({**saved, "experts": [[0, 3]]}),  # no uses
    ):
        path.write_text(broken)
        assert read_hot_set(path, files, 16) == []
    assert read_hot_set(tmp_path / "none.json", files, 16) == []
    assert len(caplog.records) == 7 and all("ignoring" in r.getMessage() for r in caplog.records)


def test_read_back_fills_free_room_only_and_keeps_unread_entries(tiny_model: Any, tmp_path: Path) -> None:
    """Read-back never evicts what a request routed, stops at the budget, and a save during it
    keeps the entries it has not read yet."""
    model_path = _model(tiny_model)
    n_expert = 16
    _, settings = load_settings(
        {"model": model_path, "mode": "streaming", "ctx_size": 512, "budget": 2 * _layer_bytes(model_path)}
    )
    files = ModelFiles.of(model_path)
    every = [(layer, e, 5) for layer in range(6) for e in range(n_expert)]
    write_hot_set(files.state_file(tmp_path), files, n_expert, every)
    model = load_model(settings)
    try:
        s = model.llama.streamer
        assert s is not None
        warm = WarmStart(s, model_path, tmp_path, save_every_s=3600)
        # the two hottest layers' worth are planned (the budget's), layer 0 and 1 of the list
        assert warm.reading
        warm.idle()  # one chunk: all of layer 0 (a chunk holds 16 MiB)
        assert s.stats().restored == n_expert and s.stats().evictions == 0
        warm.save()  # layer 1 not read yet: it stays in the file
        assert read_hot_set(warm.path, files, n_expert) == every[: 2 * n_expert]
        while warm.idle():
            pass
        stats = s.stats()
        assert stats.restored == 2 * n_expert and stats.evictions == 0
        assert stats.resident_bytes <= stats.budget_bytes
        # as routed 5 times lately: the LAYER policy's counts hold it
        assert sorted(s.hot_set()) == every[: 2 * n_expert]
    finally:
        model.close()


class _EndlessReadBack:
    """A warm start whose read-back goes on until `done`: it notes how many requests waited each
    time the engine gave it a chunk to read, and holds the first chunk until `queued`."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.queued = threading.Event()
        self.waiting: list[int] = []
        self.done = False

    def idle(self) -> bool:
        assert self.engine is not None
        self.waiting.append(self.engine.queue_depth)
        if len(self.waiting) == 1:
            assert self.queued.wait(30)
        return not self.done

    def save_if_due(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_waiting_request_is_served_before_the_next_chunk(tiny_model: Any) -> None:
    """The engine reads back a chunk only while no request waits: one queued during a chunk runs
    as soon as that chunk is read."""
    _, settings = load_settings({"model": _model(tiny_model), "ctx_size": 512})
    read_back = _EndlessReadBack()

    def loader() -> LoadedModel:
        model = load_model(settings)
        model.warm_start = read_back  # type: ignore[assignment]
        return model

    engine = Engine(loader)
    read_back.engine = engine
    engine.start()
    try:
        assert engine.wait_ready(60)
        model = engine.model
        assert model is not None
        tokens = tuple(model.llama.tokenize(b"hello", add_bos=False))
        wait_for(lambda: bool(read_back.waiting), "the first chunk")

        async def main() -> Any:
            job = engine.submit("first", GenerationRequest(tokens, SamplingParams(max_tokens=2)))
            read_back.queued.set()  # the chunk being read ends now, with a request waiting
            last = None
            async for event in job.events():
                last = event
            read_back.done = True
            return last

        assert isinstance(asyncio.run(main()), Finished)
        assert read_back.waiting[0] == 0 and set(read_back.waiting) == {0}, read_back.waiting
    finally:
        engine.close()


def test_a_budget_grown_back_is_refilled_from_the_hot_set(tiny_model: Any, tmp_path: Path) -> None:
    """Memory pressure shrinks the budget (evicting), a save keeps the hot set whole, and once the
    budget grows back the room it regains is read back from it."""
    model_path = _model(tiny_model)
    floor = _layer_bytes(model_path)
    _, settings = load_settings(
        {"model": model_path, "mode": "streaming", "ctx_size": 512, "budget": 4 * floor}
    )
    model = load_model(settings)
    try:
        s = model.llama.streamer
        assert s is not None
        warm = WarmStart(s, model_path, tmp_path, save_every_s=3600)
        assert not warm.reading  # no hot set saved yet
        model.llama.eval(model.llama.tokenize(PROMPT.encode(), add_bos=False))
        warm.save()
        hot = [(layer, e) for layer, e, _ in s.hot_set()]
        assert len(hot) > 2 * 16
        s.set_budget(floor)  # what the memory watch does under pressure
        assert not warm.idle()
        warm.save()  # a smaller cache does not shrink the hot set
        kept = read_hot_set(warm.path, ModelFiles.of(model_path), 16)
        assert sorted((layer, e) for layer, e, _ in kept) == sorted(hot)
        s.set_budget(4 * floor)
        before = s.stats()
        while warm.idle():
            pass
        stats = s.stats()
        assert stats.restored > before.restored and stats.evictions == before.evictions
        assert sorted((layer, e) for layer, e, _ in s.hot_set()) == sorted(hot)
    finally:
        model.close()
