"""Traces derived from a real one, to judge whether a cache policy holds beyond it.

The two real traces have short prompts (28-29 tokens), 6 experts per token and 128 per layer; a
policy tuned to them might not hold on a model with fewer, larger experts per token, fewer experts
per layer or a prompt longer than its decode. These derivations keep a real trace's routing
structure and change one such property. They are not real routing: they judge robustness
(`moeflash bench replay`, "Derived traces"), never a headline figure.
"""

from __future__ import annotations

import random
from dataclasses import replace

from server.loading.route_trace import Route, Trace

# the share of the decode steps moved into the prompt: of the real traces' 128, 96, leaving a
# prompt about four times the decode
PROMPT_SHARE = 0.75
# experts per layer of the "few experts" derivation: Mixtral's
FEW_EXPERTS = 8


def longer_prompt(trace: Trace, share: float = PROMPT_SHARE) -> Trace:
    """The first `share` of the decode steps become prompt steps: a prompt longer than the decode."""
    steps = trace.steps(decode=True)
    decode = steps[: int(len(steps) * share)]
    # the moved tokens follow the prompt's last step, in order
    after = max((step for _, step in trace.steps(decode=False)), default=-1) + 1
    moved = {token: after + i for i, token in enumerate(decode)}
    routes = [
        replace(r, decode=False, step=moved[(r.turn, r.step)])
        if r.decode and (r.turn, r.step) in moved
        else r
        for r in trace.routes
    ]
    routes.sort(key=lambda r: (r.decode, r.turn, r.step, r.layer))
    return replace(trace, name=f"{trace.name}, prompt +{len(decode)}", routes=routes)


def top_experts(trace: Trace, k: int) -> Trace:
    """Each token keeps only its k highest-ranked experts (slot order), each k_old / k times the
    bytes: fewer, larger experts per token, the same bytes routed."""
    scale = trace.k / k
    routes = [replace(r, experts=r.experts[:k], weights=r.weights[:k]) for r in trace.routes]
    sizes = [round(b * scale) for b in trace.entry_bytes]
    return replace(trace, name=f"{trace.name}, top {k}", routes=routes, entry_bytes=sizes, n_expert_used=k)


def other_topic(trace: Trace, seed: int = 1) -> Trace:
    """The prompt's experts renamed by a fixed permutation per layer: a prompt whose experts the
    decode does not share (a topic change), with the prompt's own reuse structure."""
    rng = random.Random(seed)
    perm = [rng.sample(range(trace.n_expert), trace.n_expert) for _ in range(trace.n_layer)]
    routes = [
        r if r.decode else replace(r, experts=tuple(perm[r.layer][e] for e in r.experts))
        for r in trace.routes
    ]
    return replace(trace, name=f"{trace.name}, prompt on another topic", routes=routes)


def first_layers(trace: Trace, n: int) -> Trace:
    """Only the first n layers: a smaller token working set."""
    routes: list[Route] = [r for r in trace.routes if r.layer < n]
    return replace(
        trace,
        name=f"{trace.name}, {n} layers",
        n_layer=n,
        routes=routes,
        entry_bytes=trace.entry_bytes[:n],
        dense_bytes=trace.dense_bytes[:n],
    )


def fewer_experts(trace: Trace, n: int) -> Trace:
    """Expert e becomes expert e mod n, and a token's experts that fall together route once: a
    model with few experts per layer, as Mixtral's 8. Each keeps its bytes, so the model is
    n / n_expert of the size and a token routes at most the bytes it did."""

    def fold(experts: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(dict.fromkeys(e % n for e in experts))

    def fold_route(r: Route) -> Route:
        weight: dict[int, float] = {}  # a folded expert's weight is its first member's
        for e, w in zip(r.experts, r.weights, strict=False):
            weight.setdefault(e % n, w)
        experts = fold(r.experts)
        weights = tuple(weight[e] for e in experts) if r.weights else ()
        return replace(r, experts=experts, weights=weights, tokens=tuple(fold(t) for t in r.tokens))

    routes = [fold_route(r) for r in trace.routes]
    return replace(trace, name=f"{trace.name}, {n} experts", routes=routes, n_expert=n)


def derivations(trace: Trace) -> list[Trace]:
    """The derived traces the replay report judges the policies on: a longer prompt, then with
    2 experts per token (when the trace routes more), on another topic, 2 experts per token on
    12 layers (when it has more), and 2 of 8 experts per layer (when it has more)."""
    longer = longer_prompt(trace)
    top2 = top_experts(longer, 2) if trace.k > 2 else None
    out = [longer, *([top2] if top2 else []), other_topic(longer)]
    if top2 and trace.n_layer > 12:
        out.append(first_layers(top2, 12))
    if top2 and trace.n_expert > FEW_EXPERTS:
        out.append(fewer_experts(top2, FEW_EXPERTS))
    return out
