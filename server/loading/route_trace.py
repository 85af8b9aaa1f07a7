"""Route traces: the file format, and replaying or recording a model's routing with one.

A route trace (`*.route.csv`, the format of bench/route-traces) lists, per token and
MoE layer, the experts the router picked. `#` header lines give the model, n_layer, n_expert,
n_expert_used and, per layer, `expert_bytes` (one expert: gate + up + down) and `dense_bytes`;
then one row per routed expert:
`turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,seq` (turn the request; phase 0
is the prompt, 1 decode; step the token's index within its request's phase; slot its rank among
the token's k; weight the router's score; residency is not used here; seq the KV sequence the
request decoded in, 0 when the column is absent, as in files written before it).

`--route-trace FILE` makes a model route every token as the trace did (streaming_ext.RouteTracer
in the eval callback, the same for a resident and a streamed model): each request's prompt token
i takes the trace's prompt step i and its decode token j the decode step j, wrapping around when
the request is longer than the trace; the steps of several turns run one after the other. With
`--parallel` above 1, requests decoded together are routed each by its own steps. Output then
differs from the model's own (benchmarks and tests only). `--record-route-trace FILE` writes the
routing a run used in the same format, one turn per request.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from server.errors import ConfigError
from server.loading.gguf_header import read_metadata, read_tensor_sizes
from server.loading.model_files import split_files
from server.settings import RouteTraceSettings

if TYPE_CHECKING:
    from server.loading.measured import MeasuredLlama
    from streaming_ext import RouteTracer

logger = logging.getLogger(__name__)

FORMAT_LINE = "# route_trace v1"
COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "weight", "residency", "expert_bytes", "seq")
_NEEDED = ("turn", "phase", "step", "layer", "expert")
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class Route:
    """One layer of one token: the experts it routed to, in slot order."""

    decode: bool
    layer: int
    experts: tuple[int, ...]
    turn: int = 0
    step: int = 0
    weights: tuple[float, ...] = ()
    seq: int = 0  # the KV sequence the token decoded in
    # a micro-batch's route (experts: their union): each token's experts, what the policy learns from
    tokens: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Trace:
    """A parsed route trace: the shape it was recorded on and its routes in file order."""

    name: str
    n_layer: int
    n_expert: int
    entry_bytes: list[int]  # per layer: bytes of one expert (gate + up + down)
    routes: list[Route]
    n_expert_used: int = 0  # k; 0 when the header does not say (then the longest route's)
    dense_bytes: list[int] = field(default_factory=list)
    model: str = ""
    arch: str = ""

    @property
    def k(self) -> int:
        """Experts routed per token."""
        return self.n_expert_used or max((len(r.experts) for r in self.routes), default=0)

    def steps(self, decode: bool) -> list[tuple[int, int]]:
        """The (turn, step) tokens of one phase, in order."""
        return sorted({(r.turn, r.step) for r in self.routes if r.decode == decode})

    def by_token(self) -> dict[tuple[bool, int, int, int], tuple[int, ...]]:
        """(decode, turn, step, layer) -> the experts that layer routed for that token."""
        return {(r.decode, r.turn, r.step, r.layer): r.experts for r in self.routes}


@dataclass(frozen=True)
class ModelShape:
    """What a trace must match to route a model, and what a recorded trace's header says."""

    path: Path
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    entry_bytes: list[int]  # per layer: one expert's bytes (0: a layer without experts)
    dense_bytes: list[int]  # per layer: the layer's other tensors

    @classmethod
    def of(cls, path: Path) -> ModelShape:
        """Read from the GGUF header and tensor table (all split files)."""
        meta = read_metadata(path)
        arch = str(meta.get("general.architecture", ""))
        n_layer = int(meta.get(f"{arch}.block_count", 0))
        n_expert = int(meta.get(f"{arch}.expert_count", 0))
        k = int(meta.get(f"{arch}.expert_used_count", 0))
        expert = [0] * n_layer
        dense = [0] * n_layer
        for part in split_files(path):
            for name, size in read_tensor_sizes(part).items():
                match = _BLOCK.match(name)
                if match is None or int(match.group(1)) >= n_layer:
                    continue
                layer = int(match.group(1))
                if "_exps." in name:
                    expert[layer] += size
                else:
                    dense[layer] += size
        per_expert = [total // n_expert if n_expert else 0 for total in expert]
        return cls(path, arch, n_layer, n_expert, k, per_expert, dense)


def _header(path: Path, name: str, lines: list[str]) -> Trace:
    """The trace the `#` lines describe, without its routes."""
    n_layer = n_expert = k = 0
    model = arch = ""
    entry: dict[int, int] = {}
    dense: dict[int, int] = {}
    for line in lines:
        fields = dict(kv.split("=", 1) for kv in line[1:].split() if "=" in kv)
        try:
            if "n_layer" in fields:
                n_layer, n_expert = int(fields["n_layer"]), int(fields["n_expert"])
                k = int(fields.get("n_expert_used", 0))
                model, arch = fields.get("model", ""), fields.get("arch", "")
            if "layer" in fields and "expert_bytes" in fields:
                entry[int(fields["layer"])] = int(fields["expert_bytes"])
                dense[int(fields["layer"])] = int(fields.get("dense_bytes", 0))
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"{path}: bad header line {line.strip()!r}") from exc
    if n_layer <= 0 or n_expert <= 0:
        raise ConfigError(f"{path}: no '# ... n_layer=... n_expert=...' header")
    missing = [layer for layer in range(n_layer) if layer not in entry]
    if missing:
        raise ConfigError(f"{path}: no '# layer=N expert_bytes=...' header for layers {missing[:8]}")
    return Trace(
        name,
        n_layer,
        n_expert,
        [entry[layer] for layer in range(n_layer)],
        [],
        n_expert_used=k,
        dense_bytes=[dense[layer] for layer in range(n_layer)],
        model=model,
        arch=arch,
    )


