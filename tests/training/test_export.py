"""The exported GGUF: llama.cpp's logits are the torch model's, streamed and resident alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from server.loading.streaming import load_streaming_llama
from server.modelgen.spec import QType
from server.training import tokenizer, train
from streaming_ext import Policy, StreamerConfig
from tests.models import LLAMA_DEFAULTS, expert_layer_bytes, greedy, last_logits, load_llama

PROMPT = "The for statement in Python iterates over the items of any sequence"


def _f16_rounded(run: Path) -> torch.nn.Module:
    """The run's model with every weight matrix rounded to F16, as the F16 export stores it."""
    model, _, _ = train.load_model(run)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # norms and routers stay F32 in the file (modelgen's tensor plan)
            if p.dim() >= 2 and not name.endswith("router.weight"):
                p.copy_(p.half().float())
    return model


def test_llama_cpp_logits_match_torch(tiny_run: Path, tiny_gguf: Callable[[QType], Path]) -> None:
    ids = tokenizer.load(tiny_run / "tokenizer.json").encode(PROMPT).ids[:16]
    with torch.no_grad():
        expected = _f16_rounded(tiny_run)(torch.tensor([ids]))[0][0].numpy()
    llm = load_llama(tiny_gguf(QType.F16))
    try:
        got = []
        for tok in ids:
            llm.eval([tok])
            got.append(last_logits(llm))
    finally:
        llm.close()
    got_arr = np.stack(got)
    # llama.cpp multiplies F16 weights by activations rounded to F16: the logits differ by ~1e-3,
    # up to ~2e-2 where that rounding flips a near-tie in the router's top-k (|logits| ~2-3);
    # without q/k norms or with another RoPE layout they are off by ~0.5-1
    np.testing.assert_allclose(got_arr, expected, atol=2e-2 * float(np.abs(expected).max()), rtol=0)
    assert (got_arr.argmax(-1) == expected.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("qtype", [QType.F16, QType.Q8_0, QType.Q4_0], ids=lambda q: q.name)
def test_streaming_is_byte_identical(
    tiny_run: Path, tiny_gguf: Callable[[QType], Path], qtype: QType
) -> None:
    path = tiny_gguf(qtype)
    ids = tokenizer.load(tiny_run / "tokenizer.json").encode(PROMPT).ids
    resident = load_llama(path)
    try:
        expected = greedy(resident, ids, 8)
    finally:
        resident.close()
    settings = {**LLAMA_DEFAULTS}
    settings.pop("use_extra_bufts")
    n_ctx = settings.pop("n_ctx")
    # the smallest budget: one layer's experts, so experts are evicted and read again
    config = StreamerConfig(policy=Policy.LAYER)
    llm = load_streaming_llama(
        path, config, budget=expert_layer_bytes(path), n_ctx=n_ctx, flash_attn="off", **settings
    )
    try:
        got = greedy(llm, ids, 8)
        stats = llm.stats()
    finally:
        llm.close()
    assert got == expected
    assert stats.misses > 0 and stats.errors == 0
