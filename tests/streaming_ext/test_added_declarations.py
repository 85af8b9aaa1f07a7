"""A config field, a counter and a route record field, each added in one place, reach everything
built on them.

The fixture copies the build inputs, adds one line to each of the header's lists (a uint64_t
option in front of MF_CONFIG_FIELDS, a counter in front of MF_STATS_FIELDS, an int32_t in front
of MF_ROUTE_RECORD_FIELDS: every offset after them moves) and one line of C that uses the first
two (each route counts the option's value into the counter), and builds the copy with the
repository's Makefile. With no Python edit, the copy's library and generated module then have
the field in the C struct, the ctypes struct and StreamerConfig (with the header's default), the
counter in the C storage, mf_stats, the Python record, `moeflash generate --json` and /metrics,
and the record field in the C struct, the ctypes struct and RouteRecord.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from streaming_ext import StreamerConfig, StreamerStats
from tests.models import expert_layer_bytes
from tests.servers import serve_process

REPO = Path(__file__).resolve().parents[2]
ADDED_FIELD = '    X(test_knob, uint64_t, INT, 3, "an option a test added")'
ADDED_COUNTER = '    X(test_added, COUNTER, COUNT, "a counter a test added")'
ADDED_RECORD = '    X(test_mark, int32_t, "a route record field a test added")'
ROUTE_LINE = "    ADD(s->st.routes, 1);\n"
ADDED_LINE = "    ADD(s->st.test_added, s->cfg.test_knob);\n"

# run in the copy: the field and the counter as the copy's C library and Python see them, and a
# streamed decode with the option set to 5
PROBE = """
import ctypes, dataclasses, json, sys
from pathlib import Path
import streaming_ext
from streaming_ext import StreamerConfig, StreamerStats, load_library
from streaming_ext._lib import MfConfig, MfRouteRecord, MfStats
from server.loading.streaming import load_streaming_llama

cdll = load_library().cdll  # refuses a library whose declarations differ from the module's
llm = load_streaming_llama(
    Path(sys.argv[1]), StreamerConfig(test_knob=5), budget=int(sys.argv[2]), follow_memory=False,
    n_ctx=256, n_threads=2,
)
try:
    llm.eval([(7 * i + 40) % 300 for i in range(16)])
    stats = llm.stats()
finally:
    llm.close()
