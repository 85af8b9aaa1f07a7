"""Chat and legacy completions: protocol request -> engine job -> response or SSE stream.

Everything that can refuse a request (model id, n, bounds that depend on the model,
template, grammar, context length, queue) runs BEFORE the 200 is sent; once streaming,
a failure is reported in-band as `data: {"error": ...}`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
from sse_starlette import ServerSentEvent
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.chat_template import ChatTemplate
from server.decode import GenerationRequest, GenerationStats, TextDelta, TokenLogprob, TokenTiming
from server.engine import Engine, Failed, Finished, Job
from server.errors import ContextLengthExceeded, InvalidRequest, NotFound, ServiceUnavailable
from server.http_errors import describe
from server.metrics import Metrics
from server.model_loader import LoadedModel, StreamerTelemetry
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    media_parts,
)
from server.reasoning import PlainSplitter, make_splitter
from server.settings import ServerSettings
from server.sse import DONE, event, sse_response
from server.tools import (
    ChatOutput,
    OutPiece,
    ToolCallArgs,
    ToolCallStart,
    auto_tool_grammar,
    call_syntax,
    check_grammar,
    json_object_grammar,
    schema_grammar,
    tool_grammar,
)

logger = logging.getLogger(__name__)

TIMINGS_HEADER = "x-moeflash-timings"
# what a request still connected when its job was cancelled gets: only shutdown does that
_SHUTDOWN = ServiceUnavailable("the server is shutting down", retry_after_s=5, code="shutting_down")


@dataclass
class ServeContext:
    """Per-app state shared by the routes (lives on app.state, never in a module global)."""

    settings: ServerSettings
    engine: Engine
    metrics: Metrics
    warned_fields: set[str] = field(default_factory=set)
    _template: ChatTemplate | None = None

    def ready_model(self) -> LoadedModel:
        model = self.engine.model
        if model is None:
            error = self.engine.load_error
            if error is not None:
                raise ServiceUnavailable(
                    f"the model failed to load: {error}", retry_after_s=60, code="model_failed"
                )
            raise ServiceUnavailable(
                "the model is still loading", retry_after_s=self.settings.retry_after_s, code="model_loading"
            )
        return model

    def template(self, model: LoadedModel) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate(model.llama, model.info.chat_template)
        return self._template

    def warn_unknown(self, extra: dict[str, Any] | None) -> None:
        for name in extra or {}:
            if name not in self.warned_fields:
                self.warned_fields.add(name)
                logger.warning("ignoring unknown request field %r (logged once)", name)


def _check_model(ctx: ServeContext, model: LoadedModel, requested: str) -> None:
    if requested not in model.info.names:
        served = ", ".join(repr(name) for name in model.info.names)
        raise NotFound(
            f"the model {requested!r} does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )


def _max_tokens(ctx: ServeContext, model: LoadedModel, requested: int | None, n_prompt: int) -> int:
    """The tokens to generate: what was asked, clamped to the server's cap and to the context left
    (as llama-server does: clients that send large defaults work, finish_reason says "length")."""
    cap = ctx.settings.max_completion_tokens
    room = model.info.n_ctx - n_prompt
    return min(requested or cap, cap, room)


def _check_prompt(ctx: ServeContext, model: LoadedModel, n_prompt: int, what: str) -> None:
    """A prompt that leaves no room for a token is refused in OpenAI's words, which client
    libraries (litellm, LangChain) recognise as a context-window error; `what`: "messages" or
    "prompt"."""
    n_ctx = model.info.n_ctx
    cap = ctx.settings.max_prompt_tokens
    if cap is not None and n_prompt > cap:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {cap} tokens (the server's prompt cap). However, "
            f"your {what} resulted in {n_prompt} tokens. Please reduce the length of the {what}."
        )
    if n_prompt >= n_ctx:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {n_ctx} tokens. However, your {what} resulted in "
            f"{n_prompt} tokens. Please reduce the length of the {what}."
        )


def _logit_bias(model: LoadedModel, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out: list[tuple[int, float]] = []
    for key, value in (bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < model.info.n_vocab:
            raise InvalidRequest(
                f"logit_bias key {key!r} is not a token id of this model", param="logit_bias"
            )
        out.append((int(key), value))
    return tuple(out)


def _want_timings(flag: bool | None, request: Request) -> bool:
    return bool(flag) or request.headers.get(TIMINGS_HEADER, "").lower() in ("1", "true", "yes")


def usage_of(stats: GenerationStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def timings_of(stats: GenerationStats, telemetry: StreamerTelemetry | None) -> dict[str, Any]:
    decode_s = stats.decode_ns / 1e9
    lookups = (telemetry.cache_hits + telemetry.cache_misses) if telemetry else 0
    return {
        "prompt_ms": stats.prompt_ns / 1e6,
        "decode_ms": stats.decode_ns / 1e6,
        "tok_per_s": stats.completion_tokens / decode_s if decode_s > 0 and stats.completion_tokens else None,
        "flash_wait_ms": telemetry.flash_wait_ns / 1e6 if telemetry else None,
        "compute_ms": telemetry.compute_ns / 1e6 if telemetry else None,
        "cache_ms": telemetry.cache_ns / 1e6 if telemetry else None,
        "hit_rate": telemetry.cache_hits / lookups if telemetry and lookups else None,
        "bytes_read": telemetry.bytes_read if telemetry else None,
    }


def token_timings(t: TokenTiming) -> dict[str, Any]:
    """The timings of one streamed token's decode step, in the shape of the final timings (no
    prompt_ms: the prompt is the first token's step), plus prefetch_hits (routed experts that a
    read-ahead had brought in) and expert_memory_bytes (the expert cache's memory in use)."""
    lookups = (t.hits or 0) + (t.misses or 0)
    return {
        "prompt_ms": None,
        "decode_ms": t.wall_ns / 1e6,
        "tok_per_s": 1e9 / t.wall_ns if t.wall_ns > 0 else None,
        "flash_wait_ms": t.flash_wait_ns / 1e6 if t.flash_wait_ns is not None else None,
        "compute_ms": t.compute_ns / 1e6 if t.compute_ns is not None else None,
        "cache_ms": t.cache_ns / 1e6 if t.cache_ns is not None else None,
        "hit_rate": (t.hits or 0) / lookups if lookups else None,
        "bytes_read": t.bytes_read,
        "prefetch_hits": t.prefetch_hits,
        "expert_memory_bytes": t.memory_bytes,
    }


def _chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": lp.bytes,
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in lp.top_logprobs
                ],
            }
            for lp in lps
        ],
        "refusal": None,
    }


