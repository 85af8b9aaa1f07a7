"""`moeflash bench`: the side-by-side benchmark, and `--replay` of routing traces.

moeflash bench --shape qwen30b-shape --caps 0.25,0.5          # generates (or reuses) the model
moeflash bench --model m.gguf --caps 4G,8G --tokens 32
moeflash bench --replay ../shared/data/route-traces/qwen.route.csv
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from server.errors import ConfigError, MoeflashError

logger = logging.getLogger(__name__)

_GB = 10**9


def register(subparsers: Any) -> None:
    """Add the `bench` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark moeflash against stock mmap and the disk ceiling (or replay routing traces)",
        description="Side-by-side benchmark on one model file under memory caps, with the BENCH.md ratios; "
        "or --replay a routing trace through the streamer's cache policy.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--shape", help="synthetic model preset to generate or reuse (e.g. qwen30b-shape)")
    what.add_argument("--model", type=Path, help="an existing GGUF (first file of a split set)")
    what.add_argument("--replay", type=Path, nargs="+", help="route trace(s) to replay (*.route.csv)")
    p.add_argument("--caps", default="0.25,0.5", help="memory caps: fractions of the file size or sizes (4G)")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per system (default 32)")
    p.add_argument("--mmap-tokens", type=int, default=8, help="decode tokens of the stock mmap run (slow)")
    p.add_argument("--ctx-size", type=int, default=1024, help="context size of every run")
    p.add_argument("--no-levers", action="store_true", help="skip the one-lever-at-a-time variants")
    p.add_argument("--ceiling-seconds", type=float, default=8.0, help="seconds per disk-ceiling pattern")
    p.add_argument("--models-dir", type=Path, default=Path("models"), help="where --shape models live")
    p.add_argument("--delete-model", action="store_true", help="delete a generated model afterwards")
    p.add_argument("--out", type=Path, help="report path without suffix (default bench/reports/<name>)")
    p.set_defaults(func=run)


def _parse_caps(text: str, file_bytes: int) -> list[int]:
    from server.settings import parse_size

    caps = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        try:
            value = float(part)
            caps.append(int(value * file_bytes) if value <= 1.0 else int(value))
        except ValueError:
            try:
                caps.append(parse_size(part))
            except ValueError as exc:
                raise ConfigError(f"--caps: {exc}") from None
    if not caps:
        raise ConfigError("--caps needs at least one cap")
    return caps


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


def _shape_model(args: argparse.Namespace, progress: bool) -> tuple[Path, bool]:
    """The --shape model: reused when its recorded sha256 and generator fingerprint still match,
    else generated."""
    from server.bench.harness import disk_room_ok
    from server.modelgen import estimate_size, generate_model, preset

    spec = preset(args.shape)
    args.models_dir.mkdir(parents=True, exist_ok=True)
    path = args.models_dir / f"{args.shape}.gguf"
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
    ok, free = disk_room_ok(args.models_dir, need)
    if not ok:
        raise ConfigError(
            f"not enough disk: {args.shape} needs {need / _GB:.1f} GB and 15 GB must stay free "
            f"({free / _GB:.1f} GB free in {args.models_dir})"
        )
    generate_model(spec, path, progress=progress, overwrite=True)
    sidecar.write_text(f"{_sha256(path)}\n{fingerprint}\n")
    return path, True


def describe_model(path: Path) -> dict[str, Any]:
    """Size, bytes per expert, routed bytes per token and dense bytes of a GGUF."""
    import gguf

    from server.gguf_header import read_metadata
    from server.model_files import split_files
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
        "routed_bytes_per_token": expert_bytes * k // n_expert,
        "expert_bytes": expert_bytes,
        "dense_bytes": file_bytes - expert_bytes,
    }


def _progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """The `bench` subcommand."""
    command = "moeflash " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.replay:
        from server.bench.replay_report import run_replay

        return run_replay(args.replay, args.out, command, _progress)
    if args.tokens < 4 or args.mmap_tokens < 1:
        raise ConfigError("--tokens must be >= 4 and --mmap-tokens >= 1")
    from server.bench.harness import BenchConfig, run_bench
    from server.bench.report import write_reports
    from server.bench.systems import default_systems

    generated = False
    if args.shape:
        path, generated = _shape_model(args, progress=sys.stderr.isatty())
    else:
        path = args.model
        if not path.exists():
            raise ConfigError(f"model {path} does not exist")
    try:
        info = describe_model(path)
        if args.shape:
            info["sha256"] = path.with_suffix(".sha256").read_text().strip()
        cfg = BenchConfig(
            model=path,
            caps=_parse_caps(args.caps, info["file_bytes"]),
            decode_tokens=args.tokens,
            ctx_size=args.ctx_size,
            ceiling_seconds=args.ceiling_seconds,
        )
        systems = default_systems(args.mmap_tokens, levers=not args.no_levers)
        try:
            result = run_bench(cfg, systems, info, _progress)
        except OSError as exc:
            raise MoeflashError(str(exc)) from exc
        out = args.out or Path("bench/reports") / info["name"]
        for p in write_reports(result, out, command):
            print(p)
        print(json.dumps(result.ratios, indent=1))
    finally:
        if generated and args.delete_model:
            path.unlink(missing_ok=True)
            path.with_suffix(".sha256").unlink(missing_ok=True)
    return 0
