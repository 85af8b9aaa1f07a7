"""A real uvicorn server on a free loopback port, in-process, for the server tests.

The server runs the production app (`create_app`) on the production engine; the test keeps
a handle on the engine so it can assert on its state (queue depth, the running job, what
happened to a cancelled job) instead of on time.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from server.engine.generation import GenerationStats
from server.engine.token_loop import Sequence, TokenLoop
from server.engine.worker import Engine
from server.http.app import create_app
from server.lifecycle.served import served_engine
from server.lifecycle.switching import ModelSwitch
from server.loading.loader import LoadedModel
from server.settings import load_settings
from tests.commands import REPO

# bounded polling for state changes on the server (no test asserts on how long they take)
POLL_S = 0.01
WAIT_S = 60.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll `condition` until true; fail the test with `what` if it never becomes true."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL_S)


@dataclass
class RunningServer:
    base_url: str
    engine: Engine
    api_key: str | None
    port: int
    switch: ModelSwitch | None = None  # serving a directory: its models and the switch

    @property
    def model(self) -> LoadedModel:
        model = self.engine.model
        assert model is not None
        return model

    @property
    def model_id(self) -> str:
        """The served model's id, loaded or released (an Ollama keep_alive 0 request releases it)."""
        info = self.engine.info
        assert info is not None
        return info.id

    def job_stats(self, job_id: str) -> GenerationStats:
        """What the worker recorded for a finished job (waits until it is finished)."""
        found: list[GenerationStats] = []

        def done() -> bool:
            found[:] = [stats for jid, stats in list(self.engine.history) if jid == job_id]
            return bool(found)

        wait_for(done, f"job {job_id} to finish")
        return found[0]

    def eog_tokens(self) -> list[int]:
        import llama_cpp

        vocab = self.model.llama._model.vocab
        return [t for t in range(self.model.info.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]


@contextlib.contextmanager
def running_server(
    model_path: Path | None,
    *,
    loader: Callable[[], LoadedModel] | None = None,
    wait_ready: bool = True,
    **overrides: Any,
) -> Iterator[RunningServer]:
    """Serve `model_path` with settings `overrides` (field names of ServerSettings/ModelSettings,
    `models_dir`: serve that directory's models, switching on request, and `journal`: keep the
    token loop's journal), loaded as `moeflash serve` loads it; its state directory is a fresh one
    unless given."""
    journal = overrides.pop("journal", False)  # keep the token loop's journal (engine.journal)
    host = overrides.pop("host", "127.0.0.1")
    port = free_port("127.0.0.1" if host == "127.0.0.1" else "0.0.0.0")
    own_state = None if "state_dir" in overrides else tempfile.mkdtemp(prefix="moeflash-state-")
    models_dir = overrides.pop("models_dir", None)
    server_settings, model_settings = load_settings(
        {"model": model_path, "host": host, "port": port, "state_dir": own_state, **overrides}
    )
    if loader is None:
        engine, switch = served_engine(server_settings, model_settings, models_dir)
    else:
        engine = Engine(
            loader,
            max_queue=server_settings.max_queue,
            queue_full_status=server_settings.queue_full_status,
            retry_after_s=server_settings.retry_after_s,
        )
        switch = None
    if journal:
        engine.journal = []
    app = create_app(server_settings, engine, switch)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, "uvicorn to start")
        if wait_ready:
            assert engine.wait_ready(WAIT_S), f"model did not load: {engine.load_error}"
        url_host = "127.0.0.1" if host in ("127.0.0.1", "0.0.0.0") else host
        yield RunningServer(
            base_url=f"http://{url_host}:{port}",
            engine=engine,
            api_key=server_settings.resolved_api_key(),
            port=port,
            switch=switch,
        )
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        engine.close()
        if own_state is not None:
            shutil.rmtree(own_state, ignore_errors=True)


@contextlib.contextmanager
def serve_process(
    model: Path,
    *extra: str,
    log_level: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """`moeflash serve --model MODEL EXTRA...` as a user runs it, in a process of its own (a crash
    ends that process, never the suite), once /health answers 200; killed when done. Its output
    is piped: a test that sends many requests sets `log_level` WARNING so the pipe never fills.
    `cwd` is where it runs (its packages are imported from there first)."""
    port = free_port()
    level = ["--log-level", log_level] if log_level else []
    cmd = [
        sys.executable,
        "-m",
        "server.cli",
        *level,
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        *extra,
    ]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:

        def ready() -> bool:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, "moeflash serve to be ready")
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def script_generation(monkeypatch: pytest.MonkeyPatch, run: Callable[[Sequence], None]) -> None:
    """The engine's steps call `run(sequence)` on each running request instead of decoding: it
    emits what the test scripts (sequence.emit) and fills sequence.stats; what it raises fails the
    step's requests as a failed decode does. Each request ends after it."""

    def step(loop: TokenLoop) -> list[Sequence]:
        for sequence in loop.running:
            run(sequence)
            sequence.finish(sequence.stats.finish_reason or "stop")
        ended, loop.running = loop.running, []
        return ended

    monkeypatch.setattr(TokenLoop, "step", step)
