"""Minimal valid instances of the pinned SDKs' own request types, read from the packages.

`members(union)` lists a union's member types (TypedDicts of the SDKs' *Param modules, or the
pydantic models of their response types); `minimal(member)` builds the smallest value that type
accepts: its required fields only, the first member of every union field, one element in every
required list. `variants(member)` adds one value per alternative of each union field the
minimal value passes through (a document's plain-text source beside its PDF one). Every string
is a marker naming where it sits (`FunctionCallOutput.output`), so a test finds it in the prompt.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin

import pydantic
import typing_extensions as te

_WRAPPERS = (te.Required, te.NotRequired, te.Annotated, typing.Annotated, te.ReadOnly)
_LISTS = (list, collections.abc.Iterable, collections.abc.Sequence)


def _bare(tp: Any) -> Any:
    while get_origin(tp) in _WRAPPERS:
        tp = get_args(tp)[0]
    return tp


def members(union: Any) -> list[Any]:
    """The member types of `union` (nested unions flattened, None left out)."""
    tp = _bare(union)
    if get_origin(tp) in (Union, types.UnionType):
        return [m for arg in get_args(tp) for m in members(arg)]
    return [] if tp is type(None) else [tp]


def _fields(tp: Any) -> dict[str, tuple[Any, bool]]:
    """A TypedDict's or a model's fields: name -> (type, required)."""
    if te.is_typeddict(tp):
        hints = typing.get_type_hints(tp, include_extras=True)
        total = getattr(tp, "__total__", True)
        return {
            name: (
                hint,
                get_origin(hint) is te.Required or (total and get_origin(hint) is not te.NotRequired),
            )
            for name, hint in hints.items()
        }
    assert isinstance(tp, type) and issubclass(tp, pydantic.BaseModel), tp
    return {f.alias or name: (f.annotation, f.is_required()) for name, f in tp.model_fields.items()}


def type_tag(member: Any) -> str | None:
    """The `type` literal a member declares (None where it has none, or several)."""
    hint = _fields(member).get("type")
    if hint is None:
        return None
    args = get_args(_bare(hint[0]))
    return str(args[0]) if get_origin(_bare(hint[0])) is Literal and len(args) == 1 else None


class _NoValue(Exception):
    """A type no JSON value is made of (a file object): an alternative to pass over."""


def _value(tp: Any, where: str, pick: dict[str, int]) -> Any:
    tp = _bare(tp)
    origin = get_origin(tp)
    if tp is str or tp is object or tp is Any:
        return where
    if tp is bool:
        return False
    if tp in (int, float):
        return tp(1)
    if origin is Literal:
        return get_args(tp)[0]
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if where in pick:
            return _value(options[pick[where] % len(options)], where, pick)
        for option in options:
            try:
                return _value(option, where, pick)
            except _NoValue:
                continue
        raise _NoValue(where)
    if origin in _LISTS:
        return [_value(get_args(tp)[0], f"{where}.0", pick)]
    if origin in (dict, collections.abc.Mapping):
        return {}
    if not (te.is_typeddict(tp) or (isinstance(tp, type) and issubclass(tp, pydantic.BaseModel))):
        raise _NoValue(where)
    return {
        name: _value(hint, f"{where}.{name}", pick)
        for name, (hint, required) in _fields(tp).items()
        if required
    }


def minimal(member: Any) -> dict[str, Any]:
    """The smallest valid value of `member`, its strings markers of where they sit."""
    value = _value(member, member.__name__, {})
    assert isinstance(value, dict)
    return value


def _unions(tp: Any, where: str, pick: dict[str, int]) -> Iterator[tuple[str, int]]:
    """(place, number of alternatives) of each union the value at `where` passes through."""
    tp = _bare(tp)
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if len(options) > 1:
            yield where, len(options)
        yield from _unions(options[pick.get(where, 0) % len(options)], where, pick)
    elif origin in _LISTS:
        yield from _unions(get_args(tp)[0], f"{where}.0", pick)
    elif te.is_typeddict(tp) or (isinstance(tp, type) and issubclass(tp, pydantic.BaseModel)):
        for name, (hint, required) in _fields(tp).items():
            if required:
                yield from _unions(hint, f"{where}.{name}", pick)


def variants(member: Any) -> list[dict[str, Any]]:
    """`minimal(member)` and one value more per other alternative of each union it passes through."""
    out = [minimal(member)]
    for where, count in _unions(member, member.__name__, {}):
        for k in range(1, count):
            try:
                value = _value(member, member.__name__, {where: k})
            except _NoValue:
                continue
            if value not in out:
                out.append(value)
    return out


def markers(value: Any, prefix: str, skip: frozenset[str]) -> list[str]:
    """The marker strings of `value` (those starting with `prefix`) under no key in `skip`."""
    if isinstance(value, dict):
        return [m for k, v in value.items() if k not in skip for m in markers(v, prefix, skip)]
    if isinstance(value, list):
        return [m for v in value for m in markers(v, prefix, skip)]
    return [value] if isinstance(value, str) and value.startswith(prefix) else []
