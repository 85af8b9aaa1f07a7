"""The route: POST /v1/responses, whole or as a stream of events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.engine.token_loop import GenerationStats
from server.http.errors import describe
from server.http.responses.mapping import Toolbox, to_chat_request
from server.http.responses.output import OutputBuilder, OutputShape, new_id
from server.http.responses.protocol import ResponsesRequest, ResponseStatus
from server.http.serving import Pieces, Plan, ServeContext, collect, finish_reason, prepare_chat, streamed
from server.http.sse import named_event, sse_response


def _status(stats: GenerationStats, plan: Plan) -> ResponseStatus:
    return "incomplete" if finish_reason(stats, plan.output.n_calls) == "length" else "completed"


async def create_response(ctx: ServeContext, body: ResponsesRequest, request: Request) -> Response:
    """POST /v1/responses."""
    ctx.warn_unknown(body.model_extra)
    chat, tools = to_chat_request(body, ctx.warned_fields, ctx.settings.max_completion_tokens)
    async with ctx.using(body.model) as model:
        plan = await prepare_chat(ctx, model, chat, model_id=body.model)
    shape = OutputShape(new_id("resp"), plan.created, body)
    if body.stream:
        shutdown = anyio.Event()
        return sse_response(_stream(ctx, plan, shape, tools, shutdown), ctx.settings.keepalive_s, shutdown)
    pieces, _, finished = await collect(ctx, plan, request)
    builder = OutputBuilder(tools)
    for piece in pieces:
        for _ in builder.feed(piece):
            pass
    for _ in builder.finish():
        pass
    return JSONResponse(shape.response(_status(finished.stats, plan), builder.output(), finished.stats))


async def _stream(
    ctx: ServeContext, plan: Plan, shape: OutputShape, tools: Toolbox, shutdown: anyio.Event
) -> AsyncIterator[ServerSentEvent]:
    sequence = 0

    def sse(kind: str, payload: dict[str, Any]) -> ServerSentEvent:
        nonlocal sequence
        sequence += 1
        return named_event(kind, {"type": kind, "sequence_number": sequence - 1, **payload})

    yield sse("response.created", {"response": shape.response("in_progress", [], None)})
    yield sse("response.in_progress", {"response": shape.response("in_progress", [], None)})
    builder = OutputBuilder(tools)
    try:
        async for item in streamed(ctx, plan, shutdown):
            if isinstance(item, Pieces):
                for piece in item.pieces:
                    for kind, payload in builder.feed(piece):
                        yield sse(kind, payload)
            else:
                for kind, payload in builder.finish():
                    yield sse(kind, payload)
                status = _status(item.stats, plan)
                final = shape.response(status, builder.output(), item.stats)
                yield sse(
                    "response.completed" if status == "completed" else "response.incomplete",
                    {"response": final},
                )
    except Exception as exc:  # noqa: BLE001 - after the 200, an error is an event (the API's own)
        _, body, _ = describe(exc, ctx.engine.queue_full_status)
        error = body["error"]
        assert isinstance(error, dict)
        yield sse(
            "error", {"code": error.get("code"), "message": error.get("message"), "param": error.get("param")}
        )
