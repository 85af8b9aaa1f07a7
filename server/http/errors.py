"""The one mapping from exceptions to HTTP: status, headers and the error body.

Used by the app's exception handlers, by the security middleware (which answers before
FastAPI routes) and by the streams' in-band errors, so every error path shares one shape.
The OpenAI routes: {"error": {"message", "type", "param", "code"}}. The Anthropic routes
(/v1/messages and everything under it, `is_anthropic`): Anthropic's envelope
{"type": "error", "error": {"type", "message", "param", "code"}} with Anthropic's error type
for the status (invalid_request_error for any 4xx it has no type for, overloaded_error for
503, api_error for 500), and a context overflow in Anthropic's words, "prompt is too long:
N tokens > M maximum", which Claude Code compacts its conversation on. param and code are
this server's additions to either envelope. The Ollama routes (/api/...): Ollama's
{"error": "<message>"}, which the ollama libraries raise as ResponseError.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import JSONResponse

from server.errors import (
    AuthenticationFailed,
    ClientClosed,
    ContextLengthExceeded,
    ExpertReadError,
    Forbidden,
    ForbiddenOrigin,
    InvalidHost,
    InvalidRequest,
    MethodNotAllowed,
    ModelLoadError,
    NotFound,
    PayloadTooLarge,
    PullError,
    QueueFull,
    RequestError,
    ServiceUnavailable,
)

logger = logging.getLogger(__name__)

# Anthropic's API: this route and every path under it (count_tokens, unknown ones for their 404)
ANTHROPIC_PREFIX = "/v1/messages"

# Ollama's API: every path under it
OLLAMA_PREFIX = "/api/"

# Anthropic's error type per status (docs.anthropic.com/en/api/errors); another 4xx is an
# invalid_request_error, another 5xx an api_error
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# (status, OpenAI error type) per exception class; the first isinstance match wins
_STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (InvalidRequest, 400, "invalid_request_error"),
    (ContextLengthExceeded, 400, "invalid_request_error"),
    (InvalidHost, 400, "invalid_request_error"),
    (AuthenticationFailed, 401, "authentication_error"),
    (ForbiddenOrigin, 403, "permission_error"),
    (Forbidden, 403, "permission_error"),
    (PullError, 400, "invalid_request_error"),
    (NotFound, 404, "not_found_error"),
    (MethodNotAllowed, 405, "invalid_request_error"),
    (PayloadTooLarge, 413, "invalid_request_error"),
    (QueueFull, 429, "rate_limit_error"),
    (ServiceUnavailable, 503, "service_unavailable_error"),
    (ClientClosed, 499, "client_closed_request"),
    (ModelLoadError, 503, "service_unavailable_error"),
    (ExpertReadError, 500, "server_error"),
)


def is_anthropic(path: str) -> bool:
    """Whether `path` is a route of Anthropic's API (its envelope, and x-api-key as the key)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def is_ollama(path: str) -> bool:
    """Whether `path` is a route of the Ollama API (its envelope)."""
    return path.startswith(OLLAMA_PREFIX)


def anthropic_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def describe(
    exc: BaseException, queue_full_status: int = 429, *, anthropic: bool = False, ollama: bool = False
) -> tuple[int, dict[str, object], dict[str, str]]:
    """(status, body, headers) for an exception, in Anthropic's envelope and words if
    `anthropic`, in Ollama's if `ollama`; unknown exceptions are a logged 500."""
    headers: dict[str, str] = {}
    match = next(((status, type_) for cls, status, type_ in _STATUS if isinstance(exc, cls)), None)
    if match is None:
        logger.error("unexpected error: %r", exc, exc_info=exc)
        status, type_ = 500, "server_error"
        message, param, code = "internal server error", None, None
    else:
        status, type_ = match
        message = str(exc)
        param = exc.param if isinstance(exc, RequestError) else None
        code = exc.code if isinstance(exc, RequestError) else None
    if isinstance(exc, ContextLengthExceeded):
        code, param = "context_length_exceeded", "messages"
        if anthropic:
            message = f"prompt is too long: {exc.n_prompt} tokens > {exc.max_prompt} maximum"
    if isinstance(exc, QueueFull):
        status = queue_full_status
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, ServiceUnavailable):
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, MethodNotAllowed) and exc.allow:
        headers["Allow"] = exc.allow
    if isinstance(exc, AuthenticationFailed):
        headers["WWW-Authenticate"] = "Bearer"
    if anthropic:
        return status, {"type": "error", **error_body(message, anthropic_type(status), param, code)}, headers
    if ollama:
        return status, {"error": message}, headers
    return status, error_body(message, type_, param, code), headers


def error_response(exc: BaseException, queue_full_status: int = 429, path: str = "") -> JSONResponse:
    """A JSONResponse for `exc` (see `describe`) to a request for `path`."""
    status, body, headers = describe(
        exc, queue_full_status, anthropic=is_anthropic(path), ollama=is_ollama(path)
    )
    return JSONResponse(body, status_code=status, headers=headers)


def _located(loc: Sequence[Any], body: Any, kind: str) -> tuple[str, ...]:
    """The parts of a validation error's location that name a place in `body`: pydantic's union
    branch labels (`str`, `list[...]`) and tags (`function_call`) are not in the body and are
    dropped; the last part stays for a field that is missing or not allowed."""
    node, out = body, []
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            node = node[part]
        elif not (i == len(loc) - 1 and kind in ("missing", "extra_forbidden")):
            continue
        out.append(str(part))
    return tuple(out)


def validation_error(errors: Sequence[Mapping[str, Any]], body: Any) -> InvalidRequest:
    """One 400 for a request's validation errors: the deepest error, its `param` the field in the
    body that failed (`input.1.arguments`), never a union branch (`input.str`). Errors at the
    places above it are the union's other branches failing too, and are not counted as more."""
    if not errors:
        return InvalidRequest("invalid request", code="invalid_value")
    located = [(_located(e.get("loc", ())[1:], body, str(e.get("type"))), e) for e in errors]
    path, first = max(located, key=lambda pair: len(pair[0]))
    others = {p for p, _ in located if p != path[: len(p)]}
    param = ".".join(path) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    more = f" (and {len(others)} more problems)" if others else ""
    where = f"{param}: " if param else ""
    return InvalidRequest(f"{where}{message}{more}", param=param, code="invalid_value")
