"""The C test programs of tests/c, run on this machine or, cross-built for aarch64 (`make arm`),
under qemu-user as a phone's CPU.

Each program prints one "ok ..." or "FAIL ..." line per check, among lines of its own
("tokens ...", "page ..."), and exits 0 only if every check passed.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOST_BUILD = REPO / "tests" / "c" / "build"
# the CPU qemu emulates for each aarch64 build variant (`make arm`, MOEFLASH_CPU): armv8.2-a with
# dot product and fp16, phones of the last six years; armv8.6-a with int8 matrix multiply too
# (qemu-user has no such core by name: "max" has every feature, SVE included, which the build
# does not use)
QEMU_CPUS = {"armv8.2": "cortex-a76", "armv8.6": "max"}
AARCH64_SYSROOT = "/usr/aarch64-linux-gnu"
EM_AARCH64 = 183  # e_machine of an aarch64 ELF file


@dataclass(frozen=True)
class Run:
    """A finished run of a C test program."""

    returncode: int
    stdout: str
    stderr: str

    def verdicts(self) -> list[str]:
        """The first word of each "ok ..." / "FAIL ..." line, in order."""
        words = [line.split()[:1] for line in self.stdout.splitlines()]
        return [w[0] for w in words if w in (["ok"], ["FAIL"])]

    def value(self, key: str) -> str:
        """The rest of the first line that starts with `key` and a space (AssertionError if none)."""
        for line in self.stdout.splitlines():
            if line.startswith(key + " "):
                return line[len(key) + 1 :]
        raise AssertionError(f"no '{key}' line in:\n{self.stdout}")

    def report(self) -> str:
        """What to show when a check fails: the program's output and the end of its errors."""
        return f"exit {self.returncode}\n{self.stdout}\n{self.stderr[-3000:]}"


def elf_machine(path: Path) -> int:
    """The e_machine field of an ELF file (little-endian)."""
    header = path.read_bytes()[:20]
    assert header[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return int.from_bytes(header[18:20], "little")


def run_host(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> Run:
    """tests/c/build/NAME ARGS on this machine."""
    program = HOST_BUILD / name
    assert program.is_file(), f"{program} is missing: build it with `make ext`"
    return _run([str(program), *args], env, timeout)


def run_aarch64(
    name: str,
    *args: str,
    variant: str = "armv8.2",
    page_size: int = 4096,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> Run:
    """tests/c/build/aarch64-VARIANT/NAME ARGS under qemu-user, as that variant's CPU, with pages
    of `page_size` bytes (Android devices use 4 KiB or 16 KiB)."""
    return _run(aarch64_argv(name, *args, variant=variant, page_size=page_size), env, timeout)


def aarch64_argv(name: str, *args: str, variant: str = "armv8.2", page_size: int = 4096) -> list[str]:
    """The command line that runs tests/c/build/aarch64-VARIANT/NAME ARGS under qemu-user (for a
    program the caller starts and stops itself)."""
    program = HOST_BUILD / f"aarch64-{variant}" / name
    assert program.is_file(), f"{program} is missing: build it with `make arm`"
    assert elf_machine(program) == EM_AARCH64, f"{program} is not an aarch64 program"
    qemu = ["qemu-aarch64", "-cpu", QEMU_CPUS[variant], "-p", str(page_size), "-L", AARCH64_SYSROOT]
    return [*qemu, str(program), *args]


def _run(argv: list[str], env: dict[str, str] | None, timeout: float) -> Run:
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, env={**os.environ, **(env or {})}
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)
