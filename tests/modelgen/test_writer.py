"""Writing: exact sizes, determinism, split layout, refusals that leave nothing behind."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from server.errors import ModelGenError
from server.modelgen import QType, estimate_size, generate_model, preset, preset_names
from server.modelgen import writer as writer_module
from server.modelgen.layout import plan_layout
from server.modelgen.quant import tensor_chunks
from server.modelgen.spec import TensorSpec
from tests.conftest import TinyModelFactory

TINY = [name for name in preset_names() if name.startswith("tiny-")]
PLENTY = 1 << 40  # an injected free-space probe with room for anything


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tensor_bytes(paths: list[Path]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for path in paths:
        for t in gguf.GGUFReader(path).tensors:
            out[t.name] = t.data.tobytes()
    return out


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("name", TINY)
def test_estimate_size_is_exact(name: str, tiny_model: TinyModelFactory) -> None:
    path = tiny_model(name)
    assert path.stat().st_size == estimate_size(preset(name))


@pytest.mark.parametrize("name", TINY)
def test_file_parses_and_holds_the_planned_tensors(name: str, tiny_model: TinyModelFactory) -> None:
    spec = preset(name)
    reader = gguf.GGUFReader(tiny_model(name))
    plan = plan_layout(spec, Path("x.gguf")).files[0]
    assert [t.name for t in reader.tensors] == [t.name for t in plan.tensors]
    for t, planned in zip(reader.tensors, plan.tensors, strict=True):
        assert tuple(int(n) for n in t.shape) == planned.ne
        assert t.tensor_type.value == planned.qtype.ggml_type
        assert t.data_offset % spec.alignment == 0
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == spec.arch


@pytest.mark.parametrize(
    ("name", "down"),
    [
        ("tiny-qwen3moe", None),
        ("tiny-hyv3", None),
        ("tiny-gptoss", None),
        ("tiny-gemma4", None),
        ("tiny-qwen3moe", QType.Q8_0),
    ],
)
def test_expert_bytes_match_the_expert_slices(
    tiny_model: TinyModelFactory, name: str, down: QType | None
) -> None:
    overrides = {"down_qtype": down} if down else {}  # the plain presets' files are shared
    spec = dataclasses.replace(preset(name), **overrides)
    reader = gguf.GGUFReader(tiny_model(name, **overrides))
    per_layer = []
    for il in range(spec.n_layer):
        experts = [
            t for t in reader.tensors if t.name.startswith(f"blk.{il}.") and t.name.endswith("_exps.weight")
        ]
        per_layer.append(sum(int(t.n_bytes) // spec.n_expert for t in experts))
        assert per_layer[-1] == spec.expert_bytes_of(il)
    assert spec.routed_bytes_per_token == spec.n_expert_used * sum(per_layer)
    assert (len(set(per_layer)) > 1) == (down is not None)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    spec = preset("tiny-gptoss")
    a = generate_model(spec, tmp_path / "a.gguf", seed=7)[0]
    b = generate_model(spec, tmp_path / "b.gguf", seed=7)[0]
    c = generate_model(spec, tmp_path / "c.gguf", seed=8)[0]
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)
    ta, tc = _tensor_bytes([a]), _tensor_bytes([c])
    assert all(ta[name] != tc[name] for name in ta)  # every tensor, not just some, depends on the seed


def test_experts_are_distinct_slices(tiny_model: TinyModelFactory) -> None:
    # a streamer that loads the wrong expert must change the output: no two experts may be equal
    spec = preset("tiny-qwen3moe")
    for t in gguf.GGUFReader(tiny_model("tiny-qwen3moe")).tensors:
        if t.name.endswith("_exps.weight"):
            slices = t.data.reshape(spec.n_expert, -1)
            assert len({s.tobytes() for s in slices}) == spec.n_expert


@pytest.mark.parametrize("qtype", [QType.F16, QType.Q8_0, QType.Q5_0, QType.Q4_0, QType.MXFP4])
def test_weight_spread_matches_the_plan(qtype: QType) -> None:
    # dequantize what the generator wrote and compare with the planned std (zero mean)
    t = TensorSpec("blk.0.ffn_up_exps.weight", (256, 64, 4), qtype, std=0.05)
    data = np.concatenate(list(tensor_chunks(t, seed=3)))
    assert data.nbytes == t.nbytes
    values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype.name]).astype(np.float64)
    tolerance = 0.45 if qtype is QType.MXFP4 else 0.05  # MXFP4 scales are powers of two
    assert abs(values.std() / 0.05 - 1) < tolerance
    assert abs(values.mean()) < 0.05 * 0.05


def test_split_set_holds_the_same_tensors(tmp_path: Path) -> None:
    spec = preset("tiny-qwen3moe")
    whole = generate_model(spec, tmp_path / "whole.gguf")
    parts = generate_model(spec, tmp_path / "model.gguf", split_max_size=2_000_000)
    n = len(parts)
    assert n >= 3
    assert [p.name for p in parts] == [f"model-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert all(p.stat().st_size <= 2_000_000 for p in parts)
    assert not (tmp_path / "model.gguf").exists()
    assert _tensor_bytes(parts) == _tensor_bytes(whole)
    for i, path in enumerate(parts):
        fields = gguf.GGUFReader(path).fields
        assert fields["split.no"].parts[-1][0] == i
        assert fields["split.count"].parts[-1][0] == n
        assert fields["split.tensors.count"].parts[-1][0] == len(
            plan_layout(spec, Path("x.gguf")).files[0].tensors
        )
        assert ("tokenizer.ggml.tokens" in fields) == (i == 0)
    assert sum(p.stat().st_size for p in parts) > estimate_size(spec)  # each file has its own header


def test_split_that_fits_in_one_file_is_a_plain_file(tmp_path: Path) -> None:
    spec = preset("tiny-qwen3moe")
    paths = generate_model(spec, tmp_path / "m.gguf", split_max_size=10**9)
    assert paths == [tmp_path / "m.gguf"]
    assert "split.count" not in gguf.GGUFReader(paths[0]).fields
    assert paths[0].stat().st_size == estimate_size(spec)


def test_split_smaller_than_a_tensor_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ModelGenError, match=r"split_max_size 200000 is smaller than tensor blk\.0\.ffn_gate_exps"
    ):
        generate_model(preset("tiny-qwen3moe"), tmp_path / "m.gguf", split_max_size=200_000)
    assert _listing(tmp_path) == []


def test_no_disk_room_is_refused_before_writing(tmp_path: Path) -> None:
    spec = preset("tiny-qwen3moe")
    asked: list[Path] = []

    def almost_full(directory: Path) -> int:
        asked.append(directory)
        return estimate_size(spec)  # the model itself would fit, the margin would not

    with pytest.raises(ModelGenError, match=rf"not enough free disk space in {tmp_path}: the model needs"):
        generate_model(spec, tmp_path / "m.gguf", disk_free=almost_full)
    assert asked == [tmp_path]
    assert _listing(tmp_path) == []


def test_disk_room_counts_every_split(tmp_path: Path) -> None:
    spec = preset("tiny-qwen3moe")
    total = plan_layout(spec, tmp_path / "m.gguf", 2_000_000).total_size
    need = total + writer_module.DISK_MARGIN_BYTES + int(total * writer_module.DISK_MARGIN_FRACTION)
    with pytest.raises(ModelGenError, match="not enough free disk space"):
        generate_model(spec, tmp_path / "m.gguf", split_max_size=2_000_000, disk_free=lambda _: need - 1)
    assert _listing(tmp_path) == []
    paths = generate_model(spec, tmp_path / "m.gguf", split_max_size=2_000_000, disk_free=lambda _: need)
    assert sum(p.stat().st_size for p in paths) == total


def test_existing_file_is_kept_without_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "m.gguf"
    target.write_bytes(b"precious")
    with pytest.raises(ModelGenError, match=r"m\.gguf already exists; pass --force"):
        generate_model(preset("tiny-qwen3moe"), target)
    assert target.read_bytes() == b"precious"
    assert _listing(tmp_path) == ["m.gguf"]
    generate_model(preset("tiny-qwen3moe"), target, overwrite=True)
    assert target.stat().st_size == estimate_size(preset("tiny-qwen3moe"))


def test_existing_split_member_is_kept_without_overwrite(tmp_path: Path) -> None:
    spec = preset("tiny-qwen3moe")
    n = len(plan_layout(spec, tmp_path / "m.gguf", 2_000_000).files)
    member = tmp_path / f"m-00002-of-{n:05d}.gguf"
    member.write_bytes(b"precious")
    with pytest.raises(ModelGenError, match="already exists"):
        generate_model(spec, tmp_path / "m.gguf", split_max_size=2_000_000)
    assert _listing(tmp_path) == [member.name]


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("m.bin", r"output file name must end in \.gguf"),
        ("missing/m.gguf", r"output directory does not exist"),
    ],
)
def test_bad_output_paths(tmp_path: Path, out: str, message: str) -> None:
    with pytest.raises(ModelGenError, match=message):
        generate_model(preset("tiny-qwen3moe"), tmp_path / out)
    assert _listing(tmp_path) == []


def test_output_path_that_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "d.gguf").mkdir()
    with pytest.raises(ModelGenError, match="is a directory"):
        generate_model(preset("tiny-qwen3moe"), tmp_path / "d.gguf", overwrite=True)


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_bad_seed(tmp_path: Path, seed: Any) -> None:
    with pytest.raises(ModelGenError, match="seed must be a non-negative integer"):
        generate_model(preset("tiny-qwen3moe"), tmp_path / "m.gguf", seed=seed)


@pytest.mark.parametrize("failure", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_interrupted_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    real = tensor_chunks

    def failing(t: TensorSpec, seed: int) -> Iterator[np.ndarray]:
        if t.name == "blk.2.ffn_up_exps.weight":
            raise failure
        yield from real(t, seed)

    monkeypatch.setattr(writer_module, "tensor_chunks", failing)
    with pytest.raises(type(failure)):
        generate_model(preset("tiny-qwen3moe"), tmp_path / "m.gguf", split_max_size=2_000_000)
    assert _listing(tmp_path) == []


def test_overwrite_that_fails_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "m.gguf"
    target.write_bytes(b"old model")

    def failing(t: TensorSpec, seed: int) -> Iterator[np.ndarray]:
        raise RuntimeError("generator failed")
        yield  # pragma: no cover

    monkeypatch.setattr(writer_module, "tensor_chunks", failing)
    with pytest.raises(RuntimeError):
        generate_model(preset("tiny-qwen3moe"), target, overwrite=True)
    assert target.read_bytes() == b"old model"
    assert _listing(tmp_path) == ["m.gguf"]


def test_progress_bar_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    generate_model(preset("tiny-qwen3moe"), tmp_path / "m.gguf", progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "m.gguf" in captured.err and "100%" in captured.err


def test_no_progress_output_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    generate_model(preset("tiny-qwen3moe"), tmp_path / "m.gguf")
    assert capsys.readouterr() == ("", "")


def test_custom_alignment_aligns_every_tensor(tmp_path: Path) -> None:
    spec = dataclasses.replace(preset("tiny-qwen3moe"), alignment=4096)
    path = generate_model(spec, tmp_path / "m.gguf")[0]
    reader = gguf.GGUFReader(path)
    assert all(t.data_offset % 4096 == 0 for t in reader.tensors)
    assert path.stat().st_size == estimate_size(spec)
