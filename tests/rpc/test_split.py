"""The byte-identity gate of pooled devices: a model whose last layers run on an RPC helper
(`moeflash worker`, another process in its own memory cgroup) gives the tokens and every logits
row of the model run in one process, both streamed under a budget that evicts, for every
architecture of the other gates. The helper's layers run llama.cpp's plain kernels (the RPC
server takes no repacked layouts), so both sides run with the repacked layouts off
(docs/devices.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from server.bench.cgroup import MemoryCgroup, probe
from server.bench.link import ShapedLink
from server.loading.budget import model_tensors
from server.rpc.devices import layer_bytes
from tests.models import expert_layer_bytes
from tests.rpc.helpers import helper, run_split

MIB = 2**20
HELPER_CAP = 512 * MIB
MAIN_CAP = 768 * MIB
# a step's inputs for two layers of tiny-qwen3moe in a 512-token context (the hidden state, the
# positions, the attention mask), with room: the graph sent again each step is several times this
UP_BYTES_PER_TOKEN = 40 * 1024


@pytest.mark.parametrize(
    "preset", ["tiny-qwen3moe", "tiny-gptoss", "tiny-mixtral", "tiny-qwen2moe", "tiny-hyv3", "tiny-gemma4"]
)
def test_a_helper_holding_the_last_layers_changes_no_bit(
    tiny_model: Callable[..., Path], preset: str, tmp_path: Path
) -> None:
    support = probe()
    if support.version is None:
        pytest.skip(f"memory cgroups unavailable: {support.reason}")
    path = tiny_model(preset)
    n_layer = 1 + max(layer_bytes(model_tensors(path)))
    remote = max(1, n_layer // 2)  # at least a third of the layers
    settings: dict[str, Any] = {
        "model": str(path),
        "mode": "streaming",
        "budget": expert_layer_bytes(path),
        "repack": "off",
        "ctx_size": 512,
        "parallel": 1,
        "threads": 2,
    }
    alone = run_split(settings)
    with MemoryCgroup(HELPER_CAP, support) as helper_group, MemoryCgroup(MAIN_CAP, support) as main_group:
        with helper(tmp_path, cgroup=helper_group) as (endpoint, log, _):
            split = run_split({**settings, "rpc": endpoint, "rpc_layers": str(remote)}, main_group)
            held = sum(int(n) for n in re.findall(r"Allocated (\d+) bytes", log.read_text()))
        assert helper_group.oom_kills() == 0 and main_group.oom_kills() == 0
    assert (split["tokens"], split["digest"]) == (alone["tokens"], alone["digest"])
    assert split["moe_layers_streamed"] == n_layer - remote, split["log"][-2000:]
    assert split["stats"]["evictions"] > 0, "the budget let the cache hold every local expert"
    # the helper held the weights of its layers (and their KV and compute buffers besides)
    per_layer = layer_bytes(model_tensors(path))
    assert held >= sum(per_layer[il] for il in range(n_layer - remote, n_layer)), log.read_text()[-2000:]


def test_a_decode_step_sends_the_helper_its_inputs_not_its_graph(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Patch 0015: the helper's part of a step is the same graph while llama.cpp reuses it, so it
    recomputes the graph it holds; only the step's inputs cross the link (the graph of two layers
    is tens of KiB a step). Per-token telemetry names the time waited on the helper."""
    path = tiny_model("tiny-qwen3moe")
    with helper(tmp_path) as (endpoint, _, _), ShapedLink(endpoint) as link:
        argv = [sys.executable, "-m", "server.cli", "--log-level", "WARNING", "generate", "-m", str(path)]
        argv += ["--mode", "streaming", "-n", "48", "--ignore-eos", "--json", "-c", "512"]
        argv += ["--rpc", link.endpoint, "--rpc-layers", "2"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        window = link.window(*report["decode_window"])
    tokens = report["decode_tokens"]
    assert window.round_trips >= tokens
    assert window.up_bytes / tokens < UP_BYTES_PER_TOKEN, window
    assert sum(t["helper_wait_ns"] for t in report["per_token"]) > 0


def _plain_cpu_buffer_type() -> int:
    """ggml's CPU buffer type without the repacked layouts (llama.cpp's extra buffer types)."""
    import ctypes

    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    lib.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    buft: int = lib.ggml_backend_cpu_buffer_type()
    return buft


@pytest.mark.parametrize("preset", ["tiny-qwen3moe", "tiny-gptoss", "tiny-gemma4"])
def test_the_default_layouts_split_as_one_process_with_plain_helper_layers(
    tiny_model: Callable[..., Path], preset: str, tmp_path: Path
) -> None:
    """With the repacked layouts on (the default), the main server's layers run them and the
    helper's the plain kernels (the RPC server takes no repacked tensor): the split gives the
    tokens and logits of the model in one process, resident, with the helper's layers held in
    ggml's plain CPU buffers and every other weight as the defaults put it. (On x86 the plain and
    repacked kernels of these types give the same bits, so it also gives the unsplit model's;
    elsewhere that is not checked.)"""
    from server.loading.resident import load_resident_llama
    from tests.models import greedy
    from tests.rpc.helpers import N_TOKENS, PROMPT

    path = tiny_model(preset)
    n_layer = 1 + max(layer_bytes(model_tensors(path)))
    remote = n_layer // 2
    settings: dict[str, Any] = {"model": str(path), "mode": "streaming", "ctx_size": 512, "parallel": 1}
    settings |= {"threads": 2, "budget": expert_layer_bytes(path)}
    with helper(tmp_path) as (endpoint, _, _):
        split = run_split({**settings, "rpc": endpoint, "rpc_layers": str(remote)})
    helper_layers = "|".join(str(il) for il in range(n_layer - remote, n_layer))
    llama = load_resident_llama(
        path,
        n_ctx=512,
        parallel=1,
        repack="on",
        devices=[],
        tensor_buft_overrides=[(rf"^blk\.(?:{helper_layers})\.", _plain_cpu_buffer_type())],
        n_batch=512,
        n_ubatch=512,
        swa_full=False,
        n_threads=2,
        n_threads_batch=2,
    )
    try:
        alone = greedy(llama, PROMPT, N_TOKENS)
    finally:
        llama.close()
    assert (split["tokens"], split["digest"]) == alone and split["moe_layers_streamed"] == n_layer - remote
