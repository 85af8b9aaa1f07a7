"""`moeflash make-model` end to end, in a subprocess like a user runs it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.modelgen import QType, estimate_size, preset, preset_names

REPO = Path(__file__).resolve().parents[2]


def make_model(*args: str, preamble: str = "") -> subprocess.CompletedProcess[str]:
    """Run `python -m server.cli make-model ARGS` (after `preamble`, Python run first in the process)."""
    code = f"{preamble}\nimport sys\nfrom server.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code, "make-model", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_module_entry_point_writes_a_model(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.cli",
            "make-model",
            str(out),
            "--preset",
            "tiny-qwen3moe",
            "--layers",
            "2",
            "--no-progress",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    spec = dataclasses.replace(preset("tiny-qwen3moe"), n_layer=2)
    assert out.stat().st_size == estimate_size(spec)
    line = proc.stdout.strip()
    assert line.startswith(f"wrote {out}: ")
    for part in (
        "qwen3moe",
        "2 layers",
        "n_embd 256",
        "experts 4/16",
        "Q4_0",
        "per expert",
        "routed per token",
    ):
        assert part in line
    assert len(proc.stdout.splitlines()) == 1


def test_shape_flags_override_the_preset(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    proc = make_model(
        str(out),
        "--arch",
        "gpt-oss",
        "--layers",
        "2",
        "--experts",
        "8",
        "--experts-used",
        "2",
        "--ff-exp",
        "64",
        "--qtype",
        "q8_0",
        "--dense-qtype",
        "F16",
        "--down-qtype",
        "f16",
        "--vocab",
        "1000",
        "--seed",
        "3",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    spec = dataclasses.replace(
        preset("tiny-gptoss"),
        n_layer=2,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=64,
        n_vocab=1000,
        expert_qtype=QType.Q8_0,
        dense_qtype=QType.F16,
        down_qtype=QType.F16,
    )
    assert out.stat().st_size == estimate_size(spec)
    assert "gpt-oss, 2 layers" in proc.stdout
    assert "experts 2/8 x ff 64 (Q8_0, down F16 on 1 of 2 layers; dense F16)" in proc.stdout
    assert "per expert (mean over layers)" in proc.stdout


def test_embd_change_rederives_head_dim(tmp_path: Path) -> None:
    proc = make_model(str(tmp_path / "m.gguf"), "--embd", "512", "--heads", "8", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "heads 8/2 x 64" in proc.stdout


def test_split_output(tmp_path: Path) -> None:
    proc = make_model(
        str(tmp_path / "m.gguf"), "--preset", "tiny-hyv3", "--split-max-size", "1.5M", "--no-progress"
    )
    assert proc.returncode == 0, proc.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    n = len(files)
    assert n >= 2 and files == [f"m-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert f"({n} files)" in proc.stdout


def test_list_presets() -> None:
    proc = make_model("--list-presets")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == preset_names()
    assert "GiB" in next(line for line in lines if line.startswith("qwen30b-shape "))


def test_progress_bar_on_stderr_by_default(tmp_path: Path) -> None:
    proc = make_model(str(tmp_path / "m.gguf"))
    assert proc.returncode == 0, proc.stderr
    assert "100%" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "nope"], "error: unknown preset 'nope'; valid: tiny-qwen3moe"),
        (["--experts-used", "32"], "error: invalid model shape: n_expert_used 32 exceeds n_expert 16"),
        (
            ["--heads", "6", "--head-dim", "64", "--heads-kv", "4"],
            "n_head 6 is not a multiple of n_head_kv 4",
        ),
        (["--ff-exp", "100"], "n_ff_exp = 100 is not a multiple of Q4_0's block of 32"),
        (["--qtype", "MXFP4"], "MXFP4 experts are only supported for gpt-oss"),
        (["--layers", "0"], "n_layer must be a positive integer"),
        (["--split-max-size", "lots"], "error: invalid size 'lots'"),
        (["--split-max-size", "200K"], "split_max_size 200000 is smaller than tensor"),
        (["--seed", "-4"], "seed must be a non-negative integer"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    proc = make_model(str(tmp_path / "m.gguf"), "--no-progress", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stderr.startswith("moeflash make-model: error: ")
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_unknown_architecture_is_a_usage_error(tmp_path: Path) -> None:
    proc = make_model(str(tmp_path / "m.gguf"), "--arch", "mamba")
    assert proc.returncode == 2
    assert "invalid choice: 'mamba'" in proc.stderr and "qwen3moe" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_missing_output_path() -> None:
    proc = make_model()
    assert proc.returncode == 2
    assert "missing OUT.gguf" in proc.stderr


def test_existing_file_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    proc = make_model(str(out), "--no-progress")
    assert proc.returncode == 2
    assert f"error: {out} already exists; pass --force" in proc.stderr
    assert out.read_bytes() == b"keep me"
    proc = make_model(str(out), "--no-progress", "--force")
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size == estimate_size(preset("tiny-qwen3moe"))


def test_write_failure_mid_file_leaves_nothing(tmp_path: Path) -> None:
    # a real I/O error: the file-size rlimit makes write() fail with EFBIG after 1 MiB
    preamble = (
        "import resource, signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))"
    )
    proc = make_model(str(tmp_path / "m.gguf"), "--no-progress", preamble=preamble)
    assert proc.returncode == 2
    assert "error: writing the model failed: [Errno 27] File too large" in proc.stderr
    assert list(tmp_path.iterdir()) == []
