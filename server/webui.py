"""GET /: a one-file chat page with live tok/s and the compute / flash-wait / cache bars.

Plain HTML and JavaScript in server/static/index.html, no build step and no external assets
(the phone may be offline). The bars read the opt-in timings extension; resident models show
n/a there (nothing is streamed). The page is served without the API key; it takes the key from
a pairing link (#key=..., server/lan.py) or asks for it, keeps it in the browser and sends it.
"""

from __future__ import annotations

from importlib.resources import files


def index_html() -> str:
    """The page's HTML (read from the package, so it works from a wheel too)."""
    return files("server").joinpath("static/index.html").read_text(encoding="utf-8")
