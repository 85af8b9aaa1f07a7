"""Trace replay: real routing traces through the streamer's cache policy, next to references.

A route trace (bench/route-traces/*.route.csv, read by server/loading/route_trace.py)
lists, per token and layer, the experts the router picked. Replaying it through
`streaming_ext.CachePolicy` runs the very C code the streamer runs (mf_cache.c); LFU, random,
`rates` (every entry's rate known in advance) and Belady's offline optimum are reference policies
written here (they are not streamer policies).
Hit rates are per routed (layer, expert) entry:
cumulative over the whole trace and over decode steps only, as in the published curves.
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from server.bench.systems import EMULATED_PREDICTOR_ERROR
from server.loading.route_trace import Route, Trace
from streaming_ext import CachePolicy, Policy, RateClass

logger = logging.getLogger(__name__)

_MIB = 2**20
BUDGETS_MIB = (250, 500, 750, 1000, 1500, 2000, 2500, 3000, 4000, 6000, 8000)


@dataclass(frozen=True)
class ReplayResult:
    """Hit rates of one policy at one budget."""

    policy: str
    budget_mib: int
    hit_pct_cum: float
    hit_pct_decode: float
    read_mib: float


class _Counter:
    def __init__(self) -> None:
        self.hits = self.misses = self.decode_hits = self.decode_misses = 0
        self.read_bytes = 0

    def add(self, route: Route, misses: int, entry: int) -> None:
        hits = len(set(route.experts)) - misses
        self.hits += hits
        self.misses += misses
        self.read_bytes += misses * entry
        if route.decode:
            self.decode_hits += hits
            self.decode_misses += misses

    def result(self, policy: str, budget_mib: int) -> ReplayResult:
        total = self.hits + self.misses
        dec = self.decode_hits + self.decode_misses
        return ReplayResult(
            policy,
            budget_mib,
            100.0 * self.hits / total if total else 0.0,
            100.0 * self.decode_hits / dec if dec else 0.0,
            self.read_bytes / _MIB,
        )


def _streamer(trace: Trace, budget_bytes: int, policy: Policy) -> _Counter:
    cache = CachePolicy(trace.n_layer, trace.n_expert, trace.entry_bytes, budget_bytes, policy)
    counter = _Counter()
    try:
        for route in trace.routes:
            misses = cache.route(route.layer, list(route.experts), route.tokens)
            counter.add(route, misses, trace.entry_bytes[route.layer])
    finally:
        cache.close()
    return counter


def replay_streamer(trace: Trace, budget_mib: int, policy: Policy) -> ReplayResult:
    """The streamer's own policy code (mf_cache.c) on the trace."""
    return _streamer(trace, budget_mib * _MIB, policy).result(policy.name.lower(), budget_mib)


class _Bytes:
    """A byte budget, as the streamer's: entries of different layers may differ in size."""

    def __init__(self, trace: Trace, budget_bytes: int) -> None:
        self.sizes, self.budget, self.used = trace.entry_bytes, budget_bytes, 0

    def full_for(self, layer: int) -> bool:
        return self.used > 0 and self.used + self.sizes[layer] > self.budget

    def add(self, key: tuple[int, int], sign: int = 1) -> None:
        self.used += sign * self.sizes[key[0]]


def _replay_reference(trace: Trace, budget_mib: int, name: str, seed: int = 0) -> ReplayResult:
    resident: set[tuple[int, int]] = set()
    freq: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    rng = random.Random(seed)
    budget = _Bytes(trace, budget_mib * _MIB)
    counter = _Counter()
    for step, route in enumerate(trace.routes):
        want = {(route.layer, e) for e in route.experts}
        misses = 0
        for key in want:
            freq[key] = freq.get(key, 0) + 1
            last[key] = step
            if key in resident:
                continue
            misses += 1
            while budget.full_for(route.layer):
                candidates = [k for k in resident if k not in want] or list(resident)
                if name == "lfu":  # ties go to the least recently used
                    victim = min(candidates, key=lambda k: (freq[k], last[k]))
                else:
                    victim = rng.choice(candidates)
                resident.discard(victim)
                budget.add(victim, -1)
            resident.add(key)
            budget.add(key)
        counter.add(route, misses, trace.entry_bytes[route.layer])
    return counter.result(name, budget_mib)


