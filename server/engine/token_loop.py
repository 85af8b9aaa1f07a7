"""The token loop: every running request decoded together, one llama_decode a step, each with
its own sampling, stop strings and logprobs; prompts prefilled in chunks inside the steps, their
cached prefix reused.

Runs on one thread only (the engine's worker, or `generate`): it drives llama_decode. The
context holds one KV sequence a slot (`--parallel`, server/loading/measured.py `Slot`); a
request decodes in one slot (`Sequence`), and `TokenLoop.step` feeds every running sequence's
next tokens in one batch (docs/api.md, "Concurrency and life cycle").
llama-cpp-python's `Llama._create_completion` is not used: it decodes one sequence, needs
logits_all=True (an n_ctx x n_vocab float matrix) for logprobs, applies logit_bias through a
Python sampler it marks as broken, cannot be cancelled during prefill and does not report how
many prompt tokens it reused. This loop uses the library's pieces instead: its batch, its sampler
chain (`_internals.LlamaSampler`: logit bias, penalties, grammar, top-k/p, min-p, temperature,
seeded dist, sampling from any row of the step's logits) and its detokenizer.
"""

from __future__ import annotations

import codecs
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from server.engine.generation import (
    GenerationRequest,
    GenerationStats,
    SamplingParams,
    TextDelta,
    TokenLogprob,
    TopLogprob,
)
from server.engine.prompt_cache import common_prefix, reuse_live, sliding_window
from server.engine.step_costs import StepCosts

if TYPE_CHECKING:
    from llama_cpp._internals import LlamaSampler

    from server.engine.prompt_cache import PromptCache
    from server.loading.measured import DecodeStep, MeasuredLlama, Slot

logger = logging.getLogger(__name__)

# penalties look back this many generated tokens (llama-cpp-python's default)
PENALTY_LAST_N = 64


class _StopFilter:
    """Holds back text that could be the start of a stop string; cuts at the first match."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""
        self.matched: str | None = None  # the stop string found (the earliest in the text)
        self._pending_lps: list[tuple[int, TokenLogprob]] = []  # (end offset in pending, lp)

    def feed(self, text: str, logprob: TokenLogprob | None) -> tuple[TextDelta, bool]:
        """Add one token's text; returns what may be shown now and whether a stop matched."""
        self._pending += text
        if logprob is not None:
            self._pending_lps.append((len(self._pending), logprob))
        hits = [(at, stop) for stop in self._stops if (at := self._pending.find(stop)) >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda hit: hit[0])
            delta = self._release(cut)
            self._pending, self._pending_lps = "", []
            return delta, True
        hold = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        return self._release(len(self._pending) - hold), False

    def flush(self) -> TextDelta:
        """Release everything held back (generation ended without a stop string)."""
        return self._release(len(self._pending))

    def _release(self, upto: int) -> TextDelta:
        text = self._pending[:upto]
        released = [lp for end, lp in self._pending_lps if end <= upto]
        self._pending = self._pending[upto:]
        self._pending_lps = [(end - upto, lp) for end, lp in self._pending_lps if end > upto]
        return TextDelta(text, released)


def _build_sampler(llama: MeasuredLlama, params: SamplingParams, seed: int) -> LlamaSampler:
    from llama_cpp._internals import LlamaSampler
    from llama_cpp.llama_grammar import LlamaGrammar

    sampler = LlamaSampler()  # type: ignore[no-untyped-call]
    n_vocab = llama.n_vocab()
    if params.logit_bias:
        sampler.add_logit_bias(n_vocab, dict(params.logit_bias))
    if params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        sampler.add_penalties(
            n_vocab,
            PENALTY_LAST_N,
            params.repeat_penalty,
            params.frequency_penalty,
            params.presence_penalty,
        )
    if params.grammar is not None and (params.grammar_trigger_tokens or params.grammar_trigger_patterns):
        sampler.add_grammar_lazy_patterns(
            llama._model,
            LlamaGrammar.from_string(params.grammar),
            list(params.grammar_trigger_patterns),
            list(params.grammar_trigger_tokens),
        )
    elif params.grammar is not None:
        sampler.add_grammar(llama._model, LlamaGrammar.from_string(params.grammar))
    if params.temperature == 0.0:
        sampler.add_greedy()  # type: ignore[no-untyped-call]
    else:
        if params.top_k > 0:
            sampler.add_top_k(params.top_k)
        if params.top_p < 1.0:
            sampler.add_top_p(params.top_p, 1)
        if params.min_p > 0.0:
            sampler.add_min_p(params.min_p, 1)
        sampler.add_temp(params.temperature)
        sampler.add_dist(seed)
    return sampler


