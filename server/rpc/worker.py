"""`moeflash worker`: this device's memory and cores lent to a main server on another one.

It runs llama.cpp's RPC server from this process's build (patch 0012): the CPU device, every
core unless told, within `--memory` bytes of buffers (reported to the main server, so its
placement sees the right figure, and enforced: an allocation past it is refused), one main
server at a time (another is answered "busy"), and a tensor cache in the state directory bounded
by `--cache-max`, so a restarted main server does not send the weights again.
"""

from __future__ import annotations

import logging
import os
import signal

from server.errors import ConfigError
from server.loading.budget import margin_bytes, memory_limit
from server.rpc.ggml import Ggml
from server.rpc.hello import this_build
from server.settings import WorkerSettings, is_loopback_host
from server.units import format_size

logger = logging.getLogger(__name__)

CACHE_DIR = "rpc-cache"

INSECURE = (
    "the RPC protocol has no authentication and no encryption: anyone who reaches {endpoint} can "
    "read the weights and run code paths of llama.cpp never meant for strangers; prefer the loopback "
    "and an SSH tunnel (ssh -N -L {port}:127.0.0.1:{port} this-device)"
)


def default_memory() -> int:
    """What this process may use (the cgroup's limit or the machine's available memory), less
    what it holds and the margin the loaders keep."""
    limit = memory_limit()
    return max(0, limit.bytes - limit.in_use - margin_bytes(limit.bytes))


def run_worker(settings: WorkerSettings) -> int:
    """Serve until interrupted (SIGINT or SIGTERM end the process at once: the cache's files are
    written whole, then renamed). ConfigError for an address or a size it refuses."""
    endpoint = f"{settings.host}:{settings.port}"
    why = INSECURE.format(endpoint=endpoint, port=settings.port)
    if not is_loopback_host(settings.host):
        if not settings.insecure_lan:
            raise ConfigError(
                f"--host {settings.host} is not the loopback: {why}. --insecure-lan listens there anyway"
            )
        logger.warning("listening on %s: %s", endpoint, why)
    memory = settings.memory if settings.memory is not None else default_memory()
    if memory <= 0:
        raise ConfigError("no memory to lend: --memory must be a positive size")
    threads = settings.threads or os.cpu_count() or 1
    cache_dir = settings.state_dir / CACHE_DIR if settings.cache_max else None
    if cache_dir is not None:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the tensor cache {cache_dir}: {exc}") from exc
    build = this_build()
    logger.info(
        "RPC helper %s: %s of memory, %d threads, %s, build %s",
        endpoint,
        format_size(memory),
        threads,
        f"tensor cache {cache_dir} (at most {format_size(settings.cache_max)})"
        if cache_dir
        else "no tensor cache",
        build,
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    Ggml.load().start_rpc_server(endpoint, cache_dir, threads, memory, settings.cache_max, build)
    return 1  # the server only returns when it cannot listen or accept
