"""The token loop: prompt prefill with KV-cache prefix reuse, sampling, stop strings, logprobs.

Runs on the engine's worker thread only (it drives llama_decode). llama-cpp-python's own
`Llama._create_completion` is not used because it needs logits_all=True (an n_ctx x n_vocab
float matrix) for logprobs, applies logit_bias through a Python sampler it marks as broken,
cannot be cancelled during prefill and does not report how many prompt tokens it reused.
This loop uses the library's pieces instead: `Llama.eval`, its sampler chain
(`_internals.LlamaSampler`: logit bias, penalties, grammar, top-k/p, min-p, temperature,
seeded dist) and its detokenizer.
"""

from __future__ import annotations

import codecs
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from server.loading.prompt_cache import reuse_live

if TYPE_CHECKING:
    from llama_cpp._internals import LlamaSampler

    from server.loading.measured import DecodeStep, MeasuredLlama
    from server.loading.prompt_cache import PromptCache

logger = logging.getLogger(__name__)

# penalties look back this many generated tokens (llama-cpp-python's default)
PENALTY_LAST_N = 64


@dataclass(frozen=True)
class SamplingParams:
    """Everything that decides which token comes next, plus when to stop."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None  # GBNF, already checked to compile
    # lazy grammar: free text until one of these tokens / patterns, then the grammar applies
    grammar_trigger_tokens: tuple[int, ...] = ()
    grammar_trigger_patterns: tuple[str, ...] = ()
    # keep going past end-of-generation tokens (benchmarks: a fixed number of tokens)
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """A tokenized prompt and how to continue it."""

    prompt_tokens: tuple[int, ...]
    params: SamplingParams
    # render control tokens as text: the harmony parser needs <|channel|> and friends
    render_special: bool = False


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


@dataclass(frozen=True)
class TextDelta:
    """New visible text (stop strings already cut), the logprobs of its tokens and the decode step
    that produced its last token (None for the first token: its step is the prompt)."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    timing: DecodeStep | None = None


@dataclass
class GenerationStats:
    """What happened to one request, filled in by the worker."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None  # stop | length | cancelled
    stop_string: str | None = None  # the request's stop string that ended generation, if one did
    prompt_ns: int = 0
    decode_ns: int = 0
    # tokens sampled after the request was marked cancelled (the contract: at most one)
    tokens_after_cancel: int = 0


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


def text_tokens(llama: MeasuredLlama, text: str) -> tuple[int, ...]:
    """A plain text prompt's tokens (legacy completions, `moeflash generate`): BOS first where
    the model's vocabulary asks for one; special tokens written in the text are parsed."""
    add_bos = bool(llama._model.add_bos_token()) and llama.token_bos() >= 0
    return tuple(llama.tokenize(text.encode("utf-8"), add_bos, True))


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


def _token_logprob(llama: MeasuredLlama, token: int, piece: bytes, top_n: int, special: bool) -> TokenLogprob:
    n_vocab = llama.n_vocab()
    logits = np.ctypeslib.as_array(llama._ctx.get_logits_ith(-1), shape=(n_vocab,)).astype(np.float64)
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


def generate(
    llama: MeasuredLlama,
    request: GenerationRequest,
    stats: GenerationStats,
    emit: Callable[[TextDelta], None],
    cancelled: Callable[[], bool],
    on_token: Callable[[int, DecodeStep | None], None] | None = None,
    prompt_cache: PromptCache | None = None,
) -> None:
    """Decode `request` on `llama`, calling `emit` for each visible piece of text.

    The prompt's longest prefix already in the KV cache, or kept by `prompt_cache`, is reused or
    restored and only the rest is prefilled, in micro-batches of n_batch from where it starts (and
    from a sliding-window model's checkpoint, server/loading/prompt_cache.py).

    Returns when a stop condition is met or `cancelled()` turns true (checked before each
    token and between prefill batches); fills `stats`. `on_token(token, step)`, if given, sees
    every sampled token with the decode step that produced it (None for the first: the prompt),
    end-of-generation tokens included. Raises what llama.cpp raises.
    """
    import llama_cpp

    params = request.params
    tokens = request.prompt_tokens
    stats.prompt_tokens = len(tokens)
    start = time.perf_counter_ns()
    if prompt_cache is not None:
        stats.cached_tokens = prompt_cache.prefix(llama, tokens)
    else:
        stats.cached_tokens = reuse_live(llama, tokens)
    # a sliding-window model's prefill stops once where the cache keeps a checkpoint
    stop = prompt_cache.checkpoint_at(stats.cached_tokens, len(tokens)) if prompt_cache else None
    spans = (
        [(stats.cached_tokens, stop), (stop, len(tokens))] if stop else [(stats.cached_tokens, len(tokens))]
    )
    llama.begin_phase(0)
    for lo, hi in spans:
        for i in range(lo, hi, llama.n_batch):
            if cancelled():
                stats.finish_reason = "cancelled"
                # the KV cache holds a partial prompt: _input_ids says which, so it stays reusable
                return
            llama.eval(list(tokens[i : min(hi, i + llama.n_batch)]))
        if prompt_cache is not None and hi == stop:
            prompt_cache.checkpoint(llama)
    prefilled = time.perf_counter_ns()
    stats.prompt_ns = prefilled - start
    llama.begin_phase(1)

    seed = params.seed if params.seed is not None else random.getrandbits(32)
    sampler = _build_sampler(llama, params, seed & 0xFFFFFFFF)
    stop_filter = _StopFilter(params.stop)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    vocab = llama._model.vocab
    max_tokens = min(params.max_tokens, llama.n_ctx() - len(tokens))
    finish = "length"
    timing: DecodeStep | None = None  # of the step that produced the token being sampled
    try:
        while stats.completion_tokens < max_tokens:
            if cancelled():
                finish = "cancelled"
                break
            token = sampler.sample(llama._ctx, -1)
            if cancelled():
                stats.tokens_after_cancel += 1
            if on_token is not None:
                on_token(token, timing)
            if not params.ignore_eos and llama_cpp.llama_vocab_is_eog(vocab, token):
                finish = "stop"
                break
            stats.completion_tokens += 1
            piece = llama._model.detokenize([token], request.render_special)
            logprob = (
                _token_logprob(llama, token, piece, params.top_logprobs, request.render_special)
                if params.logprobs
                else None
            )
            delta, stopped = stop_filter.feed(decoder.decode(piece), logprob)
            if delta.text or delta.logprobs:
                emit(replace(delta, timing=timing))
            if stopped:
                finish = "stop"
                stats.stop_string = stop_filter.matched
                break
            if stats.completion_tokens >= max_tokens:
                break
            # the sampled token enters the KV cache so the next turn can reuse it
            llama.eval([token])
            timing = llama.steps[-1]
        # after a stop-string match nothing is pending; otherwise release the held-back text
        tail = stop_filter.flush()
        tail = TextDelta(tail.text + decoder.decode(b"", final=True), tail.logprobs)
        if tail.text or tail.logprobs:
            emit(tail)
    finally:
        sampler.close()  # type: ignore[no-untyped-call]
        stats.decode_ns = time.perf_counter_ns() - prefilled
        stats.finish_reason = finish
