"""The trained tokenizer: llama.cpp, reading it from the exported GGUF, gives the trainer's ids."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import llama_cpp
import pytest

from server.modelgen.spec import QType
from server.training import corpus, tokenizer

TEXTS = [
    "The for statement in Python differs a bit from what you may be used to in C or Pascal.",
    "I'm sure they'LL say it's 12345 or 3.14159, don't you think?",
    "  leading spaces,\ttabs,\n\nnew lines   and trailing   ",
    'def f(x):\n    return {"a": [1, 2]}  # comment\n',
    "Ünïcödé: café, naïve, 東京, emoji 🙂, ß and Ω.",
    corpus.chat('What does "apple" mean?', "Apple is a noun. It means fruit with red or yellow skin."),
    "<|im_start|>system\nBe brief.<|im_end|>\n<tool_call>\n{}\n</tool_call><think></think><|endoftext|>",
]


@pytest.fixture(scope="module")
def vocab_only(tiny_gguf: Callable[[QType], Path]) -> llama_cpp.Llama:
    return llama_cpp.Llama(str(tiny_gguf(QType.F16)), vocab_only=True, verbose=False)


@pytest.mark.parametrize("text", TEXTS, ids=[f"text{i}" for i in range(len(TEXTS))])
def test_ids_match_llama_cpp(tiny_run: Path, vocab_only: llama_cpp.Llama, text: str) -> None:
    tok = tokenizer.load(tiny_run / "tokenizer.json")
    ours = tok.encode(text).ids
    theirs = vocab_only.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    assert ours == theirs
    assert vocab_only.detokenize(theirs, special=True).decode("utf-8") == text


def test_ids_match_on_heldout_text(tiny_run: Path, small_corpus: Path, vocab_only: llama_cpp.Llama) -> None:
    tok = tokenizer.load(tiny_run / "tokenizer.json")
    text = (small_corpus / "heldout.txt").read_text(encoding="utf-8")[:20_000]
    assert tok.encode(text).ids == vocab_only.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def test_vocab_has_chatml_specials(tiny_run: Path) -> None:
    vocab = tokenizer.to_vocab(tokenizer.load(tiny_run / "tokenizer.json"))
    assert vocab.tokens[vocab.eos_id] == "<|im_end|>"
    assert vocab.tokens[vocab.bos_id] == "<|endoftext|>"
    assert len(vocab.tokens) == 512 and len(set(vocab.tokens)) == 512
