"""The /api/chat and /api/generate handlers, on the chat path, and what they share with the model
routes (models.py): the names a request may use and the NDJSON framing.

They map their request (mapping.py) onto `prepare_chat`, so everything that can refuse them does
so before the 200, as on the other routes; a raw /api/generate is a prompt used as it is, as
/v1/completions uses it. They answer whole (stream: false) or as NDJSON, one JSON object a line,
the last with done: true and the durations. A stream ends when its reader leaves (the job is
cancelled with it); an error after the 200 is one {"error": ...} line. A request with no
messages (or an empty prompt) loads the model as Ollama does (with --models-dir, switching to
it) and is answered with done_reason "load"; with keep_alive 0 it releases the model instead
("unload"). keep_alive (seconds or a Go duration; negative: never) is how long the model stays
loaded once idle after the request (server/lifecycle/residency.py). `name:latest` names the model
`name`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Annotated, Any, Protocol

from fastapi import Body
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.engine.generation import GenerationRequest, TokenLogprob
from server.engine.tool_calls import OutPiece
from server.engine.worker import Finished
from server.errors import InvalidRequest
from server.http.job_events import Pieces
from server.http.ollama.mapping import (
    chat_request,
    check_generate,
    generate_request,
    sampling,
)
from server.http.ollama.output import Collected, created_at, durations, logprobs_out
from server.http.ollama.protocol import (
    ChatLine,
    ChatRequest,
    Durations,
    GenerateLine,
    GenerateRequest,
    KeepAlive,
    LogprobOut,
    MessageOut,
    Out,
    ToolCallOut,
)
from server.http.openai.completions import TextOutput
from server.http.serving import (
    Ctx,
    Frame,
    Plan,
    ServeContext,
    check_model,
    check_prompt,
    clamp_max_tokens,
    prepare_chat,
    prompt_tokens,
    respond,
    submit,
)
from server.units import parse_duration

LATEST = ":latest"


def served_name(ctx: ServeContext, requested: str) -> str:
    """The served name `requested` means (`name:latest` is `name`); NotFound if none (with
    --alias '*', any name is the served model's)."""
    names = ctx.served_names()
    base = requested.removesuffix(LATEST)
    if requested not in names and base in names:
        return base
    if ctx.switch is not None:
        return ctx.switch.resolve(requested).name
    check_model(ctx.model_info(), requested)
    return requested


def keep_alive_seconds(keep_alive: KeepAlive | None) -> float | None:
    """The request's keep_alive in seconds (negative: never), None if it sends none (the server's
    --keep-alive applies)."""
    return None if keep_alive is None else parse_duration(keep_alive)


def _warn(ctx: ServeContext, body: ChatRequest | GenerateRequest) -> None:
    ctx.warn_unknown(body.model_extra)
    if body.options is not None:
        ctx.warn_unknown({f"options.{k}": v for k, v in (body.options.model_extra or {}).items()})


class _Lines(Protocol):
    """How chat and generate write one line of their answer; `last` set on the done line."""

    def __call__(
        self,
        text: str,
        thinking: str,
        calls: list[ToolCallOut] | None,
        logprobs: list[LogprobOut] | None,
        last: Durations | None,
    ) -> Out: ...


def _chat_lines(model: str) -> _Lines:
    def line(
        text: str,
        thinking: str,
        calls: list[ToolCallOut] | None,
        logprobs: list[LogprobOut] | None,
        last: Durations | None,
    ) -> Out:
        message = MessageOut(content=text, thinking=thinking or None, tool_calls=calls or None)
        done = last.model_dump(exclude_none=True) if last is not None else {}
        return ChatLine(
            model=model,
            created_at=created_at(),
            message=message,
            done=last is not None,
            logprobs=logprobs,
            **done,
        )

    return line


def _generate_lines(model: str) -> _Lines:
    def line(
        text: str,
        thinking: str,
        calls: list[ToolCallOut] | None,
        logprobs: list[LogprobOut] | None,
        last: Durations | None,
    ) -> Out:
        done = last.model_dump(exclude_none=True) if last is not None else {}
        return GenerateLine(
            model=model,
            created_at=created_at(),
            response=text,
            thinking=thinking or None,
            done=last is not None,
            logprobs=logprobs,
            **done,
        )

    return line


class OllamaLines:
    """An Ollama answer (an EventFormat): NDJSON lines of text and thinking as they come, the
    tool calls in one line once the job ends, then the done line with its durations; an error
    after the 200 is one {"error": ...} line. Whole: one object with all of it."""

    ndjson = True

    def __init__(self, plan: Plan, lines: _Lines, think: bool, started_ns: int) -> None:
        self._plan = plan
        self._lines = lines
        self._collected = Collected(keep_thinking=think)
        self._started_ns = started_ns
        self._top = plan.job.request.params.top_logprobs > 0
        self._logprobs = plan.job.request.params.logprobs

    def opening(self) -> list[Frame]:
        return []

    def pieces(self, item: Pieces) -> list[Frame]:
        self._collected.feed(item.pieces)
        text, thinking = self._collected.take_text()
        lps = logprobs_out(item.logprobs, self._top) if self._logprobs and item.logprobs else None
        return (
            [(None, self._lines(text, thinking, None, lps, None).to_json())]
            if text or thinking or lps
            else []
        )

    def closing(self, finished: Finished) -> list[Frame]:
        calls = self._collected.tool_calls()
        frames: list[Frame] = [(None, self._lines("", "", calls, None, None).to_json())] if calls else []
        last = durations(finished.stats, self._started_ns)
        return [*frames, (None, self._lines("", "", None, None, last).to_json())]

    def failure(self, error: dict[str, object]) -> list[Frame]:
        return [(None, error)]

    def whole(
        self, pieces: list[OutPiece], logprobs: list[TokenLogprob], finished: Finished
    ) -> dict[str, Any]:
        self._collected.feed(pieces)
        text, thinking = self._collected.take_text()
        lps = logprobs_out(logprobs, self._top) if self._logprobs else None
        last = durations(finished.stats, self._started_ns)
        return self._lines(text, thinking, self._collected.tool_calls(), lps, last).to_json()


def _loaded(lines: _Lines, reason: str) -> Response:
    return JSONResponse(lines("", "", None, None, Durations(done_reason=reason)).to_json())


async def chat(body: Annotated[ChatRequest, Body()], request: Request, ctx: Ctx) -> Response:
    """Ollama chat, whole or streamed (NDJSON)."""
    started_ns = time.monotonic_ns()
    _warn(ctx, body)
    name = served_name(ctx, body.model)
    lines = _chat_lines(body.model)
    keep_alive = keep_alive_seconds(body.keep_alive)
    if not body.messages and keep_alive == 0:  # Ollama's "unload now"
        await ctx.unload(name)
        return _loaded(lines, "unload")
    async with ctx.using(name, keep_alive) as model:  # an empty request loads the model, as Ollama's does
        if not body.messages:
            return _loaded(lines, "load")
        chat = chat_request(body, ctx.settings.max_completion_tokens)
        plan = await prepare_chat(ctx, model, chat, model_id=name)
    events = OllamaLines(plan, lines, body.think is not False, started_ns)
    return await respond(ctx, plan, events, request, body.stream)


async def generate(body: Annotated[GenerateRequest, Body()], request: Request, ctx: Ctx) -> Response:
    """Ollama generate (templated, or raw), whole or streamed (NDJSON)."""
    started_ns = time.monotonic_ns()
    _warn(ctx, body)
    name = served_name(ctx, body.model)
    check_generate(body)
    if body.raw and body.format:
        raise InvalidRequest(
            "format needs the chat template: a raw prompt is not constrained", param="format"
        )
    lines = _generate_lines(body.model)
    cap = ctx.settings.max_completion_tokens
    keep_alive = keep_alive_seconds(body.keep_alive)
    if not body.prompt and keep_alive == 0:  # Ollama's "unload now"
        await ctx.unload(name)
        return _loaded(lines, "unload")
    async with ctx.using(name, keep_alive) as model:  # an empty prompt loads the model, as Ollama's does
        if not body.prompt:
            return _loaded(lines, "load")
        if not body.raw:
            plan = await prepare_chat(ctx, model, generate_request(body, cap), model_id=name)
        else:
            tokens = await prompt_tokens(model, body.prompt)
            check_prompt(ctx, model, len(tokens), "prompt")
            params = sampling(body.options, cap, body.logprobs, body.top_logprobs)
            params = replace(params, max_tokens=clamp_max_tokens(ctx, model, params.max_tokens, len(tokens)))
            request_ = GenerationRequest(tokens, params)
            plan = submit(
                ctx, model, "cmpl-", request_, TextOutput(), model_id=name, timings=False, include_usage=False
            )
    events = OllamaLines(plan, lines, body.think is not False, started_ns)
    return await respond(ctx, plan, events, request, body.stream)
