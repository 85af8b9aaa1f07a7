"""Files by job: no source file under server/ or streaming_ext/ grows past MAX_LINES.

A file that does is holding more than one job (request models, mapping and the route of an API;
the callback, the gate and the life cycle of the streamer): split it by job, as server/http's
API packages and streaming_ext/src's units are split.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 600
SOURCES = ("*.py", "*.c", "*.h")


def test_no_source_file_is_over_the_line_cap() -> None:
    files = [
        path for top in ("server", "streaming_ext") for glob in SOURCES for path in (REPO / top).rglob(glob)
    ]
    assert len(files) > 50  # the globs found the tree
    over = {
        str(path.relative_to(REPO)): lines
        for path in files
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not over, f"split these by job (over {MAX_LINES} lines): {over}"
