"""`moeflash pull`, `list` and `rm`: models from the Hugging Face Hub, on disk (server/hub)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from server.cli.arguments import add_arguments, settings_of
from server.errors import PullError
from server.settings import StoreSettings
from server.units import format_size

if TYPE_CHECKING:
    from server.hub import Storage


def _storage(args: argparse.Namespace) -> Storage:
    """--models-dir, else the Hugging Face cache."""
    from server.hub import default_storage

    return default_storage(settings_of(StoreSettings, args).models_dir)


def run_pull(args: argparse.Namespace) -> int:
    from server.hub import hub_api, pull

    model = pull(args.ref, _storage(args), hub_api(), progress=not args.quiet)
    # user-facing: what was pulled and how to serve it
    print(f"pulled {model.name} ({format_size(model.size)}, {len(model.files)} file(s)) from {model.origin}")
    print(f"serve it: moeflash serve --model {model.files[0]}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    models = _storage(args).models()
    if not models:
        print("no models (moeflash pull OWNER/NAME[:QUANT] gets one)", file=sys.stderr)
        return 0
    width = max(len(m.name) for m in models)
    for m in models:
        print(f"{m.name:<{width}}  {format_size(m.size):>9}  {m.origin}  {m.files[0]}")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    storage = _storage(args)
    models = storage.models()
    chosen = [m for m in models if args.name in (m.name, str(m.files[0]))]
    if not chosen:
        known = ", ".join(sorted({m.name for m in models})) or "none"
        raise PullError(f"no model {args.name!r} here (the models: {known}); moeflash list shows them")
    for model in chosen:
        for path in storage.remove(model):
            print(f"removed {path}")
    return 0


def register(subparsers: Any) -> None:
    """Add `pull`, `list` and `rm` to the moeflash command line."""
    pull = subparsers.add_parser(
        "pull",
        help="download a GGUF model from the Hugging Face Hub",
        description="Download OWNER/NAME[:QUANT] from the Hugging Face Hub (HF_ENDPOINT and HF_TOKEN "
        "honoured): a split set whole, resumed after an interruption, checked against the sha256 the "
        "Hub reports. QUANT (e.g. Q4_K_M) is matched case-insensitively in the file names.",
    )
    pull.add_argument("ref", metavar="OWNER/NAME[:QUANT]", help="the model repository and quant")
    pull.add_argument("--quiet", action="store_true", help="no progress bars")
    add_arguments(pull, (StoreSettings,))
    pull.set_defaults(func=run_pull)

    listing = subparsers.add_parser(
        "list", help="list the models pulled", description="List the models pulled."
    )
    add_arguments(listing, (StoreSettings,))
    listing.set_defaults(func=run_list)

    rm = subparsers.add_parser("rm", help="remove a model pulled", description="Remove a model pulled.")
    rm.add_argument("name", metavar="NAME", help="the model's name as `moeflash list` shows it, or its path")
    add_arguments(rm, (StoreSettings,))
    rm.set_defaults(func=run_rm)
