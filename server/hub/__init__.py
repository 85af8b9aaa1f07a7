"""Models from the Hugging Face Hub: `moeflash pull`, `list` and `rm` (server/cli/models.py).

catalog: which files `REPO[:QUANT]` names in a repository's tree (pure); storage: where
pulled models live (the Hugging Face cache or a models directory) and how they are listed and
removed; pull: the download, resumed after an interruption and checked against the Hub's sha256.
"""

from server.hub.catalog import HubFile, HubModel, choose, parse_ref
from server.hub.pull import hub_api, pull, resolve
from server.hub.storage import CacheStorage, DirectoryStorage, LocalModel, Storage, default_storage

__all__ = [
    "CacheStorage",
    "DirectoryStorage",
    "HubFile",
    "HubModel",
    "LocalModel",
    "Storage",
    "choose",
    "default_storage",
    "hub_api",
    "parse_ref",
    "pull",
    "resolve",
]
