"""The route handler: POST /v1/responses, whole or as a stream of events."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body
from starlette.requests import Request
from starlette.responses import Response

from server.engine.generation import GenerationStats, TokenLogprob
from server.engine.tool_calls import OutPiece
from server.engine.worker import Finished
from server.http.job_events import Pieces
from server.http.openai.responses.mapping import Toolbox, to_chat_request
from server.http.openai.responses.output import OutputBuilder, OutputShape, new_id
from server.http.openai.responses.protocol import ResponsesRequest, ResponseStatus
from server.http.serving import Ctx, Frame, Plan, finish_reason, prepare_chat, respond


def _status(stats: GenerationStats, plan: Plan) -> ResponseStatus:
    return "incomplete" if finish_reason(stats, plan.output.n_calls) == "length" else "completed"


async def create_response(body: Annotated[ResponsesRequest, Body()], request: Request, ctx: Ctx) -> Response:
    """OpenAI Responses API (stateless), whole or streamed (SSE)."""
    ctx.warn_unknown(body.model_extra)
    chat, tools = to_chat_request(body, ctx.warned_fields, ctx.settings.max_completion_tokens)
    async with ctx.using(body.model) as model:
        plan = await prepare_chat(ctx, model, chat, model_id=body.model)
    shape = OutputShape(new_id("resp"), plan.created, body)
    return await respond(ctx, plan, ResponseEvents(plan, shape, tools), request, bool(body.stream))


class ResponseEvents:
    """A Responses answer (an EventFormat): response.created and .in_progress, the output items'
    events as the pieces come, then response.completed (or .incomplete); each event numbered by
    its sequence_number; an `error` event if the job fails after the 200."""

    ndjson = False

    def __init__(self, plan: Plan, shape: OutputShape, tools: Toolbox) -> None:
        self._plan = plan
        self._shape = shape
        self._builder = OutputBuilder(tools)
        self._tools = tools
        self._sequence = 0

    def _event(self, kind: str, payload: dict[str, Any]) -> Frame:
        self._sequence += 1
        return kind, {"type": kind, "sequence_number": self._sequence - 1, **payload}

    def opening(self) -> list[Frame]:
        start = {"response": self._shape.response("in_progress", [], None)}
        return [self._event("response.created", start), self._event("response.in_progress", start)]

    def pieces(self, item: Pieces) -> list[Frame]:
        return [
            self._event(kind, payload) for piece in item.pieces for kind, payload in self._builder.feed(piece)
        ]

    def closing(self, finished: Finished) -> list[Frame]:
        frames = [self._event(kind, payload) for kind, payload in self._builder.finish()]
        status = _status(finished.stats, self._plan)
        final = self._shape.response(status, self._builder.output(), finished.stats)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*frames, self._event(kind, {"response": final})]

    def failure(self, error: dict[str, object]) -> list[Frame]:
        inner = error.get("error")
        fields = inner if isinstance(inner, dict) else {}
        payload = {"code": fields.get("code"), "message": fields.get("message"), "param": fields.get("param")}
        return [self._event("error", payload)]

    def whole(
        self, pieces: list[OutPiece], logprobs: list[TokenLogprob], finished: Finished
    ) -> dict[str, Any]:
        builder = OutputBuilder(self._tools)
        for piece in pieces:
            for _ in builder.feed(piece):
                pass
        for _ in builder.finish():
            pass
        return self._shape.response(_status(finished.stats, self._plan), builder.output(), finished.stats)
