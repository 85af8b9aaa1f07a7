"""Trace-routed runs (--route-trace, --record-route-trace) through the one loader and token loop.

Recording a run gives the model's own routing (checked against an independent recorder) and
changes nothing; replaying a trace makes every layer route each token as the trace says (the
recording of a replayed run is the trace, wrapped where the run is longer), on a resident and a
streamed model alike; and the identity gate of trace routing: a streamed model whose budget
evicts on every route gives the resident model's tokens and logits, byte for byte, under the
same trace. A trace that does not fit the model is refused before it loads.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

import pytest

from server.engine.generation import GenerationRequest, GenerationStats, SamplingParams
from server.engine.token_loop import generate
from server.errors import ConfigError
from server.loading.loader import load_model
from server.loading.route_trace import (
    ModelShape,
    Route,
    build_tracer,
    load_trace,
    recorded_routes,
    write_trace,
)
from server.settings import Budget, ModelSettings, RouteTraceSettings
from tests.models import RouteRecorder, expert_layer_bytes, last_logits, load_llama

PROMPT = tuple((7 * i + 40) % 300 for i in range(24))
N_TOKENS = 10
# the trace is shorter than the run in both phases: replay wraps around
TRACE_PROMPT_STEPS, TRACE_DECODE_STEPS = 16, 6


class Run(NamedTuple):
    tokens: list[int]
    digest: str  # sha256 of every logits row sampled from
    routes: list[Route]  # the routing the run used, as recorded
    evictions: int  # the expert cache's (0 for a resident model)
    prefetched: int  # over the decode steps: entries read ahead of their layer's routing
    prefetch_hits: int  # of them, routed by their layer


def run(
    path: Path,
    mode: str,
    budget: Budget = "auto",
    replay: Path | None = None,
    prefetch_from_trace: bool = False,
    prefetch: Literal["router", "history", "off"] = "router",
    prefetch_trace_error: float = 0.0,
) -> Run:
    """Greedy decoding on the engine's token loop, its routing recorded."""
    settings = ModelSettings(
        model=path, mode=mode, budget=budget, ctx_size=512, threads=2, flash_attn="off", prefetch=prefetch
    )
    record = path.with_suffix(".recorded.csv")
    routing = RouteTraceSettings(
        route_trace=replay,
        record_route_trace=record,
        prefetch_from_trace=prefetch_from_trace,
        prefetch_trace_error=prefetch_trace_error,
    )
    loaded = load_model(settings, routing)
    digest = hashlib.sha256()
    tokens: list[int] = []

    def on_token(token: int, _step: object) -> None:
        digest.update(last_logits(loaded.llama).tobytes())
        tokens.append(token)

    try:
        params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
        generate(
            loaded.llama,
            GenerationRequest(PROMPT, params),
            GenerationStats(),
            lambda _d: None,
            lambda: False,
            on_token,
        )
        routes = recorded_routes(loaded.llama)
        streamer = loaded.llama.totals().streamer
        decode = [step.streamer for step in loaded.llama.steps if step.n_tokens == 1 and step.streamer]
    finally:
        loaded.close()
    return Run(
        tokens,
        digest.hexdigest(),
        routes,
        streamer.evictions if streamer else 0,
        sum(s.prefetched for s in decode),
        sum(s.prefetch_hits for s in decode),
    )


def random_trace(
    path: Path,
    out: Path,
    seed: int = 1,
    chained: bool = False,
    steps: tuple[int, int] = (TRACE_PROMPT_STEPS, TRACE_DECODE_STEPS),
) -> Path:
    """A trace of the model's shape with routing drawn at random (nothing like the model's own);
    `chained`: only layer 0 at random, each next layer's experts those of the layer before shifted
    by one (what follows what is then learnable from past tokens)."""
    shape = ModelShape.of(path)
    rng = random.Random(seed)
    routes = []
    for phase, n_steps in enumerate(steps):
        for step in range(n_steps):
            experts = tuple(rng.sample(range(shape.n_expert), shape.n_expert_used))
            for layer in range(shape.n_layer):
                if chained and layer > 0:
                    experts = tuple((e + 1) % shape.n_expert for e in experts)
                elif layer > 0:
                    experts = tuple(rng.sample(range(shape.n_expert), shape.n_expert_used))
                routes.append(Route(phase == 1, layer, experts, 0, step))
    write_trace(out, shape, routes)
    return out


