"""The model a benchmark runs on: a synthetic preset generated once and reused while the file and
the generator still match, and the figures of a GGUF the ratios need (bytes per expert, routed
bytes per token, dense bytes)."""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import Any

from server.bench.harness import disk_room_ok
from server.errors import ConfigError
from server.units import format_size

logger = logging.getLogger(__name__)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def generator_fingerprint(spec: Any) -> str:
    """What the generator would write for `spec`: the spec and the generator's source. A model
    file is only reused when this matches the one recorded with it, so a generator change (a
    new value spread, say, that leaves every size alone) is never benchmarked on a stale file."""
    import server.modelgen

    digest = hashlib.sha256(repr(spec).encode())
    for source in sorted(Path(server.modelgen.__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def shape_model(shape: str, models_dir: Path, progress: bool) -> tuple[Path, bool]:
    """The preset `shape`'s model in `models_dir`: reused when its recorded sha256 and generator
    fingerprint still match, else generated."""
    from server.modelgen import estimate_size, generate_model, preset

    spec = preset(shape)
    models_dir.mkdir(parents=True, exist_ok=True)
    path = models_dir / f"{shape}.gguf"
    sidecar = path.with_suffix(".sha256")
    fingerprint = generator_fingerprint(spec)
    if path.exists() and sidecar.exists() and path.stat().st_size == estimate_size(spec):
        recorded = sidecar.read_text().splitlines()
        if recorded[1:] != [fingerprint]:
            logger.info("%s was written by another generator or shape: generating it again", path)
        else:
            logger.info("checking %s against its recorded sha256", path)
            if _sha256(path) == recorded[0]:
                logger.info("reusing %s", path)
                return path, False
    need = estimate_size(spec)
    ok, free = disk_room_ok(models_dir, need)
    if not ok:
        raise ConfigError(
            f"not enough disk: {shape} needs {format_size(need, unit='GB', digits=1)} and 15 GB must stay "
            f"free ({format_size(free, unit='GB', digits=1)} free in {models_dir})"
        )
    generate_model(spec, path, progress=progress, overwrite=True)
    sidecar.write_text(f"{_sha256(path)}\n{fingerprint}\n")
    return path, True


def describe_model(path: Path) -> dict[str, Any]:
    """Size, bytes per expert, routed bytes per token and dense bytes of a GGUF."""
    import gguf

    from server.loading.gguf_header import read_metadata
    from server.loading.model_files import split_files
    from streaming_ext import Streamer, StreamerConfig

    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(path)
    arch = meta.get("general.architecture", "?")
    k = int(meta.get(f"{arch}.expert_used_count", "0"))
    streamer = Streamer(path, StreamerConfig())
    try:
        expert_bytes = streamer.expert_bytes
    finally:
        streamer.close()
    n_expert = int(meta.get(f"{arch}.expert_count", "1"))
    files = split_files(path)
    file_bytes = sum(p.stat().st_size for p in files)
    experts = [t for t in reader.tensors if re.search(r"_exps\.weight$", t.name)]
    slice_sizes = [t.n_bytes // n_expert for t in experts]
    # layers may differ in expert size (Q4_K_M keeps ffn_down in Q6_K on half of them): the mean
    # expert, and the exact bytes a token routes to (k of each layer's experts)
    n_moe_layers = len({t.name.split(".")[1] for t in experts})
    per_layer: dict[str, int] = {}
    for t in experts:
        layer = t.name.split(".")[1]
        per_layer[layer] = per_layer.get(layer, 0) + t.n_bytes // n_expert
    per_expert = expert_bytes // (n_expert * n_moe_layers) if n_moe_layers else 0
    return {
        "name": str(meta.get("general.name", path.stem)),
        "path": str(path),
        "architecture": arch,
        "file_bytes": file_bytes,
        "n_expert": n_expert,
        "n_expert_used": k,
        "bytes_per_expert": per_expert,
        "bytes_per_expert_slice": max(slice_sizes) if slice_sizes else per_expert,
        # the largest expert (gate + up + down) of any layer: the streamer's frame, the size at
        # which its cache counts every expert (docs/memory.md, "Expert memory")
        "frame_bytes": max(per_layer.values(), default=per_expert),
        "routed_bytes_per_token": expert_bytes * k // n_expert,
        "expert_bytes": expert_bytes,
        "dense_bytes": file_bytes - expert_bytes,
    }
