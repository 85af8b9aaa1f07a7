"""`moeflash bench`'s forms: one subcommand a benchmark, each taking its own flags and no other's,
and the forms of before (mode flags on `bench` itself) refused with the new command spelled out.

Parsing only, in this process (no benchmark runs), but for one old form run as users run it."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from types import MappingProxyType

import pytest

from server.cli import build_parser
from tests.commands import moeflash

# what each benchmark needs to parse at all: the model, or replay's traces
NEEDS = MappingProxyType(
    {
        "suite": ("--model", "m.gguf"),
        "replay": ("t.route.csv",),
        "warm-start": ("--model", "m.gguf"),
        "prompt-cache": ("--model", "m.gguf"),
        "parallel": ("--model", "m.gguf"),
    }
)
ALL = frozenset(NEEDS)
MODEL_RUNS = frozenset({"suite", "warm-start", "prompt-cache"})  # the model settings go to their runs
# a flag with its value, and the benchmarks it belongs to: every other one must refuse it
FLAGS: tuple[tuple[tuple[str, ...], frozenset[str]], ...] = (
    (("--out", "o"), ALL),
    (("--caps", "0.5"), ALL - {"replay"}),
    (("--shape", "tiny-qwen3moe"), ALL - {"replay"}),
    (("--shapes-dir", "d"), ALL - {"replay"}),
    (("--tokens", "16"), ALL - {"replay"}),
    (("--rounds", "2"), frozenset({"warm-start", "parallel"})),
    (("--ctx-size", "2048"), MODEL_RUNS | {"parallel"}),
    (("--mmap-tokens", "2"), frozenset({"suite"})),
    (("--no-levers",), frozenset({"suite"})),
    (("--ceiling-seconds", "0.2"), frozenset({"suite"})),
    (("--route-trace", "t.route.csv"), frozenset({"suite"})),
    (("--delete-model",), MODEL_RUNS),
    (("--lanes", "2"), MODEL_RUNS),
    (("--no-overlap",), MODEL_RUNS),
    (("--config", "c.toml"), MODEL_RUNS),  # passed on to their runs with the flags
    # generate's, and the old forms' mode flags
    (("--record-route-trace", "x.csv"), frozenset()),
    (("--prefetch-from-trace",), frozenset()),
    (("--replay", "t.route.csv"), frozenset()),
    (("--warm-start",), frozenset()),
    (("--prompt-cache",), frozenset()),
)


def _refusal(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The usage error `moeflash ARGV` ends in (exit status 2, as argparse's), before anything runs."""
    with pytest.raises(SystemExit) as stopped:
        args = build_parser().parse_args(list(argv))
        args.func(args)
    assert stopped.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("flag", "owners"), FLAGS, ids=[f[0][0] for f in FLAGS])
def test_each_benchmark_takes_its_own_flags_and_refuses_the_others(
    flag: tuple[str, ...], owners: frozenset[str], capsys: pytest.CaptureFixture[str]
) -> None:
    for name, need in NEEDS.items():
        # --shape instead of --model: one of them, not both
        argv = ["bench", name, *(() if flag[0] == "--shape" and name != "replay" else need), *flag]
        if name in owners:
            build_parser().parse_args(argv)
        else:
            assert f"unrecognized arguments: {flag[0]}" in _refusal(argv, capsys), argv


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            "--replay a.route.csv b.route.csv --out o",
            "moeflash bench replay a.route.csv b.route.csv --out o",
        ),
        (
            "--warm-start --shape qwen30b-shape --caps 0.25 --rounds 3",
            "moeflash bench warm-start --shape qwen30b-shape --caps 0.25 --rounds 3",
        ),
        # the mode flag decides wherever it stands; flags the old mode ignored are left out
        (
            "--model m.gguf --mmap-tokens 2 --prompt-cache --caps 0.5 -c 4096",
            "moeflash bench prompt-cache --model m.gguf --caps 0.5 -c 4096",
        ),
        # no mode flag: the suite, bench's --models-dir under its name now
        (
            "--shape x --models-dir d --route-trace t.csv --lanes 2 --rounds 3",
            "moeflash bench suite --shape x --shapes-dir d --route-trace t.csv --lanes 2",
        ),
        ("-m 'a b.gguf' --tokens=4", "moeflash bench suite -m 'a b.gguf' --tokens 4"),
    ],
)
def test_an_old_form_names_the_new_command(old: str, new: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refusal(["bench", *shlex.split(old)], capsys)
    mode = shlex.split(new)[2]
    assert f"is `moeflash bench {mode}` now" in err and err.rstrip().endswith(new), err
    build_parser().parse_args(shlex.split(new)[1:])  # and the command named is one that parses


def test_bench_alone_lists_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refusal(["bench"], capsys)
    assert "name a benchmark: moeflash bench {suite,replay,warm-start,prompt-cache,parallel,rpc}" in err


@pytest.mark.parametrize("name", ["suite", "warm-start", "prompt-cache", "parallel"])
def test_benchs_models_dir_is_named_shapes_dir(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    # serve's --models-dir is a directory of models to serve; bench's was where --shape's live
    err = _refusal(["bench", name, "--shape", "x", "--models-dir", "d"], capsys)
    assert "--models-dir is --shapes-dir in bench" in err
    assert (
        build_parser().parse_args(["bench", name, "--shape", "x", "--shapes-dir", "d"]).shapes_dir.name == "d"
    )


def test_an_old_form_run_as_users_run_it_exits_2_naming_the_new_command() -> None:
    proc = moeflash("bench", "--replay", "bench/route-traces/qwen.route.csv")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.rstrip().endswith("moeflash bench replay bench/route-traces/qwen.route.csv")
    assert "Traceback" not in proc.stderr
