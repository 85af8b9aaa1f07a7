"""A route tracer (the C mf_route_trace): replays recorded routing into a model and records the
routing it runs, from the context's eval callback.

Install `eval_callback` with `handle` as cb_eval / cb_eval_user_data; for a streamed model, chain
the streamer's callback behind it (`chain`), so the streamer sees the replayed ids. Call
`begin_phase(0, seq)` before a request's prompt in KV sequence `seq`, `begin_phase(1, seq)` before
its decode steps, and `begin_batch` with each llama_decode call (streaming_ext.batch.DecodeCall):
each token then has its request, phase and step, and the C side maps every node's rows to those
tokens through the call's micro-batches. Nothing here runs per graph node: the per-node path is
in C (mf_route.c).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from typing import Any

from streaming_ext._declared import RECORD, RouteRecord
from streaming_ext._lib import MfRouteRecord, StreamLib, load_library
from streaming_ext.batch import DecodeCall
from streaming_ext.streamer import Streamer, StreamerError

_ERR_LEN = 512
_TAKE = 65536  # records moved per call


class RouteTracer:
    """Replayed and/or recorded routing for a model of n_layer layers, n_expert experts, k used."""

    def __init__(self, n_layer: int, n_expert: int, k: int, lib: StreamLib | None = None) -> None:
        self.lib = lib or load_library()
        self.n_layer, self.n_expert, self.k = n_layer, n_expert, k
        handle = ctypes.c_void_p()
        rc = self.lib.cdll.mf_route_trace_new(n_layer, n_expert, k, ctypes.byref(handle))
        if rc != 0:
            raise StreamerError(f"cannot create a route tracer: {os.strerror(-rc)}", -rc)
        self._handle: int | None = handle.value
        import llama_cpp

        address = ctypes.cast(self.lib.cdll.mf_route_trace_eval_cb, ctypes.c_void_p).value
        if address is None:
            raise StreamerError("mf_route_trace_eval_cb has no address", errno.ENOSYS)
        self.eval_callback = llama_cpp.ggml_backend_sched_eval_callback(address)
        self._chained: Any = None  # keeps the chained callback object alive
        self._turns = 0  # prompts begun
        self._seqs: dict[int, list[int]] = {}  # KV sequence -> [turn, phase, its next token's step]

    @property
    def handle(self) -> int:
        """The mf_route_trace pointer (the callback's user data)."""
        if self._handle is None:
            raise StreamerError("the route tracer is closed", errno.EBADF)
        return self._handle

    def replay(self, phase: int, ids: Sequence[Sequence[Sequence[int]]]) -> None:
        """Route phase `phase` (0 prompt, 1 decode) by ids[step][layer][slot]; a layer whose ids
        are -1 routes as the model does."""
        flat = [e for step in ids for layer in step for e in layer]
        if len(flat) != len(ids) * self.n_layer * self.k:
            raise ValueError(f"replayed ids must be [steps][{self.n_layer} layers][{self.k}]")
        arr = (ctypes.c_int32 * len(flat))(*flat)
        rc = self.lib.cdll.mf_route_trace_set_replay(self.handle, phase, len(ids), arr)
        if rc != 0:
            raise StreamerError(f"cannot replay that routing: {os.strerror(-rc)}", -rc)

    def record(self, on: bool) -> None:
        """Record every route from now on (after replacement) or stop."""
        self.lib.cdll.mf_route_trace_set_recording(self.handle, int(on))

    def chain(self, callback: Any, user_data: int) -> None:
        """Run `callback` (a llama_cpp.ggml_backend_sched_eval_callback) after this tracer's."""
        self._chained = callback
        self.lib.cdll.mf_route_trace_chain(self.handle, ctypes.cast(callback, ctypes.c_void_p), user_data)

    def keep_layers(self, n: int) -> None:
        """Route only the layers below n (0: all): the others run on an RPC helper (server/rpc)."""
        self.lib.cdll.mf_route_trace_keep_layers(self.handle, n)

    def begin_phase(self, phase: int, seq: int = 0) -> None:
        """The tokens of KV sequence `seq` decoded from now on are a new request's prompt (0) or
        its decode steps (1), from step 0."""
        if phase == 0 or seq not in self._seqs:
            self._seqs[seq] = [self._turns, 0, 0]
            self._turns += 1
        self._seqs[seq][1:] = [0 if phase == 0 else 1, 0]

    def begin_batch(self, call: DecodeCall) -> None:
        """The next llama_decode call (a sequence never begun starts a prompt)."""
        tokens = []
        for seq in call.seqs:
            if seq not in self._seqs:
                self.begin_phase(0, seq)
            state = self._seqs[seq]
            tokens.append((state[0], state[1], state[2]))
            state[2] += 1
        turn, phase, step = (call.column([tokens[i][f] for i in call.order]) for f in range(3))
        rc = self.lib.cdll.mf_route_trace_begin_batch(self.handle, *call.c_args(), turn, phase, step)
        if rc != 0:
            raise StreamerError(f"cannot announce a batch to the route tracer: {os.strerror(-rc)}", -rc)

    def predict_for(self, streamer: Streamer, error_share: float = 0.0, seed: int = 0) -> None:
        """Make `streamer`'s prefetch read what this tracer replays next (mf_route_trace_predict):
        a prefetch that knows the future, the upper bound of any predictor's; with `error_share`,
        that share of each token's guesses replaced by experts it does not route (an emulated
        predictor, drawn from `seed`). Close the streamer first."""
        rc = self.lib.cdll.mf_route_trace_set_predict_error(self.handle, error_share, seed)
        if rc != 0:
            raise StreamerError(f"a prediction error share must be in [0, 1), not {error_share}", -rc)
        address = ctypes.cast(self.lib.cdll.mf_route_trace_predict, ctypes.c_void_p).value
        self.lib.cdll.mf_streamer_set_predictor(streamer.handle, address, self.handle)

    def take_records(self) -> list[RouteRecord]:
        """The records not yet taken, oldest first."""
        out: list[RouteRecord] = []
        buf = (MfRouteRecord * _TAKE)()
        while (n := int(self.lib.cdll.mf_route_trace_take_recorded(self.handle, buf, _TAKE))) > 0:
            out += [RouteRecord(**{field.name: getattr(r, field.name) for field in RECORD}) for r in buf[:n]]
        return out

    def take_error(self) -> StreamerError | None:
        """The error that stopped a graph (a node the trace does not fit), or None."""
        msg = ctypes.create_string_buffer(_ERR_LEN)
        rc = self.lib.cdll.mf_route_trace_take_error(self.handle, msg, _ERR_LEN)
        return None if rc == 0 else StreamerError(msg.value.decode(errors="replace"), -rc)

    def close(self) -> None:
        """Free the tracer; only after the context using its callback has been freed."""
        if self._handle is not None:
            self.lib.cdll.mf_route_trace_free(self._handle)
            self._handle = None
