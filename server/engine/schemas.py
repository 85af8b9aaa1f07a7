"""Client JSON Schemas made into schemas the grammar converter compiles: degrade, never fail.

`prepare_schema(schema, where, level)` returns a new schema that llama-cpp-python's converter
(`json_schema_to_gbnf`) turns into a grammar llama.cpp parses without deep recursion, and the
notes of what it changed (the caller logs them in one line):
- annotations (description, title, examples, ...) are dropped; a schema left with nothing that
  constrains (`{"description": ...}`, `true`) means any JSON value;
- keywords the converter does not implement (minimum, multipleOf, not, ...) are dropped, as are
  formats and types it does not know; malformed keyword values too;
- repetition bounds (minLength, maxLength, minItems, maxItems) above `level.max_repeat` are
  relaxed to unbounded: llama.cpp's parser refuses a minimum, and silently drops a maximum,
  above its MAX_REPETITION_THRESHOLD (2000), and each bounded repetition costs one grammar rule
  per count; at lower levels patterns go too;
- nesting deeper than MAX_DEPTH means any value below it, and a $ref that does not resolve in
  the document means any value: the converter and llama.cpp then recurse a bounded depth.
InvalidRequest (a 400) only for what nothing can be made of: a root that is not a schema,
`false` where a value is required.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from server.errors import InvalidRequest

# schema nesting below which everything means "any value": bounds the converter's recursion
# (a few Python frames per level) and the nesting of the grammar's rules
MAX_DEPTH = 32
# llama.cpp's grammar parser (src/llama-grammar.cpp, MAX_REPETITION_THRESHOLD): x{m,n} with
# m above it is refused, with n above it means x{m,}
LLAMA_MAX_REPETITIONS = 2000

# any JSON value, in the converter's terms (it reads {} as "any object")
ANY_VALUE: dict[str, Any] = {"type": ["object", "array", "string", "number", "boolean", "null"]}

_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "example",
        "$schema",
        "$id",
        "id",
        "$comment",
        "$anchor",
        "deprecated",
        "readOnly",
        "writeOnly",
        "markdownDescription",
        "discriminator",
        "strict",
    }
)
_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_FORMATS = frozenset({"date", "time", "date-time"})
_UUID_FORMAT = re.compile(r"^uuid[1-5]?$")
_QUANTIFIER = re.compile(r"\{\d+(,\d*)?\}")
_BOUNDS = ("minLength", "maxLength", "minItems", "maxItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# keywords the converter acts on in a schema without a type
_DISPATCHED = frozenset(
    {
        "$ref",
        "anyOf",
        "oneOf",
        "allOf",
        "const",
        "enum",
        "properties",
        "additionalProperties",
        "items",
        "prefixItems",
        "pattern",
        "format",
    }
)


@dataclass(frozen=True)
class Level:
    """How much of a schema is kept: bounds up to `max_repeat`, patterns if `patterns`."""

    max_repeat: int
    patterns: bool


# tried in order until the grammar is small and shallow enough and compiles in time
LEVELS = (Level(LLAMA_MAX_REPETITIONS, True), Level(100, False), Level(0, False))


@dataclass
class Prepared:
    """The converter's schema and what was changed to get it (empty when nothing was)."""

    schema: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def prepare_schema(schema: Any, where: str, level: Level = LEVELS[0]) -> Prepared:
    """The schema the converter is given for client schema `schema` (at request part `where`)."""
    if schema is False:
        raise InvalidRequest(f"{where} is the schema false: no value can match it", param=where)
    if schema is not True and not isinstance(schema, dict):
        raise InvalidRequest(
            f"{where} must be a JSON Schema object, got {type(schema).__name__}", param=where
        )
    walker = _Walker(where, level)
    out = walker.walk(schema, where, 0)
    walker.fix_refs(out, out, where, 0)
    if "$ref" in out and len(out) > 1:
        # the converter's ref resolver skips the keys beside a $ref, so refs inside a root's
        # $defs stay unresolved: a one-branch anyOf holds the root's $ref instead
        out = {"anyOf": [{"$ref": out.pop("$ref")}], **out}
    return Prepared(out, walker.notes)


def value_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counted up to `limit` + 1 (iterative: any depth)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack and deepest <= limit:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


def is_any(schema: dict[str, Any]) -> bool:
    return schema == ANY_VALUE


