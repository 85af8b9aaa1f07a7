"""`moeflash` run as a user runs it: a subprocess of this interpreter, from the checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def moeflash(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """`moeflash --log-level WARNING ARGS...`; its output captured, its exit status not checked."""
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "--log-level", "WARNING", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
