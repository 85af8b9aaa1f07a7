"""The structs shared by C and ctypes (mf_config, mf_stats, mf_route_record) have one layout.

The library reports each struct's size, field count and every field's offset by name
(streaming_ext/src/mf_layout.c, whose static assertions make its field lists complete: a field
added to a C struct but not to its list fails the build). These tests compare them with the ctypes
declarations in streaming_ext/_lib.py, so a field added, removed, renamed or moved on one side
only fails here, and `load_library()` refuses such a library.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import pytest

from server.settings import ModelSettings
from streaming_ext import StreamerConfig, StreamLibError, _lib, load_library
from streaming_ext._lib import SHARED_STRUCTS, layout_mismatches

STRUCTS = [pytest.param(name, struct, id=name) for name, struct in SHARED_STRUCTS]


@pytest.fixture(scope="module")
def cdll() -> ctypes.CDLL:
    return load_library().cdll


def c_call(cdll: ctypes.CDLL, name: str, *args: Any) -> int:
    return int(getattr(cdll, name)(*args))


def fields_of(struct: type[ctypes.Structure]) -> list[tuple[str, Any]]:
    return [(field[0], field[1]) for field in struct._fields_]


def make_struct(fields: list[tuple[str, Any]]) -> type[ctypes.Structure]:
    return type("Variant", (ctypes.Structure,), {"_fields_": fields})


@pytest.mark.parametrize(("name", "struct"), STRUCTS)
def test_size_and_field_count_match(cdll: ctypes.CDLL, name: str, struct: type[ctypes.Structure]) -> None:
    assert c_call(cdll, f"mf_{name}_size") == ctypes.sizeof(struct)
    assert c_call(cdll, f"mf_{name}_n_fields") == len(struct._fields_)


@pytest.mark.parametrize(("name", "struct"), STRUCTS)
def test_every_field_sits_at_its_c_offset(
    cdll: ctypes.CDLL, name: str, struct: type[ctypes.Structure]
) -> None:
    offsets = {field: c_call(cdll, f"mf_{name}_offset", field.encode()) for field, _ in fields_of(struct)}
    assert offsets == {field: getattr(struct, field).offset for field, _ in fields_of(struct)}


@pytest.mark.parametrize(("name", "struct"), STRUCTS)
def test_ctypes_struct_has_no_padding(name: str, struct: type[ctypes.Structure]) -> None:
    # the C structs have none (mf_layout.c asserts it), so every byte is a field on both sides
    assert sum(ctypes.sizeof(kind) for _, kind in fields_of(struct)) == ctypes.sizeof(struct), name


@pytest.mark.parametrize(
    ("name", "field"),
    [
        pytest.param("stats", "wait_ns", id="stats-old-wait_ns"),
        pytest.param("stats", "manage_ns", id="stats-old-manage_ns"),
        pytest.param("stats", "prefetch_used", id="stats-old-prefetch_used"),
        pytest.param("stats", "memory_bytes", id="stats-old-memory_bytes"),
        pytest.param("config", "budget_bytes", id="config-old-budget_bytes"),
        pytest.param("config", "no_prefetch", id="config-old-no_prefetch"),
        pytest.param("config", "", id="config-empty"),
    ],
)
def test_unknown_field_has_no_offset(cdll: ctypes.CDLL, name: str, field: str) -> None:
    assert c_call(cdll, f"mf_{name}_offset", field.encode()) == -1


def _variants(struct: type[ctypes.Structure]) -> dict[str, list[tuple[str, Any]]]:
    fields = fields_of(struct)
    return {
        "field-added-at-the-end": [*fields, ("extra", ctypes.c_uint64)],
        "int32-added-at-the-end": [*fields, ("extra", ctypes.c_int32)],
        "field-added-in-front": [("extra", ctypes.c_uint64), *fields],
        "last-field-dropped": fields[:-1],
        "first-two-swapped": [fields[1], fields[0], *fields[2:]],
        "field-renamed": [
            (fields[-1][0] + "_x", fields[-1][1]) if i == len(fields) - 1 else f for i, f in enumerate(fields)
        ],
    }


VARIANTS = [
    pytest.param(name, variant, fields, id=f"{name}-{variant}")
    for name, struct in SHARED_STRUCTS
    for variant, fields in _variants(struct).items()
]


@pytest.mark.parametrize(("name", "variant", "fields"), VARIANTS)
def test_a_change_on_one_side_only_is_reported(
    cdll: ctypes.CDLL, name: str, variant: str, fields: list[tuple[str, Any]]
) -> None:
    assert layout_mismatches(cdll, name, make_struct(fields)), variant


@pytest.mark.parametrize(("name", "struct"), STRUCTS)
def test_the_declared_structs_match(cdll: ctypes.CDLL, name: str, struct: type[ctypes.Structure]) -> None:
    assert layout_mismatches(cdll, name, struct) == []


def test_load_library_refuses_a_layout_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = make_struct([*fields_of(_lib.MfStats), ("extra", ctypes.c_uint64)])
    monkeypatch.setattr(_lib, "SHARED_STRUCTS", (("config", _lib.MfConfig), ("stats", extra)))
    with pytest.raises(StreamLibError, match=r"does not match streaming_ext/_lib\.py.*mf_stats.*make ext"):
        load_library()


def test_streamer_config_has_no_budget_and_overlap_is_on() -> None:
    # the budget is set with Streamer.set_budget; overlap is on by default, as in the server
    names = {field.name for field in dataclasses.fields(StreamerConfig)}
    assert "budget_bytes" not in names
    assert StreamerConfig().overlap is True
    assert ModelSettings.model_fields["overlap"].default is True
