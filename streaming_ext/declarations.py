"""The C library's declarations as Python: its counters, enums, config fields and functions.

moeflash_stream.h declares each once, and the library reports them back as data:
- MF_STATS_FIELDS (mf_stats_field_*): the counters, each with its kind and unit;
- the enums' member lists (mf_enum_member_*);
- MF_CONFIG_FIELDS (mf_config_field_*): struct mf_config's fields, each with its C type, its kind
  to Python and its default;
- MF_ROUTE_RECORD_FIELDS (mf_route_record_field_*): struct mf_route_record's fields and C types;
- moeflash_stream_functions.h (mf_api_function_*): every exported function as one
  MF_FUNCTION(return type, name, (parameters)) line. The header makes that line the prototype the
  compiler checks the definition against, mf_layout.c makes it a row of the table the library
  reports, and `ctype` below maps each C type of it to ctypes (a type it does not know fails the
  build, naming it). So a function is declared once, for C and for Python, and a library whose
  functions differ from the generated module's is caught by digest like any other declaration;
  parsing the header in Python instead would need the preprocessor (X-macros, MF_API) and would
  not see what the built library holds.

`make ext` runs this file as a script on the library it just built, which writes
streaming_ext/_declared.py: the enums, the counter record (StreamerStats), the options
(StreamerConfig, with the header's defaults), the route record (RouteRecord) and the lists STATS,
CONFIG, RECORD and FUNCTIONS, from which streaming_ext/_lib.py builds the ctypes structs and
signatures. _lib.py refuses a library whose
declarations differ from that module's (a stale build). Run as a script it imports nothing of
streaming_ext, which may not be importable before its output exists.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the C enums, by the name mf_enum_member_* knows them and the Python class generated for each
ENUMS: tuple[tuple[str, str], ...] = (
    ("policy", "Policy"),
    ("prefetch", "Prefetch"),
    ("reader", "Reader"),
    ("rate_class", "RateClass"),
)
KINDS = ("COUNTER", "GAUGE")
UNITS = ("COUNT", "BYTES", "NS", "FLAG")
# a config field's kind: these, or the upper-case name of an enum of ENUMS that it holds
CONFIG_KINDS = ("PATH", "INT", "BOOL", "FLOAT")
# the structs shared with Python, by their C names (pointers to them map to pointers to ctypes structs)
STRUCTS = ("mf_config", "mf_stats", "mf_route_record")

_SCALARS: dict[str, Any] = {
    "bool": ctypes.c_bool,
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "uint8_t": ctypes.c_uint8,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
# pointers Python passes as plain addresses: to opaque handles, and the typedefs of pointers
_HANDLES = ("void", "mf_streamer", "mf_cache", "mf_route_trace", "struct ggml_tensor")
_POINTER_TYPEDEFS = ("ggml_backend_buffer_type_t", "ggml_backend_sched_eval_callback", "mf_predictor")
_TOKEN = re.compile(r"\w+|\*")


@dataclass(frozen=True)
class Stat:
    """One counter of struct mf_stats: its C name, kind (COUNTER: cumulative, a span's value is a
    difference; GAUGE: the value now), unit (COUNT, BYTES, NS, FLAG) and description."""

    name: str
    kind: str
    unit: str
    text: str


@dataclass(frozen=True)
class EnumMember:
    name: str
    value: int
    text: str


@dataclass(frozen=True)
class ConfigField:
    """One field of struct mf_config: its C name and type, its kind (CONFIG_KINDS or the
    upper-case name of the enum it holds), its default (the C double the library reports) and
    description."""

    name: str
    c_type: str
    kind: str
    default: float
    text: str

    def c_value(self, value: float) -> int | float:
        """`value` (a StreamerConfig field's: an int, bool, float or enum member) as ctypes takes it."""
        return float(value) if self.kind == "FLOAT" else int(value)


@dataclass(frozen=True)
class RecordField:
    """One field of struct mf_route_record: its C name and type, and description."""

    name: str
    c_type: str
    text: str


@dataclass(frozen=True)
class Function:
    """One exported function: its name, return type and parameter types, as canonical C types
    ("const char *", "mf_streamer **")."""

    name: str
    returns: str
    params: tuple[str, ...]


@dataclass(frozen=True)
class Declarations:
    stats: tuple[Stat, ...]
    enums: tuple[tuple[str, tuple[EnumMember, ...]], ...]
    config: tuple[ConfigField, ...]
    record: tuple[RecordField, ...]
    functions: tuple[Function, ...]

    def digest(self) -> str:
        """A fingerprint of everything declared: equal digests, equal declarations."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]


def canonical_type(text: str) -> str:
    """A C type as written ("const mf_config*") in one spelling ("const mf_config *")."""
    tokens = _TOKEN.findall(text)
    words, stars = [t for t in tokens if t != "*"], "*" * tokens.count("*")
    return " ".join(words) + (" " + stars if stars else "")


def parse_params(text: str) -> tuple[str, ...]:
    """The parameter types of a C parameter list as the library reports it ("(int32_t i)")."""
    inner = text.strip().removeprefix("(").removesuffix(")").strip()
    if inner in ("", "void"):
        return ()
    types: list[str] = []
    for param in inner.split(","):
        tokens = _TOKEN.findall(param)
        # a type and a name, nothing else (no arrays, no function pointers: typedef them)
        if not re.fullmatch(r"[\w\s*]+", param) or len(tokens) < 2 or tokens[-1] == "*":
            raise ValueError(f"parameter {param.strip()!r} of {text} is not `type name`")
        types.append(canonical_type(" ".join(tokens[:-1])))
    return tuple(types)


def ctype(c_type: str, structs: Mapping[str, type[ctypes.Structure]]) -> Any:
    """The ctypes type of a canonical C type (None for void). `structs` maps the C names of the
    shared structs to their ctypes classes. ValueError for a type with no mapping here."""
    base = c_type.removeprefix("const ")
    stars = base.count("*")
    base = base.rstrip(" *")
    if stars == 0 and base == "void":
        return None
    if stars == 0 and base in _SCALARS:
        return _SCALARS[base]
    if stars == 0 and base in _POINTER_TYPEDEFS:
        return ctypes.c_void_p
    if stars == 1 and base == "char":
        return ctypes.c_char_p
    if stars == 1 and base in _HANDLES:
        return ctypes.c_void_p
    if stars == 1 and base in _SCALARS:
        return ctypes.POINTER(_SCALARS[base])
    if stars == 1 and base in structs:
        return ctypes.POINTER(structs[base])
    if stars == 2 and base in _HANDLES and base != "void":
        return ctypes.POINTER(ctypes.c_void_p)
    raise ValueError(f"no ctypes type for the C type {c_type!r}: map it in streaming_ext/declarations.py")


def declare_functions(
    cdll: ctypes.CDLL, functions: Iterable[Function], structs: Mapping[str, type[ctypes.Structure]]
) -> None:
    """Set argtypes and restype of each function on `cdll` (AttributeError for one it lacks)."""
    for function in functions:
        fn = getattr(cdll, function.name)
        fn.argtypes = [ctype(p, structs) for p in function.params]
        fn.restype = ctype(function.returns, structs)


# the functions that report the others: their signatures, the only ones written out in Python,
# are checked against the library's own report of them (read_functions)
_REPORTERS = (
    Function("mf_api_n_functions", "int32_t", ()),
    Function("mf_api_function_name", "const char *", ("int32_t",)),
    Function("mf_api_function_returns", "const char *", ("int32_t",)),
    Function("mf_api_function_params", "const char *", ("int32_t",)),
)


def placeholder_structs() -> dict[str, type[ctypes.Structure]]:
    """Empty ctypes structs under the shared structs' C names: enough to map the types of functions
    that are not called with them (at build time, before the real ones exist)."""
    return {name: type(name, (ctypes.Structure,), {"_fields_": []}) for name in STRUCTS}


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode()


def read_functions(cdll: ctypes.CDLL) -> tuple[Function, ...]:
    """The library's functions as it reports them (mf_api_function_*), every type mapped to ctypes."""
    declare_functions(cdll, _REPORTERS, {})
    functions: list[Function] = []
    for i in range(int(cdll.mf_api_n_functions())):
        name, returns, params = (
            _text(getattr(cdll, f"mf_api_function_{part}")(i)) for part in ("name", "returns", "params")
        )
        if name is None or returns is None or params is None:
            raise ValueError(f"function {i} ({name}) is not a declaration")
        functions.append(Function(name, canonical_type(returns), parse_params(params)))
    reported = {f.name: f for f in functions}
    for reporter in _REPORTERS:
        if reported.get(reporter.name) != reporter:
            raise ValueError(
                f"{reporter.name} is declared {reported.get(reporter.name)} in C, {reporter} here"
            )
    placeholders = placeholder_structs()
    for function in functions:
        for c_type in (function.returns, *function.params):
            ctype(c_type, placeholders)
    return tuple(functions)


def check_config_field(field: ConfigField, enums: Mapping[str, tuple[EnumMember, ...]]) -> None:
    """ValueError when Python cannot hold `field` as declared (`enums`: members by kind)."""
    integer = field.c_type in ("int32_t", "int64_t", "uint32_t", "uint64_t")
    wanted = {"PATH": field.c_type == "const char *", "FLOAT": field.c_type in ("float", "double")}
    problem = ""
    if field.kind not in (*CONFIG_KINDS, *enums):
        problem = f"kind {field.kind} is none of {CONFIG_KINDS} or an enum's name"
    elif not wanted.get(field.kind, integer):
        problem = f"kind {field.kind} cannot be held in a {field.c_type}"
    elif field.kind in ("INT", "BOOL", *enums) and field.default != int(field.default):
        problem = f"default {field.default} is not an integer"
    elif field.kind == "BOOL" and field.default not in (0, 1):
        problem = f"default {field.default} is not 0 or 1"
    elif field.kind in enums and int(field.default) not in {m.value for m in enums[field.kind]}:
        problem = f"default {field.default} is no member of enum mf_{field.kind.lower()}"
    if problem:
        raise ValueError(f"mf_config.{field.name}: {problem}")


def read_declarations(cdll: ctypes.CDLL) -> Declarations:
    """The declarations as the library reports them; every function of it must have been declared
    (declare_functions) first."""
    functions = read_functions(cdll)
    stats: list[Stat] = []
    for i in range(int(cdll.mf_stats_n_fields())):
        name, kind, unit, text = (
            _text(getattr(cdll, f"mf_stats_field_{part}")(i)) for part in ("name", "kind", "unit", "text")
        )
        if name is None or kind not in KINDS or unit not in UNITS or text is None:
            raise ValueError(f"counter {i} ({name}) has kind {kind} and unit {unit}: not a declaration")
        stats.append(Stat(name, str(kind), str(unit), text))
    enums: list[tuple[str, tuple[EnumMember, ...]]] = []
    for c_name, _ in ENUMS:
        members: list[EnumMember] = []
        while (member := _text(cdll.mf_enum_member_name(c_name.encode(), len(members)))) is not None:
            value = int(cdll.mf_enum_member_value(c_name.encode(), len(members)))
            text = _text(cdll.mf_enum_member_text(c_name.encode(), len(members))) or ""
            members.append(EnumMember(member, value, text))
        if not members:
            raise ValueError(f"the library declares no members of enum mf_{c_name}")
        enums.append((c_name, tuple(members)))
    config: list[ConfigField] = []
    for i in range(int(cdll.mf_config_n_fields())):
        name, c_type, kind, text = (
            _text(getattr(cdll, f"mf_config_field_{part}")(i)) for part in ("name", "type", "kind", "text")
        )
        if name is None or c_type is None or kind is None or text is None:
            raise ValueError(f"config field {i} ({name}) is not a declaration")
        field = ConfigField(name, canonical_type(c_type), kind, float(cdll.mf_config_field_default(i)), text)
        check_config_field(field, {c_name.upper(): members for c_name, members in enums})
        config.append(field)
    record: list[RecordField] = []
    for i in range(int(cdll.mf_route_record_n_fields())):
        name, c_type, text = (
            _text(getattr(cdll, f"mf_route_record_field_{part}")(i)) for part in ("name", "type", "text")
        )
        if name is None or c_type not in ("int32_t", "float") or text is None:
            raise ValueError(f"route record field {i} ({name}) of type {c_type}: not a declaration")
        record.append(RecordField(name, str(c_type), text))
    return Declarations(tuple(stats), tuple(enums), tuple(config), tuple(record), functions)


def _doc(text: str) -> str:
    return f'"""{text}"""' if '"' not in text and "\\" not in text else repr(text)


def _option(field: ConfigField, decls: Declarations) -> tuple[str, str]:
    """A StreamerConfig field's Python type and default, as source."""
    classes = dict(ENUMS)
    for c_name, members in decls.enums:
        if field.kind == c_name.upper():
            member = next(m for m in members if m.value == int(field.default))
            return classes[c_name], f"{classes[c_name]}.{member.name}"
    if field.kind == "BOOL":
        return "bool", repr(bool(field.default))
    if field.kind == "FLOAT":
        return "float", repr(field.default)
    return "int", repr(int(field.default))


def render(decls: Declarations) -> str:
    """The source of streaming_ext/_declared.py for these declarations."""
    out = [
        '"""Generated by `make ext` (streaming_ext/declarations.py) from the library\'s declarations in',
        "streaming_ext/include/moeflash_stream.h (MF_STATS_FIELDS, MF_CONFIG_FIELDS, the enum member lists,",
        'moeflash_stream_functions.h): do not edit.\n"""',
        "",
        "from __future__ import annotations",
        "",
        "from dataclasses import dataclass",
        "from enum import IntEnum",
        "",
        "from streaming_ext.declarations import ConfigField, Function, RecordField, Stat",
        "from streaming_ext.stats import StatsRecord",
        "",
        f'DIGEST = "{decls.digest()}"',
    ]
    classes = dict(ENUMS)
    for c_name, members in decls.enums:
        out += ["", "", f"class {classes[c_name]}(IntEnum):", f'    """enum mf_{c_name}."""', ""]
        for m in members:
            out.append(f"    {m.name} = {m.value}  # {m.text}")
        texts = ", ".join(f"{m.value}: {m.text!r}" for m in members)
        out += [
            "",
            "    @property",
            "    def text(self) -> str:",
            '        """The member\'s description in moeflash_stream.h."""',
            f"        texts = {{{texts}}}",
            "        return texts[self.value]",
        ]
    out += ["", "", "STATS: tuple[Stat, ...] = ("]
    out += [f"    Stat({s.name!r}, {s.kind!r}, {s.unit!r}, {s.text!r})," for s in decls.stats]
    out += [")", "", "CONFIG: tuple[ConfigField, ...] = ("]
    out += [
        f"    ConfigField({f.name!r}, {f.c_type!r}, {f.kind!r}, {f.default!r}, {f.text!r}),"
        for f in decls.config
    ]
    out += [")", "", "RECORD: tuple[RecordField, ...] = ("]
    out += [f"    RecordField({f.name!r}, {f.c_type!r}, {f.text!r})," for f in decls.record]
    out += [")", "", "FUNCTIONS: tuple[Function, ...] = ("]
    out += [f"    Function({f.name!r}, {f.returns!r}, {f.params!r})," for f in decls.functions]
    out += [
        ")",
        "",
        "",
        "@dataclass(frozen=True)",
        "class StreamerStats(StatsRecord):",
        '    """struct mf_stats: the counters, under their C names and in their C order."""',
        "",
    ]
    for s in decls.stats:
        out.append(f"    {s.name}: int")
        out.append(f"    {_doc(f'{s.kind.lower()}, {s.unit.lower()}: {s.text}')}")
    out += ["", "    @classmethod", "    def declared(cls) -> tuple[Stat, ...]:", "        return STATS", ""]
    out += [
        "",
        "@dataclass(frozen=True)",
        "class StreamerConfig:",
        "    \"\"\"struct mf_config's options with the header's defaults: every field but the model's path",
        "    (Streamer's argument). The expert budget is not one of them: Streamer.set_budget sets it.",
        '    """',
        "",
    ]
    for f in decls.config:
        if f.kind != "PATH":
            py_type, default = _option(f, decls)
            out += [f"    {f.name}: {py_type} = {default}", f"    {_doc(f.text)}"]
    out += [
        "",
        "",
        "@dataclass(frozen=True)",
        "class RouteRecord:",
        '    """struct mf_route_record: one routed expert, as a route tracer records it."""',
        "",
    ]
    for r in decls.record:
        out += [f"    {r.name}: {'float' if r.c_type == 'float' else 'int'}", f"    {_doc(r.text)}"]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    """declarations.py LIBRARY OUTPUT: write OUTPUT (streaming_ext/_declared.py) for LIBRARY."""
    if len(argv) != 2:
        print("usage: declarations.py LIBRARY OUTPUT", file=sys.stderr)
        return 2
    import llama_cpp  # noqa: F401  # loads libllama/libggml, which the library links against

    cdll = ctypes.CDLL(argv[0])
    declare_functions(cdll, read_functions(cdll), placeholder_structs())
    Path(argv[1]).write_text(render(read_declarations(cdll)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
