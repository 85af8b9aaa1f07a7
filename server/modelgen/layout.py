"""Where every byte goes: the file set (one file or a gguf-split set), headers, offsets, sizes.

Everything here is computed before anything is written, so the total size is exact (for the
disk-room check and `estimate_size`) and the writer only has to stream tensor data.

Split layout, as llama.cpp's loader expects (src/llama-model-loader.cpp, llama_split_path):
files `<stem>-00001-of-0000N.gguf`, ...; the first holds all metadata, every file holds
split.no (u16), split.count (u16) and split.tensors.count (i32) plus general.alignment (each
file's data section is parsed with its own alignment); tensors are never cut, and files are
filled greedily in tensor order up to `split_max_size` bytes per file (header included).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from gguf import GGUFValueType

from server.errors import ModelGenError
from server.modelgen.archs import model_kvs, tensor_plan
from server.modelgen.gguf_format import KV, TensorInfo, encode_header, pad_to
from server.modelgen.spec import ModelSpec, TensorSpec
from server.modelgen.tokenizer import Vocab, build_vocab

# gguf-split caps: split.no / split.count are u16, and the file names carry 5 digits
MAX_SPLITS = 65535
GGUF_SUFFIX = ".gguf"


@dataclasses.dataclass(frozen=True)
class PlannedFile:
    """One output file: final path, header bytes, the tensors of its data section."""

    path: Path
    header: bytes
    tensors: tuple[TensorSpec, ...]
    infos: tuple[TensorInfo, ...]
    size: int  # bytes: header + every tensor padded to the alignment


@dataclasses.dataclass(frozen=True)
class Layout:
    spec: ModelSpec
    vocab: Vocab
    files: tuple[PlannedFile, ...]

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def paths(self) -> list[Path]:
        return [f.path for f in self.files]


def split_paths(out: Path, count: int) -> list[Path]:
    """The names llama.cpp derives for `count` splits of `out`: x.gguf -> x-00001-of-0000N.gguf, ..."""
    stem = out.name[: -len(GGUF_SUFFIX)] if out.name.endswith(GGUF_SUFFIX) else out.name
    return [out.with_name(f"{stem}-{i:05d}-of-{count:05d}{GGUF_SUFFIX}") for i in range(1, count + 1)]


def plan_layout(
    spec: ModelSpec, out: Path, split_max_size: int | None = None, vocab: Vocab | None = None
) -> Layout:
    """The complete file plan for `spec` written to `out` (split when split_max_size is given).

    `vocab` (default: the synthetic one) is the tokenizer written; a trained model brings its own.
    """
    if vocab is None:
        vocab = build_vocab(spec.arch, spec.n_vocab)
    elif len(vocab.tokens) != spec.n_vocab:
        raise ModelGenError(f"the vocabulary has {len(vocab.tokens)} tokens, the model {spec.n_vocab}")
    tensors = tensor_plan(spec)
    kvs = model_kvs(spec, vocab)
    align = spec.alignment
    if split_max_size is None:
        return Layout(spec, vocab, (_planned_file(out, kvs, tensors, align),))

    if isinstance(split_max_size, bool) or not isinstance(split_max_size, int) or split_max_size < 1:
        raise ModelGenError(f"split_max_size must be a positive number of bytes (got {split_max_size!r})")
    groups = _group_tensors(tensors, kvs, align, split_max_size)
    if len(groups) == 1:
        # everything fits in one file: write a plain, unsplit GGUF like gguf-split does
        return Layout(spec, vocab, (_planned_file(out, kvs, tensors, align),))
    if len(groups) > MAX_SPLITS:
        raise ModelGenError(
            f"split_max_size {split_max_size} would need {len(groups)} files (max {MAX_SPLITS})"
        )
    paths = split_paths(out, len(groups))
    files = []
    for i, (path, group) in enumerate(zip(paths, groups, strict=True)):
        file_kvs = [*(kvs if i == 0 else [_alignment_kv(align)]), *_split_kvs(i, len(groups), len(tensors))]
        files.append(_planned_file(path, file_kvs, group, align))
        if files[-1].size > split_max_size:  # _group_tensors guarantees this; keep it honest
            raise AssertionError(f"planned split {path.name} is {files[-1].size} > {split_max_size} bytes")
    return Layout(spec, vocab, tuple(files))


def _alignment_kv(align: int) -> KV:
    return KV("general.alignment", GGUFValueType.UINT32, align)


def _split_kvs(index: int, count: int, n_tensors: int) -> list[KV]:
    return [
        KV("split.no", GGUFValueType.UINT16, index),
        KV("split.count", GGUFValueType.UINT16, count),
        KV("split.tensors.count", GGUFValueType.INT32, n_tensors),
    ]


def _info_size(t: TensorSpec) -> int:
    # name (u64 length + bytes), n_dims u32, ne u64 each, type u32, offset u64
    return 8 + len(t.name.encode("utf-8")) + 4 + 8 * len(t.ne) + 4 + 8


def _group_tensors(
    tensors: Sequence[TensorSpec], kvs: Sequence[KV], align: int, max_size: int
) -> list[list[TensorSpec]]:
    """Greedy split of `tensors` into files of at most `max_size` bytes each."""
    # split KV values have fixed widths, so their encoded size does not depend on the values
    split_kv_bytes = sum(len(kv.encode()) for kv in _split_kvs(0, 1, 1))
    first_kv = sum(len(kv.encode()) for kv in kvs) + split_kv_bytes
    other_kv = len(_alignment_kv(align).encode()) + split_kv_bytes

    def file_size(kv_bytes: int, info_bytes: int, data_bytes: int) -> int:
        # magic + version + tensor count + kv count = 24 bytes
        return pad_to(24 + kv_bytes + info_bytes, align) + data_bytes

    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    info_bytes = data_bytes = 0
    for t in tensors:
        kv = first_kv if not groups else other_kv
        t_info, t_data = _info_size(t), pad_to(t.nbytes, align)
        if current and file_size(kv, info_bytes + t_info, data_bytes + t_data) > max_size:
            groups.append(current)
            current, info_bytes, data_bytes = [], 0, 0
            kv = other_kv
        if not current and file_size(kv, t_info, t_data) > max_size:
            raise ModelGenError(
                f"split_max_size {max_size} is smaller than tensor {t.name} "
                f"({file_size(kv, t_info, t_data)} bytes in a file of its own); "
                "tensors are never cut across files"
            )
        current.append(t)
        info_bytes += t_info
        data_bytes += t_data
    groups.append(current)
    return groups


def _planned_file(path: Path, kvs: Sequence[KV], tensors: Sequence[TensorSpec], align: int) -> PlannedFile:
    infos = []
    offset = 0
    for t in tensors:
        infos.append(TensorInfo(t.name, t.ne, t.qtype.ggml_type, offset))
        offset += pad_to(t.nbytes, align)
    header = encode_header(kvs, infos, align)
    return PlannedFile(path, header, tuple(tensors), tuple(infos), len(header) + offset)
