"""The server's own routes: GET /health (is the model there) and GET /metrics (Prometheus)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from server.engine.worker import EngineState
from server.http.metrics import CONTENT_TYPE
from server.http.serving import Ctx


async def health(ctx: Ctx) -> JSONResponse:
    """200 once the model has loaded, also while it is released after its keep_alive, or freed
    and loaded again (a reload, a switch): requests are taken then, and wait for the load; 503
    while it first loads, after a failed load, and at shutdown."""
    engine = ctx.engine
    state = engine.state
    between = (EngineState.RELEASING, EngineState.RELEASED, EngineState.LOADING)
    taken = state in between and engine.loads > 0
    status = 200 if state is EngineState.READY or taken else 503
    body: dict[str, Any] = {"status": "ok" if status == 200 else state.value}
    if taken:
        body["model"] = state.value  # "releasing", "released" or "loading"
    if engine.load_error is not None:
        body["error"] = str(engine.load_error)
    info = engine.info
    if info is not None and (info.helpers or info.helpers_left_out):
        # the --rpc helpers of the loaded model (docs/devices.md)
        body["helpers"] = {endpoint: {"layers": layers} for endpoint, layers in info.helpers} | {
            endpoint: {"left_out": True} for endpoint in info.helpers_left_out
        }
    return JSONResponse(body, status_code=status)


async def prometheus(ctx: Ctx) -> Response:
    """Prometheus text exposition."""
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


def router() -> APIRouter:
    """The server's routes."""
    routes = APIRouter(tags=["server"])
    routes.add_api_route("/health", health, methods=["GET"])
    routes.add_api_route("/metrics", prometheus, methods=["GET"])
    return routes
