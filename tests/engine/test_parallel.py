"""Requests decoded together: the byte-identity gate of the shared step, batch invariance, and
the token loop's slots (admission, chunked prefill, cancellation, a prefix shared across slots).

The gate runs one schedule (requests started at fixed steps, prompts longer than a step so their
prefill is chunked beside running decodes) streamed under a budget that evicts and resident,
records each step's plan (sequence, tokens, sampled) and compares the plans, every sequence's
tokens and every logprob bit for bit; at least half of the steps hold two or more sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from server.engine.generation import GenerationRequest, GenerationStats, SamplingParams, TextDelta
from server.engine.prompt_cache import PromptCache, StateKey, Window, model_identity
from server.engine.token_loop import Planned, TokenLoop
from server.loading.measured import DecodeStep, MeasuredLlama
from server.loading.resident import load_resident_llama
from server.loading.streaming import load_streaming_llama
from streaming_ext import StreamerConfig
from tests.models import expert_layer_bytes

N_BATCH = 32
SLOTS = 4


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(5 + (i * (31 + 2 * seed) + 7 * seed) % 250 for i in range(n))


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
SEEDED = SamplingParams(
    max_tokens=12,
    temperature=0.8,
    top_k=40,
    top_p=0.9,
    seed=7,
    repeat_penalty=1.1,
    ignore_eos=True,
    logprobs=True,
)

# step -> the requests started before it: two at once, then two that join running decodes, each
# with a prompt over a step's budget
SCHEDULE: dict[int, list[GenerationRequest]] = {
    0: [GenerationRequest(prompt(0, 70), GREEDY), GenerationRequest(prompt(1, 20), SEEDED)],
    4: [GenerationRequest(prompt(2, 90), GREEDY)],
    6: [GenerationRequest(prompt(3, 45), SEEDED)],
}


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the sampled token's, then its top ones
    stats: GenerationStats = field(default_factory=GenerationStats)

    def emit(self, delta: TextDelta) -> None:
        for lp in delta.logprobs:
            self.logprobs += [lp.logprob, *(top.logprob for top in lp.top_logprobs)]

    def on_token(self, token: int, _: DecodeStep | None) -> None:
        self.tokens.append(token)


def run_schedule(
    llama: MeasuredLlama,
    schedule: dict[int, list[GenerationRequest]],
    replay: list[tuple[Planned, ...]] | None = None,
    beside: int | None = None,
    prompt_cache: PromptCache | None = None,
) -> tuple[list[tuple[Planned, ...]], list[Outcome]]:
    """Run `schedule` on a fresh token loop (its steps' plans those of `replay` when given, the
    prompt tokens beside decodes `beside` when given, with `prompt_cache` when given): each
    step's plan and every request's outcome."""
    loop = TokenLoop(llama, prompt_cache, beside=beside)
    if replay is not None:
        loop.replay = {i: {p.index: p.n_tokens for p in plan} for i, plan in enumerate(replay)}
    plans: list[tuple[Planned, ...]] = []
    outcomes: list[Outcome] = []
    try:
        step = 0
        while loop.running or step <= max(schedule):
            for request in schedule.get(step, []):
                out = Outcome()
                loop.start(request, out.stats, out.emit, lambda: False, out.on_token)
                outcomes.append(out)
            loop.step()
            plans.append(loop.last_plan)
            step += 1
    finally:
        loop.close()
    return plans, outcomes


def ram_cache(llama: MeasuredLlama, path: Path) -> PromptCache:
    """A prompt cache in RAM only, 64 MiB: what lets a slot take another's prefix."""
    key = StateKey.of(llama, model_identity(path))
    return PromptCache(key, ram_bytes=64 << 20, flash_bytes=0, directory=None, window=Window.of(llama))


def load(path: Path, mode: str, flash: bool, **kw: Any) -> MeasuredLlama:
    settings: dict[str, Any] = {
        "n_ctx": 512,
        "n_batch": N_BATCH,
        "n_ubatch": N_BATCH,
        "swa_full": False,
        "n_threads": 2,
        "n_threads_batch": 2,
        "flash_attn": "on" if flash else "off",
        "parallel": SLOTS,
        **kw,
    }
    if mode == "streaming":
        return load_streaming_llama(path, StreamerConfig(), budget=expert_layer_bytes(path), **settings)
    return load_resident_llama(path, **settings)


def outcome_of(
    path: Path,
    mode: str,
    flash: bool,
    schedule: dict[int, list[GenerationRequest]],
    replay: list[tuple[Planned, ...]] | None = None,
) -> Any:
    llama = load(path, mode, flash)
    try:
        assert len(llama.slots) == SLOTS and llama.n_ctx_seq == 512
        plans, outcomes = run_schedule(llama, schedule, replay)
        evicted = llama.streamer.stats().evictions if llama.streamer is not None else None
    finally:
        llama.close()
    return plans, [(o.tokens, o.logprobs, o.stats.finish_reason) for o in outcomes], evicted