def load_trace(path: Path) -> Trace:
    """Parse a *.route.csv file. ConfigError, naming the file and line, for anything that is not
    such a trace (a route with repeated experts, or more than the header's k, included)."""
    try:
        with path.open() as fh:
            lines = fh.readlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read route trace {path}: {exc}") from exc
    head = _header(path, path.name.split(".")[0], [ln for ln in lines if ln.startswith("#")])
    n_layer, n_expert, k = head.n_layer, head.n_expert, head.n_expert_used
    reader = csv.DictReader(ln for ln in lines if not ln.startswith("#"))
    if not set(_NEEDED) <= set(reader.fieldnames or ()):
        raise ConfigError(f"{path}: the column header must name {', '.join(_NEEDED)}")
    routes: list[Route] = []
    key: tuple[int, int, int, int] | None = None
    experts: list[int] = []
    weights: list[float] = []
    seq = 0

    def close_route() -> None:
        if key is None:
            return
        if len(set(experts)) != len(experts) or (k and len(experts) > k):
            raise ConfigError(
                f"{path}: turn {key[0]} phase {key[1]} step {key[2]} layer {key[3]} routes to {experts} "
                f"(experts must be distinct, at most {k or 'k'} of them)"
            )
        routes.append(Route(key[1] == 1, key[3], tuple(experts), key[0], key[2], tuple(weights), seq))

    for rec in reader:
        try:
            row = tuple(int(rec[name]) for name in _NEEDED)
            weight = float(rec.get("weight") or 0.0)
            row_seq = int(rec.get("seq") or 0)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{path}: line {reader.line_num}: {', '.join(_NEEDED)} must be integers"
            ) from exc
        turn, phase, step, layer, expert = row
        if not (0 <= layer < n_layer and 0 <= expert < n_expert) or phase not in (0, 1) or step < 0:
            raise ConfigError(
                f"{path}: line {reader.line_num}: phase {phase}, step {step}, layer {layer} or expert "
                f"{expert} outside the header's {n_layer} layers x {n_expert} experts (phase 0 or 1)"
            )
        if (turn, phase, step, layer) != key:
            close_route()
            key, experts, weights, seq = (turn, phase, step, layer), [], [], row_seq
        experts.append(expert)
        weights.append(weight)
    if key is None:
        raise ConfigError(f"{path}: no routes")
    close_route()
    return dataclasses.replace(head, routes=routes)


