"""How many prompt tokens a step takes beside running decodes, from costs measured on the token
loop's own steps (docs/api.md, "Concurrency and life cycle")."""

from __future__ import annotations

# beside running decodes a step takes as many prompt tokens as keep it within this many times a
# step of those decodes alone (alone, a prompt takes n_batch a step): each decoding request's next
# token waits for the step, so its gap between tokens stays within about this factor, and the
# prompt prefills at 1 - 1/factor of its rate alone, 1.5x its time at 3
STEP_OVER_DECODE = 3.0
# the prompt tokens beside decodes until both costs are measured
PROMPT_TOKENS_BESIDE_DECODES = 8
# the weight of a new step in the moving averages
NEW_STEP_WEIGHT = 0.2


class StepCosts:
    """Moving averages of a step of n decodes alone, by n (four requests' decodes take longer
    than one's, so a budget sized by another count would stretch the gaps), and of a prompt token
    beside decodes (the step's time beyond its decodes', over its prompt tokens; a prompt alone,
    in n_batch chunks, costs less a token and is not counted)."""

    def __init__(self) -> None:
        self.decode_ns: dict[int, float] = {}
        self.prompt_token_ns: float | None = None

    def learn(self, decodes: int, prompt_tokens: int, wall_ns: float) -> None:
        """Count a step of `decodes` decodes and `prompt_tokens` prompt tokens that took `wall_ns`."""

        def mix(old: float | None, new: float) -> float:
            return new if old is None else (1 - NEW_STEP_WEIGHT) * old + NEW_STEP_WEIGHT * new

        if prompt_tokens == 0:
            self.decode_ns[decodes] = mix(self.decode_ns.get(decodes), wall_ns)
        elif decodes and decodes in self.decode_ns:
            spent = max(0.0, wall_ns - self.decode_ns[decodes])
            self.prompt_token_ns = mix(self.prompt_token_ns, spent / prompt_tokens)

    def prompt_beside(self, decodes: int, most: int) -> int:
        """Prompt tokens a step takes beside `decodes` running decodes (at most `most`): as many as
        keep it within STEP_OVER_DECODE times a step of those decodes alone."""
        decode_ns = self.decode_ns.get(decodes)
        if decode_ns is None or self.prompt_token_ns is None:
            return min(most, PROMPT_TOKENS_BESIDE_DECODES)
        room = (STEP_OVER_DECODE - 1) * decode_ns / max(1.0, self.prompt_token_ns)
        return max(1, min(most, int(room)))