def _decode_rates(trace: Trace) -> list[list[float]]:
    """Per layer and expert, the share of the layer's decode visits that route it over the whole
    trace (an expert never routed in decode gets half a route, so that distance still ranks it)."""
    visits = [0] * trace.n_layer
    routed = [[0] * trace.n_expert for _ in range(trace.n_layer)]
    for route in trace.routes:
        if route.decode:
            visits[route.layer] += 1
            for e in set(route.experts):
                routed[route.layer][e] += 1
    return [[min(1.0, max(c, 0.5) / max(n, 1)) for c in row] for row, n in zip(routed, visits, strict=True)]


def _rates_known(trace: Trace, budget_bytes: int) -> _Counter:
    """The `rates` reference: every entry's decode rate p over the whole trace known in advance,
    its order not. It evicts the entry with the most layer steps to its expected next use per
    byte, d + n_layer (1 - p) / p for an entry d steps before its layer's next visit: what
    frequencies alone buy when they are known, not learned. Within a layer d and the size are the
    same for every entry, so each layer's candidate is its rarest resident entry (a heap)."""
    rates = _decode_rates(trace)
    n_layer = trace.n_layer
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(n_layer)]  # (p, expert), lazily invalidated
    resident: set[tuple[int, int]] = set()
    budget = _Bytes(trace, budget_bytes)
    counter = _Counter()

    def rarest(layer: int, pinned: set[int]) -> tuple[float, int] | None:
        heap, held, found = heaps[layer], [], None
        while heap:
            p, e = heap[0]
            if (layer, e) not in resident:
                heapq.heappop(heap)  # stale: evicted since
            elif e in pinned:
                held.append(heapq.heappop(heap))
            else:
                found = (p, e)
                break
        for item in held:
            heapq.heappush(heap, item)
        return found

    for route in trace.routes:
        cur, want, misses = route.layer, set(route.experts), 0
        for e in want:
            if (cur, e) in resident:
                continue
            misses += 1
            while budget.full_for(cur):
                worst: tuple[float, int, int] | None = None
                for layer in range(n_layer):
                    found = rarest(layer, want if layer == cur else set())
                    if found is None:
                        continue
                    d = (layer - cur) % n_layer or n_layer
                    steps = (d + n_layer * (1.0 - found[0]) / found[0]) * trace.entry_bytes[layer]
                    if worst is None or steps > worst[0]:
                        worst = (steps, layer, found[1])
                if worst is None:
                    break  # only the running route's own entries are resident
                resident.discard((worst[1], worst[2]))
                budget.add((worst[1], worst[2]), -1)
            resident.add((cur, e))
            heapq.heappush(heaps[cur], (rates[cur][e], e))
            budget.add((cur, e))
        counter.add(route, misses, trace.entry_bytes[cur])
    return counter


def _next_uses(trace: Trace) -> Iterator[list[int]]:
    """For each route, the index of the next route using each of its entries (inf if none)."""
    nxt: dict[tuple[int, int], int] = {}
    out: list[list[int]] = []
    for i in range(len(trace.routes) - 1, -1, -1):
        route = trace.routes[i]
        row = []
        for e in route.experts:
            key = (route.layer, e)
            row.append(nxt.get(key, 1 << 62))
            nxt[key] = i
        out.append(row)
    return reversed(out)


def replay_belady(trace: Trace, budget_mib: int) -> ReplayResult:
    """Belady's offline optimum: evict the entries used furthest in the future until the new one fits.

    Under the same byte budget as the streamer's policies (experts of different layers differ in
    size); this is how the published curves beside the traces were made (reproduced within 0.14
    points of decode hit rate at every budget).
    """
    return _belady(trace, budget_mib * _MIB).result("belady", budget_mib)


