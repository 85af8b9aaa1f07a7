"""The repository never reaches outside itself: a user's clone is all there is.

Docs, Makefile, code, tests and committed reports name in-repo files only (the route traces are
in bench/route-traces, the HTTP contract is docs/api.md, the benchmark definitions are
docs/benchmarks.md), and no path of the machine they were written on: no absolute path under a
machine's own trees (checkouts, homes, scratch, mounts), no `../` that climbs out of the
checkout. System interfaces (/usr, /proc, /sys, /dev, /etc) are not a machine's files and are
not checked. vendor/ and node_modules/ hold third-party files and are not checked; neither is
this file, which has to spell the paths it forbids.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve().relative_to(REPO).as_posix()
# a checkout's sibling directory (../shared, ../../shared from a subfolder) or its absolute path
OUTSIDE = re.compile(rb"\.\./shared\b|/work/shared\b")
# an absolute path under a machine's own trees: where checkouts, homes, scratch files and mounts live
MACHINE_ROOTS = rb"work|home|root|Users|mnt|media|tmp|srv|opt|data|scratch"
MACHINE_PATH = re.compile(rb"(?<![\w.~$/-])/(?:" + MACHINE_ROOTS + rb")/[\w.-]+")
# the files that hold such paths on purpose, and which
ALLOWED: dict[str, tuple[bytes, ...]] = {
    "Dockerfile": (b"/home/moeflash",),  # the image's own layout, made by the Dockerfile
    # the recording phone's model path, in the header of a third-party trace kept verbatim
    "bench/route-traces/qwen.route.csv": (b"/data/local",),
    "bench/route-traces/gemma.route.csv": (b"/data/local",),
    # opencode's own scratch directory and an example path of its bash tool's description, in a
    # recorded request kept verbatim
    "tests/agents/sequences/opencode.json": (b"/tmp/opencode", b"/Users/name"),
}
# a relative path that climbs: it must stay inside the checkout
CLIMB = re.compile(rb"(?:\.\./)+[\w.-]*")
# [text](target) in Markdown, the target up to a space, a closing parenthesis or a #fragment
MD_LINK = re.compile(r"\]\(([^)\s#]+)")


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
    ).stdout
    return [
        p
        for p in out.decode().split("\0")
        if p and not p.startswith("vendor/") and "node_modules/" not in p and p != SELF
    ]


def test_no_tracked_file_points_outside_the_repo() -> None:
    offenders = []
    for rel in tracked_files():
        path = REPO / rel
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        for n, line in enumerate(path.read_bytes().splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{rel}:{n}: {line.decode(errors='replace').strip()[:120]}")
    assert not offenders, "files that reach outside the repository:\n" + "\n".join(offenders)


def test_no_tracked_file_holds_a_machine_path() -> None:
    """No absolute path of a machine's trees (the checkout's own included), no `../` out of the
    checkout: what would have caught a training run's directory written into the docs, the
    trainer and the Makefile."""
    offenders = []
    for rel in tracked_files():
        path = REPO / rel
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_bytes().splitlines(), 1):
            where = f"{rel}:{n}: {line.decode(errors='replace').strip()[:120]}"
            for found in MACHINE_PATH.findall(line):
                if not found.startswith(ALLOWED.get(rel, ())):
                    offenders.append(where)
            for climb in CLIMB.findall(line):
                if not (path.parent / climb.decode(errors="replace")).resolve().is_relative_to(REPO):
                    offenders.append(where)
    assert not offenders, "machine paths in tracked files:\n" + "\n".join(dict.fromkeys(offenders))


def test_markdown_links_resolve_inside_the_repo() -> None:
    broken = []
    for rel in tracked_files():
        if not rel.endswith(".md") or not (REPO / rel).is_file():
            continue
        base = (REPO / rel).parent
        for target in MD_LINK.findall((REPO / rel).read_text(encoding="utf-8")):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            resolved = (base / target).resolve()
            if not resolved.is_relative_to(REPO) or not resolved.exists():
                broken.append(f"{rel}: {target}")
    assert not broken, "Markdown links that do not resolve inside the repository:\n" + "\n".join(broken)
