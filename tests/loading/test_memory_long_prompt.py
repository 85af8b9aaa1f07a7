"""A prompt that fills the configured context completes under a memory cap.

`moeflash serve` runs in a memory cgroup (cgroup v1 or v2) with its automatic budget. Its expert
budget, its KV cache and llama.cpp's compute buffers must all fit under the cap together. The
compute buffers only fill when a long prompt arrives. Here they are counted and measured, with
flash attention (`--flash-attn on`, smaller buffers) and without it (the default, with the attention
scratch). Each case sends prompts that fill the context and checks that no process of the group
was OOM-killed:
- a 2-layer qwen30b-shape model (820 MiB) streamed under a 1000 MiB cap, 8192-token context,
  three such prompts at once: they queue and all complete. Before the compute buffers were
  counted, the first prompt got the server OOM-killed under this cap;
- the same model resident under a 2200 MiB cap, without flash attention;
- gemma4 (sliding-window layers) at its training context, 32768 tokens, streamed under a cap;
- a cap that cannot hold the context: the server refuses to start and names the numbers.

Skips with the reason when this machine cannot create a memory cgroup (server/bench/cgroup.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.bench.cgroup import MemoryCgroup, probe
from server.modelgen import generate_model, preset
from tests.servers import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
CTX = 8192
# full contexts under these caps need flash attention's smaller buffers (docs/memory.md)
FLASH = ("--flash-attn", "on")
# room left in the context for the completion (and for a re-tokenised prompt a few tokens longer)
SLACK = 48


@pytest.fixture(scope="module")
def cgroups() -> Any:
    support = probe()
    if support.version is None:
        pytest.skip(f"memory cgroups unavailable: {support.reason}")
    return support


@pytest.fixture(scope="module")
def two_layer_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    spec = dataclasses.replace(preset("qwen30b-8l-shape"), n_layer=2)
    path = generate_model(spec, tmp_path_factory.mktemp("long") / "q2l.gguf")[0]
    yield path
    path.unlink()


def prompt_of(model: Path, n_tokens: int) -> str:
    """Text that the model's tokenizer cuts into about `n_tokens` tokens."""
    import llama_cpp

    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    try:
        words = " ".join(f"river{i % 97} stone{i % 89} light" for i in range(n_tokens))
        tokens = vocab.tokenize(words.encode(), add_bos=False)[:n_tokens]
        return vocab.detokenize(tokens).decode("utf-8", "replace")
    finally:
        vocab.close()


def serve_capped(
    cgroup: MemoryCgroup, model: Path, *extra: str
) -> tuple[subprocess.Popen[str], Callable[[], int]]:
    """Start `moeflash serve` inside `cgroup`; returns the process and a function that waits for
    it to be ready and gives its port."""
    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", str(port), *extra]
    proc = cgroup.popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def ready() -> int:
        def up() -> bool:
            assert proc.poll() is None, f"the server exited: {proc.communicate()[1][-3000:]}"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, "moeflash serve to be ready", timeout_s=300)
        return port

    return proc, ready


def complete(port: int, prompt: str) -> dict[str, Any]:
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=1200,
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def run_full_context(
    support: Any, model: Path, cap: int, ctx: int, n_requests: int, *extra: str
) -> list[dict[str, Any]]:
    """Serve `model` under `cap` with a `ctx`-token context; send `n_requests` prompts that fill
    it at once; check that they all complete and that nothing was OOM-killed."""
    prompt = prompt_of(model, ctx - SLACK)
    with MemoryCgroup(cap, support) as cgroup:
        proc, ready = serve_capped(cgroup, model, "--alias", "m", "--ctx-size", str(ctx), *extra)
        try:
            port = ready()
            with concurrent.futures.ThreadPoolExecutor(n_requests) as pool:
                bodies = list(pool.map(lambda _: complete(port, prompt), range(n_requests)))
            assert proc.poll() is None, "the server died"
        finally:
            proc.terminate()
            _, log = proc.communicate(timeout=60)
        peak, kills = cgroup.peak_bytes(), cgroup.oom_kills()
    print(f"cap {cap / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB; budget: {_budget_line(log)}")
    assert kills == 0, f"{kills} process(es) OOM-killed under {cap / MIB:.0f} MiB:\n{log[-3000:]}"
    assert peak <= cap
    for body in bodies:
        usage = body["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] > ctx - 2 * SLACK, usage
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    return bodies


def _budget_line(log: str) -> str:
    return next((line for line in log.splitlines() if "expert budget" in line), "(resident)")


@pytest.mark.slow
def test_streamed_full_context_prompts_under_a_cap(cgroups: Any, two_layer_model: Path) -> None:
    run_full_context(cgroups, two_layer_model, 1000 * MIB, CTX, 3, "--mode", "streaming", *FLASH)


@pytest.mark.slow
def test_resident_full_context_prompt_under_a_cap(cgroups: Any, two_layer_model: Path) -> None:
    run_full_context(cgroups, two_layer_model, 2200 * MIB, CTX, 1, "--mode", "resident")


@pytest.mark.slow
def test_sliding_window_model_at_its_training_context(cgroups: Any, tiny_model: Any) -> None:
    model = tiny_model("tiny-gemma4")
    n_ctx_train = preset("tiny-gemma4").n_ctx
    run_full_context(cgroups, model, 700 * MIB, n_ctx_train, 1, "--mode", "streaming", *FLASH)


def test_a_context_the_cap_cannot_hold_is_refused_at_start(cgroups: Any, two_layer_model: Path) -> None:
    with MemoryCgroup(500 * MIB, cgroups) as cgroup:
        proc, _ = serve_capped(cgroup, two_layer_model, "--ctx-size", str(CTX), "--mode", "streaming")
        _, log = proc.communicate(timeout=300)
        kills = cgroup.oom_kills()
    assert proc.returncode != 0
    assert kills == 0
    assert f"not enough memory for a {CTX}-token context" in log, log[-3000:]
    terms = (
        "in use",
        "weights in RAM",
        "KV",
        "compute",
        "margin",
        "below one layer's experts",
        "--flash-attn on",
    )
    for term in terms:
        assert term in log, (term, log[-3000:])