def _belady(trace: Trace, budget_bytes: int) -> _Counter:
    resident: dict[tuple[int, int], int] = {}  # entry -> its next use
    heap: list[tuple[int, tuple[int, int]]] = []  # (-next use, entry), lazily invalidated
    budget = _Bytes(trace, budget_bytes)
    counter = _Counter()
    for route, next_uses in zip(trace.routes, _next_uses(trace), strict=True):
        misses = 0
        pinned = {(route.layer, e) for e in route.experts}
        for e, nu in zip(route.experts, next_uses, strict=True):
            key = (route.layer, e)
            if key not in resident:
                misses += 1
                held: list[tuple[int, tuple[int, int]]] = []
                while budget.full_for(route.layer) and heap:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) != -neg:
                        continue  # stale heap record
                    if victim in pinned:
                        held.append((neg, victim))
                    else:
                        del resident[victim]
                        budget.add(victim, -1)
                for item in held:
                    heapq.heappush(heap, item)
                budget.add(key)
            resident[key] = nu
            heapq.heappush(heap, (-nu, key))
        counter.add(route, misses, trace.entry_bytes[route.layer])
    return counter


def replay_all(trace: Trace, budgets_mib: Iterable[int] = BUDGETS_MIB) -> list[ReplayResult]:
    """Every policy at every budget."""
    results: list[ReplayResult] = []
    for budget in budgets_mib:
        results.append(replay_streamer(trace, budget, Policy.LAYER))
        results.append(replay_streamer(trace, budget, Policy.LRU))
        results.append(_replay_reference(trace, budget, "lfu"))
        results.append(_replay_reference(trace, budget, "random"))
        results.append(replay_belady(trace, budget))
    return results


def run_routes(trace: Trace, decode_steps: int, n_batch: int) -> list[Route]:
    """The routes a trace-routed `moeflash generate` run hands the streamer's cache, in order:
    the trace's prompt in micro-batches of n_batch tokens, each layer routing the union of its
    batch's experts once (the last layer only in the last batch, for the last token: the only
    one whose logits are asked for), then decode_steps decode tokens, wrapping around the trace's
    decode steps as mf_route.c does."""
    by_token = trace.by_token()
    prompt, decode = trace.steps(decode=False), trace.steps(decode=True)
    last = trace.n_layer - 1
    out: list[Route] = []
    for start in range(0, len(prompt), n_batch):
        batch = prompt[start : start + n_batch]
        final = start + n_batch >= len(prompt)
        for layer in range(trace.n_layer):
            tokens = batch[-1:] if layer == last else batch
            if layer == last and not final:
                continue
            keys = [(False, turn, step, layer) for turn, step in tokens]
            routed = [by_token[key] for key in keys if key in by_token]
            union = sorted({e for experts in routed for e in experts})
            if union:
                out.append(Route(False, layer, tuple(union), tokens=tuple(routed)))
    for i in range(decode_steps):
        turn, step = decode[i % len(decode)]
        for layer in range(trace.n_layer):
            experts = by_token.get((True, turn, step, layer))
            if experts:
                out.append(Route(True, layer, experts))
    return out


# the prompt's micro-batch of a run (the default --n-batch)
SERVED_N_BATCH = 512


def served(trace: Trace, n_batch: int = SERVED_N_BATCH) -> Trace:
    """The trace as a run routes it (`run_routes`, every decode step once): what the cache of a
    server sees, each prompt micro-batch a union of its tokens' experts."""
    routes = run_routes(trace, len(trace.steps(decode=True)), n_batch)
    return replace(trace, name=f"{trace.name} as served", routes=routes)


def replay_served(trace: Trace, budgets_mib: Iterable[int] = BUDGETS_MIB) -> list[ReplayResult]:
    """The default policy, LRU and Belady on the trace as served (`served`), at each budget that
    holds the largest route (a union may need a whole layer's experts: the streamer's floor)."""
    run = served(trace)
    need = max(len(r.experts) * trace.entry_bytes[r.layer] for r in run.routes)
    results: list[ReplayResult] = []
    for budget in budgets_mib:
        if budget * _MIB < need:
            continue
        results.append(replay_streamer(run, budget, Policy.LAYER))
        results.append(replay_streamer(run, budget, Policy.LRU))
        results.append(replay_belady(run, budget))
    return results


# budgets of the across-shapes table, in token working sets (one token's routed experts over
# every layer): the scale on which traces of models of different shapes compare
WORKING_SETS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def token_working_set(trace: Trace) -> int:
    """Bytes of one token's routed experts over every layer."""
    return trace.k * sum(trace.entry_bytes)


