"""A local HTTP server that answers as the Hugging Face Hub does, for the real huggingface_hub client.

What huggingface_hub 2.4 asks of the Hub on the plain HTTP path (file_download.py, hf_api.py),
and what this server answers:
- GET /api/models/OWNER/NAME: the model's info, its commit as `sha`; a repository it does not
  hold is a 401 with `X-Error-Code: RepoNotFound`, as the Hub answers an anonymous client.
- GET /api/models/OWNER/NAME/tree/REV?recursive=True: the files (size, git oid, `lfs` with the
  sha256), `PAGE` entries a page, the next page named by a `Link: <...>; rel="next"` header.
- HEAD /OWNER/NAME/resolve/REV/PATH: a 302 to the CDN (another origin, another port here, so
  the client neither follows it nor sends the token there) with `X-Repo-Commit`,
  `X-Linked-Etag` (the sha256), `X-Linked-Size` and the git `ETag`; `X-Error-Code:
  EntryNotFound` with a 404 for a path it does not hold.
- GET /cdn/SHA256 on the CDN's port: the bytes, or with `Range: bytes=N-` a 206 from byte N.
Faults a test sets: `cut_after` (the next CDN answer stops after that many bytes and closes the
connection, then the CDN answers 503 until `cut_after` is None again) and `lie` (a file's bytes
are served, its sha256 advertised is another). Every request is recorded in `requests`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

PAGE = 2  # tree entries a page, so that a repository of a few files is paginated


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class FakeHub:
    """Repositories (repo id -> {path: bytes}) and the faults to inject; `url` (the Hub) and
    `cdn_url` once started."""

    repos: dict[str, dict[str, bytes]]
    url: str = ""
    cdn_url: str = ""
    cut_after: int | None = None
    lie: set[str] = field(default_factory=set)  # paths whose advertised sha256 is wrong
    requests: list[Seen] = field(default_factory=list)
    _cut_done: bool = False

    def heal(self) -> None:
        """No more faults: the CDN answers again."""
        self.cut_after = None
        self._cut_done = False
        self.lie.clear()

    def commit(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def sha256(self, repo: str, path: str) -> str:
        data = self.repos[repo][path]
        if path in self.lie:
            data = data + b"!"
        return hashlib.sha256(data).hexdigest()

    def blob(self, sha: str) -> bytes | None:
        for repo, files in self.repos.items():
            for path, data in files.items():
                if self.sha256(repo, path) == sha:
                    return data
        return None

    def ranges(self, path_fragment: str) -> list[str | None]:
        """The Range headers of the CDN requests so far whose path holds `path_fragment`."""
        return [s.range for s in self.requests if s.path.startswith("/cdn/") and path_fragment in s.path]


def _entry(hub: FakeHub, repo: str, path: str) -> dict[str, object]:
    data = hub.repos[repo][path]
    oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    lfs = {"oid": hub.sha256(repo, path), "size": len(data), "pointerSize": 134}
    return {"type": "file", "oid": oid, "size": len(data), "path": path, "lfs": lfs}


def _tree(hub: FakeHub, repo: str) -> list[dict[str, object]]:
    entries: list[dict[str, object]] = []
    folders = sorted({p.rsplit("/", 1)[0] for p in hub.repos[repo] if "/" in p})
    for folder in folders:
        entries.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": folder})
    entries += [_entry(hub, repo, p) for p in sorted(hub.repos[repo])]
    return entries


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HubHTTPServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"X-Error-Code": code, "Content-Type": "application/json"})

    def _record(self) -> None:
        hub = self.server.hub
        hub.requests.append(
            Seen(self.command, self.path, self.headers.get("Range"), self.headers.get("Authorization"))
        )

    def do_HEAD(self) -> None:
        self._record()
        hub = self.server.hub
        found = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", urlsplit(self.path).path)
        if found is None:
            return self._error(404, "NotFound", "no such route")
        repo, rev, path = found[1], unquote(found[2]), unquote(found[3])
        if repo not in hub.repos:
            return self._error(401, "RepoNotFound", "Repository not found")
        if path not in hub.repos[repo]:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}")
        entry = _entry(hub, repo, path)
        sha = hub.sha256(repo, path)
        self._send(
            302,
            headers={
                "Location": f"{hub.cdn_url}/cdn/{sha}?name={path.rsplit('/', 1)[-1]}",
                "X-Repo-Commit": hub.commit(repo),
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(entry["size"]),
                "ETag": f'"{entry["oid"]}"',
            },
        )

    def do_GET(self) -> None:
        self._record()
        hub = self.server.hub
        split = urlsplit(self.path)
        if split.path.startswith("/cdn/"):
            return self._cdn(split.path.removeprefix("/cdn/"))
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", split.path)
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(/revision/[^/]+)?", split.path)
        route = tree or info
        if route is None:
            return self._error(404, "NotFound", "no such route")
        repo = route[1]
        if repo not in hub.repos:
            return self._error(401, "RepoNotFound", "Repository not found")
        if info is not None:
            siblings = [{"rfilename": p} for p in sorted(hub.repos[repo])]
            body = {"_id": repo, "id": repo, "sha": hub.commit(repo), "siblings": siblings, "private": False}
            return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
        assert tree is not None
        if unquote(tree[2]) not in ("main", hub.commit(repo)):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {tree[2]}")
        entries = _tree(hub, repo)
        cursor = int(parse_qs(split.query).get("cursor", ["0"])[0])
        page = entries[cursor : cursor + PAGE]
        headers = {"Content-Type": "application/json"}
        if cursor + PAGE < len(entries):
            headers["Link"] = f'<{hub.url}{split.path}?recursive=True&cursor={cursor + PAGE}>; rel="next"'
        self._send(200, json.dumps(page).encode(), headers)

    def _cdn(self, sha: str) -> None:
        hub = self.server.hub
        data = hub.blob(sha)
        if data is None:
            return self._error(404, "NotFound", "no such object")
        if hub.cut_after is not None and hub._cut_done:
            return self._error(503, "Unavailable", "the CDN is down")
        start = 0
        asked = self.headers.get("Range")
        if asked is not None:
            start = int(re.fullmatch(r"bytes=(\d+)-", asked)[1])  # type: ignore[index]
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("Accept-Ranges", "bytes")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        body = data[start:]
        if hub.cut_after is not None and not hub._cut_done:
            hub._cut_done = True
            self.wfile.write(body[: hub.cut_after])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


class _HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    hub: FakeHub


@contextlib.contextmanager
def fake_hub(repos: dict[str, dict[str, bytes]]) -> Iterator[FakeHub]:
    """A FakeHub serving `repos`, the Hub and its CDN each on a free loopback port, until the block
    ends."""
    servers = [_HubHTTPServer(("127.0.0.1", 0), _Handler) for _ in ("hub", "cdn")]
    hub_port, cdn_port = (httpd.server_address[1] for httpd in servers)
    hub = FakeHub(repos=repos, url=f"http://127.0.0.1:{hub_port}", cdn_url=f"http://127.0.0.1:{cdn_port}")
    threads = []
    for httpd in servers:
        httpd.hub = hub
        threads.append(threading.Thread(target=httpd.serve_forever, name="fake-hub", daemon=True))
        threads[-1].start()
    try:
        yield hub
    finally:
        for httpd, thread in zip(servers, threads, strict=True):
            httpd.shutdown()
            httpd.server_close()
            thread.join(10)
