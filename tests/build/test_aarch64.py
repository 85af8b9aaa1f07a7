"""aarch64, the phones' CPU: the patched llama.cpp, streaming_ext and the C tests cross-built by
`make arm` in two variants and run under qemu-user: armv8.2 (MOEFLASH_CPU=armv8.2: dot product,
fp16) as a Cortex-A76, with 4 KiB and 16 KiB pages, and armv8.6 (int8 matrix multiply too, the
repacked kernels' other choice in ggml) as qemu's "max" CPU.

- tests/c/test_ready_hook.c: patch 0002's hook on ggml's NEON matmuls (vec_dot and tiled), and
  patch 0009's on the repacked ones (4x4 dot-product layouts on armv8.2, 4x8 i8mm on armv8.6);
- tests/c/test_repack_slices.c: patch 0009's repacked layouts in a plain buffer (Q4_0, Q4_K, MXFP4);
- tests/c/test_batch_invariance.c: patch 0011, a matmul's column the same bits in any batch;
- tests/c/test_frames.c: the expert frames, with UBSan (ASan does not run under qemu-user);
- tests/c/test_stream_identity.c: streamed against resident under a budget that evicts, tokens
  and a hash of every logits row, three lever sets, a budget moved mid-decode, a warm start
  (experts read back before the first token) and a negative control, on both variants;
- tests/c/test_rpc_server.c: patch 0012's RPC server as a phone helper runs it, answering this
  machine's main server (its build, its memory limit, a model's last layers held and decoded).

Emulation checks the instructions, the kernels and the memory layout an ARM build meets. Its
16 KiB pages are what sysconf reports to the program while the host kernel still maps 4 KiB ones:
a page size taken as a constant fails the frames test there (its page accounting), not the
mmap or O_DIRECT calls. It says nothing of a phone's speed, its memory pressure or its file
system.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from server.modelgen import QType
from server.rpc.hello import this_build
from tests.c_programs import run_aarch64

PAGES = [pytest.param(4096, id="4k-pages"), pytest.param(16384, id="16k-pages")]
VARIANTS = ["armv8.2", "armv8.6"]
# what ggml reports of each variant's build (llama_print_system_info)
FEATURES = {"armv8.2": ("NEON = 1", "DOTPROD = 1"), "armv8.6": ("NEON = 1", "DOTPROD = 1", "MATMUL_INT8 = 1")}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "kquant",
    [pytest.param(False, id="vec-dot"), pytest.param(True, id="tiled")],
)
def test_ready_hook_on_aarch64(tiny_model: Callable[..., Path], kquant: bool, variant: str) -> None:
    """The hook is told of every routed expert, can refuse it and says where its slice is, on
    ggml's aarch64 kernels: Q4_0 experts through the vec_dot matmul, Q4_K ones, forced, through
    the tiled one."""
    if kquant:
        model = tiny_model("tiny-qwen3moe", expert_qtype=QType.Q4_K, n_ff_exp=256)
        env = {"GGML_CPU_TILED_MM_FORCE": "1"}
    else:
        model, env = tiny_model("tiny-qwen3moe"), {}
    run = run_aarch64("test_ready_hook", str(model), "2", variant=variant, env=env)
    assert run.returncode == 0, run.report()
    assert run.verdicts() == ["ok"] * 5, run.report()


@pytest.mark.parametrize("variant", VARIANTS)
def test_repacked_ready_hook_on_aarch64(tiny_model: Callable[..., Path], variant: str) -> None:
    """Patch 0009 on each build's repacked Q4_0 (4x4 dot product, 4x8 i8mm): the hook and gemm."""
    run = run_aarch64("test_ready_hook", str(tiny_model("tiny-qwen3moe")), "2", "repack", variant=variant)
    assert run.returncode == 0, run.report()
    assert run.verdicts() == ["ok"] * 6, run.report()


