"""GET /: a one-file chat page with live tok/s and the compute / flash-wait / cache bars.

Plain HTML and JavaScript in server/http/static/index.html, no build step and no external assets
(the phone may be offline): the markdown renderer and the sanitiser it needs are vendored
(server/http/static/vendor) and inlined into the page. The bars read the opt-in timings extension;
resident models show n/a there (nothing is streamed). The page is served without the API key;
it takes the key from a pairing link (#key=..., server/http/pairing.py) or asks for it, keeps it in the
browser and sends it.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from starlette.responses import HTMLResponse

# libraries the page uses (server/http/static/vendor/README.md), inlined where it says <!-- vendor -->
_VENDOR = ("vendor/marked.umd.js", "vendor/purify.min.js")


def index_html() -> str:
    """The page's HTML with its libraries inlined (read from the package: works from a wheel too)."""
    static = files("server.http").joinpath("static")
    scripts = "".join(
        f"<script>{static.joinpath(name).read_text(encoding='utf-8')}</script>\n" for name in _VENDOR
    )
    return static.joinpath("index.html").read_text(encoding="utf-8").replace("<!-- vendor -->", scripts, 1)


class Page:
    """The chat page's route: its HTML, read once."""

    def __init__(self) -> None:
        self._html = index_html()

    async def __call__(self) -> HTMLResponse:
        return HTMLResponse(self._html)


def router() -> APIRouter:
    """GET / and HEAD / (clients probe the server with HEAD: Claude Code does before its first
    request), left out of the API's schema."""
    routes = APIRouter()
    routes.add_api_route("/", Page(), methods=["GET", "HEAD"], include_in_schema=False)
    return routes
