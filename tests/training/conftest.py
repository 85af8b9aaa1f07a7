"""Fixtures of the training tests: a small corpus, a tiny run trained for a few steps, its GGUFs.

- `small_corpus`: the real corpus build (server/training/corpus.py, from the installed Debian
  packages) cut to its first 300 kB of training text and 50 kB of held-out text, so a
  tokenizer trains on it in a second.
- `tiny_run`: train.TINY trained to its end (30 steps) on that corpus, in a session directory.
- `tiny_gguf(qtype)`: the tiny run exported (F16, Q8_0, ...), once per type.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from server.modelgen.spec import QType
from server.training import corpus, export, train


@pytest.fixture(scope="session")
def built_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    corpus.build(out)
    return out


@pytest.fixture(scope="session")
def small_corpus(built_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small-corpus")
    for name, size in (("train.txt", 300_000), ("heldout.txt", 50_000)):
        text = (built_corpus / name).read_text(encoding="utf-8")[:size]
        (out / name).write_text(text, encoding="utf-8")
    return out


@pytest.fixture(scope="session")
def tiny_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("tiny-run")
    torch.set_num_threads(1)
    train.train(run, train.TINY, corpus_dir=small_corpus)
    return run


@pytest.fixture(scope="session")
def tiny_gguf(tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[QType], Path]:
    directory = tmp_path_factory.mktemp("tiny-gguf")
    made: dict[QType, Path] = {}

    def make(qtype: QType) -> Path:
        if qtype not in made:
            made[qtype] = directory / f"tiny-{qtype.name}.gguf"
            export.export(tiny_run, made[qtype], qtype)
        return made[qtype]

    return make
