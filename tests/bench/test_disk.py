"""The disk probes (server/bench/disk.py) on a real file system."""

from __future__ import annotations

from pathlib import Path

from server.bench.disk import sequential_read, write_unread


def test_unread_bytes_are_whole_distinct_chunks(tmp_path: Path) -> None:
    path = tmp_path / "probe"
    write_unread(path, 20 << 20, chunk=4 << 20)
    data = path.read_bytes()
    assert len(data) == 20 << 20
    chunks = {data[at : at + (4 << 20)] for at in range(0, len(data), 4 << 20)}
    assert len(chunks) == 5  # no two alike: a deduplicating host could not serve one for another
    got = sequential_read(path, float("inf"), chunk=8 << 20)
    assert got.pattern == "sequential" and got.bytes_total == 20 << 20


def test_a_sequential_read_starts_where_it_is_told(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\1" * (3 << 20))
    got = sequential_read(path, 60.0, chunk=1 << 20, start=(1 << 20) + 100)
    assert got.bytes_total == 2 << 20  # from the page holding the start to the end
