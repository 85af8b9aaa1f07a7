"""Helpers for tests that run synthetic models through the patched llama-cpp-python.

- `load_llama(path, **kw)`: a Llama with the settings every byte-identity comparison must share
  (n_ctx 512, 2 threads, use_extra_bufts on as the product loads them by default, `--repack`:
  server/loading/context.py, quiet); keyword arguments override them (load_mode, cb_eval,
  tensor_buft_overrides, ...).
- `load_llama_noting_repacks(path, **kw)`: the same, with the tensors llama.cpp repacked.
- `greedy(llm, prompt_tokens, n)`: greedy decoding that returns the tokens and a sha256 of every
  logits row it looked at: the fingerprint two runs must share to count as identical.
- `RouteRecorder`: a cb_eval that records the experts each layer routed each token to.
- `expert_layer_bytes(path)`: one layer's experts, the smallest streaming budget.

The session fixtures that make the models live in conftest.py (`tiny_model`, `llama_factory`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import llama_cpp
import numpy as np

LLAMA_DEFAULTS: dict[str, Any] = {
    "devices": [],  # the CPU alone, as moeflash's loaders name it (no RPC helper of another test)
    "n_ctx": 512,
    "n_threads": 2,
    "n_threads_batch": 2,
    "use_extra_bufts": True,
    "verbose": False,
}


T = TypeVar("T")


def load_llama(path: Path | str, **kw: Any) -> llama_cpp.Llama:
    """Load `path` (the first file of a split set) with LLAMA_DEFAULTS updated by `kw`."""
    return llama_cpp.Llama(str(path), **{**LLAMA_DEFAULTS, **kw})


def noting_repacks(load: Callable[..., T], *args: Any, **kw: Any) -> tuple[T, frozenset[str]]:
    """load(*args, verbose=True, **kw), and the names of the tensors llama.cpp put in a repacked
    layout while it ran (its own log line for each, which it prints when verbose)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        loaded = load(*args, **{**kw, "verbose": True})
    return loaded, frozenset(re.findall(r"repack: repack tensor (\S+) with", err.getvalue()))


def load_llama_noting_repacks(path: Path | str, **kw: Any) -> tuple[llama_cpp.Llama, frozenset[str]]:
    """load_llama, and the tensors llama.cpp repacked (noting_repacks)."""
    return noting_repacks(load_llama, path, **kw)


def last_logits(llm: llama_cpp.Llama) -> np.ndarray:
    """A copy of the logits row of the last evaluated token (float32, n_vocab)."""
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def greedy(llm: llama_cpp.Llama, prompt_tokens: Sequence[int], n: int) -> tuple[list[int], str]:
    """Reset, evaluate the prompt, pick the argmax n times; return (tokens, sha256 of the n logits rows).

    Raises AssertionError if a logits row holds NaN or inf.
    """
    llm.reset()  # type: ignore[no-untyped-call]
    llm.eval(list(prompt_tokens))
    digest = hashlib.sha256()
    out: list[int] = []
    for step in range(n):
        row = last_logits(llm)
        assert np.isfinite(row).all(), f"non-finite logits at step {step}"
        digest.update(row.tobytes())
        token = int(np.argmax(row))
        out.append(token)
        if step + 1 < n:
            llm.eval([token])
    return out, digest.hexdigest()


class RouteRecorder:
    """cb_eval that records routing: routes[layer] = list of per-token expert-id tuples (in order).

    Pass `recorder.callback` as cb_eval and keep the recorder alive while the model runs.
    Reads the `ffn_moe_topk-<layer>` node (a strided int32 view) through ggml's own accessors,
    so no struct offsets are hard-coded.
    """

    def __init__(self, n_expert_used: int) -> None:
        libdir = Path(llama_cpp.__file__).parent / "lib"
        base = ctypes.CDLL(os.fspath(libdir / "libggml-base.so"))
        cpu = ctypes.CDLL(os.fspath(libdir / "libggml-cpu.so"))
        self._name = base.ggml_get_name
        self._name.restype, self._name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        self._nelements = base.ggml_nelements
        self._nelements.restype, self._nelements.argtypes = ctypes.c_int64, [ctypes.c_void_p]
        self._get = cpu.ggml_get_i32_nd
        self._get.restype, self._get.argtypes = ctypes.c_int32, [ctypes.c_void_p] + [ctypes.c_int] * 4
        self.k = n_expert_used
        self.routes: dict[int, list[tuple[int, ...]]] = {}
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_node)

    def _on_node(self, tensor: int, ask: bool, user_data: int) -> bool:
        name = self._name(tensor).decode()
        if not name.startswith("ffn_moe_topk-"):
            return False
        if ask:
            return True
        layer = int(name.rsplit("-", 1)[1])
        n_tokens = self._nelements(tensor) // self.k
        rows = self.routes.setdefault(layer, [])
        for j in range(n_tokens):
            rows.append(tuple(self._get(tensor, i, j, 0, 0) for i in range(self.k)))
        return True


def expert_layer_bytes(path: Path | str) -> int:
    """Bytes of one layer's experts (the smallest streaming budget, which makes every route evict)."""
    from streaming_ext import Streamer, StreamerConfig

    probe = Streamer(path, StreamerConfig())
    try:
        return probe.layer_bytes
    finally:
        probe.close()