async def _watch_disconnect(request: Request, job: Job) -> None:
    # after the body is read, receive() only returns when the client goes away
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def _collect(
    ctx: ServeContext, request: Request, job: Job, on_text: Callable[[TextDelta], None]
) -> Finished:
    """Run a non-streamed job to its end (cancelled if the client leaves); its Finished event.

    Failures are raised; a job cancelled while the client is still connected means the server
    is stopping. Metrics observe every finished job.
    """
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        async for ev in job.events():
            if isinstance(ev, TextDelta):
                on_text(ev)
            elif isinstance(ev, Failed):
                raise ev.error
            else:
                finished = ev
    finally:
        watcher.cancel()
        job.cancel()
    if finished.stats.finish_reason == "cancelled":
        # the client is still here (else nobody reads this): the server is stopping
        raise _SHUTDOWN
    ctx.metrics.observe(finished.stats)
    return finished


# ---------------------------------------------------------------------- chat


@dataclass
class ChatPlan:
    """A submitted chat job and how to present its output."""

    job: Job
    output: ChatOutput
    created: int
    model_id: str
    fingerprint: str
    timings: bool
    include_usage: bool


async def create_chat_completion(
    ctx: ServeContext, body: ChatCompletionRequest, request: Request
) -> Response:
    """POST /v1/chat/completions."""
    ctx.warn_unknown(body.model_extra)
    plan = await prepare_chat(ctx, body, request)
    if body.stream:
        shutdown = anyio.Event()
        return sse_response(_chat_stream(ctx, plan, shutdown), ctx.settings.keepalive_s, shutdown)
    return await _chat_whole(ctx, plan, request)