def write_trace(path: Path, shape: ModelShape, routes: list[Route]) -> None:
    """Write `routes` of a model of `shape` as a *.route.csv file (ConfigError if it cannot)."""
    try:
        with path.open("w", newline="") as fh:
            fh.write(f"{FORMAT_LINE}\n")
            fh.write(
                f"# model={shape.path} arch={shape.arch} n_layer={shape.n_layer} n_expert={shape.n_expert} "
                f"n_expert_used={shape.n_expert_used}\n"
            )
            for layer in range(shape.n_layer):
                fh.write(
                    f"# layer={layer} expert_bytes={shape.entry_bytes[layer]} "
                    f"dense_bytes={shape.dense_bytes[layer]}\n"
                )
            out = csv.writer(fh, lineterminator="\n")
            out.writerow(COLUMNS)
            for r in routes:
                weights = r.weights or (0.0,) * len(r.experts)
                for slot, (expert, weight) in enumerate(zip(r.experts, weights, strict=True)):
                    out.writerow(
                        (
                            r.turn,
                            int(r.decode),
                            r.step,
                            r.layer,
                            slot,
                            expert,
                            f"{weight:.6f}",
                            0,
                            shape.entry_bytes[r.layer],
                            r.seq,
                        )
                    )
    except OSError as exc:
        raise ConfigError(f"cannot write the route trace {path}: {exc}") from exc


def check_fits(trace: Trace, shape: ModelShape, path: Path) -> None:
    """ConfigError unless `trace` can route the model of `shape`: the same layers, experts and k,
    and both a prompt and a decode phase."""
    problems = []
    if trace.n_layer != shape.n_layer:
        problems.append(f"{trace.n_layer} layers (the model has {shape.n_layer})")
    if trace.n_expert != shape.n_expert:
        problems.append(f"{trace.n_expert} experts per layer (the model has {shape.n_expert})")
    if trace.k != shape.n_expert_used:
        problems.append(f"{trace.k} experts per token (the model uses {shape.n_expert_used})")
    short = [r for r in trace.routes if len(r.experts) != trace.k]
    if short:
        r = short[0]
        problems.append(f"a route of {len(r.experts)} experts (turn {r.turn} step {r.step} layer {r.layer})")
    for decode, phase in ((False, "prompt"), (True, "decode")):
        if not trace.steps(decode):
            problems.append(f"no {phase} steps")
    if problems:
        raise ConfigError(f"the route trace {path} cannot route {shape.path.name}: " + "; ".join(problems))


def build_tracer(settings: RouteTraceSettings, model_path: Path) -> tuple[RouteTracer, ModelShape] | None:
    """The RouteTracer that replays and/or records what `settings` ask for, for the model at
    `model_path`, or None when they ask for neither. ConfigError for a trace that does not fit."""
    if settings.route_trace is None and settings.record_route_trace is None:
        return None
    from streaming_ext import RouteTracer

    shape = ModelShape.of(model_path)
    if shape.n_expert <= 0 or shape.n_expert_used <= 0:
        raise ConfigError(f"{model_path.name} has no experts: there is no routing to replay or record")
    tracer = RouteTracer(shape.n_layer, shape.n_expert, shape.n_expert_used)
    try:
        if settings.route_trace is not None:
            trace = load_trace(settings.route_trace)
            check_fits(trace, shape, settings.route_trace)
            routed = trace.by_token()
            unrouted = (-1,) * shape.n_expert_used  # a layer the trace leaves to the model
            for decode in (False, True):
                ids = [
                    [routed.get((decode, turn, step, layer), unrouted) for layer in range(shape.n_layer)]
                    for turn, step in trace.steps(decode)
                ]
                tracer.replay(1 if decode else 0, ids)
            logger.info(
                "routing replayed from %s (%d prompt and %d decode steps): lossy, for benchmarks",
                settings.route_trace,
                len(trace.steps(False)),
                len(trace.steps(True)),
            )
        if settings.record_route_trace is not None:
            tracer.record(True)
    except BaseException:
        tracer.close()
        raise
    return tracer, shape


def recorded_routes(llama: MeasuredLlama) -> list[Route]:
    """The routes `llama`'s tracer recorded and not yet taken, one per token and layer in the
    order they ran (empty when it records nothing)."""
    if llama.tracer is None:
        return []
    routes: list[Route] = []
    rows: dict[tuple[int, int, int, int, int], list[tuple[int, float]]] = {}
    for r in llama.tracer.take_records():
        rows.setdefault((r.turn, r.phase, r.step, r.layer, r.seq), []).append((r.expert, r.weight))
    for (turn, phase, step, layer, seq), picks in rows.items():
        experts, weights = tuple(e for e, _ in picks), tuple(w for _, w in picks)
        routes.append(Route(phase == 1, layer, experts, turn, step, weights, seq))
    return routes