@pytest.mark.parametrize("preset", ["tiny-qwen3moe", "tiny-gptoss", "tiny-gemma4"])
@pytest.mark.parametrize("flash", [False, True], ids=["fa-off", "fa-on"])
def test_gate_requests_decoded_together(tiny_model: Callable[..., Path], preset: str, flash: bool) -> None:
    """Streamed under a budget that evicts, the shared steps give the resident model's tokens and
    logprobs for every sequence, the resident run replaying the streamed run's plans (the prompt
    tokens beside decodes are measured, so they differ run to run; tiny-gptoss and tiny-gemma4
    have sliding-window layers)."""
    path = tiny_model(preset)
    plans, streamed, evicted = outcome_of(path, "streaming", flash, SCHEDULE)
    resident_plans, resident, _ = outcome_of(path, "resident", flash, SCHEDULE, replay=plans)
    assert plans == resident_plans
    assert streamed == resident
    assert evicted, "the budget must evict for the gate to mean anything"
    assert all(reason == "length" and len(tokens) == 12 for tokens, _, reason in streamed)
    shared = sum(len(plan) >= 2 for plan in plans)
    assert shared * 2 >= len(plans), f"only {shared} of {len(plans)} steps held two sequences"
    # a prompt over the step's budget is prefilled in chunks beside the running decodes
    assert any(
        len(plan) >= 2 and any(p.n_tokens > 1 for p in plan) and any(p.n_tokens == 1 for p in plan)
        for plan in plans
    )
    assert all(sum(p.n_tokens for p in plan) <= N_BATCH for plan in plans)


@pytest.mark.parametrize("flash", [False, True], ids=["fa-off", "fa-on"])
def test_a_greedy_request_gives_its_alone_tokens_beside_others(
    tiny_model: Callable[..., Path], flash: bool
) -> None:
    """Batch invariance, resident: each greedy request's tokens beside others are its tokens alone
    (docs/api.md says where it holds)."""
    path = tiny_model("tiny-qwen3moe")
    _, together, _ = outcome_of(path, "resident", flash, SCHEDULE)
    for i, request in enumerate(r for step in sorted(SCHEDULE) for r in SCHEDULE[step]):
        if request.params.temperature != 0.0:
            continue
        _, alone, _ = outcome_of(path, "resident", flash, {0: [request]})
        assert alone[0][0] == together[i][0]


def test_cancelled_request_frees_its_slot_within_a_step(tiny_model: Callable[..., Path]) -> None:
    """A cancelled request ends at the next step without decoding; the others go on."""
    llama = load(tiny_model("tiny-qwen3moe"), "resident", True)
    loop = TokenLoop(llama, beside=8)
    try:
        gone = False
        kept, dropped = Outcome(), Outcome()
        loop.start(
            GenerationRequest(prompt(0, 10), GREEDY), kept.stats, kept.emit, lambda: False, kept.on_token
        )
        loop.start(GenerationRequest(prompt(1, 10), GREEDY), dropped.stats, dropped.emit, lambda: gone)
        loop.step()
        assert loop.free_slots == SLOTS - 2
        gone = True
        ended = loop.step()
        assert [seq.stats for seq in ended] == [dropped.stats] and dropped.stats.finish_reason == "cancelled"
        assert loop.free_slots == SLOTS - 1 and loop.last_plan[0].n_tokens == 1 and len(loop.last_plan) == 1
        loop.run()
        assert kept.stats.finish_reason == "length" and len(kept.tokens) == 12
    finally:
        loop.close()
        llama.close()


def test_a_shared_prefix_is_copied_from_a_running_slot(tiny_model: Callable[..., Path]) -> None:
    """Sub-agents sharing a system prompt: the second request takes the prefix from the first
    one's live KV (its state copied through the prompt cache's RAM into the second's KV stream)
    and gives the tokens it gives alone; without a prompt cache it prefills its own."""
    path = tiny_model("tiny-qwen3moe")
    system = prompt(5, 64)
    first = GenerationRequest(system + prompt(1, 8), GREEDY)
    second = GenerationRequest(system + prompt(2, 8), GREEDY)
    llama = load(path, "resident", True)
    try:
        cache = ram_cache(llama, path)
        plans, outcomes = run_schedule(llama, {0: [first], 3: [second]}, beside=8, prompt_cache=cache)
    finally:
        llama.close()
    assert outcomes[1].stats.cached_tokens == len(system)
    assert len(plans[3]) == 2 and plans[3][1].n_tokens == 8  # only its own tail is prefilled
    llama = load(path, "resident", True)
    try:
        _, alone = run_schedule(llama, {0: [second]})
        llama.clear()
        _, uncached = run_schedule(llama, {0: [first], 3: [second]}, beside=8)
    finally:
        llama.close()
    assert alone[0].tokens == outcomes[1].tokens
    assert uncached[1].stats.cached_tokens == 0 and uncached[1].tokens == alone[0].tokens


def test_requests_sent_at_once_with_one_system_prompt_prefill_it_once(
    tiny_model: Callable[..., Path],
) -> None:
    """Two requests started together sharing a system prompt: the second waits for the first's
    prefill of it and takes it from that slot (through the prompt cache's RAM); each gives its
    alone tokens."""
    path = tiny_model("tiny-qwen3moe")
    system = prompt(6, 80)
    requests = [GenerationRequest(system + prompt(i, 8), GREEDY) for i in (1, 2)]
    llama = load(path, "resident", True)
    try:
        plans, outcomes = run_schedule(llama, {0: requests}, prompt_cache=ram_cache(llama, path))
    finally:
        llama.close()
    assert [o.stats.cached_tokens for o in outcomes] == [0, len(system)]
    prefilled = sum(p.n_tokens for plan in plans for p in plan if not (p.n_tokens == 1 and p.sampled))
    assert prefilled == len(system) + 16
    for request, together in zip(requests, outcomes, strict=True):
        llama = load(path, "resident", True)
        try:
            _, alone = run_schedule(llama, {0: [request]})
        finally:
            llama.close()
        assert alone[0].tokens == together.tokens
