"""POST /v1/chat/completions: a ChatCompletionRequest -> the engine's ChatRequest -> a chat
completion, whole or as an SSE stream of chunks.

The checks only this API has (media parts, top_logprobs, logit_bias; n in choices.py) run here;
the rest is the one chat path of server/http/serving.py. Streaming follows docs/api.md: a first
chunk with the assistant role, one chunk per content / reasoning / tool-call piece, a last chunk
with the finish_reason, the usage chunk if asked, then [DONE].
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body
from starlette.requests import Request
from starlette.responses import Response

from server.engine.generation import TokenLogprob
from server.engine.tool_calls import OutPiece, ToolCallArgs, ToolCallStart
from server.errors import InvalidRequest
from server.http.openai.choices import check_choices, more_choices, respond_choices
from server.http.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    FinishReason,
    FunctionCall,
    FunctionDelta,
    ResponseMessage,
    TokenLogprobOut,
    ToolCall,
    ToolCallDelta,
    TopLogprobOut,
    Usage,
    media_parts,
)
from server.http.serving import (
    Chunks,
    Ctx,
    Plan,
    logit_bias,
    prepare_chat,
    want_timings,
)


async def create_chat_completion(
    body: Annotated[ChatCompletionRequest, Body()], request: Request, ctx: Ctx
) -> Response:
    """Chat completion, whole or streamed (SSE)."""
    ctx.warn_unknown(body.model_extra)
    n = check_choices(ctx, body.n)
    for param, kind in media_parts(body.messages):
        raise InvalidRequest(
            f"this model takes text only: the content part at {param} is {kind!r}; send text parts "
            "(type 'text') or a string",
            param=param,
            code="unsupported_content",
        )
    if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    async with ctx.using(body.model) as model:
        chat = body.to_chat_request(
            max_tokens_cap=ctx.settings.max_completion_tokens, logit_bias=logit_bias(model, body.logit_bias)
        )
        plan = await prepare_chat(
            ctx,
            model,
            chat,
            model_id=body.model,
            timings=want_timings(body.timings, request),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
        )
        plans = more_choices(ctx, plan, n)
    return await respond_choices(ctx, plans, lambda p: Chunks(p, ChatFormat(p)), request, bool(body.stream))


def chat_logprobs(lps: list[TokenLogprob]) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            TokenLogprobOut(
                token=lp.token,
                logprob=lp.logprob,
                bytes=lp.bytes,
                top_logprobs=[
                    TopLogprobOut(token=t.token, logprob=t.logprob, bytes=t.bytes) for t in lp.top_logprobs
                ],
            )
            for lp in lps
        ]
    )


def _delta(piece: OutPiece) -> ChoiceDelta:
    if isinstance(piece, ToolCallStart):
        start = ToolCallDelta(
            index=piece.index,
            id=piece.id,
            type="function",
            function=FunctionDelta(name=piece.name, arguments=""),
        )
        return ChoiceDelta(tool_calls=[start])
    if isinstance(piece, ToolCallArgs):
        return ChoiceDelta(
            tool_calls=[ToolCallDelta(index=piece.index, function=FunctionDelta(arguments=piece.text))]
        )
    kind, text = piece
    return ChoiceDelta(reasoning_content=text) if kind == "reasoning" else ChoiceDelta(content=text)


class ChatFormat:
    """Chat completion chunks and the whole chat completion of one plan (a ChunkFormat)."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan

    def _chunk(self, **fields: Any) -> ChatCompletionChunk:
        plan = self._plan
        return ChatCompletionChunk(
            id=plan.job.id,
            created=plan.created,
            model=plan.model_id,
            system_fingerprint=plan.fingerprint,
            **fields,
        )

    def _choice(
        self, delta: ChoiceDelta, logprobs: list[TokenLogprob], finish: FinishReason | None = None
    ) -> list[ChunkChoice]:
        lps = chat_logprobs(logprobs) if logprobs else None
        return [ChunkChoice(index=0, delta=delta, logprobs=lps, finish_reason=finish)]

    def opening(self) -> list[ChatCompletionChunk]:
        return [self._chunk(choices=self._choice(ChoiceDelta(role="assistant", content=""), []))]

    def piece(
        self, piece: OutPiece, logprobs: list[TokenLogprob], timings: dict[str, Any] | None
    ) -> ChatCompletionChunk:
        return self._chunk(choices=self._choice(_delta(piece), logprobs), timings=timings)

    def last(
        self, finish: FinishReason, logprobs: list[TokenLogprob], timings: dict[str, Any] | None
    ) -> ChatCompletionChunk:
        return self._chunk(choices=self._choice(ChoiceDelta(), logprobs, finish), timings=timings)

    def usage(self, usage: dict[str, Any]) -> ChatCompletionChunk:
        return self._chunk(choices=[], usage=Usage.model_validate(usage))

    def whole(
        self,
        pieces: list[OutPiece],
        logprobs: list[TokenLogprob],
        finish: FinishReason,
        usage: dict[str, Any],
        timings: dict[str, Any] | None,
    ) -> ChatCompletion:
        plan = self._plan
        texts: dict[str, str] = {}
        calls: list[ToolCall] = []
        for piece in pieces:
            if isinstance(piece, ToolCallStart):
                calls.append(ToolCall(id=piece.id, function=FunctionCall(name=piece.name, arguments="")))
            elif isinstance(piece, ToolCallArgs):
                calls[piece.index].function.arguments += piece.text
            else:
                texts[piece[0]] = texts.get(piece[0], "") + piece[1]
        message = ResponseMessage(
            # no text at all: "" for an answer, null beside tool calls (as OpenAI)
            content=texts.get("content", "" if not calls else None),
            tool_calls=calls or None,
            reasoning_content=texts.get("reasoning"),
        )
        choice = ChatChoice(
            index=0,
            message=message,
            logprobs=chat_logprobs(logprobs) if plan.job.request.params.logprobs else None,
            finish_reason=finish,
        )
        return ChatCompletion(
            id=plan.job.id,
            created=plan.created,
            model=plan.model_id,
            system_fingerprint=plan.fingerprint,
            choices=[choice],
            usage=Usage.model_validate(usage),
            timings=timings,
        )
