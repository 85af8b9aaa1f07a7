"""The one mapping from exceptions to HTTP: status, headers and the OpenAI error body.

Used by the app's exception handlers and by the security middleware (which answers before
FastAPI routes), so every error path shares one shape:
{"error": {"message", "type", "param", "code"}}. On the Anthropic routes (ANTHROPIC_PATHS) the
body also carries "type": "error" at the top, the envelope Anthropic's SDKs read.
"""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from server.errors import (
    AuthenticationFailed,
    ContextLengthExceeded,
    ExpertReadError,
    ForbiddenOrigin,
    InvalidHost,
    InvalidRequest,
    MethodNotAllowed,
    ModelLoadError,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    RequestError,
    ServiceUnavailable,
)

logger = logging.getLogger(__name__)

# routes of Anthropic's API: their error bodies add "type": "error", and they accept x-api-key
ANTHROPIC_PATHS = frozenset({"/v1/messages"})

# (status, OpenAI error type) per exception class; the first isinstance match wins
_STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (InvalidRequest, 400, "invalid_request_error"),
    (ContextLengthExceeded, 400, "invalid_request_error"),
    (InvalidHost, 400, "invalid_request_error"),
    (AuthenticationFailed, 401, "authentication_error"),
    (ForbiddenOrigin, 403, "permission_error"),
    (NotFound, 404, "not_found_error"),
    (MethodNotAllowed, 405, "invalid_request_error"),
    (PayloadTooLarge, 413, "invalid_request_error"),
    (QueueFull, 429, "rate_limit_error"),
    (ServiceUnavailable, 503, "service_unavailable_error"),
    (ModelLoadError, 503, "service_unavailable_error"),
    (ExpertReadError, 500, "server_error"),
)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def describe(
    exc: BaseException, queue_full_status: int = 429
) -> tuple[int, dict[str, object], dict[str, str]]:
    """(status, body, headers) for an exception; unknown exceptions are a logged 500."""
    headers: dict[str, str] = {}
    match = next(((status, type_) for cls, status, type_ in _STATUS if isinstance(exc, cls)), None)
    if match is None:
        logger.error("unexpected error: %r", exc, exc_info=exc)
        return 500, error_body("internal server error", "server_error"), headers
    status, type_ = match
    param = exc.param if isinstance(exc, RequestError) else None
    code = exc.code if isinstance(exc, RequestError) else None
    if isinstance(exc, ContextLengthExceeded):
        code, param = "context_length_exceeded", "messages"
    if isinstance(exc, QueueFull):
        status = queue_full_status
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, ServiceUnavailable):
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, MethodNotAllowed) and exc.allow:
        headers["Allow"] = exc.allow
    if isinstance(exc, AuthenticationFailed):
        headers["WWW-Authenticate"] = "Bearer"
    return status, error_body(str(exc), type_, param, code), headers


def error_response(exc: BaseException, queue_full_status: int = 429, path: str = "") -> JSONResponse:
    """A JSONResponse for `exc` (see `describe`) to a request for `path`."""
    status, body, headers = describe(exc, queue_full_status)
    if path in ANTHROPIC_PATHS:
        body = {"type": "error", **body}
    return JSONResponse(body, status_code=status, headers=headers)
