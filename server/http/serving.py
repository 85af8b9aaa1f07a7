"""What every API route shares: the checks, the one chat prepare path, and the one answer loop.

Everything that can refuse a request (model id, bounds that depend on the model, template,
grammar, context length, queue) runs BEFORE the 200 is sent, in `prepare_chat` (chat
completions, Responses and Messages, each mapped onto the engine's ChatRequest) or in the
legacy route. A submitted job becomes a `Plan`; its output arrives as `Pieces`
(server/http/job_events.py: `collect` for a whole answer, `streamed` for a stream). `respond` is the
one loop behind every API's answer, whole or streamed, parameterised by an `EventFormat`: how
that API writes the job's output (chat and legacy completions through `Chunks`, Responses,
Messages and Ollama with formats of their own). Once streaming, a failure is reported in-band,
in the API's own shape.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Protocol

import anyio
from fastapi import Depends
from sse_starlette import ServerSentEvent
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server.engine.chat import ChatRequest
from server.engine.chat_template import ChatTemplate
from server.engine.generation import GenerationRequest, GenerationStats, TokenLogprob
from server.engine.grammars import GrammarLimits, output_constraint
from server.engine.reasoning import PlainSplitter, make_splitter
from server.engine.tool_calls import ChatOutput, OutPiece, call_syntax
from server.engine.worker import Engine, Finished, Job
from server.errors import ContextLengthExceeded, InvalidRequest, NotFound, ServiceUnavailable
from server.http.errors import describe, is_anthropic, is_ollama
from server.http.job_events import Pieces, collect, streamed
from server.http.metrics import Metrics
from server.http.protocol import FinishReason, OutModel
from server.http.sse import DONE, event, named_event, sse_response
from server.http.timings import timings_of, usage_of
from server.lifecycle.residency import Residency
from server.lifecycle.switching import ModelSwitch
from server.loading.loader import LoadedModel, ModelInfo
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

TIMINGS_HEADER = "x-moeflash-timings"


@dataclass
class ServeContext:
    """Per-app state shared by the routes (lives on app.state, never in a module global)."""

    settings: ServerSettings
    engine: Engine
    metrics: Metrics
    # who holds the model and how long it stays loaded (the switch's, with --models-dir)
    residency: Residency
    # serve --models-dir: the models and the switch between them; None serves one model
    switch: ModelSwitch | None = None
    warned_fields: set[str] = field(default_factory=set)
    _template: tuple[LoadedModel, ChatTemplate] | None = None

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

    def model_info(self) -> ModelInfo:
        """The served model's description, loaded or released (one model served: no --models-dir);
        ServiceUnavailable before it has loaded."""
        info = self.engine.info
        return info if info is not None else self.ready_model().info

    @asynccontextmanager
    async def using(self, model_id: str, keep_alive_s: float | None = None) -> AsyncIterator[LoadedModel]:
        """The model a request names, ready, for the block (its checks, prompt and job's submission
        happen inside): the served model (NotFound for another id), or with --models-dir the model
        of the directory it names, switched to first if another is loaded; loaded again first if it
        was released. `keep_alive_s`: how long it stays loaded once idle (None: --keep-alive)."""
        if self.switch is None:
            check_model(self.model_info(), model_id)
            async with self.residency.lease(keep_alive_s):
                yield self.ready_model()
            return
        async with self.switch.using(model_id, self.ready_model, keep_alive_s) as model:
            yield model

    async def unload(self, model_id: str) -> None:
        """Release the model `model_id` names now if it is loaded and idle, else once it is."""
        if self.switch is None:
            check_model(self.model_info(), model_id)
            await self.residency.unload()
        else:
            await self.switch.unload(model_id)

    def served_names(self) -> tuple[str, ...]:
        """Every name a request may use: the served model's, or those of the directory's models."""
        if self.switch is None:
            return self.model_info().names
        return tuple(m.name for m in self.switch.listed())

    def template(self, model: LoadedModel) -> ChatTemplate:
        """`model`'s chat template, kept while it stays the loaded one."""
        if self._template is None or self._template[0] is not model:
            self._template = (model, ChatTemplate(model.llama, model.info.chat_template))
        return self._template[1]

    def warn_unknown(self, extra: dict[str, Any] | None) -> None:
        for name in extra or {}:
            if name not in self.warned_fields:
                self.warned_fields.add(name)
                logger.warning("ignoring unknown request field %r (logged once)", name)


def serve_context(request: Request) -> ServeContext:
    """The app's ServeContext, set by `create_app`: every route's dependency."""
    ctx = request.app.state.moeflash
    assert isinstance(ctx, ServeContext)
    return ctx