def assert_steps(routes: list[Route], n_layer: int) -> None:
    """Every layer routed each decode step once, and the prompt's last tokens in order: all of
    them, or (a last layer that computes only the tokens whose logits are asked for) the last."""
    for layer in range(n_layer):
        prompt = [r.step for r in routes if r.layer == layer and not r.decode]
        assert prompt in (list(range(len(PROMPT))), [len(PROMPT) - 1]), (
            f"layer {layer}: prompt steps {prompt}"
        )
        decode = [r.step for r in routes if r.layer == layer and r.decode]
        assert decode == list(range(N_TOKENS - 1)), f"layer {layer}: decode steps {decode}"


def by_token(routes: list[Route]) -> dict[tuple[bool, int, int], tuple[int, ...]]:
    return {(r.decode, r.step, r.layer): r.experts for r in routes}


@pytest.mark.parametrize("preset", ["tiny-qwen3moe", "tiny-gemma4"])
def test_recorded_routing_is_the_models_own(tiny_model: Callable[..., Path], preset: str) -> None:
    path = tiny_model(preset)
    tokens, _, routes, *_ = run(path, "resident")
    # an independent recorder (Python, ggml's accessors) on a plain Llama, no moeflash callback
    k = ModelShape.of(path).n_expert_used
    recorder = RouteRecorder(k)
    llm = load_llama(path, cb_eval=recorder.callback)
    try:
        llm.eval(list(PROMPT))
        plain: list[int] = []
        for _ in range(N_TOKENS):
            plain.append(int(last_logits(llm).argmax()))
            if len(plain) < N_TOKENS:
                llm.eval([plain[-1]])
    finally:
        llm.close()
    assert tokens == plain, "recording changed the output"
    for layer, rows in recorder.routes.items():
        ours = [r.experts for r in routes if r.layer == layer]
        assert ours == rows, f"layer {layer}: the recorded routing is not the model's"
    assert_steps(routes, ModelShape.of(path).n_layer)
    assert all(len(r.weights) == k and all(0.0 < w <= 1.0 for w in r.weights) for r in routes)


@pytest.mark.parametrize("preset", ["tiny-qwen3moe", "tiny-gemma4"])
def test_trace_routed_streaming_matches_resident(
    tiny_model: Callable[..., Path], tmp_path: Path, preset: str
) -> None:
    path = tiny_model(preset)
    trace_file = random_trace(path, tmp_path / f"{preset}.route.csv")
    trace = by_token(load_trace(trace_file).routes)
    own = run(path, "resident")
    resident = run(path, "resident", replay=trace_file)
    # one layer's experts: every route evicts
    streamed = run(path, "streaming", budget=expert_layer_bytes(path), replay=trace_file)
    assert streamed.evictions > 0, "the budget must evict for the gate to mean something"
    assert (streamed.tokens, streamed.digest) == (resident.tokens, resident.digest), (
        "trace-routed streaming differs from trace-routed resident"
    )
    assert resident.digest != own.digest, "the trace did not change the routing"
    for routes in (resident.routes, streamed.routes):
        assert_steps(routes, ModelShape.of(path).n_layer)
        for r in routes:
            steps = TRACE_DECODE_STEPS if r.decode else TRACE_PROMPT_STEPS
            assert r.experts == trace[(r.decode, r.step % steps, r.layer)], f"{r} is not the trace's"


