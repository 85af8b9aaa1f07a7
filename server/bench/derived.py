"""Traces derived from a real one, to judge whether a cache policy holds beyond it.

The two real traces have short prompts (28-29 tokens) and 6 experts per token; a policy tuned to
them might not hold on a model with fewer, larger experts per token or a prompt longer than its
decode. These derivations keep a real trace's routing structure and change one such property.
They are not real routing: they judge robustness (`moeflash bench --replay`, "Derived traces"),
never a headline figure.
"""

from __future__ import annotations

import random
from dataclasses import replace

from server.loading.route_trace import Route, Trace

# the share of the decode steps moved into the prompt: of the real traces' 128, 96, leaving a
# prompt about four times the decode
PROMPT_SHARE = 0.75


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


def derivations(trace: Trace) -> list[Trace]:
    """The derived traces the replay report judges the policies on: a longer prompt, then with
    2 experts per token (when the trace routes more), on another topic, and 2 experts per token
    on 12 layers (when it has more)."""
    longer = longer_prompt(trace)
    top2 = top_experts(longer, 2) if trace.k > 2 else None
    out = [longer, *([top2] if top2 else []), other_topic(longer)]
    if top2 and trace.n_layer > 12:
        out.append(first_layers(top2, 12))
    return out
