"""The measurements: route statistics on known routings; perplexity through llama.cpp."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from server.loading.route_trace import Route, Trace
from server.modelgen.spec import QType
from server.training import measure, train
from tests.models import expert_layer_bytes


def _trace(routes: list[tuple[int, ...]], n_expert: int) -> Trace:
    return Trace(
        name="t",
        n_layer=1,
        n_expert=n_expert,
        entry_bytes=[1],
        routes=[Route(True, 0, r, step=i) for i, r in enumerate(routes)],
        n_expert_used=len(routes[0]),
    )


def test_uniform_routing_has_skew_one() -> None:
    # experts (0,1), (2,3), (4,5), (6,7), (0,1), ...: every expert equally used, never twice in a row
    stats = measure.route_stats(_trace([(2 * (i % 4), 2 * (i % 4) + 1) for i in range(40)], 8))
    assert stats[0].skew == pytest.approx(1.0) and stats[0].reuse == 0.0


def test_collapsed_routing_has_skew_n_over_k() -> None:
    stats = measure.route_stats(_trace([(3, 5)] * 10, 8))
    assert stats[0].skew == pytest.approx(4.0) and stats[0].reuse == 1.0


def test_unigram_baseline_is_add_one_smoothed() -> None:
    nll = measure.unigram_nll(np.array([0, 0, 1]), [[0, 1, 2]], 3)
    # counts + 1 = 3, 2, 1 over 6
    assert nll == pytest.approx([-np.log(2 / 6), -np.log(1 / 6)])


def test_perplexity_is_the_torch_models(tiny_run: Path, tiny_gguf: Callable[[QType], Path]) -> None:
    resident, streamed = measure.perplexity(tiny_gguf(QType.F16), tiny_run, window=64, max_tokens=512)
    assert resident == streamed, "streamed logits must be the resident ones"
    # the same windows through the torch model
    model, _, _ = train.load_model(tiny_run)
    held = np.fromfile(tiny_run / "heldout.bin", dtype=np.uint16).astype(np.int64)
    nll = []
    with torch.no_grad():
        for w in measure.heldout_windows(held, 64, 512):
            logits = model(torch.tensor([w]))[0][0]
            nll += torch.nn.functional.cross_entropy(
                logits[:-1], torch.tensor(w[1:]), reduction="none"
            ).tolist()
    assert resident.tokens == len(nll)
    assert resident.model == pytest.approx(float(np.exp(np.mean(nll))), rel=1e-2)
    assert resident.model < resident.unigram * 1.5


def test_prefetch_runs_count_each_predictor(tiny_run: Path, tiny_gguf: Callable[[QType], Path]) -> None:
    path = tiny_gguf(QType.Q8_0)
    ids = np.fromfile(tiny_run / "heldout.bin", dtype=np.uint16)[:40].tolist()
    runs = {r.prefetch.name: r for r in measure.prefetch_runs(path, ids, 8, expert_layer_bytes(path))}
    assert runs["OFF"].counters.prefetched == 0 and runs["OFF"].counters.misses > 0
    router = runs["ROUTER"].counters
    assert router.prefetched > 0 and 0 < router.prefetch_hits <= router.prefetched
    assert all(r.tokens == 8 and r.counters.hits + r.counters.misses > 0 for r in runs.values())


def test_uniform_chance_is_what_route_stats_gives_uniform_routing() -> None:
    lo_s, hi_s, lo_r, hi_r = measure.uniform_chance(2000, 8, 2, draws=50)
    assert 1.0 <= lo_s <= hi_s < 1.25  # counts even out over many tokens
    assert 0.2 < lo_r <= hi_r < 0.3  # k / n_expert = 0.25: consecutive tokens independent
