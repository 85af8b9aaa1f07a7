"""The route handlers: POST /v1/messages (whole or streamed) and /v1/messages/count_tokens.

Errors on these routes carry Anthropic's envelope and error types (server/http/errors.py);
after the stream started, one `error` event in that envelope ends it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.http.errors import describe
from server.http.messages.mapping import to_chat_request
from server.http.messages.output import ContentBlocks, as_event, stop_reason_of, usage_of
from server.http.messages.protocol import (
    CountTokensRequest,
    ErrorEvent,
    MessageDelta,
    MessageOut,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageUsage,
    StopDetails,
    TokenCount,
)
from server.http.serving import (
    Pieces,
    Plan,
    ServeContext,
    collect,
    prepare_chat,
    render_chat,
    streamed,
)
from server.http.sse import named_event, sse_response


async def create_message(ctx: ServeContext, body: MessagesRequest, request: Request) -> Response:
    """POST /v1/messages."""
    ctx.warn_unknown(body.model_extra)
    async with ctx.using(body.model) as model:
        plan = await prepare_chat(ctx, model, to_chat_request(body, ctx.warned_fields), model_id=body.model)
    message_id = "msg_" + plan.job.id.removeprefix("chatcmpl-")
    if body.stream:
        shutdown = anyio.Event()
        return sse_response(_stream(ctx, plan, message_id, shutdown), ctx.settings.keepalive_s, shutdown)
    pieces, _, finished = await collect(ctx, plan, request)
    blocks = ContentBlocks()
    blocks.feed(pieces)
    blocks.finish()
    stop_reason, stop_sequence = stop_reason_of(finished.stats, blocks.complete_calls())
    message = MessageOut(
        id=message_id,
        model=plan.model_id,
        content=blocks.content(),
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=usage_of(finished.stats),
    )
    return JSONResponse(message.to_json())


async def count_tokens(ctx: ServeContext, body: CountTokensRequest) -> Response:
    """POST /v1/messages/count_tokens: the prompt tokens /v1/messages would render `body` to (its
    usage counts them as input_tokens plus cache_read_input_tokens)."""
    ctx.warn_unknown(body.model_extra)
    async with ctx.using(body.model) as model:
        _, tokens = await render_chat(ctx, model, to_chat_request(body, ctx.warned_fields))
    return JSONResponse(TokenCount(input_tokens=len(tokens)).to_json())


async def _stream(
    ctx: ServeContext, plan: Plan, message_id: str, shutdown: anyio.Event
) -> AsyncIterator[ServerSentEvent]:
    blocks = ContentBlocks()
    # sent before the prefill: the whole prompt counts as input (message_delta corrects it)
    start_usage = MessageUsage(
        input_tokens=len(plan.job.request.prompt_tokens),
        output_tokens=0,
        cache_read_input_tokens=0,
        cache_creation_input_tokens=0,
    )
    message = MessageOut(
        id=message_id,
        model=plan.model_id,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=start_usage,
    )
    try:
        yield named_event(*as_event(MessageStart(message=message)))
        async for item in streamed(ctx, plan, shutdown):
            if isinstance(item, Pieces):
                for name, payload in blocks.feed(item.pieces):
                    yield named_event(name, payload)
                continue
            for name, payload in blocks.finish():
                yield named_event(name, payload)
            stop_reason, stop_sequence = stop_reason_of(item.stats, blocks.complete_calls())
            delta = StopDetails(stop_reason=stop_reason, stop_sequence=stop_sequence)
            yield named_event(*as_event(MessageDelta(delta=delta, usage=usage_of(item.stats))))
            yield named_event(*as_event(MessageStop()))
    except Exception as exc:  # the worker's failure or the server stopping: reported in-band
        _, body, _ = describe(exc, ctx.engine.queue_full_status, anthropic=True)
        error = body["error"]
        yield named_event(*as_event(ErrorEvent(error=error if isinstance(error, dict) else {})))
    finally:
        # a no-op once the job finished; stops it when the reader left before it was streamed
        plan.job.cancel()
