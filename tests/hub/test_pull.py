"""`moeflash pull`, `list` and `rm` as a user runs them, with the real huggingface_hub client
against a local server that answers as the Hub does (tests/hub_server.py), on synthetic GGUFs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.commands import REPO
from tests.hub_server import FakeHub, fake_hub

OWNER = "moeflash-test/Tiny-GGUF"
TOKEN = "hf_test_token"
PARTS = 4  # the split set's files


def _part(i: int) -> str:
    return f"Tiny-F16-{i:05d}-of-{PARTS:05d}.gguf"


@pytest.fixture(scope="module")
def blobs(tiny_model: Any) -> dict[str, bytes]:
    """The repository's files: two single-file quants, a split set, a README, a fake GGUF."""
    single = tiny_model("tiny-qwen3moe").read_bytes()
    # over one of huggingface_hub's 10 MiB download chunks, so an interruption leaves some behind
    other = tiny_model("tiny-qwen3moe", seed=1, n_layer=16).read_bytes()
    first = tiny_model("tiny-qwen3moe", split_max_size=len(single) // 3 + 4096)
    parts = sorted(first.parent.glob(first.name.replace("00001", "*")))
    assert len(parts) == PARTS
    files = {
        "README.md": b"# Tiny\n",
        "Tiny-Q4_K_M.gguf": single,
        "Tiny-Q8_0.gguf": other,
        "Tiny-Q4_K_S.gguf": b"<html>not a model</html>" * 100,
    }
    for i, part in enumerate(parts, 1):
        files[f"F16/{_part(i)}"] = part.read_bytes()
    return files


@pytest.fixture
def hub(blobs: dict[str, bytes]) -> Iterator[FakeHub]:
    with fake_hub({OWNER: dict(blobs)}) as running:
        yield running


def moeflash(
    hub: FakeHub, cache: Path, *args: str, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent / "hf-home"))
    env.update(HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1")
    if token is not None:
        env["HF_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "--log-level", "WARNING", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_pull_list_rm_in_the_hugging_face_cache(
    hub: FakeHub, blobs: dict[str, bytes], tmp_path: Path
) -> None:
    cache = tmp_path / "hub"
    pulled = moeflash(hub, cache, "pull", f"{OWNER}:q4_k_m")
    assert pulled.returncode == 0, pulled.stderr
    snapshot = cache / "models--moeflash-test--Tiny-GGUF" / "snapshots" / hub.commit(OWNER)
    link = snapshot / "Tiny-Q4_K_M.gguf"
    assert link.is_symlink() and link.read_bytes() == blobs["Tiny-Q4_K_M.gguf"]
    assert link.resolve().name == hub.sha256(OWNER, "Tiny-Q4_K_M.gguf")  # blobs/<sha256>, as the library
    assert f"--model {link}" in pulled.stdout
    # the tree came in pages; the file through a HEAD on resolve, then the CDN
    assert any("cursor=" in s.path for s in hub.requests if "/tree/" in s.path)
    assert any(s.method == "HEAD" and "/resolve/" in s.path for s in hub.requests)

    listed = moeflash(hub, cache, "list")
    assert listed.returncode == 0 and "Tiny-Q4_K_M" in listed.stdout and OWNER in listed.stdout
    removed = moeflash(hub, cache, "rm", "Tiny-Q4_K_M")
    assert removed.returncode == 0, removed.stderr
    assert not (cache / "models--moeflash-test--Tiny-GGUF").exists()
    assert "no models" in moeflash(hub, cache, "list").stderr
    gone = moeflash(hub, cache, "rm", "Tiny-Q4_K_M")
    assert gone.returncode == 2 and "no model 'Tiny-Q4_K_M'" in gone.stderr


def test_a_split_set_is_pulled_whole_into_a_models_dir(
    hub: FakeHub, blobs: dict[str, bytes], tmp_path: Path
) -> None:
    models = tmp_path / "models"
    pulled = moeflash(hub, tmp_path / "hub", "pull", f"{OWNER}:F16", "--models-dir", str(models))
    assert pulled.returncode == 0, pulled.stderr
    names = [_part(i) for i in range(1, PARTS + 1)]
    assert sorted(p.name for p in models.iterdir()) == names
    for name in names:
        assert (models / name).read_bytes() == blobs[f"F16/{name}"]
    listed = moeflash(hub, tmp_path / "hub", "list", "--models-dir", str(models))
    assert listed.stdout.split()[0] == "Tiny-F16"
    # a second pull verifies what is there and downloads nothing
    before = len(hub.ranges("/cdn/"))
    again = moeflash(hub, tmp_path / "hub", "pull", f"{OWNER}:f16", "--models-dir", str(models))
    assert again.returncode == 0, again.stderr
    assert len(hub.ranges("/cdn/")) == before


def test_an_interrupted_pull_resumes_where_it_stopped(
    hub: FakeHub, blobs: dict[str, bytes], tmp_path: Path
) -> None:
    models = tmp_path / "models"
    cut = len(blobs["Tiny-Q8_0.gguf"]) * 3 // 4
    hub.cut_after = cut  # the connection drops mid-file, then the CDN is down
    failed = moeflash(hub, tmp_path / "hub", "pull", f"{OWNER}:Q8_0", "--models-dir", str(models))
    assert failed.returncode == 2 and "moeflash pull: error:" in failed.stderr
    assert not (models / "Tiny-Q8_0.gguf").exists()  # nothing partial looks complete
    partial = models / "Tiny-Q8_0.gguf.incomplete"
    kept = partial.stat().st_size  # the whole chunks that arrived
    assert 0 < kept <= cut
    assert moeflash(hub, tmp_path / "hub", "list", "--models-dir", str(models)).stdout == ""

    hub.heal()
    resumed = moeflash(hub, tmp_path / "hub", "pull", f"{OWNER}:Q8_0", "--models-dir", str(models))
    assert resumed.returncode == 0, resumed.stderr
    assert hub.ranges("/cdn/")[-1] == f"bytes={kept}-"
    assert (models / "Tiny-Q8_0.gguf").read_bytes() == blobs["Tiny-Q8_0.gguf"]
    assert not partial.exists()


def test_a_wrong_checksum_is_refused_and_nothing_is_kept(hub: FakeHub, tmp_path: Path) -> None:
    hub.lie.add("Tiny-Q8_0.gguf")
    cache = tmp_path / "hub"
    failed = moeflash(hub, cache, "pull", f"{OWNER}:Q8_0")
    assert failed.returncode == 2
    assert "sha256" in failed.stderr and "is not the Hub's" in failed.stderr
    assert not [p for p in cache.rglob("*") if p.is_file()]


def test_a_file_that_is_not_gguf_is_refused(hub: FakeHub, tmp_path: Path) -> None:
    models = tmp_path / "models"
    failed = moeflash(hub, tmp_path / "hub", "pull", f"{OWNER}:Q4_K_S", "--models-dir", str(models))
    assert failed.returncode == 2 and "is not a GGUF file" in failed.stderr
    assert not list(models.iterdir())


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        pytest.param(
            "moeflash-test/Nothing-GGUF", "no model repository moeflash-test/Nothing-GGUF", id="repo"
        ),
        pytest.param(f"{OWNER}:Q2_K", "has no model matching 'Q2_K'", id="quant"),
        pytest.param(f"{OWNER}:Q4_K", "is ambiguous, 2 models match", id="ambiguous"),
        pytest.param(f"{OWNER}:README.md", "README.md is not a GGUF file", id="not-gguf"),
    ],
)
def test_what_cannot_be_pulled_gets_a_clear_error(
    hub: FakeHub, tmp_path: Path, ref: str, message: str
) -> None:
    failed = moeflash(hub, tmp_path / "hub", "pull", ref)
    assert failed.returncode == 2
    assert message in failed.stderr
    assert "Traceback" not in failed.stderr


def test_the_token_goes_to_the_hub_and_never_to_its_cdn(hub: FakeHub, tmp_path: Path) -> None:
    pulled = moeflash(hub, tmp_path / "hub", "pull", f"{OWNER}:Q4_K_M", token=TOKEN)
    assert pulled.returncode == 0, pulled.stderr
    hub_side = [s for s in hub.requests if not s.path.startswith("/cdn/")]
    cdn_side = [s for s in hub.requests if s.path.startswith("/cdn/")]
    assert hub_side and all(s.authorization == f"Bearer {TOKEN}" for s in hub_side)
    assert cdn_side and all(s.authorization is None for s in cdn_side)
