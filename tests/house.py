"""How the house is kept: what is written more than once, and how big its parts are.

`make house` prints, for the tree it runs in:
- each mf_config field and each streamer counter, and how many files write it out as a record's
  field (a C member, an X-macro entry, a Python field or a quoted name in a table);
- the longest functions of server/ (none should pass 80 lines; a data table is a module
  constant, not a function);
- the import cycles among server/'s modules (there should be none);
- lines of code: Python under server/ and tests/, C under streaming_ext/.
tests/build/test_house.py holds the parts that are held as targets (the function length and the
import cycles).
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEADER = REPO / "streaming_ext" / "include" / "moeflash_stream.h"
LONG_FUNCTION = 80


@dataclass(frozen=True)
class Function:
    path: str
    name: str
    lines: int


def _python_files(root: Path) -> Iterator[Path]:
    yield from sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def functions(root: Path = REPO / "server") -> list[Function]:
    """Every function and method under `root`, longest first (its lines from `def` to its end)."""
    found = []
    for path in _python_files(root):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                rel = path.relative_to(root.parent).as_posix()
                found.append(Function(rel, node.name, node.end_lineno - node.lineno + 1))
    return sorted(found, key=lambda f: -f.lines)


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = REPO / "server") -> dict[str, set[str]]:
    """module -> the server modules it imports at run time (TYPE_CHECKING blocks left out)."""
    modules = {_module(p): p for p in _python_files(root)}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {
            id(child)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from package import submodule` needs the submodule, not the package's names
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [node.module, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def config_fields() -> list[str]:
    """The fields of struct mf_config, as the header declares them (an X-macro or the struct)."""
    text = HEADER.read_text(encoding="utf-8")
    macro = re.search(r"#define MF_CONFIG_FIELDS\(X\)(.*?)\n\n", text, re.S)
    if macro:
        return re.findall(r"X\(\s*(\w+)", macro.group(1))
    struct = re.search(r"struct mf_config\s*\{(.*?)\}\s*mf_config;", text, re.S)
    assert struct, "no mf_config in the header"
    body = re.sub(r"/\*.*?\*/|//[^\n]*", "", struct.group(1), flags=re.S)
    return re.findall(r"(\w+)\s*(?:\[[^\]]*\])?\s*;", body)


def counters() -> list[str]:
    """The streamer's counters, as MF_STATS_FIELDS declares them."""
    text = HEADER.read_text(encoding="utf-8")
    macro = re.search(r"#define MF_STATS_FIELDS\(X\)(.*?)\n\n", text, re.S)
    assert macro, "no MF_STATS_FIELDS in the header"
    return re.findall(r"X\(\s*(\w+)", macro.group(1))


def _code() -> list[Path]:
    roots = [REPO / "server", REPO / "streaming_ext"]
    return sorted(
        p
        for root in roots
        for p in root.rglob("*")
        if p.suffix in (".py", ".c", ".h")
        and p.is_file()
        and "__pycache__" not in p.parts
        and p.name != "_declared.py"  # generated from the header by `make ext`
    )


def _declarations(name: str) -> list[re.Pattern[str]]:
    """Where a record's field is written out: a C member or an X-macro entry, a Python field
    (`name: type`, a ctypes `("name", type)`), a quoted name in a table."""
    return [
        re.compile(rf"^\s*[\w\s\*]*\b{name}\s*(\[[^\]]*\])?\s*;", re.M),  # a C member
        re.compile(rf"X\(\s*{name}\b"),
        re.compile(rf"^\s*{name}\s*:", re.M),
        re.compile(rf"[\"']{name}[\"']"),
    ]


def places(names: list[str]) -> dict[str, int]:
    """How many files of server/ and streaming_ext/ write each name out as a record's field."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in _code()]
    return {
        name: sum(1 for text in texts if any(pattern.search(text) for pattern in _declarations(name)))
        for name in names
    }


def lines_of_code() -> dict[str, int]:
    def count(paths: Iterator[Path]) -> int:
        return sum(
            1
            for p in paths
            for line in p.read_text(encoding="utf-8", errors="replace").splitlines()
            if line.strip() and not line.strip().startswith(("#", "//"))
        )

    return {
        "server/ (Python)": count(_python_files(REPO / "server")),
        "tests/ (Python)": count(_python_files(REPO / "tests")),
        "streaming_ext/ (C)": count(
            p for p in (REPO / "streaming_ext").rglob("*") if p.suffix in (".c", ".h")
        ),
    }


def main() -> None:
    fields, stats = places(config_fields()), places(counters())
    print("## mf_config fields: files that write each out as a field")
    print("  " + ", ".join(f"{name} {n}" for name, n in fields.items()))
    print("## streamer counters: files that write each out as a field (of any record of that name)")
    print("  " + ", ".join(f"{name} {n}" for name, n in stats.items()))
    funcs = functions()
    long = [f for f in funcs if f.lines > LONG_FUNCTION]
    print(f"## functions of server/ over {LONG_FUNCTION} lines: {len(long)}")
    for f in funcs[: max(len(long), 5)]:
        print(f"  {f.lines:4d}  {f.path}: {f.name}")
    found = cycles(import_graph())
    print(f"## import cycles among server/'s modules: {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
    print("## lines of code (not blank, not comments)")
    for what, n in lines_of_code().items():
        print(f"  {n:6d}  {what}")


if __name__ == "__main__":
    main()
