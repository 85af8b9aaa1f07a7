"""Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) on the chat path.

A Messages request is validated (every number bounded: out of range is a 400; unknown
fields accepted and logged once), mapped onto the engine's ChatRequest and run by
`prepare_chat`, so it is refused, if at all, before the response starts, exactly like a chat
request.

One module per job: protocol.py (the request, answer and stream-event models), mapping.py (a
request -> the engine's ChatRequest), output.py (chat pieces -> content blocks, stop reason,
usage and stream events), route.py (the handlers; errors in Anthropic's envelope); `router()` routes them.
"""

from fastapi import APIRouter

from server.http.messages.mapping import to_chat_request
from server.http.messages.output import ContentBlocks
from server.http.messages.protocol import CountTokensRequest, MessageOut, MessagesRequest, TokenCount
from server.http.messages.route import count_tokens, create_message


def router() -> APIRouter:
    """Anthropic's routes."""
    routes = APIRouter(tags=["anthropic"])
    routes.add_api_route(
        "/v1/messages",
        create_message,
        methods=["POST"],
        responses={200: {"model": MessageOut, "description": "a message, or an SSE stream of its events"}},
    )
    routes.add_api_route(
        "/v1/messages/count_tokens",
        count_tokens,
        methods=["POST"],
        responses={200: {"model": TokenCount, "description": "the prompt's length in tokens"}},
    )
    return routes


__all__ = [
    "ContentBlocks",
    "CountTokensRequest",
    "MessageOut",
    "MessagesRequest",
    "TokenCount",
    "router",
    "to_chat_request",
]
