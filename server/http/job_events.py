"""A submitted job's events as an HTTP route reads them: its output as `Pieces` through
`generated`, wrapped by `collect` for a whole answer (the jobs cancelled if the client leaves:
ClientClosed) and by `streamed` for a stream (cancelled when the server shuts down or the reader
goes away). server/http/serving.py's `respond` drives them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request

from server.engine.generation import TextDelta, TokenLogprob
from server.engine.tool_calls import OutPiece
from server.engine.worker import Failed, Finished, Job
from server.errors import ClientClosed, ServiceUnavailable
from server.http.timings import token_timings

if TYPE_CHECKING:
    from server.http.serving import Plan, ServeContext

# what a request still connected when its job was cancelled gets: only shutdown does that
_SHUTDOWN = ServiceUnavailable("the server is shutting down", retry_after_s=5, code="shutting_down")


@dataclass(frozen=True)
class Pieces:
    """Output of a job as it comes: content / reasoning / tool-call pieces, the logprobs of their
    tokens and, with the timings extension on, the timings of the decode step behind them."""

    pieces: list[OutPiece]
    logprobs: list[TokenLogprob]
    timings: dict[str, Any] | None = None


async def generated(ctx: ServeContext, plan: Plan) -> AsyncIterator[Pieces | Finished]:
    """A job's output pieces, then its Finished event (observed by the metrics). A failure on the
    worker is raised; a job cancelled while its reader is still here means the server is
    stopping (raised as such). The caller cancels the job when it stops reading."""
    async for ev in plan.job.events():
        if isinstance(ev, TextDelta):
            timings = token_timings(ev.timing) if plan.timings and ev.timing is not None else None
            yield Pieces(plan.output.feed(ev.text), list(ev.logprobs), timings)
        elif isinstance(ev, Failed):
            raise ev.error
        elif ev.stats.finish_reason == "cancelled":
            raise _SHUTDOWN
        else:
            yield Pieces(plan.output.finish(), [])
            ctx.metrics.observe(ev.stats)
            yield ev


async def _watch_disconnect(request: Request, jobs: list[Job]) -> None:
    # after the body is read, receive() only returns when the client goes away
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for job in jobs:
                job.cancel()
            return


Collected = tuple[list[OutPiece], list[TokenLogprob], Finished]


async def _collected(ctx: ServeContext, plan: Plan) -> Collected:
    pieces: list[OutPiece] = []
    logprobs: list[TokenLogprob] = []
    finished: Finished | None = None
    async for item in generated(ctx, plan):
        if isinstance(item, Pieces):
            pieces += item.pieces
            logprobs += item.logprobs
        else:
            finished = item
    assert finished is not None  # generated() ends with it or raises
    return pieces, logprobs, finished


async def collect(ctx: ServeContext, plans: list[Plan], request: Request) -> list[Collected]:
    """Non-streamed jobs (a request's choices) run to their end, cancelled if the client leaves
    (ClientClosed then, not the server's shutdown)."""
    watcher = asyncio.create_task(_watch_disconnect(request, [plan.job for plan in plans]))
    try:
        return list(await asyncio.gather(*(_collected(ctx, plan) for plan in plans)))
    except ServiceUnavailable as exc:
        if watcher.done():  # it returns only once the client has gone
            raise ClientClosed from exc
        raise
    finally:
        watcher.cancel()
        for plan in plans:
            plan.job.cancel()


async def _cancel_on(shutdown: anyio.Event, job: Job) -> None:
    await shutdown.wait()
    job.cancel()


async def streamed(ctx: ServeContext, plan: Plan, shutdown: anyio.Event) -> AsyncIterator[Pieces | Finished]:
    """`generated` for a stream: the job is cancelled when the server shuts down or the reader
    goes away (the generator is closed)."""
    watcher = asyncio.create_task(_cancel_on(shutdown, plan.job))
    try:
        async for item in generated(ctx, plan):
            yield item
    finally:
        watcher.cancel()
        # a no-op when the job finished; stops the worker when the client went away
        plan.job.cancel()
