"""The moeflash exception hierarchy.

MoeflashError
 ├── ConfigError            bad settings or command-line input
 ├── ModelGenError          the synthetic-model generator refused (unknown architecture,
 │                          impossible shape, no disk room, ...)
 ├── ModelLoadError         a model file could not be loaded (missing, truncated, unsupported)
 │    └── HelperError       an RPC helper cannot be used (unreachable, busy, another build)
 │         └── HelperLost   an RPC helper was lost mid-request (the model is loaded again)
 ├── ContextLengthExceeded  a prompt does not fit the context window
 ├── ExpertReadError        reading expert weights from flash failed during a request
 ├── PullError              a model could not be pulled from the Hub (no such repository or
 │                          quant, a checksum that does not match, not a GGUF, network)
 └── RequestError           an HTTP request refused before or while it is served
      ├── InvalidRequest        bad input (validation, template, grammar, n > 1, ...)
      ├── AuthenticationFailed  missing or wrong API key
      ├── ForbiddenOrigin       an Origin header outside the CORS allow-list
      ├── Forbidden             a route the server's settings keep closed (/api/pull without
      │                         --allow-pull)
      ├── InvalidHost           a Host header outside the allow-list (DNS rebinding)
      ├── NotFound              unknown route or model
      ├── MethodNotAllowed      a known route with the wrong method
      ├── PayloadTooLarge       the request body is over the cap
      ├── QueueFull             the FIFO of waiting requests is full
      ├── ServiceUnavailable    the model is loading or the server is shutting down
      └── ClientClosed          the client left before its (non-streamed) answer was ready

Each is mapped once to a CLI exit status and, in the server (server/http/app.py,
`error_response`), to one HTTP status and an OpenAI-shaped error body.
"""

from __future__ import annotations


class MoeflashError(Exception):
    """Base of every error moeflash raises on purpose."""


class ConfigError(MoeflashError):
    """Bad settings or command-line input."""


class ModelGenError(MoeflashError):
    """The synthetic-model generator refused its input or could not write the file."""


class ModelLoadError(MoeflashError):
    """A model file could not be loaded."""


class HelperError(ModelLoadError):
    """An RPC helper (`moeflash worker`) cannot be used: unreachable, serving another main server,
    or running another build."""


class HelperLost(HelperError):
    """An RPC helper was lost during a decode step (gone, or the link cut): the step's output is
    discarded, its requests fail, and the model is loaded again."""


class ContextLengthExceeded(MoeflashError):
    """A prompt (plus the requested completion) does not fit the context window.

    `n_prompt` is the prompt's length and `max_prompt` the longest prompt accepted, in tokens:
    each API words the refusal its own way from them (Anthropic's "N tokens > M maximum")."""

    def __init__(self, message: str, *, n_prompt: int, max_prompt: int) -> None:
        super().__init__(message)
        self.n_prompt = n_prompt
        self.max_prompt = max_prompt


class ExpertReadError(MoeflashError):
    """Reading expert weights from storage failed."""


class PullError(MoeflashError):
    """A model could not be pulled from the Hugging Face Hub, or removed from local storage."""


class RequestError(MoeflashError):
    """An HTTP request is refused; `param` names the offending request field, if any."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(RequestError):
    """Bad input: always a 400, never a 422 or a 500."""


class AuthenticationFailed(RequestError):
    """The Authorization header is missing or does not carry the configured key."""


class ForbiddenOrigin(RequestError):
    """A browser Origin that is neither same-origin nor in the CORS allow-list."""


class Forbidden(RequestError):
    """A route the server's settings keep closed."""


class InvalidHost(RequestError):
    """A Host header outside the allow-list while bound to loopback."""


class NotFound(RequestError):
    """An unknown route or model id."""


class MethodNotAllowed(RequestError):
    """A known route asked with a method it does not serve."""

    def __init__(self, message: str, *, allow: str = "") -> None:
        super().__init__(message, code="method_not_allowed")
        self.allow = allow


class PayloadTooLarge(RequestError):
    """The request body is larger than the configured cap."""


class QueueFull(RequestError):
    """Too many requests are already waiting for the model."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, code="queue_full")
        self.retry_after_s = retry_after_s


class ServiceUnavailable(RequestError):
    """The model is still loading, failed to load, or the server is shutting down."""

    def __init__(self, message: str, *, retry_after_s: int, code: str = "unavailable") -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class ClientClosed(RequestError):
    """The client closed the connection before its non-streamed answer was ready: the job was
    cancelled and the answer (499, nginx's "client closed request") goes to nobody; it is what the
    log and the metrics say of the request."""

    def __init__(self) -> None:
        super().__init__("the client closed the connection before the answer was ready", code="client_closed")
