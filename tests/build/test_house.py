"""The targets of tests/house.py (`make house`) that are held: no import cycle among server/'s
modules, and the script reads the header's records."""

from __future__ import annotations

from tests import house


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