@dataclass(frozen=True)
class WorkingSetResult:
    """Decode hit rates (%) on a trace as served at a budget of some token working sets."""

    working_sets: float
    budget_mib: float
    default: float  # the streamer's default policy (mf_cache.c)
    lru: float
    rates: float  # the `rates` reference: every entry's decode rate known in advance
    belady: float  # the offline optimum


def replay_working_sets(trace: Trace, multiples: Iterable[float] = WORKING_SETS) -> list[WorkingSetResult]:
    """The default policy, LRU, the `rates` reference and Belady on the trace as served, at budgets
    of `multiples` token working sets that hold the largest route and not every expert."""
    run = served(trace)
    need = max(len(r.experts) * trace.entry_bytes[r.layer] for r in run.routes)
    everything = trace.n_expert * sum(trace.entry_bytes)
    out: list[WorkingSetResult] = []
    for m in multiples:
        budget = int(m * token_working_set(trace))
        if budget < need or budget >= everything:
            continue
        out.append(
            WorkingSetResult(
                m,
                budget / _MIB,
                _streamer(run, budget, Policy.LAYER).result("layer", 0).hit_pct_decode,
                _streamer(run, budget, Policy.LRU).result("lru", 0).hit_pct_decode,
                _rates_known(run, budget).result("rates", 0).hit_pct_decode,
                _belady(run, budget).result("belady", 0).hit_pct_decode,
            )
        )
    return out


@dataclass(frozen=True)
class RunReplay:
    """Decode hit rates (%) of the routes one run executed, replayed at its budget."""

    policy: float  # the streamer's default policy (mf_cache.c, as the run had it)
    belady: float  # the offline optimum at the same budget


def replay_run(
    trace: Trace, decode_steps: int, n_batch: int, frame_bytes: int, budget_bytes: int, policy: Policy
) -> RunReplay:
    """What a trace-routed run's expert cache must hit without prefetch: its routes
    (`run_routes`) through its cache policy under its budget, every expert counted at the frame
    size (as the streamer counts it), next to Belady's optimum under the same budget."""
    routes = run_routes(trace, decode_steps, n_batch)
    framed = Trace(trace.name, trace.n_layer, trace.n_expert, [frame_bytes] * trace.n_layer, routes, trace.k)
    ours = _streamer(framed, budget_bytes, policy).result("run", 0)
    best = _belady(framed, budget_bytes).result("belady", 0)
    return RunReplay(ours.hit_pct_decode, best.hit_pct_decode)


# next-layer predictors of prefetch that use only past routing, the trace with a share of its
# experts replaced (the emulated predictor of `make bench`), and the trace itself (an oracle)
PREDICTORS = ("none", "previous token", "co-occurrence", "emulated", "trace")


def _emulated_guess(following: tuple[int, ...], n_expert: int, rng: random.Random) -> list[int]:
    """The next layer's experts with each replaced, at EMULATED_PREDICTOR_ERROR, by one it does not
    route (mf_route.c's emulated predictor)."""
    others = [e for e in range(n_expert) if e not in following]
    wrong = EMULATED_PREDICTOR_ERROR
    return [rng.choice(others) if others and rng.random() < wrong else e for e in following]


class _CoOccurrence:
    """Which experts of layer l + 1 follow which of layer l in the same token, counted over the
    tokens routed so far: P(b at l + 1 | a at l) summed over the token's experts a at layer l."""

    def __init__(self, n_layer: int, n_expert: int) -> None:
        self.n_expert = n_expert
        self.pairs = [[[0] * n_expert for _ in range(n_expert)] for _ in range(n_layer)]
        self.seen = [[0] * n_expert for _ in range(n_layer)]

    def learn(self, layer: int, experts: tuple[int, ...], after: tuple[int, ...]) -> None:
        """One token routed `experts` at layer and `after` at layer + 1."""
        for a in experts:
            self.seen[layer][a] += 1
            row = self.pairs[layer][a]
            for b in after:
                row[b] += 1

    def predict(self, layer: int, experts: tuple[int, ...], k: int) -> list[int]:
        """The k likeliest experts of layer + 1 given layer's (fewer when little is known)."""
        score = [0.0] * self.n_expert
        for a in experts:
            n = self.seen[layer][a]
            if n:
                for b, c in enumerate(self.pairs[layer][a]):
                    score[b] += c / n
        ranked = sorted(range(self.n_expert), key=lambda b: -score[b])
        return [b for b in ranked[:k] if score[b] > 0]


