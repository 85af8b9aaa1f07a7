"""The main server's side: helpers probed, registered with ggml, and given the model's last layers.

llama.cpp places `n_gpu_layers` layers, the last ones, on the devices a load names, split
between them in the proportions of `tensor_split`; a layer there is whole on its helper (its
dense weights, experts and KV). Every load names its devices, [] without helpers: a helper
registered for an earlier load, maybe gone since, is never used by default.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from server.errors import ConfigError, HelperError
from server.loading.gguf_header import TensorInfo
from server.rpc.ggml import Ggml
from server.rpc.hello import check_helper
from server.units import format_size

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^blk\.(\d+)\.")
# what a helper keeps beside its layers' weights and KV: llama.cpp's compute buffer for its part
# of the graph, measured at 30-90 MiB for the shapes here at 512-token batches
_HELPER_MARGIN = 128 << 20


@dataclass(frozen=True)
class Helper:
    """One helper of a load: its endpoint, its ggml device and the memory it reports."""

    endpoint: str
    device: int  # ggml_backend_dev_t
    free: int
    total: int


@dataclass(frozen=True)
class Split:
    """Where the layers go: `layers[i]` of the last ones on `helpers[i]`, in order."""

    helpers: tuple[Helper, ...]
    layers: tuple[int, ...]
    n_layer: int
    layer_bytes: tuple[int, ...] = ()  # each layer's weights, for the log

    @property
    def remote(self) -> int:
        """Layers on helpers."""
        return sum(self.layers)

    @property
    def local(self) -> int:
        """Layers computed here: 0 .. local - 1."""
        return self.n_layer - self.remote

    def llama_kwargs(self) -> dict[str, Any]:
        """The Llama arguments that place them. llama.cpp counts the output matrix as one layer more,
        the last: offloaded with the others unless a tensor override keeps it here (a streamed
        model's does: its logits then never cross the link)."""
        kwargs: dict[str, Any] = {
            "devices": [h.device for h in self.helpers],
            "n_gpu_layers": self.remote + 1 if self.remote else 0,
        }
        if len(self.helpers) > 1:
            kwargs["tensor_split"] = [float(n) for n in self.layers]
        return kwargs

    def describe(self) -> str:
        """The start-up log's line: each helper, its layers and memory."""
        first = self.local
        parts = []
        for helper, n in zip(self.helpers, self.layers, strict=True):
            span = f"layers {first}-{first + n - 1}" if n else "no layers"
            weights = sum(self.layer_bytes[first : first + n])
            parts.append(
                f"{helper.endpoint}: {span} ({format_size(weights)} of weights; "
                f"{format_size(helper.free)} free)"
            )
            first += n
        return f"layers 0-{self.local - 1} here; " + "; ".join(parts)


def connect(endpoints: Sequence[str], *, optional: bool = False) -> tuple[Helper, ...]:
    """Probe each helper (HelperError naming one that is gone, busy or of another build; left out
    with a warning when `optional`), then register it with ggml."""
    ggml = Ggml.load()
    helpers = []
    for endpoint in endpoints:
        try:
            check_helper(endpoint)
        except HelperError as exc:
            if not optional:
                raise
            logger.warning("%s: left out, its layers run here (--rpc-optional)", exc)
            continue
        devices = ggml.add_rpc_server(endpoint)
        if not devices:
            raise HelperError(f"RPC helper {endpoint} offers no device")
        free, total = ggml.memory(devices[0])
        helpers.append(Helper(endpoint, devices[0], free, total))
    return tuple(helpers)


def tensor_bytes(info: TensorInfo) -> int:
    """Bytes of one tensor of the table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    return int(prod(info.shape)) // block * size


def layer_bytes(tensors: Mapping[str, TensorInfo]) -> dict[int, int]:
    """Bytes of each layer's tensors (blk.N.*)."""
    per: dict[int, int] = {}
    for name, info in tensors.items():
        if match := _LAYER.match(name):
            layer = int(match.group(1))
            per[layer] = per.get(layer, 0) + tensor_bytes(info)
    return per


def kv_bytes_per_layer(metadata: Mapping[str, Any], n_ctx_total: int) -> int:
    """F16 K and V of one layer for `n_ctx_total` cells (every slot's context)."""
    arch = metadata.get("general.architecture", "")

    def first(key: str, default: int) -> int:
        value = metadata.get(f"{arch}.{key}", default)
        return int(max(value) if isinstance(value, list) else value)

    heads = first("attention.head_count", 1)
    kv_heads = first("attention.head_count_kv", heads)
    head_dim = first("embedding_length", 0) // max(1, heads)
    k = first("attention.key_length", head_dim)
    v = first("attention.value_length", head_dim)
    return n_ctx_total * kv_heads * (k + v) * 2


def plan(
    helpers: tuple[Helper, ...],
    asked: list[int] | str,
    path: Path,
    n_ctx_total: int,
) -> Split:
    """The layers each helper holds: as asked, or (auto) as many as its memory holds with its KV
    and a compute margin, the last layers first, keeping at least one layer here. ConfigError
    for a count that does not fit the model."""
    from server.loading.budget import model_tensors
    from server.loading.gguf_header import read_metadata

    metadata = read_metadata(path)
    arch = metadata.get("general.architecture", "")
    n_layer = int(metadata.get(f"{arch}.block_count", 0))
    per_layer = layer_bytes(model_tensors(path))
    sizes = tuple(per_layer.get(il, 0) for il in range(n_layer))
    if isinstance(asked, list):
        if len(asked) != len(helpers):
            raise ConfigError(f"--rpc-layers gives {len(asked)} counts for {len(helpers)} helpers")
        if sum(asked) >= n_layer:
            raise ConfigError(f"--rpc-layers {sum(asked)} leaves none of the {n_layer} layers here")
        return Split(helpers, tuple(asked), n_layer, sizes)
    kv = kv_bytes_per_layer(metadata, n_ctx_total)
    top = n_layer - 1  # the highest layer not placed yet; layer 0 stays here
    layers = []
    # the last layers go to the last helper: llama.cpp gives each helper a consecutive span
    for helper in reversed(helpers):
        room = helper.free - _HELPER_MARGIN
        n = 0
        while top >= 1 and room >= per_layer.get(top, 0) + kv:
            room -= per_layer.get(top, 0) + kv
            top -= 1
            n += 1
        layers.append(n)
    return Split(helpers, tuple(reversed(layers)), n_layer, sizes)
