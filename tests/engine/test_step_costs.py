"""The prompt tokens a step takes beside running decodes, from the costs the loop measured."""

from __future__ import annotations

from server.engine.step_costs import PROMPT_TOKENS_BESIDE_DECODES, STEP_OVER_DECODE, StepCosts

MS = 1_000_000


def test_a_prompt_beside_decodes_keeps_the_step_within_the_factor() -> None:
    costs = StepCosts()
    assert costs.prompt_beside(1, 512) == PROMPT_TOKENS_BESIDE_DECODES  # nothing measured yet
    for _ in range(20):
        costs.learn(1, 0, 20 * MS)  # one decode alone: 20 ms
    assert costs.prompt_beside(1, 512) == PROMPT_TOKENS_BESIDE_DECODES  # no prompt token yet
    for _ in range(20):
        costs.learn(1, 8, 20 * MS + 8 * 5 * MS)  # beside it, a prompt token costs 5 ms
    assert costs.prompt_beside(1, 512) == int((STEP_OVER_DECODE - 1) * 20 / 5)
    assert costs.prompt_beside(1, 4) == 4  # never past the batch


def test_the_budget_follows_the_number_of_decodes_it_runs_beside() -> None:
    """Steps of four decodes take longer than steps of one: a stream alone after them keeps its
    own gap, not four streams' (the bench's long prompt beside one stream, after four)."""
    costs = StepCosts()
    for _ in range(20):
        costs.learn(4, 0, 80 * MS)
        costs.learn(4, 8, 80 * MS + 8 * 5 * MS)
    four = costs.prompt_beside(4, 512)
    assert costs.prompt_beside(1, 512) == PROMPT_TOKENS_BESIDE_DECODES  # one decode: not measured
    costs.learn(1, 0, 20 * MS)
    assert costs.prompt_beside(1, 512) == int((STEP_OVER_DECODE - 1) * 20 / 5) < four
    # the prompt token's cost is learnt against the decodes of its own step
    costs.learn(1, 10, 20 * MS + 10 * 7 * MS)
    assert costs.prompt_token_ns is not None and 5 * MS < costs.prompt_token_ns < 7 * MS
