"""The corpus build: deterministic, its manifest true to its files, a held-out split, dialogue."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from server.training import corpus


def test_manifest_records_the_outputs(built_corpus: Path) -> None:
    manifest = json.loads((built_corpus / "manifest.json").read_text())
    for name, sha in manifest["outputs_sha256"].items():
        assert hashlib.sha256((built_corpus / name).read_bytes()).hexdigest() == sha
    assert set(manifest["sources"]) == set(corpus.DEBIAN_PACKAGES)
    assert set(manifest["inputs_sha256"]) == set(corpus.DEBIAN_PACKAGES)


def test_build_is_deterministic(built_corpus: Path, tmp_path: Path) -> None:
    again = corpus.build(tmp_path)
    assert again == json.loads((built_corpus / "manifest.json").read_text())


def test_heldout_split_is_small_and_disjoint(built_corpus: Path) -> None:
    train = (built_corpus / "train.txt").read_text(encoding="utf-8").split(corpus.DOC_SEPARATOR)
    held = (built_corpus / "heldout.txt").read_text(encoding="utf-8").split(corpus.DOC_SEPARATOR)
    assert 0.01 < len(held) / (len(train) + len(held)) < 0.04
    assert not set(held) & set(train)


def test_dialogue_is_chatml(built_corpus: Path) -> None:
    text = (built_corpus / "train.txt").read_text(encoding="utf-8")
    turn = corpus.chat('What does "cat" mean?', "Cat is a noun.")
    assert turn.startswith("<|im_start|>user\n") and "<|im_end|>\n<|im_start|>assistant\n" in turn
    assert text.count("<|im_start|>assistant\n") > 100_000


def test_rst_is_reduced_to_prose() -> None:
    rst = """\
Heading
=======

The :func:`len` function returns the number of items of an object, and ``x`` is a name::

   >>> len([1, 2])
   2

.. note::

   Notes are dropped with their body, whatever they say.

A second paragraph that is long enough to be kept as a sentence of prose, see :ref:`the tutorial <tut>`.
"""
    assert corpus.rst_to_prose(rst) == [
        "The len function returns the number of items of an object, and x is a name:",
        "A second paragraph that is long enough to be kept as a sentence of prose, see the tutorial.",
    ]


def test_build_is_the_committed_models_corpus(built_corpus: Path) -> None:
    built = json.loads((built_corpus / "manifest.json").read_text())
    committed = json.loads(corpus.MANIFEST.read_text())
    assert built["debian_packages"] == committed["debian_packages"], (
        "the installed corpus packages are not the committed model's: "
        "rebuild server/training/corpus-manifest.json (docs/training.md) when retraining"
    )
    assert built == committed
