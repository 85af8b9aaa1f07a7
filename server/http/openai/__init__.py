"""OpenAI's API: chat completions, legacy completions, the Responses API (responses/) and the
model list; `router()` routes them.

One module per route: chat_completions.py, completions.py, models.py, and the Responses API's
package; their request and answer models are server/http/protocol.py's (responses/ has its own).
"""

from fastapi import APIRouter

from server.http.openai.chat_completions import create_chat_completion
from server.http.openai.completions import create_completion
from server.http.openai.models import get_model, list_models
from server.http.openai.responses.route import create_response
from server.http.protocol import ChatCompletion, Completion


def router() -> APIRouter:
    """OpenAI's routes."""
    routes = APIRouter(tags=["openai"])
    routes.add_api_route("/v1/models", list_models, methods=["GET"])
    routes.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    routes.add_api_route(
        "/v1/chat/completions",
        create_chat_completion,
        methods=["POST"],
        responses={200: {"model": ChatCompletion, "description": "a completion, or an SSE stream of chunks"}},
    )
    routes.add_api_route(
        "/v1/responses",
        create_response,
        methods=["POST"],
        responses={200: {"description": "a response object, or an SSE stream of Responses API events"}},
    )
    routes.add_api_route(
        "/v1/completions",
        create_completion,
        methods=["POST"],
        responses={200: {"model": Completion, "description": "a completion, or an SSE stream of chunks"}},
    )
    return routes


__all__ = ["router"]
