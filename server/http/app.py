"""The FastAPI app: `create_app(settings, engine)`, its lifespan, error mapping and middleware;
the routes are each API family's router (admin, openai, messages, ollama, webui), their handlers
given the server's state by the `Ctx` dependency (server/http/serving.py).

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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from server import __version__
from server.engine.worker import Engine
from server.errors import InvalidRequest, MethodNotAllowed, MoeflashError, NotFound, RequestError
from server.http import admin, messages, ollama, openai, webui
from server.http.errors import error_response, validation_error
from server.http.metrics import Metrics, MetricsMiddleware
from server.http.protocol import ErrorBody
from server.http.security import SecurityMiddleware
from server.http.serving import ServeContext, serve_context
from server.lifecycle.residency import Residency
from server.lifecycle.switching import ModelSwitch
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


def _answered(request: Request, exc: BaseException) -> Response:
    """`exc` as error_response writes it, in the envelope of the API the path belongs to."""
    ctx = serve_context(request)
    return error_response(exc, ctx.settings.queue_full_status, request.url.path)


async def _error(request: Request, exc: Exception) -> Response:
    return _answered(request, exc)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return _answered(request, _validation_message(exc, request))


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's errors as this server's: a 404 and a 405 with the same body as every error."""
    assert isinstance(exc, StarletteHTTPException)
    path = request.url.path
    cause = exc.__cause__
    if isinstance(cause, RequestError):  # e.g. the body cap hit while FastAPI read the body
        return _answered(request, cause)
    if isinstance(cause, RecursionError):  # JSON nested past the parser's recursion limit
        return _answered(
            request,
            InvalidRequest("the request body is JSON nested too deeply to parse", code="invalid_json"),
        )
    if exc.status_code == 404:
        return _answered(request, NotFound(f"no route {path}", code="not_found"))
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        return _answered(request, MethodNotAllowed(f"{request.method} is not allowed on {path}", allow=allow))
    if exc.status_code < 500:
        return _answered(request, InvalidRequest(str(exc.detail)))
    return _answered(request, exc)


# every error, by its handler: each answers in the envelope of the API its path belongs to
_HANDLERS = (
    (MoeflashError, _error),
    (RequestValidationError, _validation_error),
    (StarletteHTTPException, _http_error),
    (Exception, _error),
)


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
    for kind, handler in _HANDLERS:
        app.add_exception_handler(kind, handler)
    routers = (admin.router(), openai.router(), messages.router(), ollama.router(), webui.router())
    for router in routers:
        app.include_router(router)

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
    routes = frozenset(getattr(route, "path", "") for router in routers for route in router.routes)
    routes -= {"/v1/models/{model_id:path}"}
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)
    return app
