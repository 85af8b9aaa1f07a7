"""The default predictor on learned routing: the committed trained model, streamed under a cap.

The router predictor (the default) is checked against the routing-history predictor, which
guesses from how often experts followed each other in past tokens (a frequency baseline). On
the trained model the router's guesses must give at least 1.5x the cache hits of the
frequency baseline's; on the same network at its initial, untrained weights (the run's seed,
same shape and tokenizer) the same check fails: there the untrained routers send every token to
the same few experts, which any cache holds, so guessing well buys nothing. (modelgen's random
weights are another matter: their layers barely move the residual stream, so the router
predictor guesses them even better; docs/performance.md, "The default predictor on learned
routing".)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.modelgen.spec import QType
from server.training import DEMO_DIR, DEMO_MODEL, export, measure, tokenizer, train
from streaming_ext import Prefetch

# the named cap: an eighth of the experts' bytes (one layer's experts: the streamer's floor), 128
# greedy tokens
CAP_SHARE = 8
RATIO = 1.5
TOKENS = 128


def _hits(model: Path, prompt_ids: list[int]) -> dict[Prefetch, int]:
    runs = measure.prefetch_runs(
        model, prompt_ids, TOKENS, measure.expert_share(model, CAP_SHARE), (Prefetch.HISTORY, Prefetch.ROUTER)
    )
    return {r.prefetch: r.counters.hits for r in runs}


@pytest.fixture(scope="module")
def prompt_ids(built_corpus: Path) -> list[int]:
    text = measure.heldout_prompt(built_corpus / "heldout.txt")
    return tokenizer.load(DEMO_DIR / "tokenizer.json").encode(text).ids


def test_router_guesses_beat_the_frequency_baseline_on_learned_routing(prompt_ids: list[int]) -> None:
    hits = _hits(DEMO_MODEL, prompt_ids)
    assert hits[Prefetch.ROUTER] >= RATIO * hits[Prefetch.HISTORY], hits


def test_the_same_check_fails_at_the_untrained_weights(prompt_ids: list[int], tmp_path: Path) -> None:
    rc = train.RunConfig.from_json(json.loads((DEMO_DIR / "run.json").read_text()))
    untrained = tmp_path / "untrained.gguf"
    export.write_gguf(train.new_model(rc), DEMO_DIR / "tokenizer.json", untrained, QType.Q8_0, "untrained")
    hits = _hits(untrained, prompt_ids)
    assert hits[Prefetch.ROUTER] < RATIO * hits[Prefetch.HISTORY], hits
