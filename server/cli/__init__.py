"""The `moeflash` command line: one subcommand per module, each registering its own parser."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import MutableMapping, Sequence

from server import __version__
from server.errors import MoeflashError

logger = logging.getLogger(__name__)

# exit status for refused input (argparse uses 2 for usage errors too)
EXIT_ERROR = 2

# libgomp's spin before a waiting worker sleeps, in iterations (its default, 300000, is milliseconds)
OPENMP_SPINCOUNT = "1000"


def tame_openmp_spin(environ: MutableMapping[str, str]) -> None:
    """Shorten how long idle OpenMP workers spin; must run before llama_cpp is imported.

    The CPU backend is built with OpenMP. After each graph split its worker threads spin for
    milliseconds waiting for the next one, and a streamed decode stops at every MoE layer while the
    decode thread routes and waits for flash: the spinning takes the core the reader lanes need
    (measured on qwen30b-8l-shape with a 400 MB budget: a quarter of all CPU samples in libgomp,
    routing 1.6 instead of 0.5 ms per layer) and, when another process keeps one core busy, decode
    slows to 406 ms per token (1000 iterations: 178 ms; 10000: 279 ms). The price is compute when
    every expert is cached: 20-25 ms per token instead of 19-20. A value the user set wins.
    """
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT


def build_parser() -> argparse.ArgumentParser:
    """The full parser; each subcommand module adds itself through `register(subparsers)`."""
    from server.cli import bench, generate, make_model, models, serve, worker

    parser = argparse.ArgumentParser(
        prog="moeflash",
        description="Run Mixture-of-Experts models larger than RAM, streaming experts from flash.",
    )
    parser.add_argument("--version", action="version", version=f"moeflash {__version__}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity (default: INFO)",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    make_model.register(subparsers)
    serve.register(subparsers)
    generate.register(subparsers)
    bench.register(subparsers)
    models.register(subparsers)
    worker.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `moeflash` console script; returns the process exit status."""
    tame_openmp_spin(os.environ)  # before build_parser imports llama_cpp (libgomp reads it at load)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        status: int = args.func(args)
    except MoeflashError as exc:
        print(f"moeflash {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"moeflash {args.command}: interrupted", file=sys.stderr)
        return 130
    return status
