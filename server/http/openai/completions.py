"""POST /v1/completions (legacy): a text prompt continued, whole or as an SSE stream of chunks.

No chat template, tools or grammar: the prompt is tokenized as it is (special tokens parsed),
and every text delta of the job is one chunk. The checks, the job's events and the stream loop
are the ones chat completions use (server/http/serving.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body
from starlette.requests import Request
from starlette.responses import Response

from server.engine.generation import GenerationRequest, TokenLogprob
from server.engine.tool_calls import OutPiece
from server.errors import InvalidRequest
from server.http.openai.choices import check_choices, more_choices, respond_choices
from server.http.protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FinishReason,
    TextFinishReason,
    Usage,
)
from server.http.serving import (
    Chunks,
    Ctx,
    Plan,
    check_prompt,
    clamp_max_tokens,
    logit_bias,
    prompt_tokens,
    submit,
    want_timings,
)


async def create_completion(
    body: Annotated[CompletionRequest, Body()], request: Request, ctx: Ctx
) -> Response:
    """Legacy text completion, whole or streamed (SSE)."""
    ctx.warn_unknown(body.model_extra)
    n = check_choices(ctx, body.n)
    if body.suffix:
        raise InvalidRequest("suffix (insertion) is not supported", param="suffix")
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    async with ctx.using(body.model) as model:
        tokens = await prompt_tokens(model, prompt)
        check_prompt(ctx, model, len(tokens), "prompt")
        params = body.to_sampling_params(
            max_tokens=clamp_max_tokens(ctx, model, body.max_tokens, len(tokens)),
            logit_bias=logit_bias(model, body.logit_bias),
        )
        plan = submit(
            ctx,
            model,
            "cmpl-",
            GenerationRequest(tokens, params),
            TextOutput(),
            model_id=body.model,
            timings=want_timings(body.timings, request),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
        )
        plans = more_choices(ctx, plan, n)
    echo = prompt if body.echo else ""
    return await respond_choices(
        ctx, plans, lambda p: Chunks(p, TextFormat(p, echo)), request, bool(body.stream)
    )


class TextOutput:
    """The Output of a legacy completion: each text delta is one content piece, as it comes
    (an empty one too: it may carry logprobs)."""

    n_calls = 0

    def feed(self, text: str) -> list[OutPiece]:
        return [("content", text)]

    def finish(self) -> list[OutPiece]:
        return []


def _legacy_logprobs(lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.token)
    return CompletionLogprobs(
        tokens=[lp.token for lp in lps],
        token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=[{t.token: t.logprob for t in lp.top_logprobs} for lp in lps],
        text_offset=offsets,
    )


def _finish(finish: FinishReason) -> TextFinishReason:
    return "length" if finish == "length" else "stop"  # no tools here: never tool_calls


class TextFormat:
    """Legacy completion chunks and the whole completion of one plan (a ChunkFormat); `echo` is
    the prompt when echoed (its own first chunk), else ""."""

    def __init__(self, plan: Plan, echo: str) -> None:
        self._plan = plan
        self._echo = echo

    def _completion(self, choices: list[CompletionChoice], **fields: Any) -> Completion:
        plan = self._plan
        return Completion(
            id=plan.job.id,
            created=plan.created,
            model=plan.model_id,
            system_fingerprint=plan.fingerprint,
            choices=choices,
            **fields,
        )

    def _chunk(
        self, text: str, logprobs: list[TokenLogprob], finish: FinishReason | None = None, **fields: Any
    ) -> Completion:
        lps = _legacy_logprobs(logprobs, 0) if logprobs else None
        finish_reason = _finish(finish) if finish is not None else None
        choice = CompletionChoice(index=0, text=text, logprobs=lps, finish_reason=finish_reason)
        return self._completion([choice], **fields)

    def opening(self) -> list[Completion]:
        return [self._chunk(self._echo, [])] if self._echo else []

    def piece(
        self, piece: OutPiece, logprobs: list[TokenLogprob], timings: dict[str, Any] | None
    ) -> Completion:
        assert isinstance(piece, tuple)  # TextOutput gives text pieces only
        return self._chunk(piece[1], logprobs, timings=timings)

    def last(
        self, finish: FinishReason, logprobs: list[TokenLogprob], timings: dict[str, Any] | None
    ) -> Completion:
        return self._chunk("", logprobs, finish, timings=timings)

    def usage(self, usage: dict[str, Any]) -> Completion:
        return self._completion([], usage=Usage.model_validate(usage))

    def whole(
        self,
        pieces: list[OutPiece],
        logprobs: list[TokenLogprob],
        finish: FinishReason,
        usage: dict[str, Any],
        timings: dict[str, Any] | None,
    ) -> Completion:
        text = self._echo + "".join(piece[1] for piece in pieces if isinstance(piece, tuple))
        lps = _legacy_logprobs(logprobs, len(self._echo)) if self._plan.job.request.params.logprobs else None
        choice = CompletionChoice(index=0, text=text, logprobs=lps, finish_reason=_finish(finish))
        return self._completion([choice], usage=Usage.model_validate(usage), timings=timings)