# a route's parameter for the server's state
Ctx = Annotated[ServeContext, Depends(serve_context)]


# ---------------------------------------------------------------------- checks


def check_model(info: ModelInfo, requested: str) -> None:
    """NotFound unless `requested` is one of the served model's names (any id with --alias '*')."""
    if requested not in info.names and not info.any_model:
        served = ", ".join(repr(name) for name in info.names)
        raise NotFound(
            f"the model {requested!r} does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )


def clamp_max_tokens(ctx: ServeContext, model: LoadedModel, requested: int | None, n_prompt: int) -> int:
    """The tokens to generate: what was asked, clamped to the server's cap and to the context left
    (as llama-server does: clients that send large defaults work, finish_reason says "length")."""
    cap = ctx.settings.max_completion_tokens
    room = model.info.n_ctx - n_prompt
    return min(requested or cap, cap, room)


def check_prompt(ctx: ServeContext, model: LoadedModel, n_prompt: int, what: str) -> None:
    """A prompt that leaves no room for a token is refused in OpenAI's words, which client
    libraries (litellm, LangChain) recognise as a context-window error; `what`: "messages" or
    "prompt"."""
    n_ctx = model.info.n_ctx
    cap = ctx.settings.max_prompt_tokens
    if cap is not None and n_prompt > cap:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {cap} tokens (the server's prompt cap). However, "
            f"your {what} resulted in {n_prompt} tokens. Please reduce the length of the {what}.",
            n_prompt=n_prompt,
            max_prompt=cap,
        )
    if n_prompt >= n_ctx:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {n_ctx} tokens. However, your {what} resulted in "
            f"{n_prompt} tokens. Please reduce the length of the {what}.",
            n_prompt=n_prompt,
            max_prompt=n_ctx - 1,  # one token of the context is left for the answer
        )