class _Walker:
    """One pass over a client schema; `notes` collects what it dropped or relaxed."""

    def __init__(self, param: str, level: Level) -> None:
        self.param = param  # the request part refusals are blamed on; `where` names the place
        self.level = level
        self.notes: list[str] = []

    def note(self, where: str, what: str) -> None:
        self.notes.append(f"{where}: {what}")

    def walk(self, schema: Any, where: str, depth: int) -> dict[str, Any]:
        if schema is True:
            return dict(ANY_VALUE)
        if not isinstance(schema, dict):
            raise InvalidRequest(
                f"{where} must be a JSON Schema (an object or true), got {_kind(schema)}", param=self.param
            )
        if depth > MAX_DEPTH:
            self.note(where, f"nested deeper than {MAX_DEPTH} levels: any value")
            return dict(ANY_VALUE)
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if key in _ANNOTATIONS or key.startswith("x-"):
                continue
            handler = _KEYWORDS.get(key)
            if handler is None:
                self.note(where, f"dropped {key!r} (not supported)")
                continue
            handler(self, out, key, value, f"{where}.{key}", depth)
        if schema.get("nullable") is True and isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        self._check_bounds(out, where)
        return _dispatchable(out)

    # ---- keywords: each writes what it keeps into `out`

    def _type(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        names = [value] if isinstance(value, str) else value if isinstance(value, list) else None
        if names is None or not all(isinstance(n, str) for n in names):
            self.note(where, f"dropped (not a type name or list of them: {_kind(value)})")
            return
        known = [n for n in dict.fromkeys(names) if n in _TYPES]
        if len(known) < len(names):
            self.note(where, f"dropped unknown types {sorted(set(names) - _TYPES)}")
        if known:
            out["type"] = known[0] if len(known) == 1 else known

    def _nullable(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        pass  # applied once the type is known (walk)

    def _ref(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        if isinstance(value, str):
            out["$ref"] = value  # resolved against the prepared document by fix_refs
        else:
            self.note(where, "dropped (not a string)")

    def _defs(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        if not isinstance(value, dict):
            self.note(where, "dropped (not an object)")
            return
        out[key] = {name: self._sub(sub, f"{where}.{name}", depth) for name, sub in value.items()}

    def _schema_list(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        if not isinstance(value, list) or not value:
            self.note(where, "dropped (not a non-empty list of schemas)")
            return
        subs = [self._sub(sub, f"{where}[{i}]", depth) for i, sub in enumerate(value)]
        if key == "allOf":
            self._all_of(out, subs, where)
        elif key != "prefixItems" and any(is_any(sub) for sub in subs):
            out.setdefault("type", list(ANY_VALUE["type"]))  # one branch takes any value
        else:
            out[key] = subs

    def _all_of(self, out: dict[str, Any], subs: list[dict[str, Any]], where: str) -> None:
        # the converter reads allOf as the union of its parts' properties: right for objects only
        if len(subs) == 1:
            for key, value in subs[0].items():
                out.setdefault(key, value)
        elif all("properties" in sub or "$ref" in sub or is_any(sub) for sub in subs):
            out["allOf"] = [sub for sub in subs if not is_any(sub)]
        else:
            self.note(where, "dropped (allOf of parts that are not all objects)")

    def _constant(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        values = [value] if key == "const" else value
        if key == "enum" and (not isinstance(value, list) or not value):
            self.note(where, "dropped (not a non-empty list)")
        elif any(value_depth(v, MAX_DEPTH) > MAX_DEPTH for v in values):
            self.note(where, f"dropped (a value nested deeper than {MAX_DEPTH} levels)")
        else:
            out[key] = value

    def _properties(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        if not isinstance(value, dict):
            self.note(where, "dropped (not an object)")
            return
        props: dict[str, Any] = {}
        for name, sub in value.items():
            if sub is False:
                self.note(f"{where}.{name}", "left out (the schema false: never present)")
                continue
            props[name] = self._sub(sub, f"{where}.{name}", depth)
        out[key] = props

    def _required(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        if isinstance(value, list) and all(isinstance(n, str) for n in value):
            out[key] = list(dict.fromkeys(value))
        else:
            self.note(where, "dropped (not a list of property names)")

    def _additional(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        if isinstance(value, bool):
            out[key] = value
        else:
            sub = self._sub(value, where, depth)
            out[key] = True if is_any(sub) else sub

    def _items(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        if isinstance(value, list):  # the tuple form of drafts before 2020-12
            self._schema_list(out, "prefixItems", value, where, depth)
        elif value is False:  # no items: an empty array
            out[key] = dict(ANY_VALUE)
            out["maxItems"] = 0
        else:
            out[key] = self._sub(value, where, depth)

    def _bound(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value != int(value):
            self.note(where, f"dropped (not a non-negative integer: {value!r})")
        elif value > self.level.max_repeat:
            self.note(where, f"{int(value)} relaxed to unbounded (over {self.level.max_repeat})")
        else:
            out[key] = int(value)

    def _pattern(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        if not isinstance(value, str):
            self.note(where, "dropped (not a string)")
        elif not self.level.patterns:
            self.note(where, "dropped (the grammar was too large or deep with it)")
        elif nested_repetition(value):
            # x{0,n} of a group that can itself repeat (or be empty) gives llama.cpp's grammar
            # n * m ways to stand at each step: its set-up alone runs for minutes
            self.note(where, "dropped (a repetition of a group that repeats)")
        else:
            # the converter takes anchored patterns only; an unanchored one matches anywhere
            out[key] = value if value.startswith("^") and value.endswith("$") else f"^.*(?:{value}).*$"

    def _format(self, out: dict[str, Any], key: str, value: Any, where: str, depth: int) -> None:
        if isinstance(value, str) and (value in _FORMATS or _UUID_FORMAT.match(value)):
            out[key] = value
        else:
            self.note(where, f"dropped format {value!r} (not supported)")

    # ---- helpers

    def _sub(self, schema: Any, where: str, depth: int) -> dict[str, Any]:
        if schema is False:
            raise InvalidRequest(f"{where} is the schema false: no value can match it", param=self.param)
        return self.walk(schema, where, depth + 1)

    def _check_bounds(self, out: dict[str, Any], where: str) -> None:
        for low, high in (("minLength", "maxLength"), ("minItems", "maxItems")):
            if low in out and high in out and out[low] > out[high]:
                self.note(where, f"dropped {low} {out[low]} > {high} {out[high]} (no value fits)")
                del out[low], out[high]

    def fix_refs(self, node: dict[str, Any], doc: dict[str, Any], where: str, depth: int) -> None:
        """Replace each $ref that does not resolve in the prepared document `doc` with any value
        (the converter asserts on those; it resolves "#/..." pointers only)."""
        ref = node.get("$ref")
        if ref is not None and _resolve(doc, ref) is None:
            self.note(where, f"$ref {ref!r} does not resolve here: any value")
            del node["$ref"]
            node.update({k: v for k, v in ANY_VALUE.items() if k not in node})
        for key, value in node.items():
            if key in ("properties", "$defs", "definitions"):
                children = list(value.values())
            elif key in _SCHEMA_LISTS:
                children = value
            else:
                children = [value] if key in ("items", "additionalProperties") else []
            for child in children:
                if isinstance(child, dict) and depth <= MAX_DEPTH:
                    self.fix_refs(child, doc, where, depth + 1)


def nested_repetition(pattern: str) -> bool:
    """Whether a regex repeats a group that holds a repetition: `(a{0,9}){0,9}`, `(b*)+`."""
    repeats = [False]  # per open group: whether it holds a quantifier
    closed_repeats = False  # the group that just closed held one
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        quantifier = c in "*+?" or (c == "{" and _QUANTIFIER.match(pattern, i) is not None)
        if quantifier and not (c == "?" and i > 0 and pattern[i - 1] == "("):
            if closed_repeats:
                return True
            repeats[-1] = True
        closed_repeats = False
        if c == "\\":
            i += 1
        elif c == "[":
            i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            repeats.append(False)
        elif c == ")" and len(repeats) > 1:
            closed_repeats = repeats.pop()
            repeats[-1] = repeats[-1] or closed_repeats
        i += 1
    return False


def _dispatchable(out: dict[str, Any]) -> dict[str, Any]:
    """`out` in a form the converter dispatches on. It reads a type list as a union of bare
    types (dropping every other keyword), and asserts on a schema without a type that has
    none of the keywords it dispatches on (`{"maxLength": 5}`)."""
    kinds = out.get("type")
    rest = {k: v for k, v in out.items() if k not in ("type", "$defs", "definitions")}
    defs = {k: v for k, v in out.items() if k in ("$defs", "definitions")}
    if isinstance(kinds, list) and rest and not ("anyOf" in rest or "oneOf" in rest):
        return {"anyOf": [{"type": kind, **rest} for kind in kinds], **defs}
    # additionalProperties true alone constrains nothing the converter reads
    dispatched = [k for k in rest if k in _DISPATCHED]
    if rest.get("additionalProperties") is True:
        dispatched.remove("additionalProperties")
    if kinds is None and not dispatched:
        return {**ANY_VALUE, **defs}
    return out


def _resolve(doc: dict[str, Any], ref: str) -> dict[str, Any] | None:
    """The schema a local "#/a/b" pointer names in `doc`, or None."""
    if not ref.startswith("#/"):
        return None
    target: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return None
        target = target[part]
    return target if isinstance(target, dict) else None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


_KEYWORDS = {
    "type": _Walker._type,
    "nullable": _Walker._nullable,
    "$ref": _Walker._ref,
    "$defs": _Walker._defs,
    "definitions": _Walker._defs,
    "anyOf": _Walker._schema_list,
    "oneOf": _Walker._schema_list,
    "allOf": _Walker._schema_list,
    "prefixItems": _Walker._schema_list,
    "const": _Walker._constant,
    "enum": _Walker._constant,
    "properties": _Walker._properties,
    "required": _Walker._required,
    "additionalProperties": _Walker._additional,
    "items": _Walker._items,
    "minLength": _Walker._bound,
    "maxLength": _Walker._bound,
    "minItems": _Walker._bound,
    "maxItems": _Walker._bound,
    "pattern": _Walker._pattern,
    "format": _Walker._format,
}
