"""An RPC helper (`moeflash worker`) for the tests: started on a free loopback port and killed after,
and a model loaded as `serve` loads it in a process of its own (tests/split_run.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from server.bench.cgroup import MemoryCgroup
from server.errors import HelperError
from server.rpc.hello import wait_for_helper
from tests.servers import free_port

PROMPT = [(7 * i + 40) % 300 for i in range(24)]
N_TOKENS = 10


class RunningHelper(NamedTuple):
    """A started `moeflash worker`: its endpoint, its log and its process."""

    endpoint: str
    log: Path
    proc: subprocess.Popen[str]


@contextmanager
def helper(
    state_dir: Path,
    *,
    memory: str = "256M",
    cgroup: MemoryCgroup | None = None,
    extra: tuple[str, ...] = (),
    port: int | None = None,
) -> Iterator[RunningHelper]:
    """A `moeflash worker` on a loopback port (a free one unless given), up and answering."""
    port = port or free_port()
    log = state_dir / f"worker-{port}-{time.monotonic_ns()}.log"
    argv = [sys.executable, "-m", "server.cli", "worker", "--port", str(port), "--memory", memory]
    argv += ["--state-dir", str(state_dir), *extra]
    with log.open("w") as out:
        start = cgroup.popen if cgroup is not None else _popen
        proc = start(argv, stdout=out, stderr=subprocess.STDOUT)
    endpoint = f"127.0.0.1:{port}"
    try:
        try:
            wait_for_helper(endpoint, lambda: proc.poll() is None, timeout_s=60)
        except HelperError as exc:
            raise AssertionError(f"{exc}: {log.read_text()[-2000:]}") from None
        yield RunningHelper(endpoint, log, proc)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, text=True, **kwargs)


def helper_memory(endpoint: str) -> tuple[int, int]:
    """(free, total) bytes the helper at `endpoint` reports through ggml, asked in a process of
    its own: ggml's device registry is the process's."""
    script = "\n".join(
        [
            "import sys",
            "from server.rpc.devices import connect",
            "(h,) = connect([sys.argv[1]])",
            "print(h.free, h.total)",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", script, endpoint], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    free, total = done.stdout.split()
    return int(free), int(total)


def run_split(
    settings: dict[str, Any], cgroup: MemoryCgroup | None = None, *, check: bool = True
) -> dict[str, Any]:
    """tests/split_run.py's report for `settings` (a process of its own, in `cgroup` if given); with
    check off, a run that failed gives {"returncode", "log"}."""
    argv = [sys.executable, "-m", "tests.split_run", json.dumps(settings), json.dumps(PROMPT), str(N_TOKENS)]
    if cgroup is not None:
        done = cgroup.run(argv, timeout=600)
    else:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if not check and done.returncode != 0:
        return {"returncode": done.returncode, "log": done.stderr}
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    report["log"] = done.stderr
    return report
