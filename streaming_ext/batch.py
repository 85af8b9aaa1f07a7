"""A llama_decode call's tokens as llama.cpp computes them, for the C side's mapping of a routing
node's rows to tokens (mf_batch.c): the route tracer's (streaming_ext.routes) and the streamer's
sharing of its reads among KV sequences (streaming_ext.streamer)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any


def micro_batches(seqs: Sequence[int], n_ubatch: int) -> list[list[int]]:
    """The micro-batches llama.cpp computes a decode call in, as indices into its tokens, whose
    KV sequences are `seqs`: llama_batch_allocr::split_equal with sequential sequence ids, the
    split of a KV cache with a stream per sequence (moeflash's layout; with one sequence, the same
    cut as split_simple). Each micro-batch takes sequences of consecutive ids from the first token
    not yet taken, the same number of tokens from each (at most n_ubatch in all), each
    sequence's tokens in call order and the sequences one after the other."""
    left: dict[int, list[int]] = {}
    for i, seq in enumerate(seqs):
        left.setdefault(seq, []).append(i)
    taken = [False] * len(seqs)
    out: list[list[int]] = []
    while not all(taken):
        chosen: list[int] = []
        for i, seq in enumerate(seqs):
            if not taken[i] and seq not in chosen and (not chosen or seq == chosen[-1] + 1):
                chosen.append(seq)
        each = 0
        while all(each < len(left[seq]) for seq in chosen):
            each += 1
            if (each + 1) * len(chosen) > n_ubatch:
                break
        batch = [i for seq in chosen for i in left[seq][:each]]
        for seq in chosen:
            del left[seq][:each]
        for i in batch:
            taken[i] = True
        out.append(batch)
    return out


@dataclass(frozen=True)
class DecodeCall:
    """One llama_decode call: its tokens' KV sequences and output flags in call order, and the
    order llama.cpp computes them in (`order[j]`: the call index of the j-th computed token),
    cut into micro-batches ending at `ends`."""

    seqs: tuple[int, ...]
    outputs: tuple[bool, ...]
    order: tuple[int, ...]
    ends: tuple[int, ...]

    @classmethod
    def of(cls, seqs: Sequence[int], outputs: Sequence[bool], n_ubatch: int) -> DecodeCall:
        batches = micro_batches(seqs, n_ubatch)
        order = tuple(i for batch in batches for i in batch)
        return cls(tuple(seqs), tuple(outputs), order, tuple(accumulate(len(batch) for batch in batches)))

    @staticmethod
    def column(values: Sequence[int], ctype: Any = ctypes.c_int32) -> Any:
        """`values` as a C array (one element at least, so that no pointer is NULL)."""
        return (ctype * max(len(values), 1))(*values)

    def c_args(self) -> tuple[int, Any, Any, int, Any]:
        """n_tokens, seq, output, n_ubatch, ends as mf_streamer_begin_batch and
        mf_route_trace_begin_batch take them: the tokens in computed order."""
        return (
            len(self.order),
            self.column([self.seqs[i] for i in self.order]),
            self.column([int(self.outputs[i]) for i in self.order], ctypes.c_uint8),
            len(self.ends),
            self.column(self.ends, ctypes.c_int64),
        )
