"""The demo `make serve` serves: the committed trained model, served as the Makefile serves it,
answers chat questions in words, without looping."""

from __future__ import annotations

import re
from pathlib import Path

import openai

from server.hub.pull import sha256_of
from server.training import DEMO_MODEL, measure
from tests.servers import serve_process

QUESTIONS = ('What does "river" mean?', "What is a function?", 'What does "cynic" mean?')


def test_the_committed_demo_is_the_one_its_sha256_names() -> None:
    expected = (DEMO_MODEL.parent / f"{DEMO_MODEL.name}.sha256").read_text().split()[0]
    assert sha256_of(DEMO_MODEL, progress=False) == expected


def test_the_demo_answers_in_words(built_corpus: Path) -> None:
    corpus = (built_corpus / "train.txt").read_text(encoding="utf-8")
    corpus_words = set(re.findall(r"[a-z]+", corpus.lower()))
    with serve_process(DEMO_MODEL, "--mode", "streaming") as (_, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        for question in QUESTIONS:
            reply = client.chat.completions.create(
                model=DEMO_MODEL.stem,
                messages=[{"role": "user", "content": question}],
                max_tokens=48,
                temperature=0,
            )
            text = reply.choices[0].message.content or ""
            words = re.findall(r"[a-z]+", text.lower())
            assert len(words) >= 4, text
            known = sum(w in corpus_words for w in words) / len(words)
            assert known >= 0.9, text
            assert not measure.loops(text), text
