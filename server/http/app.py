"""The FastAPI app: `create_app(settings, engine)`, its lifespan, routes and error mapping.

Exceptions are mapped to HTTP once (server/http/errors.py); FastAPI's validation errors
(including malformed JSON and a wrong content type) become 400s, never 422s, and Starlette's
404/405 get the same body: the OpenAI shape, or Anthropic's under /v1/messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response

from server import __version__
from server.engine.worker import Engine, EngineState
from server.errors import InvalidRequest, MethodNotAllowed, MoeflashError, NotFound, RequestError
from server.http import ollama
from server.http.chat_completions import create_chat_completion
from server.http.completions import create_completion
from server.http.errors import error_response, validation_error
from server.http.messages import (
    CountTokensRequest,
    MessageOut,
    MessagesRequest,
    TokenCount,
    count_tokens,
    create_message,
)
from server.http.metrics import CONTENT_TYPE, Metrics, MetricsMiddleware
from server.http.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
)
from server.http.residency import Residency
from server.http.responses import ResponsesRequest, create_response
from server.http.security import SecurityMiddleware
from server.http.serving import ServeContext, check_model
from server.http.switching import DirectoryModel, ModelSwitch
from server.http.webui import index_html
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (400, 401, 404, 413, 429, 503)
}


def _validation_message(exc: RequestValidationError, request: Request) -> InvalidRequest:
    content_type = request.headers.get("content-type", "")
    if content_type and not content_type.lower().startswith("application/json"):
        return InvalidRequest(
            f"Content-Type must be application/json, not {content_type!r}", code="unsupported_content_type"
        )
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return InvalidRequest(
            f"the request body is not valid JSON: {errors[0].get('msg')}", code="invalid_json"
        )
    return validation_error(errors, exc.body)


def _card(ctx: ServeContext, name: str) -> ModelCard:
    info = ctx.model_info()
    # the budget now: it follows memory pressure from the one chosen at load
    totals = ctx.engine.totals()
    budget = totals.streamer.budget_bytes if totals is not None and totals.streamer is not None else None
    return ModelCard(
        id=name,
        created=info.created,
        context_length=info.n_ctx,
        architecture=info.architecture,
        file_size=info.file_size,
        mode=info.mode,
        budget_bytes=budget if budget is not None else info.budget_bytes,
    )


def _file_card(switch: ModelSwitch, model: DirectoryModel) -> ModelCard:
    # a model of the directory that is not loaded: what its header says, and how it would load
    return ModelCard(
        id=model.name,
        created=model.created,
        context_length=switch.ctx_size,
        architecture=model.architecture,
        file_size=model.size,
        mode=switch.mode,
    )


def _cards(ctx: ServeContext) -> list[ModelCard]:
    switch = ctx.switch
    if switch is None:
        return [_card(ctx, name) for name in ctx.model_info().names]
    loaded = switch.loaded if ctx.engine.model is not None else None
    return [_card(ctx, m.name) if m.name == loaded else _file_card(switch, m) for m in switch.listed()]


def create_app(settings: ServerSettings, engine: Engine, switch: ModelSwitch | None = None) -> FastAPI:
    """The app serving `engine`, with `switch` the models of a directory it switches between (None:
    the one model it loads); the lifespan starts the engine (model load) and closes it."""
    metrics = Metrics(engine)
    residency = (
        switch.residency if switch is not None else Residency(engine, keep_alive_s=settings.keep_alive)
    )
    ctx = ServeContext(settings=settings, engine=engine, metrics=metrics, residency=residency, switch=switch)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()  # loads in the background: /health says 503 until ready
        watcher = asyncio.create_task(residency.watch())  # releases the model after its keep_alive
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await run_in_threadpool(engine.close)

    app = FastAPI(
        title="moeflash",
        version=__version__,
        description="OpenAI-compatible API of moeflash (Mixture-of-Experts models streamed from flash).",
        lifespan=lifespan,
        responses=_ERRORS,
    )
    app.state.moeflash = ctx
    queue_status = settings.queue_full_status

    @app.exception_handler(MoeflashError)
    async def _moeflash_error(request: Request, exc: MoeflashError) -> Response:
        return error_response(exc, queue_status, request.url.path)

    # every handler answers in the envelope of the API its path belongs to (error_response)
    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(_validation_message(exc, request), queue_status, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        path = request.url.path
        cause = exc.__cause__
        if isinstance(cause, RequestError):  # e.g. the body cap hit while FastAPI read the body
            return error_response(cause, queue_status, path)
        if isinstance(cause, RecursionError):  # JSON nested past the parser's recursion limit
            deep = InvalidRequest("the request body is JSON nested too deeply to parse", code="invalid_json")
            return error_response(deep, queue_status, path)
        if exc.status_code == 404:
            return error_response(NotFound(f"no route {path}", code="not_found"), queue_status, path)
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            refused = MethodNotAllowed(f"{request.method} is not allowed on {path}", allow=allow)
            return error_response(refused, queue_status, path)
        if exc.status_code < 500:
            return error_response(InvalidRequest(str(exc.detail)), queue_status, path)
        return error_response(exc, queue_status, path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return error_response(exc, queue_status, request.url.path)

    @app.get("/health", tags=["server"])
    async def health() -> JSONResponse:
        """200 once the model has loaded, also while it is released after its keep_alive, or freed
        and loaded again (a reload, a switch): requests are taken then, and wait for the load; 503
        while it first loads, after a failed load, and at shutdown."""
        state = engine.state
        between = (EngineState.RELEASING, EngineState.RELEASED, EngineState.LOADING)
        taken = state in between and engine.loads > 0
        status = 200 if state is EngineState.READY or taken else 503
        body: dict[str, Any] = {"status": "ok" if status == 200 else state.value}
        if taken:
            body["model"] = state.value  # "releasing", "released" or "loading"
        if engine.load_error is not None:
            body["error"] = str(engine.load_error)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", tags=["server"])
    async def prometheus() -> Response:
        """Prometheus text exposition."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", tags=["openai"])
    async def list_models() -> ModelList:
        """The loaded model, once under each of its names (--alias but '*', then the file stem); with
        --models-dir, every model of the directory."""
        return ModelList(data=_cards(ctx))

    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def get_model(model_id: str) -> ModelCard:
        """A served model, if `model_id` is one of its names (any id with --alias '*')."""
        if ctx.switch is not None:
            return next(card for card in _cards(ctx) if card.id == ctx.switch.resolve(model_id).name)
        check_model(ctx.model_info(), model_id)
        return _card(ctx, model_id)

    @app.post(
        "/v1/chat/completions",
        tags=["openai"],
        responses={200: {"model": ChatCompletion, "description": "a completion, or an SSE stream of chunks"}},
    )
    async def chat_completions(body: Annotated[ChatCompletionRequest, Body()], request: Request) -> Response:
        """Chat completion, whole or streamed (SSE)."""
        return await create_chat_completion(ctx, body, request)

    @app.post(
        "/v1/messages",
        tags=["anthropic"],
        responses={200: {"model": MessageOut, "description": "a message, or an SSE stream of its events"}},
    )
    async def messages(body: Annotated[MessagesRequest, Body()], request: Request) -> Response:
        """Anthropic Messages API, whole or streamed (SSE); `x-api-key` is accepted as the key."""
        return await create_message(ctx, body, request)

    @app.post(
        "/v1/messages/count_tokens",
        tags=["anthropic"],
        responses={200: {"model": TokenCount, "description": "the prompt's length in tokens"}},
    )
    async def messages_count_tokens(body: Annotated[CountTokensRequest, Body()]) -> Response:
        """Anthropic's token count: the prompt tokens /v1/messages renders these fields to."""
        return await count_tokens(ctx, body)

    @app.post(
        "/v1/responses",
        tags=["openai"],
        responses={200: {"description": "a response object, or an SSE stream of Responses API events"}},
    )
    async def responses(body: Annotated[ResponsesRequest, Body()], request: Request) -> Response:
        """OpenAI Responses API (stateless), whole or streamed (SSE)."""
        return await create_response(ctx, body, request)

    @app.post(
        "/v1/completions",
        tags=["openai"],
        responses={200: {"model": Completion, "description": "a completion, or an SSE stream of chunks"}},
    )
    async def completions(body: Annotated[CompletionRequest, Body()], request: Request) -> Response:
        """Legacy text completion, whole or streamed (SSE)."""
        return await create_completion(ctx, body, request)

    # the Ollama API subset (server/http/ollama), for Ollama clients
    @app.get("/api/tags", tags=["ollama"])
    async def ollama_tags() -> Response:
        """The models served, as Ollama lists its models."""
        return await ollama.tags(ctx)

    @app.get("/api/ps", tags=["ollama"])
    async def ollama_ps() -> Response:
        """The model loaded."""
        return await ollama.running(ctx)

    @app.get("/api/version", tags=["ollama"])
    async def ollama_version() -> Response:
        """This server's version."""
        return await ollama.version()

    @app.post("/api/show", tags=["ollama"])
    async def ollama_show(body: Annotated[ollama.ModelRequest, Body()]) -> Response:
        """A model's details, metadata, template and capabilities."""
        return await ollama.show(ctx, body)

    @app.post("/api/chat", tags=["ollama"])
    async def ollama_chat(body: Annotated[ollama.ChatRequest, Body()], request: Request) -> Response:
        """Ollama chat, whole or streamed (NDJSON)."""
        return await ollama.chat(ctx, body, request)

    @app.post("/api/generate", tags=["ollama"])
    async def ollama_generate(body: Annotated[ollama.GenerateRequest, Body()], request: Request) -> Response:
        """Ollama generate (templated, or raw), whole or streamed (NDJSON)."""
        return await ollama.generate(ctx, body, request)

    @app.post("/api/pull", tags=["ollama"])
    async def ollama_pull(body: Annotated[ollama.ModelRequest, Body()]) -> Response:
        """Pull a model from the Hugging Face Hub (only with --allow-pull)."""
        return await ollama.pull(ctx, body)

    @app.delete("/api/delete", tags=["ollama"])
    async def ollama_delete(body: Annotated[ollama.ModelRequest, Body()]) -> Response:
        """Delete a pulled model (only with --allow-pull)."""
        return await ollama.delete(ctx, body)

    page = index_html()

    # HEAD too: clients probe the server with it (Claude Code does before its first request)
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    # outermost first: security answers before CORS, CORS before the routes
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            # whatever an allowed origin's client sends (the openai npm SDK: X-Stainless-*, OpenAI-*)
            allow_headers=["*"],
        )
    app.add_middleware(
        SecurityMiddleware,
        api_key=settings.resolved_api_key(),
        loopback=settings.is_loopback(),
        allowed_hosts=settings.allowed_hosts,
        cors_origins=settings.cors_origins,
        max_body_bytes=settings.max_body_bytes,
    )
    routes = frozenset(getattr(route, "path", "") for route in app.routes) - {"/v1/models/{model_id:path}"}
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)
    return app
