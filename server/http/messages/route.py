"""The route handlers: POST /v1/messages (whole or streamed) and /v1/messages/count_tokens.

Errors on these routes carry Anthropic's envelope and error types (server/http/errors.py);
after the stream started, one `error` event in that envelope ends it.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.engine.generation import GenerationStats, TokenLogprob
from server.engine.tool_calls import OutPiece
from server.engine.worker import Finished
from server.http.job_events import Pieces
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
    Ctx,
    Frame,
    Plan,
    prepare_chat,
    render_chat,
    respond,
)


async def create_message(body: Annotated[MessagesRequest, Body()], request: Request, ctx: Ctx) -> Response:
    """Anthropic Messages API, whole or streamed (SSE); `x-api-key` is accepted as the key."""
    ctx.warn_unknown(body.model_extra)
    async with ctx.using(body.model) as model:
        plan = await prepare_chat(ctx, model, to_chat_request(body, ctx.warned_fields), model_id=body.model)
    message_id = "msg_" + plan.job.id.removeprefix("chatcmpl-")
    return await respond(ctx, plan, MessageEvents(plan, message_id), request, bool(body.stream))


async def count_tokens(body: Annotated[CountTokensRequest, Body()], ctx: Ctx) -> Response:
    """Anthropic's token count: the prompt tokens /v1/messages renders these fields to (its usage
    counts them as input_tokens plus cache_read_input_tokens)."""
    ctx.warn_unknown(body.model_extra)
    async with ctx.using(body.model) as model:
        _, tokens = await render_chat(ctx, model, to_chat_request(body, ctx.warned_fields))
    return JSONResponse(TokenCount(input_tokens=len(tokens)).to_json())


class MessageEvents:
    """A Messages answer (an EventFormat): message_start, the content blocks' events as the
    pieces come, message_delta with the stop reason and usage, message_stop; an error event in
    Anthropic's envelope."""

    ndjson = False

    def __init__(self, plan: Plan, message_id: str) -> None:
        self._plan = plan
        self._id = message_id
        self._blocks = ContentBlocks()

    def _message(self, blocks: ContentBlocks, stats: GenerationStats | None) -> MessageOut:
        stop_reason, stop_sequence = stop_reason_of(stats, blocks.complete_calls()) if stats else (None, None)
        # before the prefill (stats None) the whole prompt counts as input; message_delta corrects it
        usage = (
            usage_of(stats)
            if stats is not None
            else MessageUsage(
                input_tokens=len(self._plan.job.request.prompt_tokens),
                output_tokens=0,
                cache_read_input_tokens=0,
                cache_creation_input_tokens=0,
            )
        )
        content = blocks.content() if stats is not None else []
        return MessageOut(
            id=self._id,
            model=self._plan.model_id,
            content=content,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=usage,
        )

    def opening(self) -> list[Frame]:
        return [as_event(MessageStart(message=self._message(self._blocks, None)))]

    def pieces(self, item: Pieces) -> list[Frame]:
        return list(self._blocks.feed(item.pieces))

    def closing(self, finished: Finished) -> list[Frame]:
        frames: list[Frame] = list(self._blocks.finish())
        stop_reason, stop_sequence = stop_reason_of(finished.stats, self._blocks.complete_calls())
        delta = StopDetails(stop_reason=stop_reason, stop_sequence=stop_sequence)
        frames.append(as_event(MessageDelta(delta=delta, usage=usage_of(finished.stats))))
        frames.append(as_event(MessageStop()))
        return frames

    def failure(self, error: dict[str, object]) -> list[Frame]:
        inner = error.get("error")
        return [as_event(ErrorEvent(error=inner if isinstance(inner, dict) else {}))]

    def whole(
        self, pieces: list[OutPiece], logprobs: list[TokenLogprob], finished: Finished
    ) -> dict[str, Any]:
        blocks = ContentBlocks()
        blocks.feed(pieces)
        blocks.finish()
        return self._message(blocks, finished.stats).to_json()