async def prepare_chat(ctx: ServeContext, body: ChatCompletionRequest, request: Request) -> ChatPlan:
    """Check a chat request against the model, render and tokenize it, submit its job: everything
    that can refuse it, before any response starts. The Responses and Messages APIs map their
    requests onto this one."""
    model = ctx.ready_model()
    _check_model(ctx, model, body.model)
    if body.n is not None and body.n > 1:
        raise InvalidRequest("n > 1 is not supported: this server generates one choice", param="n")
    for param, kind in media_parts(body.messages):
        raise InvalidRequest(
            f"this model takes text only: the content part at {param} is {kind!r}; send text parts "
            "(type 'text') or a string",
            param=param,
            code="unsupported_content",
        )
    if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    template = ctx.template(model)
    settings = ctx.settings

    tools = body.tools if body.tool_choice != "none" else None
    parallel = body.parallel_tool_calls is not False
    grammar, forced_name = tool_grammar(
        body.tools or [], body.tool_choice, parallel, settings.max_json_schema_bytes
    )
    mode = "named" if forced_name else "required" if grammar else "text"
    if grammar is None and isinstance(body.response_format, ResponseFormatJsonSchema):
        schema = body.response_format.json_schema.json_schema or {"type": "object"}
        grammar = schema_grammar(schema, settings.max_json_schema_bytes, "response_format")
    elif grammar is None and isinstance(body.response_format, ResponseFormatJsonObject):
        grammar = json_object_grammar()
    lazy = None
    if grammar is None and tools and template.style != "harmony":
        # tool_choice auto: text until the model opens a call, then only valid calls
        lazy = auto_tool_grammar(
            model.llama, template.source, tools, parallel, settings.max_json_schema_bytes
        )
        grammar = lazy.grammar if lazy is not None else None
    tool_choice = (
        body.tool_choice if isinstance(body.tool_choice, str) else "required" if body.tool_choice else None
    )

    extra = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        extra["reasoning_effort"] = body.reasoning_effort  # gpt-oss templates read it
    prompt = await run_in_threadpool(template.render, list(body.messages), body.tools, tool_choice, extra)
    tokens = await run_in_threadpool(template.tokenize, prompt)
    _check_prompt(ctx, model, len(tokens), "messages")
    if grammar is not None:
        await run_in_threadpool(
            check_grammar,
            model.llama,
            grammar,
            settings.max_grammar_compile_ms,
            "tools" if mode != "text" or lazy is not None else "response_format",
        )

    params = body.to_sampling_params(
        max_tokens=_max_tokens(ctx, model, body.max_completion_tokens or body.max_tokens, len(tokens)),
        logit_bias=_logit_bias(model, body.logit_bias),
        grammar=grammar,
    )
    if lazy is not None:
        params = replace(
            params, grammar_trigger_tokens=lazy.trigger_tokens, grammar_trigger_patterns=lazy.trigger_patterns
        )
    # a (non-lazy) grammar constrains the whole output, so no reasoning markup can appear in it
    whole_output_constrained = grammar is not None and lazy is None
    splitter = PlainSplitter() if whole_output_constrained else make_splitter(template.style, prompt)
    output = ChatOutput(
        splitter,
        mode=mode,
        forced_name=forced_name,
        parse_tools=bool(tools) and template.style != "harmony",
        syntax=call_syntax(template.style),
        parallel=parallel,
    )
    job = ctx.engine.submit(
        "chatcmpl-" + secrets.token_hex(12),
        GenerationRequest(tokens, params, render_special=template.style == "harmony"),
    )
    return ChatPlan(
        job=job,
        output=output,
        created=int(time.time()),
        model_id=body.model,
        fingerprint=model.info.fingerprint,
        timings=_want_timings(body.timings, request),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )


@dataclass(frozen=True)
class Pieces:
    """Output of a job as it comes: content / reasoning / tool-call pieces and their logprobs."""

    pieces: list[OutPiece]
    logprobs: list[TokenLogprob]


async def generated(ctx: ServeContext, plan: ChatPlan) -> AsyncIterator[Pieces | Finished]:
    """A chat job's output pieces, then its Finished event (observed by the metrics). A failure
    on the worker is raised; a job cancelled while its reader is still here means the server is
    stopping (raised as such). The caller cancels the job when it stops reading."""
    async for ev in plan.job.events():
        if isinstance(ev, TextDelta):
            yield Pieces(plan.output.feed(ev.text), list(ev.logprobs))
        elif isinstance(ev, Failed):
            raise ev.error
        elif ev.stats.finish_reason == "cancelled":
            raise _SHUTDOWN
        else:
            yield Pieces(plan.output.finish(), [])
            ctx.metrics.observe(ev.stats)
            yield ev


async def collect(
    ctx: ServeContext, plan: ChatPlan, request: Request
) -> tuple[list[OutPiece], list[TokenLogprob], Finished]:
    """A non-streamed chat job run to its end (cancelled if the client leaves): every piece, the
    logprobs, the Finished event."""
    watcher = asyncio.create_task(_watch_disconnect(request, plan.job))
    pieces: list[OutPiece] = []
    logprobs: list[TokenLogprob] = []
    finished: Finished | None = None
    try:
        async for item in generated(ctx, plan):
            if isinstance(item, Pieces):
                pieces += item.pieces
                logprobs += item.logprobs
            else:
                finished = item
    finally:
        watcher.cancel()
        plan.job.cancel()
    assert finished is not None  # generated() ends with it or raises
    return pieces, logprobs, finished


