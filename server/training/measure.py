"""How good the trained model is, and how it routes: perplexity, continuations, route statistics.

- perplexity: held-out text through llama.cpp in windows of `window` tokens, resident and with
  its experts streamed under a cap (the two must give byte-identical logits), against a unigram
  model of the training tokens (add-one smoothed) on the same predicted tokens.
- continuations: greedy text from a few prompts, raw and as chat turns.
- prefetch: a greedy decode streamed under a cap (a quarter of the experts' bytes), with no
  read-ahead, the routing-history predictor and the router predictor (the default): hit rate,
  how many experts each read ahead and how many of those were used, bytes read, decode speed.
- route statistics per layer, of a recorded route trace (`moeflash generate
  --record-route-trace`, prompt and decode tokens in order) and of the real traces in
  bench/route-traces: `skew` (the most used expert's share over the uniform share 1/n_expert:
  1 is uniform, n_expert/k is collapsed; a few hundred tokens put it well above 1 by chance
  alone) and `reuse` (the mean fraction of a token's experts that the token before it also
  used in that layer: k/n_expert for independent uniform routing).

`python -m server.training.measure --run-dir RUN --model FILE.gguf` prints them as
Markdown; docs/training.md shows its output for the committed model.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from server.hub.pull import sha256_of
from server.loading.measured import DecodeStep
from server.loading.route_trace import ModelShape, Trace, load_trace
from server.loading.streaming import load_streaming_llama
from server.training import corpus, tokenizer
from server.units import format_size
from streaming_ext import Policy, Prefetch, StreamerConfig, StreamerStats

PROMPTS = (
    "The for statement in Python",
    "A dictionary is",
    "The Devil's Dictionary says that",
)
CHAT_PROMPTS = ('What does "river" mean?', "What is a function?")
REAL_TRACES = (Path("bench/route-traces/qwen.route.csv"), Path("bench/route-traces/gemma.route.csv"))


@dataclasses.dataclass(frozen=True)
class Perplexity:
    tokens: int  # predicted tokens
    model: float
    unigram: float
    logits_sha256: str  # of every logits row evaluated (resident and streamed must agree)


def heldout_windows(ids: np.ndarray, window: int, max_tokens: int) -> list[list[int]]:
    ids = ids[: max_tokens + 1]
    return [
        ids[i : i + window].tolist() for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1
    ]


def _nll(llm: llama_cpp.Llama, windows: list[list[int]], digest: hashlib._Hash) -> list[float]:
    out: list[float] = []
    for w in windows:
        llm.reset()  # type: ignore[no-untyped-call]
        llm.eval(w)
        scores = np.asarray(llm.scores[: len(w)], dtype=np.float32)
        digest.update(scores.tobytes())
        logp = scores.astype(np.float64)
        logp -= logp.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        out.extend(-logp[np.arange(len(w) - 1), w[1:]])
    return out


def unigram_nll(train_ids: np.ndarray, windows: list[list[int]], n_vocab: int) -> list[float]:
    counts = np.bincount(train_ids, minlength=n_vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return [-logp[t] for w in windows for t in w[1:]]


def perplexity(
    model: Path, run_dir: Path, *, window: int = 256, max_tokens: int = 16384, budget: int | None = None
) -> tuple[Perplexity, Perplexity]:
    """(resident, streamed with `budget` bytes of experts, default a quarter of them)."""
    held = np.fromfile(run_dir / "heldout.bin", dtype=np.uint16).astype(np.int64)
    train = np.fromfile(run_dir / "train.bin", dtype=np.uint16).astype(np.int64)
    windows = heldout_windows(held, window, max_tokens)
    n_vocab = tokenizer.load(run_dir / "tokenizer.json").get_vocab_size()
    unigram = float(np.exp(np.mean(unigram_nll(train, windows, n_vocab))))
    settings: dict[str, Any] = {
        "n_ctx": window,
        "n_batch": window,
        "n_threads": 1,
        "n_threads_batch": 1,
        "logits_all": True,
    }
    results = []
    for streamed in (False, True):
        digest = hashlib.sha256()
        if streamed:
            llm: llama_cpp.Llama = load_streaming_llama(
                model, StreamerConfig(policy=Policy.LAYER), budget=budget or expert_share(model, 4),
                flash_attn="off", verbose=False, **settings,
            )  # fmt: skip
        else:
            llm = llama_cpp.Llama(str(model), use_extra_bufts=False, verbose=False, **settings)
        try:
            nll = _nll(llm, windows, digest)
        finally:
            llm.close()
        results.append(Perplexity(len(nll), float(np.exp(np.mean(nll))), unigram, digest.hexdigest()))
    return results[0], results[1]


def expert_share(model: Path, denominator: int) -> int:
    """1/denominator of the experts' bytes, at least one layer's experts (the streamer's floor)."""
    shape = ModelShape.of(model)
    floor = max(shape.entry_bytes) * shape.n_expert
    return max(sum(shape.entry_bytes) * shape.n_expert // denominator, floor)


def _last_logits(llm: llama_cpp.Llama) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def loops(text: str, n: int = 3) -> bool:
    """Some n words in a row come back three times or more: greedy decoding caught in a loop."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return any(count >= 3 for count in grams.values())


def continuations(model: Path, run_dir: Path, n: int = 40) -> list[tuple[str, str]]:
    """(prompt, greedy continuation) for PROMPTS and CHAT_PROMPTS (as one user turn)."""
    tok = tokenizer.load(run_dir / "tokenizer.json")
    llm = llama_cpp.Llama(str(model), n_ctx=512, n_threads=1, use_extra_bufts=False, verbose=False)
    stop = {tok.token_to_id("<|im_end|>"), tok.token_to_id(corpus.DOC_SEPARATOR)}
    out = []
    try:
        prompts = [(p, p) for p in PROMPTS]
        prompts += [(p, f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n") for p in CHAT_PROMPTS]
        for shown, text in prompts:
            llm.reset()  # type: ignore[no-untyped-call]
            llm.eval(tok.encode(text).ids)
            ids: list[int] = []
            for _ in range(n):
                nxt = int(np.argmax(_last_logits(llm)))
                if nxt in stop:
                    break
                ids.append(nxt)
                llm.eval([nxt])
            out.append((shown, tok.decode(ids)))
    finally:
        llm.close()
    return out


@dataclasses.dataclass(frozen=True)
class PrefetchRun:
    """One greedy decode streamed under a cap: its decode calls as one record (the figures are the
    record's: server/loading/measured.py DecodeStep)."""

    prefetch: Prefetch
    decode: DecodeStep

    @property
    def tokens(self) -> int:
        return self.decode.n_tokens

    @property
    def counters(self) -> StreamerStats:
        assert self.decode.streamer is not None
        return self.decode.streamer


def prefetch_runs(
    model: Path,
    prompt_ids: list[int],
    n: int,
    budget: int,
    predictors: Sequence[Prefetch] = (Prefetch.OFF, Prefetch.HISTORY, Prefetch.ROUTER),
) -> list[PrefetchRun]:
    """Decode `n` tokens after the prompt with each predictor, `budget` bytes of experts."""
    runs = []
    for prefetch in predictors:
        config = StreamerConfig(policy=Policy.LAYER, prefetch=prefetch)
        llm = load_streaming_llama(
            model, config, budget=budget, follow_memory=False, n_ctx=max(512, len(prompt_ids) + n + 1),
            n_threads=1, n_threads_batch=1, flash_attn="off", verbose=False,
        )  # fmt: skip
        try:
            llm.eval(prompt_ids)
            before = llm.stats()
            start = time.perf_counter_ns()
            for _ in range(n):
                llm.eval([int(np.argmax(_last_logits(llm)))])
            decode = DecodeStep(n, time.perf_counter_ns() - start, llm.stats() - before)
        finally:
            llm.close()
        runs.append(PrefetchRun(prefetch, decode))
    return runs


def _prefetch_table(rounds: list[list[PrefetchRun]]) -> list[str]:
    """One row per predictor: the first round's counters (the same in every round: greedy decode,
    one route per token), the median round's decode speed and its ratio to no read-ahead's."""
    lines = [
        "| prefetch | hit rate | cache hits | read ahead | of them used | MB read | flash wait s "
        "| decode tok/s (median) | vs off |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    speeds = [[r.tokens / (r.decode.wall_ns / 1e9) for r in runs] for runs in zip(*rounds, strict=True)]
    base = float(np.median(speeds[0]))
    for r, tok_s in zip(rounds[0], speeds, strict=True):
        d, s = r.decode, r.counters
        used = f"{d.prefetch_accuracy:.0%}" if d.prefetch_accuracy is not None else "-"
        median = float(np.median(tok_s))
        lines.append(
            f"| {r.prefetch.name.lower()} | {d.hit_rate or 0:.1%} | {s.hits} | {s.prefetched} | {used} "
            f"| {format_size(s.bytes_read, unit='MB', digits=1, bare=True)} | {s.flash_wait_ns / 1e9:.2f} "
            f"| {median:.1f} | {median / base:.2f}x |"
        )
    return lines


@dataclasses.dataclass(frozen=True)
class LossyOption:
    """A lossy way to read less under a cap: fewer experts per token (the model's
    expert_used_count overridden) or uncached low-weight experts dropped (StreamerConfig.skip_below).
    Measured, never a default."""

    label: str
    skip_below: float = 0.0
    top_k: int | None = None

    def llama_kwargs(self, model: Path) -> dict[str, Any]:
        if self.top_k is None:
            return {}
        arch = ModelShape.of(model).arch
        return {"kv_overrides": {f"{arch}.expert_used_count": self.top_k}}


LOSSY_OPTIONS = (
    LossyOption("exact"),
    LossyOption("top-k 3", top_k=3),
    LossyOption("top-k 2", top_k=2),
    LossyOption("skip < 0.1", skip_below=0.1),
    LossyOption("skip < 0.2", skip_below=0.2),
)


@dataclasses.dataclass(frozen=True)
class LossyRun:
    option: LossyOption
    perplexity: float  # held-out, one token per decode call, streamed under the cap
    scored: DecodeStep  # the scoring pass's record (bytes read, hits, skipped)
    tok_s: list[float]  # greedy decode speed under the cap, one per round


def lossy_runs(
    model: Path,
    run_dir: Path,
    budget: int,
    *,
    tokens: int = 2048,
    decode: int = 128,
    rounds: int = 3,
    options: Sequence[LossyOption] = LOSSY_OPTIONS,
) -> list[LossyRun]:
    """Each option's held-out perplexity and its decode speed under `budget` bytes of experts.

    Perplexity: `tokens` held-out tokens in windows of 256, each token its own decode call (as
    a chat decodes; a batched prompt routes differently). Speed: `decode` greedy tokens after a
    held-out prompt, the options alternated round after round (the machines drift)."""
    held = np.fromfile(run_dir / "heldout.bin", dtype=np.uint16).astype(np.int64)
    windows = heldout_windows(held, 256, tokens)
    prompt_ids = (
        tokenizer.load(run_dir / "tokenizer.json")
        .encode(heldout_prompt(run_dir / "corpus" / "heldout.txt", 600))
        .ids
    )

    def load(opt: LossyOption) -> Any:
        config = StreamerConfig(policy=Policy.LAYER, skip_below=opt.skip_below)
        return load_streaming_llama(
            model, config, budget=budget, follow_memory=False, n_ctx=512, n_batch=1, n_ubatch=1,
            logits_all=True, n_threads=1, n_threads_batch=1, flash_attn="off", verbose=False,
            **opt.llama_kwargs(model),
        )  # fmt: skip

    scored: dict[str, tuple[float, DecodeStep]] = {}
    for opt in options:
        llm = load(opt)
        try:
            before, start = llm.stats(), time.perf_counter_ns()
            nll = _nll(llm, windows, hashlib.sha256())
            n = sum(len(w) for w in windows)
            step = DecodeStep(n, time.perf_counter_ns() - start, llm.stats() - before)
            scored[opt.label] = (float(np.exp(np.mean(nll))), step)
        finally:
            llm.close()
    speeds: dict[str, list[float]] = {o.label: [] for o in options}
    for _ in range(rounds):
        for opt in options:
            llm = load(opt)
            try:
                llm.eval(prompt_ids)
                start = time.perf_counter_ns()
                for _ in range(decode):
                    llm.eval([int(np.argmax(_last_logits(llm)))])
                speeds[opt.label].append(decode / ((time.perf_counter_ns() - start) / 1e9))
            finally:
                llm.close()
    return [LossyRun(o, scored[o.label][0], scored[o.label][1], speeds[o.label]) for o in options]


def _lossy_table(runs: list[LossyRun]) -> list[str]:
    base = runs[0]
    lines = [
        "| option | perplexity | vs exact | MB read / token | hit rate | experts dropped "
        "| decode tok/s (median) | vs exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        d, s = r.scored, r.scored.streamer
        assert s is not None
        dropped = s.skipped / max(1, s.hits + s.misses + s.skipped)
        tok_s = float(np.median(r.tok_s))
        lines.append(
            f"| {r.option.label} | {r.perplexity:.2f} | {r.perplexity / base.perplexity:.3f} "
            f"| {format_size(s.bytes_read / d.n_tokens, unit='MB', digits=3, bare=True)} "
            f"| {d.hit_rate or 0:.1%} | {dropped:.1%} "
            f"| {tok_s:.1f} | {tok_s / float(np.median(base.tok_s)):.2f}x |"
        )
    return lines


@dataclasses.dataclass(frozen=True)
class LayerRouting:
    layer: int
    skew: float  # the most used expert's share / (1 / n_expert)
    reuse: float  # mean |E_t & E_t-1| / k over consecutive tokens


def route_stats(trace: Trace) -> list[LayerRouting]:
    """Per layer, over the trace's tokens (each turn's prompt, then its decode)."""
    by_layer: dict[int, list[tuple[int, ...]]] = {}
    for r in sorted(trace.routes, key=lambda r: (r.layer, r.turn, r.decode, r.step)):
        by_layer.setdefault(r.layer, []).append(r.experts)
    out = []
    for layer, routes in sorted(by_layer.items()):
        counts = np.bincount([e for r in routes for e in r], minlength=trace.n_expert)
        skew = float(counts.max() / counts.sum() * trace.n_expert)
        pairs = [len(set(a) & set(b)) / len(b) for a, b in zip(routes, routes[1:], strict=False)]
        out.append(LayerRouting(layer, skew, float(np.mean(pairs)) if pairs else 0.0))
    return out


def uniform_chance(n_tokens: int, n_expert: int, k: int, draws: int = 400) -> tuple[float, ...]:
    """Skew and reuse (route_stats) of independent uniform routing over `n_tokens` tokens: the
    5th and 95th percentiles of `draws` draws (seeded), as (skew lo, skew hi, reuse lo, reuse hi)."""
    rng = np.random.default_rng(0)
    skew, reuse = [], []
    for _ in range(draws):
        routes = np.argsort(rng.random((n_tokens, n_expert)), axis=1)[:, :k]
        counts = np.bincount(routes.ravel(), minlength=n_expert)
        skew.append(counts.max() / counts.sum() * n_expert)
        reuse.append(np.mean([len(set(a) & set(b)) / k for a, b in zip(routes, routes[1:], strict=False)]))
    return (*np.percentile(skew, [5, 95]), *np.percentile(reuse, [5, 95]))


def heldout_prompt(path: Path, chars: int = 1000) -> str:
    """The first held-out documents, joined by blank lines, cut to about `chars` characters."""
    docs = path.read_text(encoding="utf-8").split(corpus.DOC_SEPARATOR)
    out = ""
    for doc in docs:
        if len(out) >= chars:
            break
        out += doc.replace("<|im_start|>", "").replace("<|im_end|>", "") + "\n\n"
    return out[:chars]


def record_trace(model: Path, prompt: str, out: Path, n_predict: int = 256) -> Trace:
    """Greedy decode through `moeflash generate --record-route-trace` (streamed), parsed."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        cmd = [sys.executable, "-m", "server.cli", "generate", "-m", str(model), "--mode", "streaming",
               "--threads", "1", "--temp", "0", "--ignore-eos", "--n-predict", str(n_predict),
               "--prompt-file", f.name, "--record-route-trace", str(out)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"moeflash generate failed: {done.stderr[-2000:]}")
    return load_trace(out)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {float(np.median(values)):.2f} / {max(values):.2f}"


def _routing_table(traces: Sequence[tuple[str, Trace]]) -> list[str]:
    lines = [
        "| trace | tokens | experts (k) | skew | reuse |",
        "|---|---|---|---|---|",
    ]
    for name, trace in traces:
        s = route_stats(trace)
        spread = [_spread([x.skew for x in s]), _spread([x.reuse for x in s])]
        tokens = len(trace.steps(False)) + len(trace.steps(True))
        lines.append(f"| {name} | {tokens} | {trace.n_expert} ({trace.k}) | {spread[0]} | {spread[1]} |")
    return lines


def loss_chart(loss_csv: Path, out: Path) -> None:
    """The run's loss curve: training loss (mean of 25 steps) and held-out loss, by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = np.genfromtxt(loss_csv, delimiter=",", names=True)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    n = len(rows) // 25 * 25
    steps, loss = rows["step"][:n].reshape(-1, 25).mean(1), rows["loss"][:n].reshape(-1, 25).mean(1)
    ax.plot(steps, loss, label="training loss (mean of 25 steps)", color="#1e88e5")
    held = ~np.isnan(rows["heldout_loss"])
    ax.plot(rows["step"][held], rows["heldout_loss"][held], "o-", label="held-out loss", color="#f44336")
    run_json = loss_csv.with_name("run.json")
    reschedules = json.loads(run_json.read_text()).get("reschedules", []) if run_json.exists() else []
    for at, length in reschedules:
        ax.axvline(at, color="#9e9e9e", linestyle="--")
        label = f"cosine shortened\nto end at {length}"
        ax.annotate(label, (at, 5.5), xytext=(6, 0), textcoords="offset points")
    ax.set_xlabel("step (16 x 256 tokens)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_ylim(bottom=min(1.5, float(np.nanmin(loss)) - 0.2), top=6)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("The demo model's training run")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def report_header(model: Path) -> list[str]:
    """What the report measured: the file (its name inside and its sha256) and how."""
    import gguf

    field = gguf.GGUFReader(model).fields["general.name"]
    name = bytes(field.parts[field.data[0]]).decode()
    return [
        "# The trained demo model: quality, routing, lossy options\n",
        f"`{model.name}` ({name}, sha256 `{sha256_of(model, progress=False)}`), measured by `python -m "
        'server.training.measure` (docs/training.md, "Export and measurement"): llama.cpp on one '
        "thread, experts streamed with O_DIRECT reads from this machine's disk; decode speeds are "
        "this machine's, their ratios from alternated rounds of one run.\n",
    ]


def prefetch_report(model: Path, run_dir: Path) -> tuple[list[str], dict[Prefetch, int]]:
    """The predictors under caps of an eighth and a quarter of `model`'s experts, 128 greedy tokens
    after the run's held-out prompt; with the cache hits of each at an eighth."""
    prompt_ids = (
        tokenizer.load(run_dir / "tokenizer.json")
        .encode(heldout_prompt(run_dir / "corpus" / "heldout.txt"))
        .ids
    )
    out: list[str] = []
    hits: dict[Prefetch, int] = {}
    for share, cap in (("an eighth", expert_share(model, 8)), ("a quarter", expert_share(model, 4))):
        size = format_size(cap, unit="MiB", digits=1)
        out += [f"\n## Prefetch under a cap of {share} of the experts ({size}), 128 tokens\n"]
        # the predictors alternated, three rounds (the machines drift)
        rounds = [prefetch_runs(model, prompt_ids, 128, cap) for _ in range(3)]
        out += _prefetch_table(rounds)
        hits = hits or {r.prefetch: r.counters.hits for r in rounds[0]}
    return out, hits


def report(model: Path, run_dir: Path, max_tokens: int, trace_out: Path) -> list[str]:
    """Every measurement of the module, as the Markdown lines of a report."""
    out: list[str] = report_header(model)
    res, stream = perplexity(model, run_dir, max_tokens=max_tokens)
    if res.logits_sha256 != stream.logits_sha256:
        raise SystemExit("streamed logits differ from resident ones")
    out += [f"## Perplexity ({res.tokens} held-out tokens)\n"]
    out += [
        f"model {res.model:.2f}, unigram {res.unigram:.2f}, ratio {res.model / res.unigram:.3f} (streamed "
        f"under a quarter of the experts: identical logits, sha256 {res.logits_sha256[:16]})\n"
    ]
    out += ["## Greedy continuations\n"]
    texts = continuations(model, run_dir)
    out += [f"- {prompt!r} -> {text!r}{' (loops)' if loops(text) else ''}" for prompt, text in texts]
    prompt = heldout_prompt(run_dir / "corpus" / "heldout.txt")
    trace = record_trace(model, prompt, trace_out)
    budget = expert_share(model, 4)
    lines, hits = prefetch_report(model, run_dir)
    out += lines
    out += ["\n## Routing (skew and reuse per layer: min / median / max)\n"]
    real = [(t.name, load_trace(t)) for t in REAL_TRACES if t.exists()]
    out += _routing_table([("trained", trace), *real])
    tokens = len(trace.steps(False)) + len(trace.steps(True))
    lo_s, hi_s, lo_r, hi_r = uniform_chance(tokens, trace.n_expert, trace.k)
    out += ["", f"Independent uniform routing over as many tokens (5th-95th percentile of 400 draws): "
            f"skew {lo_s:.2f}-{hi_s:.2f}, reuse {lo_r:.2f}-{hi_r:.2f}."]  # fmt: skip
    layers = route_stats(trace)
    out += ["", "Per layer of the trained model: " + ", ".join(
        f"{r.layer}: skew {r.skew:.2f} reuse {r.reuse:.2f}" for r in layers)]  # fmt: skip
    size = format_size(budget, unit="MiB", digits=1)
    out += [f"\n## Lossy options under a cap of a quarter of the experts ({size})\n"]
    out += [
        "Perplexity of the first 2048 held-out tokens, each decoded alone as a chat decodes; decode "
        "speed of 128 greedy tokens, the options alternated over three rounds.\n"
    ]
    out += _lossy_table(lossy_runs(model, run_dir, budget))
    out += ["\n## Targets (issue 43)\n", "| target | figure | met |", "|---|---|---|"]
    ratio = hits[Prefetch.ROUTER] / max(1, hits[Prefetch.HISTORY])
    skew = max(r.skew for r in layers)
    looping = sum(loops(text) for _, text in texts)
    ppl = res.model / res.unigram
    for target, figure, met in (
        ("held-out perplexity <= 0.5 of the unigram's", f"{ppl:.3f}", ppl <= 0.5),
        ("greedy continuations that do not loop", f"{looping} of {len(texts)} loop", looping == 0),
        ("no expert above 3x a uniform share in any layer", f"largest {skew:.2f}", skew <= 3),
        (
            "router predictor >= 1.5x the history predictor's cache hits, an eighth of the experts",
            f"{ratio:.2f}x",
            ratio >= 1.5,
        ),
    ):
        out += [f"| {target} | {figure} | {'met' if met else '**not met**'} |"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Measure a trained model: perplexity, continuations, routing")
    p.add_argument("--run-dir", type=Path, required=True, help="the training run (tokenizer, token files)")
    p.add_argument("--model", type=Path, required=True, help="the run exported as GGUF")
    p.add_argument("--max-tokens", type=int, default=16384, help="held-out tokens to score")
    p.add_argument(
        "--trace-out", type=Path, default=Path("trained.route.csv"), help="where the route trace goes"
    )
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    p.add_argument("--loss-chart", type=Path, default=None, help="draw the run's loss.csv as this PNG")
    p.add_argument(
        "--prefetch-only", action="store_true",
        help="only the prefetch tables (any model of the run's vocabulary size, e.g. a random twin)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.prefetch_only:
        print("\n".join(prefetch_report(args.model, args.run_dir)[0]))
        return 0
    if args.loss_chart:
        loss_chart(args.run_dir / "loss.csv", args.loss_chart)
    lines = report(args.model, args.run_dir, args.max_tokens, args.trace_out)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
