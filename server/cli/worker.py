"""`moeflash worker`: lend this device's memory and cores to a main server (server/rpc/worker.py)."""

from __future__ import annotations

import argparse
from typing import Any

from server.cli.arguments import add_arguments, settings_of
from server.settings import WorkerSettings


def register(subparsers: Any) -> None:
    """Add the `worker` subcommand: WorkerSettings' flags."""
    p = subparsers.add_parser(
        "worker",
        help="run an RPC helper: a main server's last layers run on this device",
        description="Serve this device's memory and cores to one `moeflash serve --rpc HOST:PORT` at a "
        "time, through llama.cpp's RPC backend (docs/devices.md). It listens on the loopback: reach it "
        "from another device through an SSH tunnel.",
    )
    add_arguments(p, (WorkerSettings,))
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from server.rpc.worker import run_worker

    return run_worker(settings_of(WorkerSettings, args))
