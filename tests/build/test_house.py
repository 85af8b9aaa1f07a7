"""The targets of tests/house.py (`make house`) that are held: no function of server/ over
house.LONG_FUNCTION lines, no import cycle among server/'s modules, and the script reads the
header's records."""

from __future__ import annotations

from pathlib import Path

from tests import house


def test_no_function_in_server_is_over_the_limit() -> None:
    found = house.functions()
    assert len(found) > 1000, "the scan missed server/'s functions"
    long = [f"{f.path}: {f.name} ({f.lines} lines)" for f in found if f.lines > house.LONG_FUNCTION]
    assert long == [], f"split these along the steps of their job (a data table is a module constant): {long}"


def test_a_long_function_is_found(tmp_path: Path) -> None:
    root = tmp_path / "server"
    root.mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(house.LONG_FUNCTION))
    (root / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}")
    found = house.functions(root)
    assert [(f.path, f.name, f.lines) for f in found] == [
        ("server/m.py", "long", house.LONG_FUNCTION + 1),
        ("server/m.py", "short", 2),
    ]


def test_no_import_cycle_in_server() -> None:
    graph = house.import_graph()
    assert len(graph) > 100, "the import graph missed server/'s modules"
    assert sum(len(targets) for targets in graph.values()) > 200, "the import graph missed the imports"
    assert house.cycles(graph) == []


def test_a_cycle_is_found() -> None:
    assert house.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_record_fields_are_read_from_the_header() -> None:
    assert {"model_path", "policy", "prefetch"} <= set(house.config_fields())
    assert {"routes", "hits", "misses", "bytes_read"} <= set(house.counters())
    assert all(n >= 1 for n in house.places(house.counters()).values())