def logit_bias(model: LoadedModel, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """The request's logit_bias as (token id, bias) pairs; InvalidRequest for a key that is not a
    token id of the model."""
    out: list[tuple[int, float]] = []
    for key, value in (bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < model.info.n_vocab:
            raise InvalidRequest(
                f"logit_bias key {key!r} is not a token id of this model", param="logit_bias"
            )
        out.append((int(key), value))
    return tuple(out)


def want_timings(flag: bool | None, request: Request) -> bool:
    """Whether the timings extension is on: the request's flag or the x-moeflash-timings header."""
    return bool(flag) or request.headers.get(TIMINGS_HEADER, "").lower() in ("1", "true", "yes")


# ---------------------------------------------------------------------- plans


class Output(Protocol):
    """Generated text -> output pieces (a ChatOutput, or legacy completion's plain text)."""

    @property
    def n_calls(self) -> int: ...

    def feed(self, text: str) -> list[OutPiece]: ...

    def finish(self) -> list[OutPiece]: ...


@dataclass
class Plan:
    """A submitted job and how to present its output."""

    job: Job
    output: Output
    created: int
    model_id: str
    fingerprint: str
    timings: bool
    include_usage: bool


def submit(
    ctx: ServeContext,
    model: LoadedModel,
    id_prefix: str,
    request: GenerationRequest,
    output: Output,
    *,
    model_id: str,
    timings: bool,
    include_usage: bool,
) -> Plan:
    """Queue `request` on the engine (QueueFull / ServiceUnavailable refuse it) as a Plan."""
    job = ctx.engine.submit(id_prefix + secrets.token_hex(12), request)
    return Plan(
        job=job,
        output=output,
        created=int(time.time()),
        model_id=model_id,
        fingerprint=model.info.fingerprint,
        timings=timings,
        include_usage=include_usage,
    )


async def render_chat(
    ctx: ServeContext, model: LoadedModel, chat: ChatRequest
) -> tuple[str, tuple[int, ...]]:
    """The prompt `chat` renders to with the model's chat template, and its tokens: what
    `prepare_chat` serves and Anthropic's count_tokens counts."""
    template = ctx.template(model)
    choice = chat.tool_choice
    template_choice = choice if isinstance(choice, str) else "required" if choice is not None else None
    prompt = await run_in_threadpool(
        template.render, chat.messages, chat.tools, template_choice, chat.template_kwargs
    )
    tokens = await run_in_threadpool(template.tokenize, prompt)
    return prompt, tokens


async def prompt_tokens(model: LoadedModel, prompt: str) -> tuple[int, ...]:
    """A prompt used as it is (legacy completions, Ollama's raw generate): its tokens as llama.cpp
    reads it, BOS first when the model wants one, special tokens parsed; InvalidRequest if none."""
    llama = model.llama
    add_bos = bool(llama._model.add_bos_token()) and llama.token_bos() >= 0
    tokens = tuple(await run_in_threadpool(llama.tokenize, prompt.encode("utf-8"), add_bos, True))
    if not tokens:
        raise InvalidRequest("the prompt is empty", param="prompt")
    return tokens


async def prepare_chat(
    ctx: ServeContext,
    model: LoadedModel,
    chat: ChatRequest,
    *,
    model_id: str,
    timings: bool = False,
    include_usage: bool = False,
) -> Plan:
    """Check a chat request against `model` (the one `ctx.using(model_id)` gave: the caller holds
    it), render and tokenize it, compile its grammar and submit its job: everything that can
    refuse it, before any response starts. Every chat API (chat completions, Responses,
    Messages, Ollama) maps its request onto `chat` and comes here."""
    template = ctx.template(model)
    settings = ctx.settings
    harmony = template.style == "harmony"
    limits = GrammarLimits(settings.max_json_schema_bytes, settings.max_grammar_compile_ms)
    constraint = await run_in_threadpool(
        output_constraint, chat, model.llama, template.source, harmony, limits
    )

    choice = chat.tool_choice
    prompt, tokens = await render_chat(ctx, model, chat)
    check_prompt(ctx, model, len(tokens), "messages")

    params = replace(
        chat.sampling,
        max_tokens=clamp_max_tokens(ctx, model, chat.sampling.max_tokens, len(tokens)),
        grammar=constraint.grammar,
    )
    if constraint.lazy is not None:
        params = replace(
            params,
            grammar_trigger_tokens=constraint.lazy.trigger_tokens,
            grammar_trigger_patterns=constraint.lazy.trigger_patterns,
        )
    splitter = PlainSplitter() if constraint.whole_output else make_splitter(template.style, prompt)
    output = ChatOutput(
        splitter,
        mode=constraint.mode,
        forced_name=constraint.forced_name,
        parse_tools=bool(chat.tools) and choice != "none" and not harmony,
        syntax=call_syntax(template.style),
        parallel=chat.parallel_tool_calls,
    )
    request = GenerationRequest(tokens, params, render_special=harmony)
    return submit(
        ctx,
        model,
        "chatcmpl-",
        request,
        output,
        model_id=model_id,
        timings=timings,
        include_usage=include_usage,
    )


def finish_reason(stats: GenerationStats, n_calls: int) -> FinishReason:
    """stop | length | tool_calls; a call cut short by max_tokens is "length", like OpenAI: its
    arguments are incomplete."""
    if stats.finish_reason == "length":
        return "length"
    return "tool_calls" if n_calls else "stop"


# ---------------------------------------------------------------------- the one loop behind every answer

# one frame of a stream: an SSE event's name (None: a data-only event) and its payload (JSON, or
# the literal [DONE])
Frame = tuple[str | None, dict[str, Any] | str]
NDJSON = "application/x-ndjson"


class EventFormat(Protocol):
    """How one API writes a job's output: the frames of its stream as the job goes, or its whole
    answer. `respond` drives it: `opening`, then `pieces` for each step's output, then `closing`
    once the job finished, or `failure` (the error body in the route's envelope) if it failed
    after the 200 went out. A format keeps whatever state its API's events need."""

    @property
    def ndjson(self) -> bool:
        """Whether the stream is NDJSON lines (Ollama) rather than server-sent events."""
        ...

    def opening(self) -> Iterable[Frame]: ...

    def pieces(self, item: Pieces) -> Iterable[Frame]: ...

    def closing(self, finished: Finished) -> Iterable[Frame]: ...

    def failure(self, error: dict[str, object]) -> Iterable[Frame]: ...

    def whole(
        self, pieces: list[OutPiece], logprobs: list[TokenLogprob], finished: Finished
    ) -> dict[str, Any]:
        """The non-streamed answer's body."""
        ...


async def respond(
    ctx: ServeContext, plan: Plan, fmt: EventFormat, request: Request, stream: bool
) -> Response:
    """The answer to a submitted job: `fmt`'s stream, or its whole answer once the job ends. The
    job is cancelled when the client goes away, or (a server-sent stream) the server shuts down."""
    if not stream:
        [(pieces, logprobs, finished)] = await collect(ctx, [plan], request)
        return JSONResponse(fmt.whole(pieces, logprobs, finished))
    shutdown = anyio.Event()
    frames = frames_of(ctx, plan, fmt, shutdown, request.url.path)
    if fmt.ndjson:
        return StreamingResponse(_ndjson(frames), media_type=NDJSON)
    return sse_response(sse_events(frames), ctx.settings.keepalive_s, shutdown)


# the stream's frames written out; closing one closes the frames at once (the job is cancelled
# there), not when the collector finds them
async def _ndjson(frames: AsyncGenerator[Frame, None]) -> AsyncIterator[bytes]:
    async with aclosing(frames):
        async for _, payload in frames:
            yield ndjson_line(payload)


async def sse_events(frames: AsyncGenerator[Frame, None]) -> AsyncIterator[ServerSentEvent]:
    async with aclosing(frames):
        async for name, payload in frames:
            yield named_event(name, payload) if name else event(payload)


async def frames_of(
    ctx: ServeContext, plan: Plan, fmt: EventFormat, shutdown: anyio.Event, path: str
) -> AsyncGenerator[Frame, None]:
    try:
        for frame in fmt.opening():
            yield frame
        async for item in streamed(ctx, plan, shutdown):
            for frame in fmt.pieces(item) if isinstance(item, Pieces) else fmt.closing(item):
                yield frame
    except Exception as exc:  # noqa: BLE001 - after the 200, the worker's failure or the server stopping is a frame
        _, body, _ = describe(
            exc, ctx.engine.queue_full_status, anthropic=is_anthropic(path), ollama=is_ollama(path)
        )
        for frame in fmt.failure(body):
            yield frame


def ndjson_line(payload: dict[str, Any] | str) -> bytes:
    """One NDJSON line (Ollama's streams)."""
    return (json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


# ---------------------------------------------------------------------- chat and legacy completions


class ChunkFormat(Protocol):
    """How chat or legacy completions write a plan's output as chunks, and whole (`Chunks` makes
    it an EventFormat).

    `logprobs` are those of the tokens behind a chunk's piece(s); `timings` the extension's
    object, None when off (or, on a piece, when its token's step has none)."""

    def opening(self) -> Sequence[OutModel]:
        """Chunks sent before any output (chat: the assistant role)."""
        ...

    def piece(
        self, piece: OutPiece, logprobs: list[TokenLogprob], timings: dict[str, Any] | None
    ) -> OutModel: ...

    def last(
        self, finish: FinishReason, logprobs: list[TokenLogprob], timings: dict[str, Any] | None
    ) -> OutModel: ...

    def usage(self, usage: dict[str, Any]) -> OutModel:
        """The chunk with usage only (stream_options.include_usage)."""
        ...

    def whole(
        self,
        pieces: list[OutPiece],
        logprobs: list[TokenLogprob],
        finish: FinishReason,
        usage: dict[str, Any],
        timings: dict[str, Any] | None,
    ) -> OutModel:
        """The non-streamed response."""
        ...


class Chunks:
    """A ChunkFormat as an EventFormat: data-only events, `[DONE]` last, an error as
    `data: {"error": ...}` then `[DONE]`."""

    ndjson = False

    def __init__(self, plan: Plan, fmt: ChunkFormat) -> None:
        self._plan = plan
        self._fmt = fmt
        # logprobs of tokens whose text has not become a piece yet (a held-back marker)
        self._pending: list[TokenLogprob] = []

    def opening(self) -> list[Frame]:
        return [(None, chunk.to_json()) for chunk in self._fmt.opening()]

    def pieces(self, item: Pieces) -> list[Frame]:
        self._pending += item.logprobs
        timings = item.timings
        frames: list[Frame] = []
        for piece in item.pieces:
            frames.append((None, self._fmt.piece(piece, self._pending, timings).to_json()))
            self._pending, timings = [], None  # on the chunk that carries the token, once
        return frames

    def closing(self, finished: Finished) -> list[Frame]:
        plan, stats = self._plan, finished.stats
        timings = timings_of(stats, finished.telemetry) if plan.timings else None
        finish = finish_reason(stats, plan.output.n_calls)
        frames: list[Frame] = [(None, self._fmt.last(finish, self._pending, timings).to_json())]
        if plan.include_usage:
            frames.append((None, self._fmt.usage(usage_of(stats)).to_json()))
        return [*frames, (None, DONE)]

    def failure(self, error: dict[str, object]) -> list[Frame]:
        return [(None, error), (None, DONE)]

    def whole(
        self, pieces: list[OutPiece], logprobs: list[TokenLogprob], finished: Finished
    ) -> dict[str, Any]:
        stats = finished.stats
        timings = timings_of(stats, finished.telemetry) if self._plan.timings else None
        finish = finish_reason(stats, self._plan.output.n_calls)
        return self._fmt.whole(pieces, logprobs, finish, usage_of(stats), timings).to_json()