# the repacked layout ggml picks for each type on each variant (docs/performance.md)
LAYOUTS = {
    ("armv8.2", "q4_0"): "q4_0_4x4",
    ("armv8.2", "q4_K"): "q4_K_8x4",
    ("armv8.2", "mxfp4"): "mxfp4_4x4",
    ("armv8.6", "q4_0"): "q4_0_4x8",
    ("armv8.6", "q4_K"): "q4_K_8x8",
    ("armv8.6", "mxfp4"): "mxfp4_4x4",
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("qtype", ["q4_0", "q4_K", "mxfp4"])
def test_repacked_slices_on_aarch64(qtype: str, variant: str) -> None:
    """Each build's repacked layouts written slice by slice compute what CPU_REPACK does, and
    the layout is the one that build's ggml picks for the type (i8mm's 4x8 and 8x8 on armv8.6)."""
    run = run_aarch64("test_repack_slices", qtype, variant=variant)
    assert run.returncode == 0, run.report()
    assert run.verdicts() == ["ok"] * 5, run.report()
    assert f"with {LAYOUTS[variant, qtype]}\n" in run.stderr, run.report()


# the types whose column is not yet the same alone and in a batch: with int8 matrix multiply,
# ggml's vec_dot takes two columns at once for them (`nrows` 2 in ggml-cpu.c's type traits), summed
# in another order than one (docs/memory.md)
BATCH_DEPENDENT = {"armv8.2": set(), "armv8.6": {"q8_0", "q4_0", "q4_K"}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_invariance_on_aarch64(variant: str) -> None:
    """ggml's NEON matmuls give a column the same bits alone and in a batch: tinyBLAS at every
    batch size where it takes the type (F32, F16, Q8_0, Q4_0: patch 0011), vec_dot elsewhere;
    on armv8.6 all but the types i8mm's two-column vec_dot takes."""
    run = run_aarch64("test_batch_invariance", variant=variant)
    verdicts = {line.split()[1].rstrip(":,"): line.split()[0] for line in run.stdout.splitlines()}
    assert len(verdicts) == 8, run.report()
    failed = {qtype for qtype, verdict in verdicts.items() if verdict != "ok"}
    assert failed == BATCH_DEPENDENT[variant], run.report()


@pytest.mark.parametrize("page_size", PAGES)
def test_frames_on_aarch64(page_size: int) -> None:
    """The frames' checks (sizes in whole pages, reuse, warm frames first, exhaustion, 200000
    random takes and gives, trim) hold at the page size the emulated kernel reports."""
    run = run_aarch64("test_frames", page_size=page_size)
    assert run.returncode == 0, run.report()
    assert run.verdicts() == ["ok"] * 6, run.report()


@pytest.mark.parametrize(
    ("variant", "page_size"),
    [
        pytest.param("armv8.2", 4096, id="armv8.2-4k-pages"),
        pytest.param("armv8.2", 16384, id="armv8.2-16k-pages"),
        pytest.param("armv8.6", 4096, id="armv8.6-4k-pages"),
    ],
)
@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        pytest.param("tiny-qwen3moe", {}, id="qwen3moe-q4_0"),
        pytest.param("tiny-qwen3moe", {"expert_qtype": QType.Q4_K, "n_ff_exp": 256}, id="qwen3moe-q4_k"),
        pytest.param("tiny-gemma4", {}, id="gemma4"),
    ],
)
def test_streamed_equals_resident_on_aarch64(
    tiny_model: Callable[..., Path], preset: str, overrides: dict[str, object], variant: str, page_size: int
) -> None:
    """Streamed under the budget floor, with every lever set, the aarch64 build gives the
    resident model's tokens and logits bit for bit; a never-read expert changes them."""
    model = str(tiny_model(preset, **overrides))
    run = run_aarch64("test_stream_identity", model, "2", variant=variant, page_size=page_size)
    assert run.returncode == 0, run.report()
    assert run.verdicts() == ["ok"] * 7, run.report()
    assert int(run.value("page")) == page_size, "the emulated kernel did not use the page size asked for"
    features = run.value("system")
    assert all(feature in features for feature in FEATURES[variant]), f"not the {variant} build: {features}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_rpc_server_on_aarch64(tiny_model: Callable[..., Path], variant: str) -> None:
    """Patch 0012's RPC server built for the phone (tests/c/test_rpc_server.c under qemu-user)
    answers this machine's main server: HELLO with the build it was given, its memory limit as
    the device's memory, and a model whose last layers it holds decodes through it."""
    import json
    import subprocess

    from server.rpc.hello import check_helper, wait_for_helper
    from tests.c_programs import aarch64_argv
    from tests.rpc.helpers import helper_memory, run_split
    from tests.servers import free_port

    port, memory = free_port(), 300 << 20
    endpoint = f"127.0.0.1:{port}"
    argv = aarch64_argv("test_rpc_server", str(port), str(memory), this_build(), variant=variant)
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_helper(endpoint, lambda: server.poll() is None)
        check_helper(endpoint)
        assert helper_memory(endpoint)[1] == memory
        model = tiny_model("tiny-qwen3moe")
        settings = {"model": str(model), "mode": "streaming", "ctx_size": 512, "parallel": 1, "threads": 2}
        split = run_split({**settings, "rpc": endpoint, "rpc_layers": "2"})
        assert len(split["tokens"]) > 0 and split["moe_layers_streamed"] == 2, json.dumps(split)[:2000]
    finally:
        server.kill()
        server.communicate(timeout=30)
