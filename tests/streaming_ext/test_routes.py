"""The micro-batches a route tracer maps a decode call's rows by (streaming_ext.batch.micro_batches,
llama.cpp's split_equal with sequential sequence ids), and the C side's refusal of a call it
cannot map. The tracer following real llama.cpp splits is tests/loading/test_route_trace.py's."""

from __future__ import annotations

import ctypes

import pytest

from streaming_ext import RouteTracer
from streaming_ext.batch import DecodeCall, micro_batches


@pytest.mark.parametrize(
    ("seqs", "n_ubatch", "expected"),
    [
        # one sequence: n_ubatch tokens at a time, in order (split_simple's cut)
        ([0] * 70, 32, [list(range(32)), list(range(32, 64)), list(range(64, 70))]),
        # two decodes and a prompt chunk: one token of each, then the rest of the chunk
        ([0, 1, 2, 2, 2, 2], 32, [[0, 1, 2], [3, 4, 5]]),
        # ids must rise from the first token's sequence: a lower one waits for the next micro-batch
        ([1, 1, 1, 0], 32, [[0, 1, 2], [3]]),
        # sequences whose ids are not consecutive go into micro-batches of their own
        ([0, 2, 2], 32, [[0], [1, 2]]),
        # equal shares, bounded by n_ubatch: (each + 1) * sequences must stay within it
        ([0] * 5 + [1] * 5, 4, [[0, 1, 5, 6], [2, 3, 7, 8], [4, 9]]),
        ([], 8, []),
    ],
)
def test_micro_batches_follow_split_equal(seqs: list[int], n_ubatch: int, expected: list[list[int]]) -> None:
    assert micro_batches(seqs, n_ubatch) == expected
    assert sorted(i for batch in expected for i in batch) == list(range(len(seqs)))


def test_a_call_it_cannot_map_is_refused() -> None:
    tracer = RouteTracer(2, 4, 2)
    try:
        one = (ctypes.c_int32 * 2)(0, 0)
        flags = (ctypes.c_uint8 * 2)(0, 1)
        begin = tracer.lib.cdll.mf_route_trace_begin_batch
        bad_phase = (ctypes.c_int32 * 2)(0, 2)
        whole = (ctypes.c_int64 * 1)(2)
        assert begin(tracer.handle, 2, one, flags, 1, whole, one, bad_phase, one) != 0
        # micro-batch ends that do not cover the call
        assert begin(tracer.handle, 2, one, flags, 1, (ctypes.c_int64 * 1)(1), one, one, one) != 0
        assert begin(tracer.handle, 2, one, flags, 2, (ctypes.c_int64 * 2)(1, 1), one, one, one) != 0
        assert begin(tracer.handle, 2, one, flags, 1, whole, one, one, one) == 0
        tracer.begin_phase(0, 3)
        tracer.begin_batch(DecodeCall.of([3, 3], [False, True], 512))
    finally:
        tracer.close()
