"""Build and packaging checks: the Dockerfile lints clean and its entry point refuses to run open."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dockerfile_lints_clean() -> None:
    hadolint = shutil.which("hadolint") or str(REPO / ".venv" / "bin" / "hadolint")
    proc = subprocess.run(
        [hadolint, "--no-color", "Dockerfile"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_container_entry_point_requires_an_api_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MOEFLASH_API_KEY" and not k.startswith("MAKE")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "serve-container"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "MOEFLASH_API_KEY is not set" in proc.stderr


def test_dockerfile_runs_the_readme_setup_as_non_root() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "RUN make setup" in text
    assert "USER 10001" in text
    assert 'CMD ["make", "serve-container"]' in text
    assert "HEALTHCHECK" in text and "/health" in text


def test_python_is_linted_and_typed() -> None:
    """ruff (E, F, I, B, UP; formatting) and mypy --strict, as `make lint` runs them."""
    bin_dir = REPO / ".venv" / "bin"
    for argv in (
        [str(bin_dir / "ruff"), "check", "server", "streaming_ext", "tests"],
        [str(bin_dir / "ruff"), "format", "--check", "server", "streaming_ext", "tests"],
        [str(bin_dir / "mypy")],
    ):
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, f"{' '.join(argv)}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"


def test_every_subcommand_has_help() -> None:
    for command in ("make-model", "serve", "generate"):
        proc = subprocess.run(
            [str(REPO / ".venv" / "bin" / "moeflash"), command, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0 and "usage: moeflash" in proc.stdout, proc.stderr[-2000:]