def _token_logprob(
    llama: MeasuredLlama, row: int, token: int, piece: bytes, top_n: int, special: bool
) -> TokenLogprob:
    n_vocab = llama.n_vocab()
    logits = np.ctypeslib.as_array(llama._ctx.get_logits_ith(row), shape=(n_vocab,)).astype(np.float64)
    shifted = logits - logits.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    top: list[TopLogprob] = []
    if top_n > 0:
        best = np.argpartition(-logprobs, min(top_n, n_vocab - 1))[:top_n]
        best = best[np.argsort(-logprobs[best])]
        for tid in best.tolist():
            tpiece = llama._model.detokenize([tid], special)
            top.append(TopLogprob(tpiece.decode("utf-8", "replace"), float(logprobs[tid]), list(tpiece)))
    return TokenLogprob(piece.decode("utf-8", "replace"), float(logprobs[token]), list(piece), top)


class Sequence:
    """One request in a slot: its prompt still to prefill, then one token a step (module
    docstring). Driven by TokenLoop.step only."""

    def __init__(
        self,
        llama: MeasuredLlama,
        slot: Slot,
        request: GenerationRequest,
        stats: GenerationStats,
        emit: Callable[[TextDelta], None],
        cancelled: Callable[[], bool],
        on_token: Callable[[int, DecodeStep | None], None] | None,
        checkpoint: int | None,
    ) -> None:
        self.llama = llama
        self.slot = slot
        self.request = request
        self.stats = stats
        self.emit = emit
        self.cancelled = cancelled
        self.on_token = on_token
        self.checkpoint = checkpoint  # where a sliding-window model's prefill keeps a checkpoint
        self.started_ns = time.perf_counter_ns()
        self.prefilled_ns = 0
        self.next_token: int | None = None  # decoding: the token this step feeds
        self.timing: DecodeStep | None = None  # the step that produced the token being sampled
        self.telemetry: DecodeStep | None = None  # this request's share of every step it was in
        self.sampled: list[int] = []  # every token sampled, end-of-generation included
        self.index = 0  # the order it started in on its loop (the journal's name for it)
        self.phase: int | None = None  # the route trace's phase begun for it (MeasuredLlama.begin_phase)
        self.done = False
        params = request.params
        self.max_tokens = min(params.max_tokens, llama.n_ctx_seq - len(request.prompt_tokens))
        self._sampler: LlamaSampler | None = None
        self._stop = _StopFilter(params.stop)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def prefilling(self) -> bool:
        return len(self.slot.tokens) < len(self.request.prompt_tokens)

    def inputs(self, budget: int) -> list[int]:
        """This step's tokens: the last sampled one, or the prompt's next chunk of at most
        `budget` tokens (cut at the checkpoint)."""
        if self.next_token is not None:
            return [self.next_token]
        at, prompt = len(self.slot.tokens), self.request.prompt_tokens
        end = min(len(prompt), at + budget)
        if self.checkpoint is not None and at < self.checkpoint < end:
            end = self.checkpoint
        return list(prompt[at:end])

    def decoded(self, tokens: list[int], share: DecodeStep) -> None:
        """`tokens` entered the slot's KV in a step; `share` is this request's part of it."""
        self.slot.tokens.extend(tokens)
        self.telemetry = share if self.telemetry is None else self.telemetry + share
        self.next_token = None

    def take(self, row: int, step: DecodeStep) -> None:
        """Sample the next token from the logits of batch index `row` of the step just decoded."""
        import llama_cpp

        llama, params = self.llama, self.request.params
        if self._sampler is None:  # the prompt is in: its last row picks the first token
            self.prefilled_ns = time.perf_counter_ns()
            self.stats.prompt_ns = self.prefilled_ns - self.started_ns
            assert params.seed is not None  # TokenLoop.start drew one
            self._sampler = _build_sampler(llama, params, params.seed & 0xFFFFFFFF)
        else:
            self.timing = step
        if self.max_tokens <= 0:
            self.finish("length")
            return
        # cancellation is seen at each step's start (TokenLoop.step): a request cancelled during
        # a step samples its token of that step, and no other
        token = self._sampler.sample(llama._ctx, row)
        self.sampled.append(token)
        if self.cancelled():
            self.stats.tokens_after_cancel += 1
        if self.on_token is not None:
            self.on_token(token, self.timing)
        if not params.ignore_eos and llama_cpp.llama_vocab_is_eog(llama._model.vocab, token):
            self.finish("stop")
            return
        self.stats.completion_tokens += 1
        special = self.request.render_special
        piece = llama._model.detokenize([token], special)
        logprob = (
            _token_logprob(llama, row, token, piece, params.top_logprobs, special)
            if params.logprobs
            else None
        )
        delta, stopped = self._stop.feed(self._decoder.decode(piece), logprob)
        if delta.text or delta.logprobs:
            self.emit(replace(delta, timing=self.timing))
        if stopped:
            self.stats.stop_string = self._stop.matched
            self.finish("stop")
        elif self.stats.completion_tokens >= self.max_tokens:
            self.finish("length")
        else:
            self.next_token = token  # it enters the KV next step, so the next turn can reuse it

    def finish(self, reason: str) -> None:
        """End the request: release the held-back text, free the sampler and the slot."""
        if self.done:
            return
        self.done = True
        if reason != "cancelled" and self._sampler is not None:
            tail = self._stop.flush()
            tail = TextDelta(tail.text + self._decoder.decode(b"", final=True), tail.logprobs)
            if tail.text or tail.logprobs:
                self.emit(tail)
        if self._sampler is not None:
            self._sampler.close()  # type: ignore[no-untyped-call]
            self._sampler = None
            self.stats.decode_ns = time.perf_counter_ns() - self.prefilled_ns
        self.stats.finish_reason = reason
        self.slot.busy = False


