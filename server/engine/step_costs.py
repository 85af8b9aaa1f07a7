"""How many prompt tokens a step takes beside running decodes, from costs measured on the token
loop's own steps (docs/api.md, "Concurrency and life cycle").

Beside decodes a prompt is prefilled in chunks spaced out by steps of the decodes alone, not in a
small chunk every step: a MoE step's cost grows with the union of its tokens' experts, so the
first prompt tokens beside a decode cost the most (on qwen30b-8l-shape, 4 of them make the step
3x a decode, 64 of them 14x, each token of those at 1.1x its cost in a prompt alone;
docs/benchmarks.md, "Parallel requests"). A chunk takes as many tokens as keep its step within
CHUNK_STEP_OVER_DECODE decode steps, and the next waits until the decodes' steps since the
prompt began average MEAN_STEP_OVER_DECODE again: the decoding requests run at about a third of
their speed alone, and the prompt prefills at up to two thirds of its own."""

from __future__ import annotations

from collections import deque

# the decoding requests' steps while a prompt waits average at most this many times a step of
# those decodes alone: their mean gap between tokens (and the prompt's time, 1.5x alone at 3)
MEAN_STEP_OVER_DECODE = 3.0
# a step with a prompt chunk beside decodes takes at most about this many times a step of those
# decodes alone: the longest gap a decoding request sees, and how much of the experts' union
# the chunk shares (more tokens a chunk: fewer reads and passes a prompt token)
CHUNK_STEP_OVER_DECODE = 16.0
# the prompt tokens beside decodes until both costs are measured
PROMPT_TOKENS_BESIDE_DECODES = 8
# the weight of a new step in the prompt token's moving average
NEW_STEP_WEIGHT = 0.2
# a step of n decodes alone costs the lower quartile of the last this many: under a cap the steps
# right after a prompt read the experts it evicted, and the quartile is the cache's usual
DECODE_STEPS_KEPT = 32


class StepCosts:
    """The cost of a step of n decodes alone, by n (four requests' decodes take longer than
    one's, so a budget sized by another count would stretch the gaps); a moving average of a
    prompt token beside decodes (the step's time beyond its decodes', over its prompt tokens; a
    prompt alone, in n_batch chunks, costs less a token and is not counted); and how far the
    steps since a prompt began waiting beside decodes ran over MEAN_STEP_OVER_DECODE decode steps
    each, start to start (a decode step alone is timed without the work between steps: the pace
    errs slow)."""

    def __init__(self) -> None:
        self.decode_ns: dict[int, float] = {}
        self._decode_steps: dict[int, deque[float]] = {}
        self.prompt_token_ns: float | None = None
        self.over_ns = 0.0  # > 0: the next step runs the decodes alone
        # the decode steps as they were when the waiting prompt came: under a cap its reads evict
        # the decodes' experts and slow their steps, which must not widen their allowance
        self.alone_ns: dict[int, float] | None = None

    def learn(self, decodes: int, prompt_tokens: int, wall_ns: float) -> None:
        """Count a step of `decodes` decodes and `prompt_tokens` prompt tokens that took `wall_ns`."""

        def mix(old: float | None, new: float) -> float:
            return new if old is None else (1 - NEW_STEP_WEIGHT) * old + NEW_STEP_WEIGHT * new

        if prompt_tokens == 0:
            kept = self._decode_steps.setdefault(decodes, deque(maxlen=DECODE_STEPS_KEPT))
            kept.append(wall_ns)
            self.decode_ns[decodes] = sorted(kept)[len(kept) // 4]
        elif decodes and decodes in self.decode_ns:
            spent = max(0.0, wall_ns - self.decode_ns[decodes])
            self.prompt_token_ns = mix(self.prompt_token_ns, spent / prompt_tokens)

    def pace(self, decodes: int, prompt_tokens: int, period_ns: float, prompt_waits: bool) -> None:
        """Count the time from the start of a step of `decodes` decodes and `prompt_tokens` prompt
        tokens to the next one's, which its decoding requests waited for their tokens (sampling
        and the server's work between steps included), before a step with a prompt waiting
        (`prompt_waits`) or none. A step of the decodes alone pays back at least one of their
        steps from before: decodes that slowed past the mean by themselves do not starve it."""
        if not prompt_waits or not decodes:
            self.over_ns, self.alone_ns = 0.0, None
            return
        if self.alone_ns is None:  # a prompt began waiting: the decodes' steps before it
            self.alone_ns = dict(self.decode_ns)
        decode_ns = self.alone_ns.setdefault(decodes, self.decode_ns.get(decodes, period_ns))
        over = period_ns - MEAN_STEP_OVER_DECODE * decode_ns
        self.over_ns += over if prompt_tokens else min(over, -decode_ns)

    def prompt_beside(self, decodes: int, most: int) -> int:
        """Prompt tokens the next step takes beside `decodes` running decodes (at most `most`):
        none while the steps since the prompt began run over their mean, else as many as keep the
        step within CHUNK_STEP_OVER_DECODE times a step of those decodes alone."""
        decode_ns = self.decode_ns.get(decodes)
        if decode_ns is None or self.prompt_token_ns is None:
            return min(most, PROMPT_TOKENS_BESIDE_DECODES)
        if self.over_ns > 0:
            return 0
        room = (CHUNK_STEP_OVER_DECODE - 1) * decode_ns / max(1.0, self.prompt_token_ns)
        return max(1, min(most, int(room)))
