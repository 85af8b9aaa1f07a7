"""The systems a benchmark compares, each one `moeflash generate --json` invocation.

Every system runs in its own process (so its memory and reads are its own), under a memory
cgroup when it is capped, on the same file. Options are those of `moeflash generate`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

SHORT_PROMPT_TOKENS = 20
LONG_PROMPT_TOKENS = 512
# runs of stock mmap and of moeflash's default under each cap: the speedup is the median of the
# rounds' ratios. Five, not three: on this machine one round in three can land in a slow spell of
# the disk (qwen30b-shape at 25%, commit d41d06d: rounds of 20.3x, 21.9x and 13.8x, the last with
# 304 ms of flash wait per token against 138-220)
CAPPED_ROUNDS = 5


@dataclass(frozen=True)
class System:
    """One configuration to measure."""

    name: str
    capped: bool  # run under the memory cap (False: uncapped reference)
    args: tuple[str, ...] = ()  # extra `moeflash generate` options
    decode_tokens: int | None = None  # None: the run's default
    description: str = ""
    lever: str | None = None  # the streamer lever this variant isolates, if any
    # read the model into the page cache before the run (after the drop): a stock mmap load
    # only starts an asynchronous readahead, and a short prompt let decode begin while it ran
    # (the resident reference sped up from 0.42 to 0.15 s per token over 31 tokens)
    warm_page_cache: bool = False
    # runs of it, in rounds interleaved with the other systems' of its cap (harness._in_rounds;
    # the residency and speedup ratios are medians over rounds): the residency ratio divides two
    # runs of ~0.1 s per token, and this machine's speed drifts by more than the 5% it judges
    # (one all-cached run measured 0.875 of the resident run, the same two systems re-run
    # minutes later 0.96-0.99); under a cap the same streaming run decoded 1.47, 1.62 and 1.90
    # tok/s back to back after stock mmap (gemma4-26b-shape at 4.12 GiB: the first after stock
    # mmap slowest, repeated identical reads faster as the virtual disk's host caches them)
    repeats: int = 1
    # a prompt that fills the context but for the tokens it decodes (the memory bound's worst case)
    fill_context: bool = False
    # run with the flash attention this system's last run at the same cap computed with (its
    # `auto` resolved), so that the two run the same graph (harness._in_rounds)
    flash_attn_as: str | None = None

    def argv(
        self, model: str, prompt: str, n_predict: int, ctx_size: int, settings_flags: tuple[str, ...] = ()
    ) -> list[str]:
        """The `moeflash generate` command line of this system; `settings_flags` (model settings given
        to the bench) come before the system's own options, which win."""
        n = self.decode_tokens or n_predict
        filled = ("--prompt-tokens", str(ctx_size - n)) if self.fill_context else ()
        return [
            sys.executable,
            "-m",
            "server.cli",
            "--log-level",
            "WARNING",
            "generate",
            "--model",
            model,
            "--prompt",
            prompt,
            "-n",
            str(n),
            "--ignore-eos",
            "--ctx-size",
            str(ctx_size),
            "--json",
            # every system streams unless it says --mode resident (a later flag wins)
            "--mode",
            "streaming",
            # docs/benchmarks.md's short prompt is 20 tokens (the text alone tokenizes to more); a system's
            # own --prompt-tokens comes later and wins
            "--prompt-tokens",
            str(SHORT_PROMPT_TOKENS),
            *settings_flags,
            *self.args,
            *filled,
        ]


@dataclass(frozen=True)
class SystemSet:
    """The systems of one run: references, the best streaming setting and each lever alone."""

    uncapped: list[System] = field(default_factory=list)
    capped: list[System] = field(default_factory=list)


# the cached speed a cap's decode is judged against (issue 42): every expert cached, run without
# the cap (it holds the whole model) in the cap's rounds, each run next to one of the default's,
# so that the ratio of each round divides neighbours, and with the flash attention the default's
# run computed with (the same setting unless flags differ: memory does not choose it): one graph,
# one roofline (ratios.py refuses a pair whose settings still differ)
PAIRED_CACHED = System(
    "streaming-all-cached-paired",
    False,
    ("--budget", "all", "--preload"),
    description="moeflash with every expert cached, uncapped, in each cap's rounds beside the default "
    "and with its flash attention: the cached speed the cap's ratio divides by",
    repeats=CAPPED_ROUNDS,
    flash_attn_as="streaming",
)
# under trace routing the model's router predicts the wrong routing: the default's prefetch is the
# lower bound of prefetch, this one (mf_route_trace_predict) the upper; history prefetch predicts
# from past routing alone, honestly under a trace too; prefetch off is the floor and the run whose
# hit rate is the cache policy's alone (ratios.py checks it against the replay)
PREFETCH_FROM_TRACE = System(
    "streaming-prefetch-from-trace",
    True,
    ("--prefetch-from-trace",),
    description="moeflash, prefetch reading the next layer's experts as the trace routes them (oracle)",
)
# a predictor as good as those measured on real models (BigMoeOnEdge's next-layer predictor is
# right on 81-89% of routed slots): the trace's next layer with EMULATED_PREDICTOR_ERROR of each
# token's experts replaced at random (seeded), so its wrong guesses cost reads as real ones do
EMULATED_PREDICTOR_ERROR = 0.15
PREFETCH_EMULATED = System(
    "streaming-prefetch-emulated",
    True,
    ("--prefetch-from-trace", "--prefetch-trace-error", str(EMULATED_PREDICTOR_ERROR)),
    description=f"moeflash, prefetch reading the trace's next layer with {EMULATED_PREDICTOR_ERROR:.0%} of "
    "its experts replaced at random (an emulated predictor of real models' accuracy)",
)
PREFETCH_HISTORY = System(
    "streaming-prefetch-history",
    True,
    ("--prefetch", "history"),
    description="moeflash, prefetch predicting from past routing alone (which experts followed which)",
)
NO_PREFETCH = System("lever-no-prefetch", True, ("--prefetch", "off"), lever="prefetch off")
# the serial lever: the decode thread waits for each layer's reads, so every read is waited for
# and its I/O efficiency (bytes read per second of waiting) is the disk's while waiting
NO_OVERLAP = System("lever-no-overlap", True, ("--no-overlap",), lever="overlap off")


