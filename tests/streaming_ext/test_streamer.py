"""streaming_ext: the C library loads through ctypes, in its normal and its sanitizer build."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from streaming_ext import StreamLibError, load_library
from tests.c_programs import run_host

REPO = Path(__file__).resolve().parents[2]
ASAN_LIB = REPO / "streaming_ext" / "lib" / "libmoeflash_stream_asan.so"


def test_library_loads_and_reports_its_build() -> None:
    lib = load_library()
    assert lib.version() == "0.1.0"
    assert lib.ggml_version()  # the pinned ggml, e.g. "0.25.3"
    assert lib.patched_build()


def test_missing_library_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StreamLibError, match="make ext"):
        load_library(tmp_path / "nope.so")


def test_foreign_file_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "libbogus.so"
    bogus.write_bytes(b"not an ELF file")
    with pytest.raises(StreamLibError, match="cannot load"):
        load_library(bogus)


def sanitizer_env() -> dict[str, str]:
    """Environment that loads the ASan+UBSan build into a plain CPython."""
    libasan = subprocess.run(
        ["cc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=libasan,
        # CPython itself is not leak-clean at exit; UBSan findings abort the process
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
        MOEFLASH_STREAM_LIB=str(ASAN_LIB),
    )
    return env


def test_sanitizer_build_loads() -> None:
    assert ASAN_LIB.is_file(), "build it with `make ext`"
    code = "from streaming_ext import load_library; lib = load_library(); print(lib.path.name, lib.version())"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=sanitizer_env(),
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [ASAN_LIB.name, "0.1.0"]


def test_streaming_gates_under_sanitizers() -> None:
    """The streaming gates, the trace-routing gates and the error tests again, with the ASan+UBSan
    build of the library."""
    assert ASAN_LIB.is_file(), "build it with `make ext`"
    selection = (
        "evicts_every_layer or reader_modes or frames or sizes_differ or dropped or prefetch or stress"
        " or split or multi_turn or every_architecture or negative"
        " or recorded_routing or trace_routed or does_not_fit"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/loading/test_streaming_gates.py",
            "tests/loading/test_streaming_errors.py",
            "tests/loading/test_route_trace.py",
            "-k",
            # not unknown_architecture: llama.cpp's own C++ exception aborts under a preloaded
            # libasan (uninstrumented libstdc++), before our library is involved
            f"({selection} or test_streaming_errors) and not unknown_architecture",
        ],
        capture_output=True,
        text=True,
        env=sanitizer_env(),
        cwd=REPO,
        timeout=900,
        check=False,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert "passed" in proc.stdout and "AddressSanitizer" not in proc.stderr, tail


FRAMES_TEST = REPO / "tests" / "c" / "build" / "test_frames"


def test_frames_reuse_warm_and_trim() -> None:
    """tests/c/test_frames.c (sanitizer build): bad sizes are refused; frames given back come back
    first with their bytes, before fresh ones; 200000 random takes and gives keep live frames
    distinct and intact and the memory held exact; a trim gives back only the free frames."""
    assert FRAMES_TEST.is_file(), "build it with `make ext`"
    proc = subprocess.run([str(FRAMES_TEST)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    verdicts = [line.split()[0] for line in proc.stdout.splitlines()]
    assert verdicts == ["ok"] * 6, proc.stdout


@pytest.mark.parametrize(
    "preset", [pytest.param("tiny-qwen3moe", id="qwen3moe"), pytest.param("tiny-gemma4", id="gemma4")]
)
def test_c_gate_streamed_equals_resident(tiny_model: Callable[..., Path], preset: str) -> None:
    """tests/c/test_stream_identity.c on this machine, the same program tests/build/test_aarch64.py
    runs under emulation: streamed under the budget floor with three lever sets, with the budget
    moved mid-decode and warm-started, the tokens and every logits row equal the resident
    model's; a never-read expert changes them."""
    run = run_host("test_stream_identity", str(tiny_model(preset)), "2")
    assert run.returncode == 0, run.report()
    assert run.verdicts() == ["ok"] * 7, run.report()