async def streamed(
    ctx: ServeContext, plan: ChatPlan, shutdown: anyio.Event
) -> AsyncIterator[Pieces | Finished]:
    """`generated` for a stream: the job is cancelled when the server shuts down or the reader
    goes away (the generator is closed)."""
    watcher = asyncio.create_task(_cancel_on(shutdown, plan.job))
    try:
        async for item in generated(ctx, plan):
            yield item
    finally:
        watcher.cancel()
        plan.job.cancel()


def finish_reason(stats: GenerationStats, n_calls: int) -> str:
    """stop | length | tool_calls; a call cut short by max_tokens is "length", like OpenAI: its
    arguments are incomplete."""
    if stats.finish_reason == "length":
        return "length"
    return "tool_calls" if n_calls else "stop"


def _apply(pieces: list[OutPiece], acc: dict[str, Any]) -> None:
    for piece in pieces:
        if isinstance(piece, ToolCallStart):
            acc["calls"].append(
                {"id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": ""}}
            )
        elif isinstance(piece, ToolCallArgs):
            acc["calls"][piece.index]["function"]["arguments"] += piece.text
        else:
            acc[piece[0]] = acc.get(piece[0], "") + piece[1]


async def _chat_whole(ctx: ServeContext, plan: ChatPlan, request: Request) -> Response:
    job = plan.job
    acc: dict[str, Any] = {"calls": []}
    logprobs: list[TokenLogprob] = []

    def on_text(ev: TextDelta) -> None:
        _apply(plan.output.feed(ev.text), acc)
        logprobs.extend(ev.logprobs)

    finished = await _collect(ctx, request, job, on_text)
    stats = finished.stats
    _apply(plan.output.finish(), acc)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": acc.get("content", "" if not acc["calls"] else None),
    }
    if acc["calls"]:
        message["tool_calls"] = acc["calls"]
    if "reasoning" in acc:
        message["reasoning_content"] = acc["reasoning"]
    result: dict[str, Any] = {
        "id": job.id,
        "object": "chat.completion",
        "created": plan.created,
        "model": plan.model_id,
        "system_fingerprint": plan.fingerprint,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _chat_logprobs(logprobs) if job.request.params.logprobs else None,
                "finish_reason": finish_reason(stats, plan.output.n_calls),
            }
        ],
        "usage": usage_of(stats),
    }
    if plan.timings:
        result["timings"] = timings_of(stats, finished.telemetry)
    return JSONResponse(result)


def _delta(piece: OutPiece) -> dict[str, Any]:
    if isinstance(piece, ToolCallStart):
        call = {
            "index": piece.index,
            "id": piece.id,
            "type": "function",
            "function": {"name": piece.name, "arguments": ""},
        }
        return {"tool_calls": [call]}
    if isinstance(piece, ToolCallArgs):
        return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}
    kind, text = piece
    return {"reasoning_content": text} if kind == "reasoning" else {"content": text}


async def _cancel_on(shutdown: anyio.Event, job: Job) -> None:
    await shutdown.wait()
    job.cancel()


async def _chat_stream(
    ctx: ServeContext, plan: ChatPlan, shutdown: anyio.Event
) -> AsyncIterator[ServerSentEvent]:
    job = plan.job
    watcher = asyncio.create_task(_cancel_on(shutdown, job))
    head = {
        "id": job.id,
        "object": "chat.completion.chunk",
        "created": plan.created,
        "model": plan.model_id,
        "system_fingerprint": plan.fingerprint,
    }

    def chunk(
        delta: dict[str, Any], finish: str | None = None, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": _chat_logprobs(logprobs) if logprobs else None,
            "finish_reason": finish,
        }
        return {**head, "choices": [choice]}

    try:
        yield event(chunk({"role": "assistant", "content": ""}))
        pending_lps: list[TokenLogprob] = []
        async for ev in job.events():
            if isinstance(ev, TextDelta):
                pending_lps.extend(ev.logprobs)
                timing = token_timings(ev.timing) if plan.timings and ev.timing is not None else None
                for piece in plan.output.feed(ev.text):
                    out = chunk(_delta(piece), logprobs=pending_lps)
                    if timing is not None:  # on the chunk that carries the token, once
                        out["timings"], timing = timing, None
                    yield event(out)
                    pending_lps = []
            elif isinstance(ev, Failed):
                _, body, _ = describe(ev.error, ctx.engine.queue_full_status)
                yield event(body)
            elif ev.stats.finish_reason == "cancelled":
                # only the server cancels a stream that still has a reader: it is stopping
                yield event(describe(_SHUTDOWN)[1])
            else:
                for piece in plan.output.finish():
                    yield event(chunk(_delta(piece), logprobs=pending_lps))
                    pending_lps = []
                stats = ev.stats
                ctx.metrics.observe(stats)
                last = chunk({}, finish_reason(stats, plan.output.n_calls), logprobs=pending_lps)
                if plan.timings:
                    last["timings"] = timings_of(stats, ev.telemetry)
                yield event(last)
                if plan.include_usage:
                    yield event({**head, "choices": [], "usage": usage_of(stats)})
        yield event(DONE)
    finally:
        watcher.cancel()
        # a no-op when the job finished; stops the worker when the client went away
        job.cancel()


