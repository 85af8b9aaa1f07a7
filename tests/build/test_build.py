"""The build: a second `make setup` is a no-op, and a patch that no longer applies stops the build
with a message that names it; the native build has no AMX."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENDOR = REPO / "vendor" / "llama.cpp"


def test_second_setup_rebuilds_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "setup"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is up to date" in proc.stdout
    assert "building llama-cpp-python" not in proc.stdout
    assert "applied" not in proc.stdout


def test_a_patch_that_no_longer_applies_stops_the_build(tmp_path: Path) -> None:
    cached = VENDOR / ".cache"
    if not any(cached.glob("*.tar.gz")):
        import pytest

        pytest.skip("the pinned sdist is not cached (vendor/llama.cpp/.cache)")
    vendor = tmp_path / "llama.cpp"
    vendor.mkdir()
    for name in ("build.sh", "cmake-args.sh", "pin.env"):
        shutil.copy2(VENDOR / name, vendor / name)
    shutil.copytree(VENDOR / "patches", vendor / "patches")
    shutil.copytree(cached, vendor / ".cache")
    broken = vendor / "patches" / "0001-llama-load-mode-mmap-no-prefetch.patch"
    broken.write_text(
        broken.read_text().replace("LLAMA_LOAD_MODE_DIRECT_IO  =  4", "LLAMA_LOAD_MODE_DIRECT_IO  =  9")
    )
    # any interpreter will do: the build stops at the patch, before it installs anything
    proc = subprocess.run(
        ["bash", str(vendor / "build.sh"), sys.executable], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 1
    assert "patch 0001-llama-load-mode-mmap-no-prefetch.patch no longer applies" in proc.stderr
    assert not (vendor / "llama-cpp-python").exists(), "a half-patched tree must not be left behind"


def test_the_native_build_has_no_amx() -> None:
    """ggml's AMX buffer type segfaults in ggml_backend_amx_mul_mat on Sapphire Rapids Xeons
    (llama.cpp issue 20824) and holds a layout the streamer does not read, so the native build
    leaves AMX out on x86-64 whatever the building CPU has (vendor/llama.cpp/cmake-args.sh)."""
    import platform

    import llama_cpp

    args = subprocess.run(
        ["bash", "-c", f". {VENDOR / 'cmake-args.sh'} && llama_cmake_args native"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if platform.machine() == "x86_64":
        assert "-mno-amx-int8" in args
    info = llama_cpp.llama_print_system_info().decode()
    assert "AMX_INT8 = 1" not in info, info