@dataclass(frozen=True)
class PrefetchResult:
    """One predictor at one budget, over the decode tokens of a trace (the prompt warms the cache
    and teaches the predictors, without prefetch)."""

    predictor: str
    budget_mib: int
    hit_pct_decode: float  # routed entries resident at their routing, prefetched ones included
    slot_pct: float  # of the routed entries, the share the predictor named (cached or not)
    useful_pct: float  # of the entries prefetch read, the share their layer then routed
    read_mib_per_token: float  # demand misses plus prefetch reads
    # per RateClass of the read entries, the prefetch gate's classes: (entries read, of them routed)
    by_rate: tuple[tuple[int, int], ...] = ()


def replay_prefetch(
    trace: Trace, budget_mib: int, predictor: str, policy: Policy = Policy.LAYER
) -> PrefetchResult:
    """The streamer's cache policy and its prefetch admission (mf_cache_prefetch) on the trace in
    its order, each decode layer's successor predicted as the layer routes, as the streamer does.
    Co-occurrence learns a pair once both layers of a token have routed (past routing only)."""
    if predictor not in PREDICTORS:
        raise ValueError(f"predictor must be one of {PREDICTORS}")
    cache = CachePolicy(trace.n_layer, trace.n_expert, trace.entry_bytes, budget_mib * _MIB, policy)
    cooc = _CoOccurrence(trace.n_layer, trace.n_expert)
    rng = random.Random(0)
    by_rate = [[0, 0] for _ in RateClass]
    by_token = trace.by_token()
    routed = hits = named = loaded = useful = read_bytes = 0
    latest: dict[int, tuple[int, ...]] = {}  # per layer: the experts of its last route
    guessed: dict[int, set[int]] = {}  # per layer: the last prediction for it, and what it read
    pending: dict[int, dict[int, int]] = {}  # per layer: the entries read for it -> rate class
    try:
        for r in trace.routes:
            token = (r.decode, r.turn, r.step)
            misses = cache.route(r.layer, list(r.experts))
            before = by_token.get((*token, r.layer - 1))
            if before is not None:
                cooc.learn(r.layer - 1, before, r.experts)
            if r.decode:
                want = set(r.experts)
                routed += len(want)
                hits += len(want) - misses
                named += len(want & guessed.pop(r.layer, set()))
                read_ahead = pending.pop(r.layer, {})
                useful += len(want & read_ahead.keys())
                for e, c in read_ahead.items():
                    by_rate[c][0] += 1
                    by_rate[c][1] += e in want
                read_bytes += misses * trace.entry_bytes[r.layer]
            following = by_token.get((*token, r.layer + 1))
            if r.decode and predictor != "none" and following is not None:
                if predictor == "trace":
                    guess = list(following)
                elif predictor == "emulated":
                    guess = _emulated_guess(following, trace.n_expert, rng)
                elif predictor == "previous token":
                    guess = list(latest.get(r.layer + 1, ()))
                else:
                    guess = cooc.predict(r.layer, r.experts, trace.k)
                read = cache.prefetch(r.layer + 1, guess)
                guessed[r.layer + 1] = set(guess)
                pending[r.layer + 1] = {e: cache.rate_class(r.layer + 1, e) for e in read}
                loaded += len(read)
                read_bytes += len(read) * trace.entry_bytes[r.layer + 1]
            latest[r.layer] = r.experts
    finally:
        cache.close()
    n_decode = len(trace.steps(decode=True))
    return PrefetchResult(
        predictor,
        budget_mib,
        100.0 * hits / routed if routed else 0.0,
        100.0 * named / routed if routed else 0.0,
        100.0 * useful / loaded if loaded else 0.0,
        read_bytes / _MIB / n_decode if n_decode else 0.0,
        tuple((n, right) for n, right in by_rate),
    )
