"""One output whatever the memory, the mode and the batching.

- The product defaults, resident without a limit, and the product defaults, streamed under a
  memory cgroup whose cap makes the cache evict, give the same tokens. The other gates fix every
  setting on both sides and so prove the streamer lossless; this one fixes none but the prompt,
  the length (128 tokens: flash attention on and off part at the 46th here) and greedy sampling,
  and so proves the defaults do not pick other kernels (flash attention, weight layouts) for a
  model by its mode or the memory it gets. Its shape, 20 qwen3moe layers of 32 experts with 6
  query heads, is one no other gate uses. Skips with the reason when this machine cannot create a
  memory cgroup (server/bench/cgroup.py).
- With the default settings a prompt decoded whole, or split as the prompt cache and prompt
  chunks split it, gives the same logits, to the bit for Q4_0 weights (docs/memory.md: why flash
  attention is off).
- With the default settings a request decoded beside others in the server's slots gives its
  logits alone, to the bit; with the repacked layouts on it does not quite yet (the test prints
  the difference; docs/performance.md, "Repacked layouts").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from server.bench.cgroup import MemoryCgroup, probe
from server.loading.resident import load_resident_llama
from server.modelgen.quant import QType
from server.settings import ModelSettings

MIB = 2**20
SHAPE = {"n_layer": 20, "n_embd": 384, "n_head": 6, "head_dim": 64, "n_expert": 32, "n_ff_exp": 384}
# `moeflash generate` holds about 200 MiB here beside the experts (interpreter and libraries, dense
# weights, a 4096-token context with its attention scratch) and keeps a margin of 74: 320 MiB leaves
# the cache 51 of the 152 MiB of experts
CAP = 320 * MIB


def report(completed: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert completed.returncode == 0, completed.stderr[-3000:]
    return dict(json.loads(completed.stdout.strip().splitlines()[-1]))


def test_defaults_give_one_output_whatever_the_memory(tiny_model: Any) -> None:
    support = probe()
    if support.version is None:
        pytest.skip(f"memory cgroups unavailable: {support.reason}")
    model = tiny_model("tiny-qwen3moe", **SHAPE)
    generate = [sys.executable, "-m", "server.cli", "generate", "-m", str(model)]
    generate += ["--prompt-tokens", "200", "-n", "128", "--temp", "0", "--ignore-eos", "--json"]
    resident = report(
        subprocess.run(
            [*generate, "--mode", "resident"], capture_output=True, text=True, timeout=600, check=False
        )
    )
    with MemoryCgroup(CAP, support) as cgroup:
        streamed = report(cgroup.run([*generate, "--mode", "streaming"], timeout=600))
        assert cgroup.oom_kills() == 0
    assert streamed["totals"]["evictions"] > 0, "the cap let the cache hold every expert"
    kernels = [run["memory"]["context"]["flash_attn"] for run in (resident, streamed)]
    assert streamed["tokens"] == resident["tokens"], f"flash attention resident, streamed: {kernels}"
    assert kernels[0] == kernels[1]


def last_logits(llama: llama_cpp.Llama, parts: list[list[int]]) -> np.ndarray[Any, Any]:
    """The logits of the last token after decoding `parts` one llama_decode each, from an empty
    context."""
    llama_cpp.llama_memory_clear(llama._ctx.memory, True)
    pos = 0
    for part in parts:
        batch = llama_cpp.llama_batch_init(len(part), 0, 1)
        try:
            for i, token in enumerate(part):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, i == len(part) - 1
            batch.n_tokens = len(part)
            assert llama_cpp.llama_decode(llama._ctx.ctx, batch) == 0
        finally:
            llama_cpp.llama_batch_free(batch)
        pos += len(part)
    row = llama_cpp.llama_get_logits_ith(llama._ctx.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llama.n_vocab(),)).copy()


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_K])
def test_a_prompt_split_gives_the_same_logits(tiny_model: Any, qtype: QType) -> None:
    """Q4_0 (and Q8_0 dense) matmuls are batch-invariant; the K-quants' tiled matmul is not, to the
    last bits of a float (docs/memory.md)."""
    model: Path = tiny_model("tiny-qwen3moe", expert_qtype=qtype, dense_qtype=qtype, n_ff_exp=256)
    default = ModelSettings().flash_attn
    differences = {}
    for flash_attn in ("off", "on"):
        llama = load_resident_llama(model, n_ctx=512, flash_attn=flash_attn, parallel=1)
        try:
            prompt = llama.tokenize(b"The prompt cache reuses a prefix of this prompt. " * 5, add_bos=True)
            assert len(prompt) <= llama.n_batch, "one micro-batch holds the whole prompt"
            whole = last_logits(llama, [prompt])
            splits = [[prompt[:-1], prompt[-1:]], [prompt[:-5], prompt[-5:]], [prompt[:9], prompt[9:]]]
            differences[flash_attn] = max(float(np.abs(last_logits(llama, s) - whole).max()) for s in splits)
        finally:
            llama.close()
    print(f"{qtype.name}: largest logit difference of a split {len(prompt)}-token prompt: {differences}")
    if qtype == QType.Q4_0:
        assert differences[default] == 0.0, f"the default (flash attention {default}) is not batch-invariant"
    assert differences[default] < 1e-4 < differences["on"]


def decode_steps(llama: llama_cpp.Llama, seqs: list[int], prompts: list[list[int]], steps: int) -> list[Any]:
    """Sequence `seqs[0]`'s logits after its prompt and each of `steps` greedy tokens, every
    sequence of `seqs` decoded in the same llama_decode calls (one at a time for a single one)."""
    llama_cpp.llama_memory_clear(llama._ctx.memory, True)
    pos = {s: 0 for s in seqs}
    inputs = {s: prompts[s] for s in seqs}
    rows = []
    for _ in range(steps + 1):
        n = sum(len(t) for t in inputs.values())
        batch = llama_cpp.llama_batch_init(n, 0, 1)
        try:
            i, last = 0, {}
            for s in seqs:
                for j, token in enumerate(inputs[s]):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos[s] + j, 1
                    batch.seq_id[i][0], batch.logits[i] = s, j == len(inputs[s]) - 1
                    i += 1
                last[s], pos[s] = i - 1, pos[s] + len(inputs[s])
            batch.n_tokens = n
            assert llama_cpp.llama_decode(llama._ctx.ctx, batch) == 0
        finally:
            llama_cpp.llama_batch_free(batch)
        for s in seqs:
            row = llama_cpp.llama_get_logits_ith(llama._ctx.ctx, last[s])
            logits = np.ctypeslib.as_array(row, shape=(llama.n_vocab(),)).copy()
            if s == seqs[0]:
                rows.append(logits)
            inputs[s] = [int(np.argmax(logits))]
    return rows


def test_a_sequence_beside_others_gives_its_logits_alone(tiny_model: Any) -> None:
    """Four of the server's slots decoded together against the first one alone, 24 greedy steps
    (tiny-qwen3moe: Q4_0 experts, Q8_0 dense weights)."""
    model: Path = tiny_model("tiny-qwen3moe")
    prompts = [[(7 * i + 11 * s) % 200 + 10 for i in range(20 + 3 * s)] for s in range(4)]
    default = ModelSettings().repack
    differences = {}
    for repack in ("off", "on"):
        llama = load_resident_llama(model, n_ctx=256, repack=repack, parallel=4)
        try:
            alone = decode_steps(llama, [0], prompts, 24)
            together = decode_steps(llama, [0, 1, 2, 3], prompts, 24)
        finally:
            llama.close()
        differences[repack] = max(float(np.abs(a - b).max()) for a, b in zip(alone, together, strict=True))
    print(f"largest logit difference of a sequence beside three others, by --repack: {differences}")
    assert differences[default] == 0.0, f"the default (repack {default}) is not batch-invariant"