@dataclass(frozen=True)
class Planned:
    """One sequence's part of a step: its slot, how many tokens it fed, whether the step returned
    its logits, and its request (Sequence.index): the schedule a replay repeats."""

    seq_id: int
    n_tokens: int
    sampled: bool
    index: int = 0


@dataclass(frozen=True)
class JournalEntry:
    """What the token loop did, in order, for a replay (tests/http/test_concurrency_fuzz.py): a
    request started (`request`) or seen cancelled before step `step`, the step's plan, or a
    request ended in it (its `tokens`)."""

    kind: str  # start | cancel | step | end
    step: int
    index: int  # the request's Sequence.index (-1 for a step)
    request: GenerationRequest | None = None
    tokens: tuple[int, ...] = ()
    finish: str | None = None
    plan: tuple[Planned, ...] = ()  # a step's


class TokenLoop:
    """The one token loop: every running request's next tokens in one llama_decode a step.

    Each step holds every decoding sequence's last token, then prompt chunks of the sequences
    still prefilling, in the order they started: up to `step_tokens` in all (n_batch) when none
    decodes, else `prompt_beside()` prompt tokens (chunks spaced out by steps of the decodes
    alone), so a new prompt is prefilled between the running steps and never stalls them. A
    sequence's tokens carry
    its slot's sequence id and positions; the step returns logits for each decoding token and
    for a prompt's last one, and each sequence samples its own from its row with its own sampler.

    A request starts in the free slot holding the longest prefix of its prompt (the least recently
    used one when none does): that prefix, a longer one copied from another slot's live KV, or
    one the prompt cache restores, is reused and only the rest prefilled. Runs on one thread (the
    engine's worker, or `generate`)."""

    def __init__(
        self, llama: MeasuredLlama, prompt_cache: PromptCache | None = None, *, beside: int | None = None
    ) -> None:
        from llama_cpp._internals import LlamaBatch

        self.llama = llama
        self.prompt_cache = prompt_cache
        self.step_tokens = llama.n_batch
        self.beside = beside  # prompt tokens beside decodes, fixed (tests); None: measured
        self.costs = StepCosts()  # what prompt_beside() reads
        # the last step's start (ns), decodes and prompt tokens
        self._paced: tuple[int, int, int] | None = None
        # a replay's recorded plans: step -> {request index: tokens}, followed instead of chosen
        self.replay: dict[int, dict[int, int]] | None = None
        self.running: list[Sequence] = []
        self.steps = 0  # steps decoded by this loop
        # the step's plan, for a replay (server/engine/schedule.py) and the gates
        self.last_plan: tuple[Planned, ...] = ()
        self._batch = LlamaBatch(n_tokens=self.step_tokens, embd=0, n_seq_max=1, verbose=False)
        self._clock = 0
        self.started = 0  # requests started so far
        # when a list, every start, cancellation and end is appended (a replay repeats them)
        self.journal: list[JournalEntry] | None = None

    def close(self) -> None:
        """Free the batch (idempotent); the running requests are the caller's to finish."""
        self._batch.close()  # type: ignore[no-untyped-call]

    @property
    def free_slots(self) -> int:
        return sum(not slot.busy for slot in self.llama.slots)

    def start(
        self,
        request: GenerationRequest,
        stats: GenerationStats,
        emit: Callable[[TextDelta], None],
        cancelled: Callable[[], bool],
        on_token: Callable[[int, DecodeStep | None], None] | None = None,
    ) -> Sequence:
        """Put `request` in a free slot, its cached prefix reused (the caller checked free_slots)."""
        if request.params.seed is None:  # drawn here, so that the journal holds the seed used
            request = replace(request, params=replace(request.params, seed=random.getrandbits(32)))
        tokens = request.prompt_tokens
        stats.prompt_tokens = len(tokens)
        slot = self._slot_for(tokens)
        slot.busy = True
        self._clock += 1
        slot.used = self._clock
        cache = self.prompt_cache
        try:
            if cache is not None:
                stats.cached_tokens = cache.prefix(self.llama, slot, tokens)
            else:
                stats.cached_tokens = reuse_live(self.llama, slot, tokens)
        except BaseException:
            slot.busy = False
            raise
        checkpoint = cache.checkpoint_at(stats.cached_tokens, len(tokens)) if cache is not None else None
        sequence = Sequence(self.llama, slot, request, stats, emit, cancelled, on_token, checkpoint)
        sequence.index = self.started
        self.started += 1
        if self.journal is not None:
            self.journal.append(JournalEntry("start", self.steps, sequence.index, request))
        self.running.append(sequence)
        return sequence

    def _slot_for(self, tokens: tuple[int, ...]) -> Slot:
        """The free slot to decode `tokens` in: the one holding the longest share of them, among
        equals one next to a busy slot (llama.cpp takes the streams of consecutive slots in one
        micro-batch), then the least recently used; a longer prefix live in another slot is
        copied into it first."""
        slots = self.llama.slots
        busy = {slot.seq_id for slot in slots if slot.busy}
        free = [slot for slot in slots if not slot.busy]
        near = {s.seq_id for s in free if not busy or busy & {s.seq_id - 1, s.seq_id + 1}}
        best = max(free, key=lambda s: (common_prefix(s.tokens, tokens), s.seq_id in near, -s.used))
        n_best = common_prefix(best.tokens, tokens)
        donor = max(slots, key=lambda slot: common_prefix(slot.tokens, tokens))
        n_donor = min(common_prefix(donor.tokens, tokens), len(tokens) - 1)
        if donor is not best and n_donor > n_best and self.prompt_cache is not None and self._shares():
            self.prompt_cache.keep_if_dropped(self.llama, best, 0)
            self.prompt_cache.copy_live(self.llama, donor, best, n_donor)
        return best

    def step(self) -> list[Sequence]:
        """Decode one step for every running request; returns those that ended in it (cancelled
        ones included, without decoding). Raises what llama.cpp raises: the running requests'
        KV is then unknown, and the caller ends them all (`abort`)."""
        self.last_plan = ()  # until a step decodes
        ended = [seq for seq in self.running if seq.cancelled()]
        for seq in ended:
            seq.finish("cancelled")  # a partial prompt stays in the slot: its tokens say which
            if self.journal is not None:
                self.journal.append(JournalEntry("cancel", self.steps, seq.index))
        self.running = [seq for seq in self.running if not seq.done]
        if not self.running:
            self._paced = None
            return self._ended(ended)
        started_at = time.perf_counter_ns()
        if self._paced is not None:  # the last step's decodes waited until now
            waits = any(seq.prefilling for seq in self.running)
            self.costs.pace(self._paced[1], self._paced[2], started_at - self._paced[0], waits)
        self._share_prefixes()
        parts = self._parts()
        plan = self._fill(parts)
        llama = self.llama
        # a route trace counts each request's prompt steps from its start, its decode steps after
        for seq, _ in parts:
            phase = 0 if seq.next_token is None else 1
            if phase != seq.phase:
                llama.begin_phase(phase, seq.slot.seq_id)
                seq.phase = phase
        llama._ctx.decode(self._batch)
        step = llama.steps[-1]
        decodes = sum(seq.next_token is not None for seq, _ in parts)
        prompt_tokens = sum(len(tokens) for seq, tokens in parts if seq.next_token is None)
        if self.journal is not None:
            self.journal.append(JournalEntry("step", self.steps, -1, plan=plan))
        self.steps += 1
        self.last_plan = plan
        at = 0  # the batch index after each part's last token: its logits, when it has them
        for (seq, tokens), planned in zip(parts, plan, strict=True):
            at += len(tokens)
            seq.decoded(tokens, step.share(len(tokens), seq.slot.seq_id))
            if seq.checkpoint is not None and len(seq.slot.tokens) == seq.checkpoint and self.prompt_cache:
                self.prompt_cache.checkpoint(llama, seq.slot)
            if planned.sampled:
                seq.take(at - 1, step)
        self.costs.learn(decodes, prompt_tokens, step.wall_ns)
        self._paced = (started_at, decodes, prompt_tokens)
        ended += [seq for seq in self.running if seq.done]
        self.running = [seq for seq in self.running if not seq.done]
        return self._ended(ended)

    def _ended(self, ended: list[Sequence]) -> list[Sequence]:
        if self.journal is not None:
            for seq in ended:
                entry = JournalEntry("end", self.steps, seq.index, tokens=tuple(seq.sampled))
                self.journal.append(replace(entry, finish=seq.stats.finish_reason))
        return ended

    def _parts(self) -> list[tuple[Sequence, list[int]]]:
        """This step's tokens per running sequence: decoding ones first, then prompt chunks in the
        order the requests started, up to n_batch in all, or beside decodes `prompt_beside()`
        prompt tokens; in a replay, the recorded plan's."""
        recorded = self.replay.get(self.steps) if self.replay is not None else None
        decoding = sum(seq.next_token is not None for seq in self.running)
        budget = (
            self.step_tokens
            if decoding == 0
            else min(self.step_tokens, decoding + self.prompt_beside(decoding))
        )
        parts: list[tuple[Sequence, list[int]]] = []
        for seq in sorted(self.running, key=lambda seq: seq.next_token is None):
            if recorded is not None:
                tokens = seq.inputs(recorded[seq.index]) if seq.index in recorded else []
            elif budget <= 0 or self._follows(seq):
                continue
            else:
                tokens = seq.inputs(budget)
            if tokens:
                parts.append((seq, tokens))
                budget -= len(tokens)
        # in slot order: llama.cpp takes the KV streams of consecutive slots in one micro-batch
        return sorted(parts, key=lambda part: part[0].slot.seq_id)

    def prompt_beside(self, decoding: int) -> int:
        """Prompt tokens a step takes beside `decoding` running decodes (server/engine/step_costs.py)."""
        return (
            self.beside if self.beside is not None else self.costs.prompt_beside(decoding, self.step_tokens)
        )

    def _shares(self) -> bool:
        """Whether a slot's prefix can be copied into another: through the prompt cache's RAM (in
        the budget), not with a sliding window (early cells may be gone from the ring)."""
        return self.prompt_cache is not None and not sliding_window(self.llama)

    def _share_prefixes(self) -> None:
        """A prefilling request whose prompt another running request's slot holds further takes
        that prefix from it (requests sent at once with one system prompt prefill it once)."""
        if len(self.running) < 2 or not self._shares():
            return
        for seq in self.running:
            if not seq.prefilling:
                continue
            prompt, have = seq.request.prompt_tokens, len(seq.slot.tokens)
            for other in self.running:
                n = min(common_prefix(other.slot.tokens, prompt), len(prompt) - 1)
                # once the other holds all it will share: a copy copies its whole state
                shared = min(common_prefix(other.request.prompt_tokens, prompt), len(prompt) - 1)
                if other is not seq and n > have and (n >= shared or not other.prefilling):
                    assert self.prompt_cache is not None  # _shares()
                    copied = self.prompt_cache.copy_live(self.llama, other.slot, seq.slot, n)
                    seq.stats.cached_tokens += copied - have
                    have = copied

    def _follows(self, seq: Sequence) -> bool:
        """Whether `seq` waits this step for an earlier request still prefilling the same prompt
        tokens it needs next: it takes them from that one's slot once they are in."""
        if not seq.prefilling or not self._shares():
            return False
        prompt, have = seq.request.prompt_tokens, len(seq.slot.tokens)
        for other in self.running:
            if other is seq:
                return False  # only an earlier request leads
            if (
                other.prefilling
                and min(common_prefix(other.request.prompt_tokens, prompt), len(prompt) - 1) > have
            ):
                return True
        return False

    def _fill(self, parts: list[tuple[Sequence, list[int]]]) -> tuple[Planned, ...]:
        batch = self._batch.batch
        n = 0
        plan: list[Planned] = []
        for seq, tokens in parts:
            pos = len(seq.slot.tokens)
            sampled = seq.next_token is not None or pos + len(tokens) == len(seq.request.prompt_tokens)
            for i, token in enumerate(tokens):
                batch.token[n] = token
                batch.pos[n] = pos + i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq.slot.seq_id
                batch.logits[n] = sampled and i == len(tokens) - 1
                n += 1
            plan.append(Planned(seq.slot.seq_id, len(tokens), sampled, seq.index))
        batch.n_tokens = n
        return tuple(plan)

    def abort(self, error: BaseException) -> list[Sequence]:
        """After a failed step: end every running request (their slots emptied, the context's KV
        cleared) and return them; the caller reports `error` to each."""
        ended = self.running
        self.running = []
        for seq in ended:
            seq.finish("error")
        self.llama.clear()
        logger.warning("a decode step failed; %d request(s) ended: %s", len(ended), error)
        return ended

    def run(self) -> None:
        """Step until every running request has ended."""
        while self.running:
            self.step()


def generate(
    llama: MeasuredLlama,
    request: GenerationRequest,
    stats: GenerationStats,
    emit: Callable[[TextDelta], None],
    cancelled: Callable[[], bool],
    on_token: Callable[[int, DecodeStep | None], None] | None = None,
    prompt_cache: PromptCache | None = None,
) -> None:
    """Decode one request on `llama` alone, calling `emit` for each visible piece of text
    (`moeflash generate`, the gates): the token loop with one sequence.

    Returns when a stop condition is met or `cancelled()` turns true (checked before each step);
    fills `stats`. `on_token(token, step)`, if given, sees every sampled token with the decode
    step that produced it (None for the first: the prompt), end-of-generation tokens included.
    Raises what llama.cpp raises (the context's KV cleared)."""
    loop = TokenLoop(llama, prompt_cache)
    try:
        loop.start(request, stats, emit, cancelled, on_token)
        try:
            loop.run()
        except Exception as exc:
            loop.abort(exc)
            raise
    finally:
        loop.close()
