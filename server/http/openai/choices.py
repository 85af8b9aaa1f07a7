"""`n` > 1 on chat and legacy completions: a request's choices decoded side by side.

Each choice is a job of its own on the engine (one slot each, up to `--parallel`) with the same
prompt, id and settings; a seeded request's choice i samples with seed + i, so the choices differ
and a replay gives them again. Submitted together, the later choices take the prompt's KV from
the first one's slot instead of prefilling it again (server/engine/token_loop.py). A whole answer
lists every choice; a stream carries each choice's chunks under its index as they come, then one
usage chunk and one `[DONE]`. Usage counts the prompt once and every choice's completion.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.errors import InvalidRequest
from server.http.job_events import collect
from server.http.serving import (
    EventFormat,
    Frame,
    Plan,
    ServeContext,
    frames_of,
    respond,
    sse_events,
)
from server.http.sse import DONE, sse_response


def check_choices(ctx: ServeContext, n: int | None) -> int:
    """The choices asked for: 1 to the requests the model decodes together."""
    slots = max(1, ctx.engine.slots)
    if n is not None and not 1 <= n <= slots:
        raise InvalidRequest(
            f"n must be 1 to {slots}: the choices decode side by side, and this server decodes "
            f"{slots} request(s) together (--parallel)",
            param="n",
        )
    return n or 1


def more_choices(ctx: ServeContext, plan: Plan, n: int) -> list[Plan]:
    """`plan` and n - 1 more choices of its request, submitted at once (QueueFull refuses the
    rest; the first then runs alone and the caller's refusal cancels it)."""
    plans = [plan]
    params = plan.job.request.params
    try:
        for i in range(1, n):
            seed = None if params.seed is None else (params.seed + i) & 0xFFFFFFFF
            request = replace(plan.job.request, params=replace(params, seed=seed))
            job = ctx.engine.submit(plan.job.id, request)
            plans.append(replace(plan, job=job, output=copy.deepcopy(plan.output)))
    except BaseException:
        for submitted in plans:
            submitted.job.cancel()
        raise
    return plans


def _usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    first = usages[0]
    completion = sum(int(u["completion_tokens"]) for u in usages)
    return {**first, "completion_tokens": completion, "total_tokens": first["prompt_tokens"] + completion}


async def respond_choices(
    ctx: ServeContext,
    plans: list[Plan],
    fmt: Callable[[Plan], EventFormat],
    request: Request,
    stream: bool,
) -> Response:
    """`respond` for a request's choices: `fmt` writes one choice's output."""
    if len(plans) == 1:
        return await respond(ctx, plans[0], fmt(plans[0]), request, stream)
    if not stream:
        bodies = [
            fmt(plan).whole(*collected)
            for plan, collected in zip(plans, await collect(ctx, plans, request), strict=True)
        ]
        choices = [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]
        return JSONResponse({**bodies[0], "choices": choices, "usage": _usage([b["usage"] for b in bodies])})
    shutdown = anyio.Event()
    streams = [frames_of(ctx, plan, fmt(plan), shutdown, request.url.path) for plan in plans]
    return sse_response(sse_events(_merged(streams)), ctx.settings.keepalive_s, shutdown)


async def _merged(streams: list[AsyncGenerator[Frame, None]]) -> AsyncGenerator[Frame, None]:
    """The choices' frames as they come, each chunk's choice under its index; the usage chunks
    become one and the `[DONE]`s one, last. Closing it closes every choice's stream (their jobs
    are cancelled there)."""
    queue: asyncio.Queue[tuple[int, Frame | None]] = asyncio.Queue()

    async def pump(i: int, frames: AsyncGenerator[Frame, None]) -> None:
        try:
            async with aclosing(frames):
                async for frame in frames:
                    queue.put_nowait((i, frame))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, frames)) for i, frames in enumerate(streams)]
    usage: list[dict[str, Any]] = []
    last: dict[str, Any] | None = None
    try:
        left = len(tasks)
        while left:
            i, frame = await queue.get()
            if frame is None:
                left -= 1
                continue
            name, payload = frame
            if not isinstance(payload, dict):
                continue  # [DONE]: once, below
            if payload.get("usage") and not payload.get("choices"):
                usage.append(payload["usage"])
                last = payload
                continue
            if payload.get("choices"):
                payload = {**payload, "choices": [{**c, "index": i} for c in payload["choices"]]}
            yield name, payload
        if last is not None:
            yield None, {**last, "usage": _usage(usage)}
        yield None, DONE
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
