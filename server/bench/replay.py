"""Trace replay: real routing traces through the streamer's cache policy, next to references.

A route trace (../shared/data/route-traces/*.route.csv) lists, per token and layer, the experts
the router picked. Replaying it through `streaming_ext.CachePolicy` runs the very C code the
streamer runs (mf_cache.c); LFU, random and Belady's offline optimum are reference policies
written here (they are not streamer policies). Hit rates are per routed (layer, expert) entry:
cumulative over the whole trace and over decode steps only, as in the published curves.
"""

from __future__ import annotations

import csv
import heapq
import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from server.errors import ConfigError
from streaming_ext import CachePolicy, Policy

logger = logging.getLogger(__name__)

_MIB = 2**20
BUDGETS_MIB = (250, 500, 750, 1000, 1500, 2000, 2500, 3000, 4000, 6000, 8000)


@dataclass(frozen=True)
class Route:
    """One layer of one token: the experts it routed to."""

    decode: bool
    layer: int
    experts: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    """A parsed route trace."""

    name: str
    n_layer: int
    n_expert: int
    entry_bytes: list[int]  # per layer: bytes of one expert (gate + up + down)
    routes: list[Route]


@dataclass(frozen=True)
class ReplayResult:
    """Hit rates of one policy at one budget."""

    policy: str
    budget_mib: int
    hit_pct_cum: float
    hit_pct_decode: float
    read_mib: float


_COLUMNS = ("turn", "phase", "step", "layer", "expert")


def _header(path: Path, lines: list[str]) -> tuple[int, int, list[int]]:
    n_layer = n_expert = 0
    entry: dict[int, int] = {}
    for line in lines:
        fields = dict(kv.split("=", 1) for kv in line[1:].split() if "=" in kv)
        try:
            if "n_layer" in fields:
                n_layer, n_expert = int(fields["n_layer"]), int(fields["n_expert"])
            if "layer" in fields and "expert_bytes" in fields:
                entry[int(fields["layer"])] = int(fields["expert_bytes"])
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"{path}: bad header line {line.strip()!r}") from exc
    if n_layer <= 0 or n_expert <= 0:
        raise ConfigError(f"{path}: no '# ... n_layer=... n_expert=...' header")
    missing = [layer for layer in range(n_layer) if entry.get(layer, 0) <= 0]
    if missing:
        raise ConfigError(f"{path}: no '# layer=N expert_bytes=...' header for layers {missing[:8]}")
    return n_layer, n_expert, [entry[layer] for layer in range(n_layer)]


def load_trace(path: Path) -> Trace:
    """Parse a *.route.csv file (header comments give the shape and per-layer expert bytes).

    Raises ConfigError, naming the file and line, for anything that is not such a trace.
    """
    try:
        with path.open() as fh:
            lines = fh.readlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read route trace {path}: {exc}") from exc
    n_layer, n_expert, entry_bytes = _header(path, [ln for ln in lines if ln.startswith("#")])
    reader = csv.DictReader(ln for ln in lines if not ln.startswith("#"))
    if not set(_COLUMNS) <= set(reader.fieldnames or ()):
        raise ConfigError(f"{path}: the column header must name {', '.join(_COLUMNS)}")
    routes: list[Route] = []
    key: tuple[str, str, str, str] | None = None
    experts: list[int] = []
    for rec in reader:
        try:
            layer, expert = int(rec["layer"]), int(rec["expert"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: line {reader.line_num}: layer and expert must be integers") from exc
        if not (0 <= layer < n_layer and 0 <= expert < n_expert):
            raise ConfigError(
                f"{path}: line {reader.line_num}: layer {layer} or expert {expert} outside the header's "
                f"{n_layer} layers x {n_expert} experts"
            )
        k = (rec["turn"], rec["phase"], rec["step"], rec["layer"])
        if k != key:
            if key is not None:
                routes.append(Route(key[1] == "1", int(key[3]), tuple(experts)))
            key, experts = k, []
        experts.append(expert)
    if key is None:
        raise ConfigError(f"{path}: no routes")
    routes.append(Route(key[1] == "1", int(key[3]), tuple(experts)))
    return Trace(path.name.split(".")[0], n_layer, n_expert, entry_bytes, routes)


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


def replay_streamer(trace: Trace, budget_mib: int, policy: Policy) -> ReplayResult:
    """The streamer's own policy code (mf_cache.c) on the trace."""
    cache = CachePolicy(trace.n_layer, trace.n_expert, trace.entry_bytes, budget_mib * _MIB, policy)
    counter = _Counter()
    try:
        for route in trace.routes:
            misses = cache.route(route.layer, list(route.experts))
            counter.add(route, misses, trace.entry_bytes[route.layer])
    finally:
        cache.close()
    return counter.result(policy.name.lower(), budget_mib)


class _Bytes:
    """A byte budget, as the streamer's: entries of different layers may differ in size."""

    def __init__(self, trace: Trace, budget_mib: int) -> None:
        self.sizes, self.budget, self.used = trace.entry_bytes, budget_mib * _MIB, 0

    def full_for(self, layer: int) -> bool:
        return self.used > 0 and self.used + self.sizes[layer] > self.budget

    def add(self, key: tuple[int, int], sign: int = 1) -> None:
        self.used += sign * self.sizes[key[0]]


def _replay_reference(trace: Trace, budget_mib: int, name: str, seed: int = 0) -> ReplayResult:
    resident: set[tuple[int, int]] = set()
    freq: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    rng = random.Random(seed)
    budget = _Bytes(trace, budget_mib)
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
    resident: dict[tuple[int, int], int] = {}  # entry -> its next use
    heap: list[tuple[int, tuple[int, int]]] = []  # (-next use, entry), lazily invalidated
    budget = _Bytes(trace, budget_mib)
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
    return counter.result("belady", budget_mib)


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
