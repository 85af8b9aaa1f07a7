"""Session fixtures shared by the whole suite.

- `tiny_model(preset_name, **spec_overrides, seed=0, split_max_size=None) -> Path`: generates a
  synthetic model (server.modelgen) once per distinct argument set into a session temporary
  directory and returns its path (the first file of a split set). Overrides are ModelSpec
  fields, e.g. `tiny_model("tiny-qwen3moe", n_layer=2, expert_qtype=QType.Q8_0)`. The files are
  shared: tests must not modify them (copy first).
- `llama_factory(path, **kw) -> Llama`: tests.models.load_llama, closing every model it made
  when the test ends.
- `chromium`: Debian's chromium driven by Playwright (a Browser), skipped with the reason where
  it is not installed (`make setup-dev` installs it when run as root, as on CI).

Servers the tests start keep their state (warm start's hot sets) in a directory of the session,
MOEFLASH_STATE_DIR, never in the home directory; tests.servers gives each in-process server a
fresh one of its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import llama_cpp
import pytest

from server.modelgen import generate_model, preset
from tests.models import load_llama

CHROMIUM = Path("/usr/bin/chromium")
_STATE_DIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STATE_DIR] = tempfile.mkdtemp(prefix="moeflash-test-state-")
    os.environ["MOEFLASH_STATE_DIR"] = config.stash[_STATE_DIR]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _STATE_DIR in config.stash:
        shutil.rmtree(config.stash[_STATE_DIR], ignore_errors=True)


class TinyModelFactory(Protocol):
    def __call__(
        self, preset_name: str, *, seed: int = 0, split_max_size: int | None = None, **spec_overrides: Any
    ) -> Path: ...


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    directory = tmp_path_factory.mktemp("models")
    made: dict[str, Path] = {}

    def make(
        preset_name: str, *, seed: int = 0, split_max_size: int | None = None, **spec_overrides: Any
    ) -> Path:
        key = repr((preset_name, seed, split_max_size, sorted(spec_overrides.items())))
        if key not in made:
            spec = dataclasses.replace(preset(preset_name), **spec_overrides)
            tag = hashlib.sha256(key.encode()).hexdigest()[:12]
            out = directory / f"{preset_name}-{tag}.gguf"
            made[key] = generate_model(spec, out, seed=seed, split_max_size=split_max_size)[0]
        return made[key]

    return make


@pytest.fixture
def llama_factory() -> Iterator[Callable[..., llama_cpp.Llama]]:
    opened: list[llama_cpp.Llama] = []

    def load(path: Path | str, **kw: Any) -> llama_cpp.Llama:
        llm = load_llama(path, **kw)
        opened.append(llm)
        return llm

    yield load
    for llm in opened:
        llm.close()


@pytest.fixture
def chromium() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (make setup-dev installs it when run as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM),
            # as root (CI) Chromium needs --no-sandbox; the rest keeps it off this machine's closed network
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
            ],
        )
        try:
            yield browser
        finally:
            browser.close()
