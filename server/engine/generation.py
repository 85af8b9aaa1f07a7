"""What a request asks of the token loop and what it gets back: the sampling settings, the
tokenized request, its text as it comes (with logprobs and the decode step behind it), and what
happened to it (server/engine/token_loop.py fills them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.loading.measured import DecodeStep, MeasuredLlama


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


def text_tokens(llama: MeasuredLlama, text: str) -> tuple[int, ...]:
    """A plain text prompt's tokens (legacy completions, `moeflash generate`): BOS first where
    the model's vocabulary asks for one; special tokens written in the text are parsed."""
    add_bos = bool(llama._model.add_bos_token()) and llama.token_bos() >= 0
    return tuple(llama.tokenize(text.encode("utf-8"), add_bos, True))
