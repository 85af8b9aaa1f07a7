"""Security checks in front of every route (pure ASGI, so they also cover /docs and 404s).

Order: Host allow-list (loopback only: DNS-rebinding defence) -> Origin allow-list (a
browser page from another origin is refused, not just left without CORS headers; the CORS
middleware outside this one answers allowed preflights) -> Bearer key (constant-time
compare; /health and the chat page at / are exempt; the Anthropic routes, /v1/messages and
under it, also take it as `x-api-key`) -> body cap (Content-Length up front, and counted while read).
"""

from __future__ import annotations

import hmac
import logging
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import AuthenticationFailed, ForbiddenOrigin, InvalidHost, PayloadTooLarge, RequestError
from server.http.errors import error_response, is_anthropic

logger = logging.getLogger(__name__)

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# the health probe, and the chat page itself (static; it asks for the key and sends it on its calls)
NO_AUTH_PATHS = frozenset({"/health", "/"})


def _host_name(host: str) -> str:
    """The name part of a Host header value (port and IPv6 brackets removed), lower-case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class SecurityMiddleware:
    """Host, Origin, API key and body-size checks; errors in the route's API's envelope."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        loopback: bool,
        allowed_hosts: list[str],
        cors_origins: list[str],
        max_body_bytes: int,
    ) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._loopback = loopback
        self._hosts = LOOPBACK_NAMES | {h.lower() for h in allowed_hosts}
        self._origins = frozenset(o.rstrip("/").lower() for o in cors_origins)
        self._max_body = max_body_bytes

    def _check(self, scope: Scope, headers: dict[str, str]) -> None:
        host = headers.get("host", "")
        if self._loopback and _host_name(host) not in self._hosts:
            raise InvalidHost(f"Host header {host!r} is not allowed", code="invalid_host")
        origin = headers.get("origin")
        if origin is not None and origin.rstrip("/").lower() not in self._origins:
            parts = urlsplit(origin)
            # same-origin requests (the web page at /) carry an Origin equal to the Host
            if parts.netloc.lower() != host.lower():
                raise ForbiddenOrigin(
                    f"Origin {origin!r} is not allowed (see --cors-origin)", code="forbidden_origin"
                )
        # a CORS preflight never carries credentials; the CORS middleware answers it
        preflight = scope["method"] == "OPTIONS" and "access-control-request-method" in headers
        if self._key is not None and scope["path"] not in NO_AUTH_PATHS and not preflight:
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            bearer = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key)
            # Anthropic's SDKs send the key as x-api-key
            anthropic = is_anthropic(scope["path"])
            x_api_key = anthropic and hmac.compare_digest(
                headers.get("x-api-key", "").strip().encode(), self._key
            )
            if not (bearer or x_api_key):
                also = " or 'x-api-key: KEY'" if anthropic else ""
                raise AuthenticationFailed(
                    f"missing or invalid API key (send 'Authorization: Bearer KEY'{also})",
                    code="invalid_api_key",
                )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            raise PayloadTooLarge(
                f"request body of {length} bytes is over the {self._max_body}-byte cap", code="body_too_large"
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check(scope, headers)
        except RequestError as exc:
            await error_response(exc, path=scope["path"])(scope, receive, send)
            return
        await self.app(scope, self._capped(receive), send)

    def _capped(self, receive: Receive) -> Receive:
        seen = 0

        async def capped_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._max_body:
                    # a chunked body without Content-Length: caught by the app's handlers -> 413
                    raise PayloadTooLarge(
                        f"request body is over the {self._max_body}-byte cap", code="body_too_large"
                    )
            return message

        return capped_receive