def test_prefetch_from_the_trace_reads_what_the_trace_routes(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """The trace as an oracle, and as an emulated predictor that guesses wrong as often as told."""
    path = tiny_model("tiny-qwen3moe")
    trace_file = random_trace(path, tmp_path / "trace.route.csv")
    resident = run(path, "resident", replay=trace_file)
    # two layers' experts: room to read the next layer's beside the running one's, and evictions
    budget = 2 * expert_layer_bytes(path)
    oracle = run(path, "streaming", budget=budget, replay=trace_file, prefetch_from_trace=True)
    router = run(path, "streaming", budget=budget, replay=trace_file)
    noisy = run(
        path,
        "streaming",
        budget=budget,
        replay=trace_file,
        prefetch_from_trace=True,
        prefetch_trace_error=0.5,
    )
    assert oracle.evictions > 0
    assert (oracle.tokens, oracle.digest) == (resident.tokens, resident.digest), (
        "prefetch from the trace changed the output"
    )
    assert (noisy.tokens, noisy.digest) == (resident.tokens, resident.digest), (
        "a wrong guess changed the output"
    )
    # a decode step routes one token: the trace's next layer is exactly what gets routed
    assert oracle.prefetched > 0 and oracle.prefetch_hits == oracle.prefetched
    # half of each token's guesses are experts it does not route: read ahead, then not routed
    assert 0 < noisy.prefetch_hits < 0.75 * noisy.prefetched, noisy
    # the model's router predicts the model's routing, not the trace's: its gate closes, and the
    # decode reads few of its guesses (test_the_prefetch_gate_closes_on_wrong_guesses...)
    assert router.prefetched < oracle.prefetched / 4, (router, oracle)
    with pytest.raises(ConfigError, match="--prefetch-from-trace needs --route-trace"):
        run(path, "streaming", budget=budget, prefetch_from_trace=True)
    with pytest.raises(ConfigError, match="--prefetch-trace-error needs --prefetch-from-trace"):
        run(path, "streaming", budget=budget, replay=trace_file, prefetch_trace_error=0.5)


def test_history_prefetch_learns_what_follows_what(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    path = tiny_model("tiny-qwen3moe")
    # as long as the run, so that no token repeats one the predictor has seen
    steps = (len(PROMPT), N_TOKENS - 1)
    chained = random_trace(path, tmp_path / "chained.route.csv", chained=True, steps=steps)
    resident = run(path, "resident", replay=chained)
    budget = 2 * expert_layer_bytes(path)
    history = run(path, "streaming", budget=budget, replay=chained, prefetch="history")
    assert history.evictions > 0
    assert (history.tokens, history.digest) == (resident.tokens, resident.digest), (
        "history prefetch changed the output"
    )
    # the prompt's 24 tokens taught it the shift from each layer to the next: most of its decode
    # guesses are routed (73% here; a guess of k of 16 experts at random is right 25% of the time)
    assert history.prefetched > 0
    learned = history.prefetch_hits / history.prefetched
    # where the layers are drawn independently, the past says nothing
    independent = random_trace(path, tmp_path / "independent.route.csv", steps=steps)
    noise = run(path, "streaming", budget=budget, replay=independent, prefetch="history")
    assert noise.prefetched > 0
    guessed = noise.prefetch_hits / noise.prefetched
    assert learned > 0.5 and learned > 2 * guessed, (learned, guessed)


class Prefetches(NamedTuple):
    """Of a run that evicts: experts prefetched in the prompt, and per decode step the experts
    prefetched, the next-layer predictions made and the prefetched experts then routed."""

    prompt: int
    decode: list[int]
    predictions: list[int]
    hits: list[int]


def prefetches(
    path: Path,
    trace: Path | None,
    prefetch: Literal["router", "history"],
    n_tokens: int,
    trace_error: float | None = None,
    budget_layers: float = 2.0,
) -> Prefetches:
    """trace_error: prefetch from the trace, that share of its guesses replaced (emulated);
    budget_layers: the budget in layers' experts."""
    """The prefetches of a run routed by `trace` (None: the model's own routing)."""
    settings = ModelSettings(
        model=path,
        mode="streaming",
        budget=int(budget_layers * expert_layer_bytes(path)),
        ctx_size=512,
        threads=2,
        flash_attn="off",
        prefetch=prefetch,
        follow_memory=False,  # the budget given, whatever else the machine runs
    )
    routing = RouteTraceSettings(
        route_trace=trace,
        prefetch_from_trace=trace_error is not None,
        prefetch_trace_error=trace_error or 0.0,
    )
    loaded = load_model(settings, routing)
    try:
        params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
        generate(
            loaded.llama, GenerationRequest(PROMPT, params), GenerationStats(), lambda _d: None, lambda: False
        )
        steps = [step.streamer for step in loaded.llama.steps if step.streamer]
    finally:
        loaded.close()
    assert len(steps) == n_tokens
    decode = steps[1:]
    return Prefetches(
        steps[0].prefetched,
        [s.prefetched for s in decode],
        [s.predictions for s in decode],
        [s.prefetch_hits for s in decode],
    )


def test_the_prefetch_gate_closes_on_wrong_guesses_and_stays_open_on_right_ones(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    path = tiny_model("tiny-qwen3moe")
    n_tokens = 60
    steps = (len(PROMPT), n_tokens - 1)
    predicted = ModelShape.of(path).n_layer - 1  # layers with a layer after them
    # the model's router guesses the model's routing, not the trace's: a quarter of its guesses
    # are routed (k of 16 experts), so its prefetch stops reading, and a closed layer is predicted
    # on one visit in 8 only (mf_prefetch.c, MF_GATE_SAMPLE), to see whether its guesses turn right
    independent = random_trace(path, tmp_path / "independent.route.csv", steps=steps)
    closed = prefetches(path, independent, "router", n_tokens)
    assert sum(closed.decode[-16:]) == 0
    assert 0 < sum(closed.predictions[-16:]) <= 16 * predicted // 8 + predicted, closed.predictions
    # learned from past routing, most guesses are routed: prefetch keeps reading and predicting
    chained = random_trace(path, tmp_path / "chained.route.csv", chained=True, steps=steps)
    open_ = prefetches(path, chained, "history", n_tokens)
    assert sum(open_.decode[-16:]) > 0
    assert sum(open_.predictions[-16:]) > 16 * predicted // 2, open_.predictions


def test_the_prefetch_gate_guards_a_prompt(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """A prompt visits each layer once, and its tokens together route nearly every expert: against
    that union even random guesses look right. Each token's guesses are scored against its own
    routing, and a layer with no evidence borrows the others': wrong guesses are read for the
    first predicted layer only."""
    path = tiny_model("tiny-qwen3moe")
    shape = ModelShape.of(path)
    independent = random_trace(path, tmp_path / "independent.route.csv", steps=(len(PROMPT), 1))
    prompt = prefetches(path, independent, "router", 2).prompt
    assert 0 < prompt <= shape.n_expert, prompt
    # guessing the model's own routing, the router's prefetch reads ahead of every later layer
    own = prefetches(path, None, "router", 2).prompt
    assert own > shape.n_expert, own


def skewed_trace(path: Path, out: Path, hot: int, steps: tuple[int, int], seed: int = 1) -> Path:
    """Every token of every layer routes k of that layer's first `hot` experts (the others never):
    the rarely routed experts are known as such before any of them is guessed."""
    shape = ModelShape.of(path)
    rng = random.Random(seed)
    routes = [
        Route(phase == 1, layer, tuple(rng.sample(range(hot), shape.n_expert_used)), 0, step)
        for phase, n_steps in enumerate(steps)
        for step in range(n_steps)
        for layer in range(shape.n_layer)
    ]
    write_trace(out, shape, routes)
    return out


def test_the_prefetch_gate_drops_guesses_of_rarely_routed_experts(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Half of each token's guesses replaced by experts it does not route: of a layer's 16 experts
    8 are routed, so two thirds of the wrong guesses name one of the 8 never routed. The gate keeps
    its counts per rate class of the guessed expert (mf_reuse_rate_class): the never-routed class
    closes, the routed ones stay open, and what is read is routed more often than what is guessed."""
    path = tiny_model("tiny-qwen3moe")
    assert ModelShape.of(path).n_expert == 16
    n_tokens = 60
    trace = skewed_trace(path, tmp_path / "skewed.route.csv", 8, (len(PROMPT), n_tokens - 1))
    # room for 24 of the 32 routed entries: the routed experts are read again and again
    noisy = prefetches(path, trace, "router", n_tokens, trace_error=0.5, budget_layers=1.5)
    # past the first tokens (the gate learning), what is read is mostly routed: wrong guesses of
    # the 12 routed experts still cost reads, those of the 4 others do not
    read, hits = sum(noisy.decode[8:]), sum(noisy.hits[8:])
    assert read > 0 and hits > 0.6 * read, (read, hits)


def test_a_trace_that_does_not_fit_is_refused(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    path = tiny_model("tiny-qwen3moe")
    shape = ModelShape.of(path)
    good = load_trace(random_trace(path, tmp_path / "good.route.csv")).routes
    cases: dict[str, tuple[Any, list[Route]]] = {
        "layers": (
            ModelShape(**{**vars(shape), "n_layer": shape.n_layer - 1}),
            [r for r in good if r.layer < shape.n_layer - 1],
        ),
        "experts per layer": (ModelShape(**{**vars(shape), "n_expert": shape.n_expert * 2}), good),
        "experts per token": (
            ModelShape(**{**vars(shape), "n_expert_used": shape.n_expert_used - 1}),
            [Route(r.decode, r.layer, r.experts[:-1], r.turn, r.step) for r in good],
        ),
        "no decode steps": (shape, [r for r in good if not r.decode]),
    }
    for what, (trace_shape, routes) in cases.items():
        bad = tmp_path / f"bad-{what.replace(' ', '-')}.route.csv"
        write_trace(bad, trace_shape, routes)
        settings = ModelSettings(model=path, mode="resident", ctx_size=512)
        with pytest.raises(ConfigError, match=f"cannot route {path.name}: .*{what}"):
            load_model(settings, RouteTraceSettings(route_trace=bad))


def routes_by_request(routes: list[Route]) -> dict[int, dict[tuple[bool, int, int], tuple[Any, ...]]]:
    """turn -> (decode, step, layer) -> (experts, weights, KV sequence) of that request's token."""
    out: dict[int, dict[tuple[bool, int, int], tuple[Any, ...]]] = {}
    for r in routes:
        out.setdefault(r.turn, {})[(r.decode, r.step, r.layer)] = (r.experts, r.weights, r.seq)
    return out


def test_requests_decoded_together_are_each_routed_by_their_own_steps(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Four requests in four KV sequences, prompts prefilled in chunks beside running decodes, so
    llama.cpp cuts most steps into several micro-batches (split_equal): the routing recorded
    together is, request by request, the routing each records alone (greedy, flash attention off:
    batch invariant), each token's sequence its slot; replaying a trace together routes every
    request's tokens by the trace's steps."""
    from tests.engine.test_parallel import SCHEDULE, load, run_schedule

    path = tiny_model("tiny-qwen3moe")
    n_layer = ModelShape.of(path).n_layer
    requests = [r for step in sorted(SCHEDULE) for r in SCHEDULE[step]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    schedule = {step: [replace(r, params=greedy) for r in SCHEDULE[step]] for step in SCHEDULE}
    record = RouteTraceSettings(record_route_trace=tmp_path / "together.route.csv")
    traced = build_tracer(record, path)
    assert traced is not None
    llama = load(path, "resident", False, tracer=traced[0])
    try:
        plans, together = run_schedule(llama, schedule)
        recorded = recorded_routes(llama)
        routes = routes_by_request(recorded)
        alone = []
        for request in requests:
            llama.clear()
            _, outcome = run_schedule(llama, {0: [replace(request, params=greedy)]})
            alone.append((outcome[0].tokens, routes_by_request(recorded_routes(llama))))
    finally:
        llama.close()
    assert sum(len(plan) >= 3 for plan in plans) >= 3, "too few steps held three sequences"
    assert sorted(routes) == list(range(len(requests)))
    seqs = set()
    for turn, (tokens, own) in enumerate(alone):
        assert together[turn].tokens == tokens
        (mine,) = own.values()
        assert {key: value[:2] for key, value in routes[turn].items()} == {
            key: value[:2] for key, value in mine.items()
        }, f"request {turn}: routed otherwise beside others than alone"
        (seq,) = {value[2] for value in routes[turn].values()}
        seqs.add(seq)
        decode = sorted({step for decode, step, _ in routes[turn] if decode})
        assert decode == list(range(len(tokens) - 1)) and len(routes[turn]) > n_layer * len(tokens)
    assert len(seqs) == 4, "the requests did not decode in four sequences"
    # the file keeps each route's sequence (a file without the column reads as sequence 0)
    write_trace(tmp_path / "written.route.csv", ModelShape.of(path), recorded)
    assert [r.seq for r in load_trace(tmp_path / "written.route.csv").routes] == [r.seq for r in recorded]

    trace_file = random_trace(path, tmp_path / "trace.route.csv")
    trace = by_token(load_trace(trace_file).routes)
    replay = RouteTraceSettings(route_trace=trace_file, record_route_trace=tmp_path / "replayed.route.csv")
    traced = build_tracer(replay, path)
    assert traced is not None
    llama = load(path, "resident", False, tracer=traced[0])
    try:
        run_schedule(llama, schedule)
        replayed = recorded_routes(llama)
    finally:
        llama.close()
    assert {r.turn for r in replayed} == set(range(len(requests)))
    for r in replayed:
        steps = TRACE_DECODE_STEPS if r.decode else TRACE_PROMPT_STEPS
        assert r.experts == trace[(r.decode, r.step % steps, r.layer)], f"{r} is not the trace's"


def test_a_shared_steps_reads_are_split_by_routing(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """Telemetry of a shared step: a request decoding beside another's prompt chunk, the two routed
    (by a trace) to disjoint experts, every route read (no cache, no prefetch): each step's reads
    are shared among the requests whole, and the decoding request's share is the bytes of its own
    experts (every layer's k), not its share of the step's tokens."""
    from server.engine.token_loop import TokenLoop

    path = tiny_model("tiny-qwen3moe")
    shape = ModelShape.of(path)
    k = shape.n_expert_used
    routes = [
        Route(decode, layer, tuple(range(k, 2 * k)) if decode else tuple(range(k)), 0, step)
        for decode, n_steps in ((False, 64), (True, 16))
        for step in range(n_steps)
        for layer in range(shape.n_layer)
    ]
    write_trace(tmp_path / "split.route.csv", shape, routes)
    settings = ModelSettings(
        model=path,
        mode="streaming",
        budget=2 * expert_layer_bytes(path),
        ctx_size=256,
        threads=2,
        flash_attn="off",
        prefetch="off",
        cache_policy="none",
        follow_memory=False,
        parallel=2,
    )
    loaded = load_model(settings, RouteTraceSettings(route_trace=tmp_path / "split.route.csv"))
    loop = TokenLoop(loaded.llama, beside=8)
    shared = []
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        first = GenerationStats()
        loop.start(GenerationRequest(PROMPT[:4], params), first, lambda _d: None, lambda: False)
        for n in range(12):
            if n == 2:
                loop.start(
                    GenerationRequest(PROMPT + PROMPT, params),
                    GenerationStats(),
                    lambda _d: None,
                    lambda: False,
                )
            loop.step()
            step = loaded.llama.steps[-1]
            assert step.streamer is not None and step.unmapped_bytes == 0.0
            assert sum(step.seq_bytes) == pytest.approx(step.streamer.bytes_read, abs=1.0)
            plan = loop.last_plan
            if len(plan) == 2 and plan[1].n_tokens > 1:
                shared.append(
                    (step, loop.running[0].slot.seq_id, loop.running[1].slot.seq_id, plan[1].n_tokens)
                )
    finally:
        loop.close()
        loaded.close()
    assert shared, "no step decoded one request beside another's prompt"
    own = shape.n_layer * k * shape.entry_bytes[0]  # the decoding token's experts, every layer
    for step, decoding, prefilling, chunk in shared:
        assert step.streamer is not None
        total = step.streamer.bytes_read
        mine, theirs, by_tokens = step.share(1, decoding), step.share(chunk, prefilling), step.share(1)
        assert mine.streamer is not None and theirs.streamer is not None and by_tokens.streamer is not None
        assert (mine.streamer.bytes_read, theirs.streamer.bytes_read) == (own, total - own)
        assert by_tokens.streamer.bytes_read == total // (chunk + 1) != own
