"""The prompt tokens a step takes beside running decodes, from the costs the loop measured: chunks
within CHUNK_STEP_OVER_DECODE decode steps, spaced so that the steps average MEAN_STEP_OVER_DECODE
(steps timed start to start by the token loop)."""

from __future__ import annotations

from server.engine.step_costs import (
    CHUNK_STEP_OVER_DECODE,
    MEAN_STEP_OVER_DECODE,
    PROMPT_TOKENS_BESIDE_DECODES,
    StepCosts,
)

MS = 1_000_000


def measured(decodes: int = 1, decode_ms: int = 20, token_ms: int = 5) -> StepCosts:
    """Costs that learnt a step of `decodes` decodes and a prompt token beside them, nothing owed."""
    costs = StepCosts()
    for _ in range(20):
        costs.learn(decodes, 0, decode_ms * MS)
        costs.learn(decodes, 8, (decode_ms + 8 * token_ms) * MS)
    return costs


def prefill(costs: StepCosts, decode_ms: int, prompt: int = 1000, decodes: int = 1) -> list[float]:
    """Each step's time (ms) while a `prompt`-token prompt prefills beside `decodes` decodes whose
    step takes `decode_ms`, a prompt token 5 ms more (at most 500 steps)."""
    steps_ms: list[float] = []
    while prompt > 0 and len(steps_ms) < 500:
        chunk = min(prompt, costs.prompt_beside(decodes, 512))
        prompt -= chunk
        steps_ms.append(decode_ms + 5 * chunk)
        costs.learn(decodes, chunk, steps_ms[-1] * MS)
        costs.pace(decodes, chunk, steps_ms[-1] * MS, prompt_waits=prompt > 0)
    assert prompt == 0, f"{prompt} prompt tokens still wait after 500 steps"
    return steps_ms


def test_a_chunk_beside_decodes_keeps_its_step_within_the_factor() -> None:
    costs = StepCosts()
    assert costs.prompt_beside(1, 512) == PROMPT_TOKENS_BESIDE_DECODES  # nothing measured yet
    for _ in range(20):
        costs.learn(1, 0, 20 * MS)  # one decode alone: 20 ms
    assert costs.prompt_beside(1, 512) == PROMPT_TOKENS_BESIDE_DECODES  # no prompt token yet
    costs = measured()  # beside it, a prompt token costs 5 ms
    assert costs.prompt_beside(1, 512) == int((CHUNK_STEP_OVER_DECODE - 1) * 20 / 5)
    assert costs.prompt_beside(1, 4) == 4  # never past the batch


def test_chunks_are_spaced_so_the_decodes_keep_their_mean() -> None:
    """After a chunk's step the decodes run alone until the steps since the prompt began average
    MEAN_STEP_OVER_DECODE decode steps; then the next chunk goes."""
    costs = measured()
    steps_ms = prefill(costs, decode_ms=20)
    assert max(steps_ms) <= CHUNK_STEP_OVER_DECODE * 20
    # the last chunk's step is not paid back: no prompt waits after it
    assert sum(steps_ms[:-1]) / len(steps_ms[:-1]) <= MEAN_STEP_OVER_DECODE * 20
    assert steps_ms.count(20) > len(steps_ms) / 2, "the decodes alone between the chunks"
    # the prompt's time: about MEAN / (MEAN - 1) of its chunks' prompt time, not more
    assert sum(steps_ms) <= 1.1 * (MEAN_STEP_OVER_DECODE / (MEAN_STEP_OVER_DECODE - 1)) * 5 * 1000
    # nothing waits: nothing owed, the next prompt's first chunk goes at once
    assert costs.over_ns == 0 and costs.prompt_beside(1, 512) > 0


def test_the_budget_follows_the_number_of_decodes_it_runs_beside() -> None:
    """Steps of four decodes take longer than steps of one: a stream alone after them keeps its
    own gap, not four streams' (the bench's long prompt beside one stream, after four)."""
    costs = measured(decodes=4, decode_ms=80)
    four = costs.prompt_beside(4, 512)
    assert costs.prompt_beside(1, 512) == PROMPT_TOKENS_BESIDE_DECODES  # one decode: not measured
    costs.learn(1, 0, 20 * MS)
    assert costs.prompt_beside(1, 512) == int((CHUNK_STEP_OVER_DECODE - 1) * 20 / 5) < four
    # the prompt token's cost is learnt against the decodes of its own step
    costs.learn(1, 10, 20 * MS + 10 * 7 * MS)
    assert costs.prompt_token_ns is not None and 5 * MS < costs.prompt_token_ns < 7 * MS


def test_decodes_slowed_beside_the_prompt_keep_the_allowance_from_before_it() -> None:
    """Under a cap a prompt's reads evict the decodes' experts and their steps slow (here from 20
    to 40 ms): the steps still average MEAN_STEP_OVER_DECODE times the 20 ms of before."""
    costs = measured()
    steps_ms = prefill(costs, decode_ms=40)
    assert costs.decode_ns[1] > 39 * MS  # learnt: the chunks' size follows today's steps
    assert sum(steps_ms[:-1]) / len(steps_ms[:-1]) <= MEAN_STEP_OVER_DECODE * 20


def test_a_waiting_prompt_is_never_starved() -> None:
    """Decodes that run slower than the mean by themselves (under a cap that thrashes: 5x their
    steps from before the prompt) still leave the prompt chunks: it prefills."""
    costs = measured(decodes=2)
    costs.pace(2, 0, 20 * MS, prompt_waits=True)  # the prompt comes
    steps_ms = prefill(costs, decode_ms=100, decodes=2)
    assert sum(step > 100 for step in steps_ms) >= 3
