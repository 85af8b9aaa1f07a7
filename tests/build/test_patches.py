"""Each patch in vendor/llama.cpp/patches has a test here that fails without it.

0001 llama.cpp load mode MMAP_NO_PREFETCH: the file is mapped but not read at load.
0002 ggml-cpu mul_mat_id ready hook, which also says where a slice is: tests/c/test_ready_hook.c
     (built by `make ext`), through the vec_dot and the tiled matmul.
0003 llama-cpp-python Llama(...): cb_eval, cb_eval_user_data, tensor_buft_overrides,
     use_extra_bufts and load_mode reach llama.cpp, and survive context re-creation.
0004 llama_get_context_bytes: a context's KV cache, compute and output buffers, as llama.cpp
     allocated them (they grow with the context and the micro-batch as llama.cpp sizes them).
0005 llama-cpp-python's JSON grammars keep control characters and lone surrogates out of
     strings: tests/http/test_structured_output.py, whose strict parsers refuse them.
0006 llama-cpp-python's converter writes bounded repetitions flat (x{m,n}), not as one nested
     group per repetition, which overflowed llama.cpp's parser's stack.
0009 ggml-cpu repacked MUL_MAT_ID: asks the ready hook where each slice is and computes an expert's
     tokens 4 at a time (gemm): tests/c/test_ready_hook.c with `repack`; repacked layouts in other
     buffer types, their slices written without a log line: tests/c/test_repack_slices.c.
0010 Q4_K keeps the file's layout on x86, where ggml's tiled K-quant kernel is built (the q4_K case of
     test_0009_repacked_slices_in_a_plain_buffer).
0011 ggml-cpu matmuls give a column the same bits whatever its batch (F32, F16, IQ4_NL; on ARM
     Q8_0 and Q4_0 too): tests/c/test_batch_invariance.c.
0012 ggml-rpc's server within limits (memory reported and enforced, a bounded tensor cache, one
     client at a time, its build in HELLO): tests/rpc/test_worker.py.
0013 llama-cpp-python's `devices`: a load names its devices, so a helper registered for an earlier
     load and gone since is not used (tests/rpc/test_worker.py); a split's layers go to the
     helper named (tests/rpc/test_split.py).
0014 ggml-rpc's client reports a lost helper instead of aborting (keep-alive, timeouts): a helper
     killed or cut off mid-stream fails that request, and the server stays up
     (tests/rpc/test_faults.py); and counts the time waited on it (per-token helper_wait_ns,
     tests/rpc/test_split.py).
0015 ggml-backend computes a split whose eval-callback view covers it whole as the split itself,
     keeping its graph id: the helper recomputes its graph, only the inputs cross the link
     (tests/rpc/test_split.py).
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import pytest

from server.modelgen import QType
from tests.models import greedy, load_llama

REPO = Path(__file__).resolve().parents[2]
READY_HOOK_TEST = REPO / "tests" / "c" / "build" / "test_ready_hook"
REPACK_SLICES_TEST = REPO / "tests" / "c" / "build" / "test_repack_slices"
BATCH_INVARIANCE_TEST = REPO / "tests" / "c" / "build" / "test_batch_invariance"
# x86 builds carry ggml's tiled K-quant kernel, and there Q4_K keeps the file's layout (patch 0010)
TILED_BUILD = platform.machine() == "x86_64"
# the repacked layouts llama.cpp has on x86 and on aarch64 for MoE experts: Q4_0, Q4_K (aarch64
# only: tests/build/test_aarch64.py), MXFP4
REPACKED = [
    pytest.param({}, id="q4_0"),
    pytest.param(
        {"expert_qtype": QType.Q4_K, "n_ff_exp": 256},
        id="q4_K",
        marks=pytest.mark.skipif(TILED_BUILD, reason="Q4_K is not repacked where the tiled kernel is"),
    ),
    pytest.param({"preset": "tiny-gptoss"}, id="mxfp4"),
]


def mapping_rss_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (from /proc/self/smaps)."""
    target = str(path.resolve())
    total_kb = 0
    in_target = False
    header = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ [0-9a-f]+ \S+ \d+\s*(.*)$")
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            m = header.match(line)
            if m:
                in_target = m.group(1).strip() == target
            elif in_target and line.startswith("Rss:"):
                total_kb += int(line.split()[1])
    return total_kb * 1024