# the uncapped references: stock llama.cpp fully in RAM, and every expert cached
UNCAPPED = (
    System(
        "resident",
        False,
        ("--mode", "resident"),
        description="stock llama.cpp, model fully in RAM (page cache warmed first)",
        warm_page_cache=True,
        repeats=3,
    ),
    System(
        "streaming-all-cached",
        False,
        # every expert read at load: decode then measures compute alone
        ("--budget", "all", "--preload"),
        description="moeflash with every expert cached (compute-bound reference)",
        repeats=3,
    ),
    System(
        "resident-prefill-512",
        False,
        ("--mode", "resident", "--prompt-tokens", str(LONG_PROMPT_TOKENS)),
        decode_tokens=2,
        description="stock llama.cpp fully in RAM, a 512-token prompt (the prefill reference)",
        warm_page_cache=True,
    ),
    System(
        "streaming-all-cached-prefill-512",
        False,
        ("--budget", "all", "--preload", "--prompt-tokens", str(LONG_PROMPT_TOKENS)),
        decode_tokens=4,
        description="every expert cached, a 512-token prompt (compute-bound prefill reference)",
    ),
)
# stock mmap under the cap decodes the bench's --mmap-tokens (default_systems sets them). The
# file's layouts: repacked weights are copies in anonymous memory, which a cap below the model's
# size cannot hold (the cgroup kills the process), so llama.cpp's own way of running a model
# larger than memory is mmap with repacking off
MMAP = ("--mode", "resident", "--repack", "off")
MMAP_CAPPED = System(
    "mmap-capped",
    True,
    MMAP,
    description="stock llama.cpp load_mode MMAP (use_extra_bufts off) under the cap",
    repeats=CAPPED_ROUNDS,
)
# the capped systems after stock mmap: its prefill, moeflash's default and its references
CAPPED = (
    System(
        "mmap-capped-prefill-512",
        True,
        (*MMAP, "--prompt-tokens", str(LONG_PROMPT_TOKENS)),
        decode_tokens=2,
        description="stock llama.cpp mmap under the cap, a 512-token prompt (prefill speedup)",
    ),
    System(
        "streaming",
        True,
        (),
        description="moeflash, default (best) settings, budget auto",
        repeats=CAPPED_ROUNDS,
    ),
    PAIRED_CACHED,
    System(
        "streaming-prefill-512",
        True,
        ("--prompt-tokens", str(LONG_PROMPT_TOKENS)),
        decode_tokens=4,
        description="moeflash, a 512-token prompt (prefill rate and time to first token)",
    ),
    System(
        "streaming-full-context",
        True,
        (),
        decode_tokens=4,
        description="moeflash, a prompt that fills the context (memory discipline at its worst)",
        fill_context=True,
    ),
)
# each lever alone (prefetch and overlap off are NO_PREFETCH and NO_OVERLAP)
LEVERS = (
    System("lever-no-cache", True, ("--cache-policy", "none"), lever="cache off"),
    System("lever-lru", True, ("--cache-policy", "lru"), lever="LRU policy"),
    System("lever-lanes-1", True, ("--lanes", "1"), lever="1 lane"),
    System("lever-lanes-2", True, ("--lanes", "2"), lever="2 lanes"),
    System("lever-buffered", True, ("--reader", "buffered"), lever="O_DIRECT off"),
)


def default_systems(mmap_tokens: int, levers: bool = True, traced: bool = False) -> SystemSet:
    """resident + all-cached streaming (uncapped); stock mmap, streaming best and levers (capped);
    `traced` (routing replayed from a trace): prefetch from past routing, from the trace and off,
    and overlap off, levers or not."""
    capped = [replace(MMAP_CAPPED, decode_tokens=mmap_tokens), *CAPPED]
    if levers:
        capped += LEVERS
    if levers or traced:
        capped += [NO_PREFETCH, NO_OVERLAP]
    if traced:
        capped += [PREFETCH_HISTORY, PREFETCH_FROM_TRACE, PREFETCH_EMULATED]
    return SystemSet(list(UNCAPPED), capped)
