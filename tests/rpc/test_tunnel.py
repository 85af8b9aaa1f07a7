"""The safe way across a LAN, as docs/devices.md shows it: the helper on its loopback, the main
server reaching it through `ssh -N -L` (a real sshd, Debian's openssh-server, on the loopback).
The split serves through the tunnel; the tunnel killed mid-stream fails that request and the
server goes on without the helper (--rpc-optional)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.rpc.helpers import helper
from tests.rpc.test_faults import SERVE, SHAPE, _answer, _eos, _health, _stream_until_lost
from tests.servers import free_port, serve_process, wait_for

SSHD = Path("/usr/sbin/sshd")


@contextmanager
def sshd(tmp: Path) -> Iterator[tuple[int, Path]]:
    """An sshd on a free loopback port that lets this user in with a fresh key: (port, the key)."""
    key = tmp / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "host_key")], check=True)
    shutil.copy(key.with_suffix(".pub"), tmp / "authorized_keys")
    port = free_port()
    config = tmp / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp / 'host_key'}\n"
        f"AuthorizedKeysFile {tmp / 'authorized_keys'}\nPidFile {tmp / 'sshd.pid'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
        "UsePAM no\nStrictModes no\nAllowTcpForwarding yes\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege separation directory
    proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: proc.poll() is None and _accepts(port), "sshd to listen")
        yield port, key
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def _accepts(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@contextmanager
def tunnel(ssh_port: int, key: Path, target: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`ssh -N -L` from a free loopback port to `target` through the sshd: (its endpoint, ssh)."""
    local = free_port()
    user = os.environ.get("USER") or "root"
    argv = ["ssh", "-N", "-L", f"{local}:{target}", "-p", str(ssh_port), "-i", str(key)]
    argv += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes"]
    argv += ["-o", "ExitOnForwardFailure=yes", "-o", "LogLevel=ERROR", f"{user}@127.0.0.1"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: proc.poll() is None and _accepts(local), "the SSH tunnel")
        yield f"127.0.0.1:{local}", proc
    finally:
        proc.kill()
        proc.communicate(timeout=30)


@pytest.mark.skipif(
    not SSHD.exists() or shutil.which("ssh") is None, reason="no sshd: make setup-dev installs it"
)
def test_a_helper_through_an_ssh_tunnel(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    path = tiny_model("tiny-qwen3moe", **SHAPE)
    with helper(tmp_path, memory="1G") as running, sshd(tmp_path) as (ssh_port, key):
        with tunnel(ssh_port, key, running.endpoint) as (local, ssh):
            with serve_process(path, "--rpc", local, "--rpc-optional", *SERVE, log_level="WARNING") as (
                proc,
                port,
            ):
                assert _health(port)["helpers"] == {local: {"layers": 2}}
                assert _answer(port)
                _, error = _stream_until_lost(port, _eos(path), ssh.kill)
                assert "was lost during a decode step" in error, error
                wait_for(lambda: _health(port).get("helpers") == {local: {"left_out": True}}, "the reload")
                assert _answer(port) and proc.poll() is None