@pytest.fixture(scope="module")
def qwen(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("tiny-qwen3moe")


def test_0001_no_prefetch_maps_without_reading(qwen: Path) -> None:
    size = qwen.stat().st_size
    # control: the stock MMAP mode populates the whole mapping at load (MAP_POPULATE)
    stock = load_llama(qwen, load_mode=llama_cpp.LLAMA_LOAD_MODE_MMAP, use_extra_bufts=False)
    try:
        stock_rss = mapping_rss_bytes(qwen)
        stock_out = greedy(stock, list(range(40, 52)), 6)
    finally:
        stock.close()
    assert stock_rss > 0.9 * size, f"control failed: stock mmap mapped only {stock_rss} of {size} bytes"

    # repacked layouts are copies llama.cpp reads out of the mapping: plain ones stay mapped
    lazy = load_llama(qwen, load_mode=llama_cpp.LLAMA_LOAD_MODE_MMAP_NO_PREFETCH, use_extra_bufts=False)
    try:
        lazy_rss = mapping_rss_bytes(qwen)
        lazy_out = greedy(lazy, list(range(40, 52)), 6)
    finally:
        lazy.close()
    assert lazy_rss < 0.1 * size, f"MMAP_NO_PREFETCH faulted in {lazy_rss} of {size} bytes at load"
    assert lazy_out == stock_out, "the load mode must not change the output"


def test_0001_load_mode_name_round_trips() -> None:
    mode = llama_cpp.LLAMA_LOAD_MODE_MMAP_NO_PREFETCH
    assert llama_cpp.llama_load_mode_name(mode) == b"mmap-noprefetch"
    assert llama_cpp.llama_load_mode_from_str(b"mmap-noprefetch") == mode


@pytest.mark.parametrize(
    "kquant",
    [pytest.param(False, id="vec-dot"), pytest.param(True, id="tiled")],
)
def test_0002_ready_hook_announces_and_places_routed_experts(
    tiny_model: Callable[..., Path], kquant: bool
) -> None:
    """The hook is told of every routed expert before its slice is read, can refuse it, and says
    where the slice is: the matmul reads the bytes it points at. Q4_0 experts go through the
    vec_dot matmul; Q4_K ones, forced, through the tiled one (GGML_CPU_TILED_MM_FORCE)."""
    assert READY_HOOK_TEST.is_file(), "build it with `make ext`"
    if kquant:
        model = tiny_model("tiny-qwen3moe", expert_qtype=QType.Q4_K, n_ff_exp=256)
        env = {**os.environ, "GGML_CPU_TILED_MM_FORCE": "1"}
    else:
        model, env = tiny_model("tiny-qwen3moe"), dict(os.environ)
    argv = [str(READY_HOOK_TEST), str(model), "2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["ok"] * 5, proc.stdout


@pytest.mark.parametrize("model_args", REPACKED)
def test_0009_repacked_mul_mat_id_asks_the_ready_hook(
    tiny_model: Callable[..., Path], model_args: dict[str, object]
) -> None:
    """With the experts repacked (CPU_REPACK), repack's MUL_MAT_ID asks the hook for every routed
    expert and reads the slice where it says, through gemm (experts with 4 tokens or more) and
    gemv; without the patch the hook is never called there."""
    assert READY_HOOK_TEST.is_file(), "build it with `make ext`"
    args = dict(model_args)
    model = tiny_model(str(args.pop("preset", "tiny-qwen3moe")), **args)
    argv = [str(READY_HOOK_TEST), str(model), "2", "repack"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["ok"] * 6, proc.stdout


@pytest.mark.parametrize("qtype", ["q4_0", "q4_K", "mxfp4"])
def test_0009_repacked_slices_in_a_plain_buffer(qtype: str) -> None:
    """Slices written by ggml_cpu_repack_slice into a plain CPU buffer, with the layout in the
    tensor's extra, compute what CPU_REPACK computes, bit for bit; without it, the plain kernel."""
    assert REPACK_SLICES_TEST.is_file(), "build it with `make ext`"
    argv = [str(REPACK_SLICES_TEST), qtype]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    if qtype == "q4_K" and TILED_BUILD:
        assert proc.stdout.startswith("ok q4_K has no repacked layout"), proc.stdout
        return
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["ok"] * 5, proc.stdout
    # the layout ggml picks on x86 with AVX2 (AVX-512 machines too): 8 rows interleaved, 8-byte blocks
    if " avx2 " in Path("/proc/cpuinfo").read_text():
        assert f"with {qtype}_8x8\n" in proc.stderr, proc.stderr[-3000:]


def test_0011_a_matmul_column_is_the_same_in_any_batch() -> None:
    """Every weight type a model's matmuls use, F32 and F16 (a MoE router, some output layers)
    and IQ4_NL included: a column computed alone and in a batch of 2 to 8 gives the same bits
    (without the patch one column takes ggml's vec_dot and several llamafile's tinyBLAS)."""
    assert BATCH_INVARIANCE_TEST.is_file(), "build it with `make ext`"
    argv = [str(BATCH_INVARIANCE_TEST)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["ok"] * 8, proc.stdout


def test_0003_cb_eval_is_called_and_survives_recreation(qwen: Path) -> None:
    calls = {"ask": 0, "observed": 0}

    def on_eval(tensor: int, ask: bool, user_data: int) -> bool:
        if ask:
            calls["ask"] += 1
            return True  # observe every node: the graph is split per node, output must not change
        calls["observed"] += 1
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(on_eval)
    reference = load_llama(qwen)
    try:
        expected = greedy(reference, list(range(40, 52)), 4)
    finally:
        reference.close()

    llm = load_llama(qwen, cb_eval=callback)
    try:
        assert greedy(llm, list(range(40, 52)), 4) == expected
        assert calls["ask"] > 0 and calls["observed"] > 0, "cb_eval given to Llama(...) was never called"
        state = llm.__getstate__()
        assert state["cb_eval"] is callback
    finally:
        llm.close()

    calls["ask"] = 0
    twin = llama_cpp.Llama(**state)  # re-creation from the state keeps the callback
    try:
        assert greedy(twin, list(range(40, 52)), 4) == expected
        assert calls["ask"] > 0
    finally:
        twin.close()


def test_0003_use_extra_bufts_reaches_the_loader(
    tiny_model: Callable[..., Path], capfd: pytest.CaptureFixture[str]
) -> None:
    q4 = tiny_model("tiny-qwen3moe")  # Q4_0 experts
    load_llama(q4, use_extra_bufts=True, verbose=True).close()
    with_repack = capfd.readouterr().err
    if "CPU_REPACK" not in with_repack:
        pytest.skip("this CPU build has no Q4_0 repacking, so use_extra_bufts has no visible effect")
    llm = load_llama(q4, use_extra_bufts=False, verbose=True)
    try:
        assert llm.__getstate__()["use_extra_bufts"] is False
    finally:
        llm.close()
    assert "CPU_REPACK" not in capfd.readouterr().err


def test_0003_tensor_buft_overrides_reach_the_loader(qwen: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cpu = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    buft = cpu.ggml_backend_cpu_buffer_type()
    llm = load_llama(qwen, tensor_buft_overrides=[(r"ffn_down_exps\.weight", buft)], verbose=True)
    try:
        assert llm.__getstate__()["tensor_buft_overrides"] == [(r"ffn_down_exps\.weight", buft)]
    finally:
        llm.close()
    err = capfd.readouterr().err
    assert re.search(r"blk\.0\.ffn_down_exps\.weight .* buffer type overridden to CPU", err), err[-2000:]
    assert not re.search(r"ffn_up_exps\.weight .* overridden", err), "only matching tensors move"


def test_0003_null_buffer_type_is_refused(qwen: Path) -> None:
    with pytest.raises(ValueError, match="null buffer type"):
        load_llama(qwen, tensor_buft_overrides=[(r"ffn_up_exps\.weight", 0)])


def test_0004_context_bytes_follow_the_context_and_the_micro_batch(qwen: Path) -> None:
    def measured(**kw: int) -> tuple[llama_cpp.llama_context_bytes, int]:
        llm = load_llama(qwen, **kw)
        try:
            return llama_cpp.llama_get_context_bytes(llm._ctx.ctx), llm.n_vocab()
        finally:
            llm.close()

    small, n_vocab = measured(n_ctx=256, n_batch=64, n_ubatch=64)
    long_ctx, _ = measured(n_ctx=2048, n_batch=64, n_ubatch=64)
    big_batch, _ = measured(n_ctx=256, n_batch=256, n_ubatch=256)
    # the KV cache holds n_ctx cells (F16 K and V); the scores of a micro-batch over the whole
    # context live in the compute buffers; the output buffer holds one row of logits
    assert long_ctx.memory == 8 * small.memory > 0
    assert long_ctx.compute > small.compute > 0 and big_batch.compute > small.compute
    assert small.output >= n_vocab * 4


def test_0006_bounded_repetitions_are_written_flat() -> None:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from server.engine.grammars import grammar_cost

    strings = str(json_schema_to_gbnf('{"type": "string", "minLength": 2, "maxLength": 1500}'))
    arrays = str(json_schema_to_gbnf('{"type": "array", "items": {"type": "integer"}, "maxItems": 1500}'))
    assert "char{2,1500}" in strings and '("," space integer){0,1499}' in arrays
    # the unpatched converter nested 1500 groups here
    assert grammar_cost(strings)[0] <= 2 and grammar_cost(arrays)[0] <= 2
