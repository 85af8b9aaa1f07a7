"""Server-sent events exactly as the openai SDK expects them (sse-starlette underneath).

Chat completions: `data: <json>\\n\\n` events only (Responses and Messages: `event:` lines too),
`: ping` comment keep-alives (a non-JSON data line would break the SDK), `data: [DONE]` last.
An error after the 200 went out is sent as `data: {"error": {...}}` followed by `data: [DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent

DONE = "[DONE]"
SEP = "\n"


def _ping() -> ServerSentEvent:
    return ServerSentEvent(comment="ping", sep=SEP)


def event(payload: dict[str, Any] | str) -> ServerSentEvent:
    """One `data:` event: a JSON object, or the literal [DONE]."""
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    )
    return ServerSentEvent(data=data, sep=SEP)


def named_event(name: str, payload: dict[str, Any] | str) -> ServerSentEvent:
    """One `event: <name>` + `data: <json>` event, the framing of the Responses and Anthropic
    Messages streams (their SDKs dispatch on the event name)."""
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    )
    return ServerSentEvent(event=name, data=data, sep=SEP)


# seconds a stream gets, once the server shuts down, to send its last events
SHUTDOWN_GRACE_S = 5.0


def sse_response(
    events: AsyncIterator[ServerSentEvent], keepalive_s: float, shutdown: anyio.Event
) -> EventSourceResponse:
    """A 200 text/event-stream response; pings every `keepalive_s` while nothing is sent.

    `shutdown` is set when the server stops: the producer then cancels its job and ends the
    stream with an error event and [DONE] instead of being cut off.
    """
    return EventSourceResponse(
        events,
        shutdown_event=shutdown,
        shutdown_grace_period=SHUTDOWN_GRACE_S,
        ping=keepalive_s,
        sep=SEP,
        ping_message_factory=_ping,
    )
