"""What the agent tests share: a real server whose app is wrapped in a recorder, and a runner
for an agent CLI as a subprocess with a home of its own and no way to phone home.

`Recorder` is an ASGI middleware around the production app (`create_app`): it keeps, for each
HTTP exchange, the method, path, request body, status and the first and last bytes of the
answer, so a test asserts on what a client actually sent and on what the real server said back.
Nothing is answered by the recorder itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import tests.servers
from server.http.app import create_app
from tests.servers import RunningServer, running_server

REPO = Path(__file__).resolve().parents[2]
AGENTS = REPO / "tests" / "agents"
NODE_BIN = AGENTS / "node_modules" / ".bin"
AIDER_PYTHON = REPO / ".venv" / "aider" / "bin" / "python"
SERVED_ID = "demo-qwen3moe"  # the id `make serve` gives the demo model, as README shows it
RESPONSE_HEAD_BYTES = 64 << 10  # kept of each answer's start: an error body, the first events
RESPONSE_TAIL_BYTES = 64 << 10  # kept of each answer's end: how a stream ended (events echo the request)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class Exchange:
    """One HTTP request to the server, the start of its answer and its last bytes."""

    method: str
    path: str
    request: bytearray = field(default_factory=bytearray)
    status: int | None = None
    response: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    left: bool = False  # the client went away before the answer started: nobody waited for it

    def body(self) -> Any:
        """The request body as JSON (None when empty or not JSON)."""
        try:
            return json.loads(self.request) if self.request else None
        except ValueError:
            return None

    def summary(self) -> str:
        body = self.body()
        shape = ""
        if isinstance(body, dict):
            tools = body.get("tools") or []
            shape = f" model={body.get('model')!r} stream={body.get('stream')!r} tools={len(tools)}"
        answer = bytes(self.response[:600]).decode(errors="replace")
        left = " (the client had left)" if self.left else ""
        return f"{self.method} {self.path} -> {self.status}{left}{shape}: {answer}"


class Recorder:
    """ASGI middleware recording every HTTP exchange with the app it wraps."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.exchanges: list[Exchange] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = Exchange(scope["method"], scope["path"])
        self.exchanges.append(exchange)

        async def recorded_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                exchange.request += message.get("body", b"")
            elif message["type"] == "http.disconnect" and exchange.status is None:
                exchange.left = True
            return message

        async def recorded_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                room = RESPONSE_HEAD_BYTES - len(exchange.response)
                exchange.response += chunk[: max(room, 0)]
                exchange.tail = (exchange.tail + chunk)[-RESPONSE_TAIL_BYTES:]
            await send(message)

        await self.app(scope, recorded_receive, recorded_send)

    def posts(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path == path]

    def report(self) -> str:
        """Every exchange, one line each: what a failing test prints."""
        return "\n".join(e.summary() for e in self.exchanges) or "(no request reached the server)"

    def assert_no_error(self) -> None:
        """Every request the client waited for was answered, none with a 4xx or 5xx (a request it
        gave up on, e.g. a side request aborted once the turn ended, has no one to answer)."""
        failed = [e for e in self.exchanges if not e.left and (e.status is None or e.status >= 400)]
        assert not failed, "requests the server refused:\n" + "\n".join(e.summary() for e in failed)


@dataclass
class AgentServer:
    server: RunningServer
    recorder: Recorder

    @property
    def base_url(self) -> str:
        return self.server.base_url


@contextlib.contextmanager
def recorded_server(model: Path, **overrides: Any) -> Iterator[AgentServer]:
    """`tests.servers.running_server` on `model` with its app wrapped in a Recorder."""
    recorders: list[Recorder] = []

    def create_recorded_app(*args: Any, **kwargs: Any) -> Recorder:
        recorder = Recorder(create_app(*args, **kwargs))
        recorders.append(recorder)
        return recorder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tests.servers, "create_app", create_recorded_app)
        with running_server(model, **overrides) as server:
            patch.undo()
            yield AgentServer(server, recorders[0])


@dataclass
class AgentRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def tail(self) -> str:
        return (
            f"exit {self.returncode} after {self.seconds:.0f} s\n"
            f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}"
        )


def offline_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of an agent process: a fresh home (no user config, no login, nothing left
    behind), node 22 from tests/agents first on PATH, and only what the runner needs of ours."""
    for sub in ("home", "config", "cache", "data", "state"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": f"{NODE_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(home / "home"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_DATA_HOME": str(home / "data"),
        "XDG_STATE_HOME": str(home / "state"),
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CI": "1",
        "LANG": "C.UTF-8",
    }
    # what this machine needs of the outer environment: OpenBLAS's core type, where it is set
    # because older OpenBLAS builds (aider's numpy) crash on this processor without it
    env.update({name: value for name, value in os.environ.items() if name.startswith("OPENBLAS_")})
    env.update(extra)
    return env


def run_agent(argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> AgentRun:
    """Run an agent CLI to its end, stdin closed. A run past `timeout_s` fails the test; its whole
    process group is killed (agents start shells and helpers of their own)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"{Path(argv[0]).name} did not finish in {timeout_s:.0f} s\n"
            f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # helpers the agent left behind
    return AgentRun(proc.returncode, stdout, stderr, time.monotonic() - started)


def installed(tool: Path) -> Path:
    """A client the set-up installs: its absence fails the test (never a skip)."""
    assert tool.exists(), f"{tool} is missing: `make setup-dev` installs the agent clients"
    return tool
