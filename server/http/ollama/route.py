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
loaded once idle after the request (server/http/residency.py). `name:latest` names the model
`name`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Protocol

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server.engine.token_loop import GenerationRequest
from server.errors import InvalidRequest
from server.http.completions import TextOutput
from server.http.errors import describe
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
from server.http.serving import (
    Pieces,
    Plan,
    ServeContext,
    check_model,
    check_prompt,
    clamp_max_tokens,
    collect,
    prepare_chat,
    prompt_tokens,
    streamed,
    submit,
)
from server.settings import parse_duration

NDJSON = "application/x-ndjson"
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


def ndjson(payload: dict[str, object]) -> bytes:
    return (json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


async def _stream(
    ctx: ServeContext, plan: Plan, lines: _Lines, collected: Collected, started_ns: int, top: bool
) -> AsyncIterator[bytes]:
    want_logprobs = plan.job.request.params.logprobs
    try:
        # nothing sets the event: the job ends with the stream (its reader gone, or shutdown)
        async for item in streamed(ctx, plan, anyio.Event()):
            if isinstance(item, Pieces):
                collected.feed(item.pieces)
                text, thinking = collected.take_text()
                lps = logprobs_out(item.logprobs, top) if want_logprobs and item.logprobs else None
                if text or thinking or lps:
                    yield ndjson(lines(text, thinking, None, lps, None).to_json())
                continue
            calls = collected.tool_calls()
            if calls:
                yield ndjson(lines("", "", calls, None, None).to_json())
            yield ndjson(lines("", "", None, None, durations(item.stats, started_ns)).to_json())
    except Exception as exc:  # noqa: BLE001 - after the 200, the worker's failure or the server stopping is a line
        _, body, _ = describe(exc, ctx.engine.queue_full_status, ollama=True)
        yield ndjson(body)


async def _answer(
    ctx: ServeContext,
    plan: Plan,
    request: Request,
    lines: _Lines,
    *,
    stream: bool,
    think: bool,
    started_ns: int,
) -> Response:
    top = plan.job.request.params.top_logprobs > 0
    collected = Collected(keep_thinking=think)
    if stream:
        return StreamingResponse(_stream(ctx, plan, lines, collected, started_ns, top), media_type=NDJSON)
    pieces, logprobs, finished = await collect(ctx, plan, request)
    collected.feed(pieces)
    text, thinking = collected.take_text()
    lps = logprobs_out(logprobs, top) if plan.job.request.params.logprobs else None
    last = durations(finished.stats, started_ns)
    return JSONResponse(lines(text, thinking, collected.tool_calls(), lps, last).to_json())


def _loaded(lines: _Lines, reason: str) -> Response:
    return JSONResponse(lines("", "", None, None, Durations(done_reason=reason)).to_json())


async def chat(ctx: ServeContext, body: ChatRequest, request: Request) -> Response:
    """POST /api/chat."""
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
    think = body.think is not False
    return await _answer(ctx, plan, request, lines, stream=body.stream, think=think, started_ns=started_ns)


async def generate(ctx: ServeContext, body: GenerateRequest, request: Request) -> Response:
    """POST /api/generate."""
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
    think = body.think is not False
    return await _answer(ctx, plan, request, lines, stream=body.stream, think=think, started_ns=started_ns)