# ---------------------------------------------------------------------- legacy completions


async def create_completion(ctx: ServeContext, body: CompletionRequest, request: Request) -> Response:
    """POST /v1/completions."""
    ctx.warn_unknown(body.model_extra)
    model = ctx.ready_model()
    _check_model(ctx, model, body.model)
    if body.n is not None and body.n > 1:
        raise InvalidRequest("n > 1 is not supported: this server generates one choice", param="n")
    if body.suffix:
        raise InvalidRequest("suffix (insertion) is not supported", param="suffix")
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    llama = model.llama
    add_bos = bool(llama._model.add_bos_token()) and llama.token_bos() >= 0
    tokens = tuple(await run_in_threadpool(llama.tokenize, prompt.encode("utf-8"), add_bos, True))
    if not tokens:
        raise InvalidRequest("the prompt is empty", param="prompt")
    _check_prompt(ctx, model, len(tokens), "prompt")
    params = body.to_sampling_params(
        max_tokens=_max_tokens(ctx, model, body.max_tokens, len(tokens)),
        logit_bias=_logit_bias(model, body.logit_bias),
    )
    job = ctx.engine.submit("cmpl-" + secrets.token_hex(12), GenerationRequest(tokens, params))
    head = {
        "id": job.id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "system_fingerprint": model.info.fingerprint,
    }
    timings = _want_timings(body.timings, request)
    echo = prompt if body.echo else ""
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shutdown = anyio.Event()
        stream = _completion_stream(ctx, job, head, echo, timings, include_usage, shutdown)
        return sse_response(stream, ctx.settings.keepalive_s, shutdown)

    pieces: list[str] = [echo]
    lps: list[TokenLogprob] = []

    def on_text(ev: TextDelta) -> None:
        pieces.append(ev.text)
        lps.extend(ev.logprobs)

    finished = await _collect(ctx, request, job, on_text)
    stats = finished.stats
    text = "".join(pieces)
    result: dict[str, Any] = {
        **head,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": _legacy_logprobs(lps, len(echo)) if params.logprobs else None,
                "finish_reason": finish_reason(stats, 0),
            }
        ],
        "usage": usage_of(stats),
    }
    if timings:
        result["timings"] = timings_of(stats, finished.telemetry)
    return JSONResponse(result)


def _legacy_logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in lps],
        "text_offset": offsets,
    }


async def _completion_stream(
    ctx: ServeContext,
    job: Job,
    head: dict[str, Any],
    echo: str,
    timings: bool,
    include_usage: bool,
    shutdown: anyio.Event,
) -> AsyncIterator[ServerSentEvent]:
    watcher = asyncio.create_task(_cancel_on(shutdown, job))

    def chunk(text: str, finish: str | None = None, lps: list[TokenLogprob] | None = None) -> dict[str, Any]:
        logprobs = _legacy_logprobs(lps, 0) if lps else None
        return {
            **head,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }

    try:
        if echo:
            yield event(chunk(echo))
        async for ev in job.events():
            if isinstance(ev, TextDelta):
                out = chunk(ev.text, lps=ev.logprobs)
                if timings and ev.timing is not None:
                    out["timings"] = token_timings(ev.timing)
                yield event(out)
            elif isinstance(ev, Failed):
                _, body, _ = describe(ev.error, ctx.engine.queue_full_status)
                yield event(body)
            elif ev.stats.finish_reason == "cancelled":
                yield event(describe(_SHUTDOWN)[1])
            else:
                stats = ev.stats
                ctx.metrics.observe(stats)
                last = chunk("", finish_reason(stats, 0))
                if timings:
                    last["timings"] = timings_of(stats, ev.telemetry)
                yield event(last)
                if include_usage:
                    yield event({**head, "choices": [], "usage": usage_of(stats)})
        yield event(DONE)
    finally:
        watcher.cancel()
        job.cancel()
