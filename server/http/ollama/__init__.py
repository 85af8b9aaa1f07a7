"""The Ollama API subset (/api/tags, /api/show, /api/ps, /api/version, /api/chat,
/api/generate, and with --allow-pull /api/pull and /api/delete) on the chat path.

Ollama clients (the `ollama` Python and JS libraries, Open WebUI's Ollama connection, phone
apps) speak it. A chat or generate request is validated (every number bounded: out of range is
a 400; unknown fields and Ollama-only options accepted and logged once), mapped onto the
engine's ChatRequest and run by `prepare_chat`, so it is refused, if at all, before the answer
starts, exactly like a chat completion; errors carry Ollama's {"error": "..."} envelope.

One module per job: protocol.py (the request and answer models), mapping.py (a request -> the
engine's ChatRequest and sampling), output.py (chat pieces -> message text, thinking, tool calls,
durations), route.py (chat and generate, NDJSON streaming), models.py (tags, show, ps, version,
pull, delete); `router()` routes them.
"""

from fastapi import APIRouter

from server.http.ollama.models import delete, pull, running, show, tags, version
from server.http.ollama.route import chat, generate


def router() -> APIRouter:
    """The Ollama routes."""
    routes = APIRouter(tags=["ollama"])
    routes.add_api_route("/api/tags", tags, methods=["GET"])
    routes.add_api_route("/api/ps", running, methods=["GET"])
    routes.add_api_route("/api/version", version, methods=["GET"])
    routes.add_api_route("/api/show", show, methods=["POST"])
    routes.add_api_route("/api/chat", chat, methods=["POST"])
    routes.add_api_route("/api/generate", generate, methods=["POST"])
    routes.add_api_route("/api/pull", pull, methods=["POST"])
    routes.add_api_route("/api/delete", delete, methods=["DELETE"])
    return routes


__all__ = ["router"]