print(json.dumps({
    "package": streaming_ext.__file__,
    "c_config_offset": cdll.mf_config_offset(b"test_knob"),
    "ctypes_config_offset": MfConfig.test_knob.offset,
    "c_model_path_offset": cdll.mf_config_offset(b"model_path"),
    "ctypes_config_fields": [f[0] for f in MfConfig._fields_],
    "default": StreamerConfig().test_knob,
    "c_stats_offset": cdll.mf_stats_offset(b"test_added"),
    "ctypes_stats_fields": [f[0] for f in MfStats._fields_],
    "record_fields": [f.name for f in dataclasses.fields(StreamerStats)],
    "test_added": stats.test_added,
    "routes": stats.routes,
    "c_record_offset": cdll.mf_route_record_offset(b"test_mark"),
    "ctypes_record_fields": [f[0] for f in MfRouteRecord._fields_],
    "route_record_fields": [f.name for f in dataclasses.fields(streaming_ext.RouteRecord)],
}))
"""


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not in {path.name} once"
    path.write_text(text.replace(old, new))


@pytest.fixture(scope="module")
def added(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The copy of the build inputs with the field and the counter added, built (its library and
    its _declared.py)."""
    copy = tmp_path_factory.mktemp("added") / "tree"
    shutil.copytree(
        REPO / "streaming_ext", copy / "streaming_ext", ignore=shutil.ignore_patterns("lib", "_declared.py")
    )
    shutil.copy(REPO / "Makefile", copy / "Makefile")
    for link in ("vendor", ".venv"):
        (copy / link).symlink_to(REPO / link)
    header = copy / "streaming_ext" / "include" / "moeflash_stream.h"
    _edit(header, "#define MF_CONFIG_FIELDS(X)", f"#define MF_CONFIG_FIELDS(X) \\\n{ADDED_FIELD}")
    _edit(header, "#define MF_STATS_FIELDS(X)", f"#define MF_STATS_FIELDS(X) \\\n{ADDED_COUNTER}")
    _edit(
        header, "#define MF_ROUTE_RECORD_FIELDS(X)", f"#define MF_ROUTE_RECORD_FIELDS(X) \\\n{ADDED_RECORD}"
    )
    _edit(copy / "streaming_ext" / "src" / "mf_callback.c", ROUTE_LINE, ROUTE_LINE + ADDED_LINE)
    targets = ["streaming_ext/lib/libmoeflash_stream.so", "streaming_ext/_declared.py"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-C", str(copy), *targets],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return copy


def _copy_env() -> dict[str, str]:
    # run from the copy: its streaming_ext (library and generated module) is the one imported
    return {k: v for k, v in os.environ.items() if k != "MOEFLASH_STREAM_LIB"}


def _run_in(copy: Path, *args: str) -> str:
    """The output of `python ARGS` run in the copy, which must succeed."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=copy,
        env=_copy_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_field_and_a_counter_added_in_c_reach_python(added: Path, tiny_model: Callable[..., Path]) -> None:
    model = tiny_model("tiny-qwen3moe")
    seen = json.loads(_run_in(added, "-c", PROBE, str(model), str(expert_layer_bytes(model))))
    assert Path(seen["package"]).is_relative_to(added)
    # the C struct and the ctypes one: the new field first, every other field behind it
    assert seen["c_config_offset"] == seen["ctypes_config_offset"] == 0
    assert seen["c_model_path_offset"] == 8
    assert seen["ctypes_config_fields"][0] == "test_knob"
    assert seen["default"] == 3, "StreamerConfig's default is the header's"
    # the counter: C storage, mf_stats and the record, and the value C counted with the option
    assert seen["c_stats_offset"] == 0
    assert seen["ctypes_stats_fields"][0] == seen["record_fields"][0] == "test_added"
    assert seen["routes"] > 0 and seen["test_added"] == 5 * seen["routes"]
    # the route record's field: the C struct, the ctypes one and the Python record
    assert seen["c_record_offset"] == 0
    assert seen["ctypes_record_fields"][0] == seen["route_record_fields"][0] == "test_mark"
    # the repository's own build is untouched
    assert "test_knob" not in {f.name for f in dataclasses.fields(StreamerConfig)}


def test_a_counter_added_in_c_reaches_generate_and_metrics(
    added: Path, tiny_model: Callable[..., Path]
) -> None:
    model = tiny_model("tiny-qwen3moe")
    budget = str(expert_layer_bytes(model))
    model_flags = ["--model", str(model), "--mode", "streaming", "--budget", budget, "--ctx-size", "256"]
    generate = ["-m", "server.cli", "--log-level", "WARNING", "generate", *model_flags]
    report = json.loads(_run_in(added, *generate, "-n", "3", "--ignore-eos", "--json"))
    # the option's default (3) reached C through the server's StreamerConfig: 3 a route
    totals = report["totals"]
    assert totals["routes"] > 0 and totals["test_added"] == 3 * totals["routes"]
    assert all(record["test_added"] == 3 * record["routes"] for record in report["per_token"])
    assert "test_added" not in {s.name for s in StreamerStats.declared()}

    # the server, run from the copy too
    with serve_process(model, *model_flags[2:], log_level="WARNING", env=_copy_env(), cwd=added) as (_, port):
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    assert (
        "# HELP moeflash_streamer_test_added_total a counter a test added (since the model loaded)" in metrics
    )
    assert "\nmoeflash_streamer_test_added_total 0.0\n" in metrics
