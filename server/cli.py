"""The `moeflash` command line: one subcommand per module, each registering its own parser."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from server import __version__
from server.errors import MoeflashError

logger = logging.getLogger(__name__)

# exit status for refused input (argparse uses 2 for usage errors too)
EXIT_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """The full parser; each subcommand module adds itself through `register(subparsers)`."""
    from server import generate_command, serve_command
    from server.bench import command as bench_command
    from server.modelgen import command as make_model_command

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
    make_model_command.register(subparsers)
    serve_command.register(subparsers)
    generate_command.register(subparsers)
    bench_command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `moeflash` console script; returns the process exit status."""
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


if __name__ == "__main__":
    raise SystemExit(main())
