"""The byte-level BPE tokenizer trained on the corpus, and its GGUF form.

The trainer's side is Hugging Face `tokenizers`: Qwen2's pre-tokenizer regex (llama.cpp's
LLAMA_VOCAB_PRE_TYPE_QWEN2, "qwen2" in tokenizer.ggml.pre) splitting the text, then GPT-2's
byte-to-unicode mapping, then BPE. llama.cpp's side is a modelgen `Vocab` ("gpt2" model, the
ChatML family's special tokens), written by the same code that writes every synthetic model.
tests/training/test_tokenizer.py checks that both give the same ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from server.modelgen.tokenizer import CHATML, TokenType, Vocab

# llama.cpp src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN2
QWEN2_PRETOKENIZER = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
FAMILY = dataclasses.replace(CHATML, name="chatml-trained", pre="qwen2")


def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZER), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A tokenizer of exactly `vocab_size` tokens (specials first, then bytes, then merges)."""
    tok = new_tokenizer()
    specials = [AddedToken(text, special=kind == TokenType.CONTROL) for text, kind in FAMILY.specials]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load(path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(path))


def to_vocab(tok: Tokenizer) -> Vocab:
    """The tokenizer as the tokenizer.* keys of a GGUF (llama.cpp's "gpt2" BPE model)."""
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    tokens = tuple(text for text, _ in by_id)
    if [i for _, i in by_id] != list(range(len(tokens))):
        raise ValueError("token ids are not contiguous")
    kinds = dict(FAMILY.specials)
    types = tuple(int(kinds.get(t, TokenType.NORMAL)) for t in tokens)
    merges = tuple(m if isinstance(m, str) else " ".join(m) for m in model["merges"])
    ids = {t: i for t, i in by_id}
    return Vocab(
        family=FAMILY,
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos_id=ids[FAMILY.bos],
        eos_id=ids[FAMILY.eos],
        eot_id=ids[FAMILY.eot],
        pad_id=ids[FAMILY.pad],
    )
