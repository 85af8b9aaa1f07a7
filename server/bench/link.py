"""A link between two processes on this machine, shaped in user space and measured.

This machine's kernel has no `netem`, and no shaping proxy is packaged here (Debian's `trickle`
shapes bandwidth but adds no delay), so the RPC benchmark puts this relay between the main server
and its helper: every chunk one side sends leaves after the link's serialization time (a FIFO at
`rate_bps`) and arrives `delay_s` later, in order, each direction on its own; with rate 0 and
delay 0 it is a plain relay (the loopback, with the relay's own cost). It records every chunk
(its time on CLOCK_MONOTONIC, which other processes read too, its direction and size), so a run
can count the bytes and round trips of a time window: a round trip is a burst from the main
server answered by a burst from the helper. `measure` reports what the relay itself delivers:
the round-trip time of one byte and the rate of a bulk transfer through it.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from dataclasses import dataclass, field

CHUNK = 1 << 20
UP, DOWN = 0, 1  # main server -> helper, helper -> main server


@dataclass(frozen=True)
class Shape:
    """A link: its name, rate in bits per second (0: unbounded) and one-way delay in seconds."""

    name: str
    rate_bps: float = 0.0
    delay_s: float = 0.0


LOOPBACK = Shape("loopback")
SHAPES = {s.name: s for s in (LOOPBACK, Shape("1gbit-1ms", 1e9, 0.001), Shape("300mbit-3ms", 300e6, 0.003))}


@dataclass
class Window:
    """What crossed the link in a time window."""

    up_bytes: int = 0
    down_bytes: int = 0
    round_trips: int = 0
    # from each burst of the main server to the start of the helper's answer, summed: the time the
    # main server waited on the link and on the helper's compute
    waited_s: float = 0.0


@dataclass
class _Direction:
    """One direction's FIFO: chunks waiting for their arrival time."""

    queue: collections.deque[tuple[float, bytes]] = field(default_factory=collections.deque)
    ready: threading.Condition = field(default_factory=threading.Condition)
    free_at: float = 0.0  # when the link finishes serializing what it holds
    closed: bool = False


class ShapedLink:
    """A relay from a loopback port to `target` (HOST:PORT), shaped as `shape`; a context manager."""

    def __init__(self, target: str, shape: Shape = LOOPBACK) -> None:
        self.shape = shape
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.events: list[tuple[float, int, int]] = []  # (monotonic s, direction, bytes)
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="link-accept", daemon=True).start()

    def __enter__(self) -> ShapedLink:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the port and every connection through it."""
        self._closed = True
        for sock in (self._listener, *self._sockets):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                near, _ = self._listener.accept()
            except OSError:
                return
            try:
                far = socket.create_connection(self._target)
            except OSError:
                near.close()
                continue
            for sock in (near, far):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [near, far]
            for src, dst, direction in ((near, far, UP), (far, near, DOWN)):
                lane = _Direction()
                threading.Thread(target=self._read, args=(src, lane, direction), daemon=True).start()
                threading.Thread(target=self._deliver, args=(dst, lane), daemon=True).start()

    def _read(self, src: socket.socket, lane: _Direction, direction: int) -> None:
        rate, delay = self.shape.rate_bps, self.shape.delay_s
        try:
            while chunk := src.recv(CHUNK):
                now = time.monotonic()
                with self._lock:
                    self.events.append((now, direction, len(chunk)))
                with lane.ready:
                    start = max(now, lane.free_at)
                    lane.free_at = start + (len(chunk) * 8 / rate if rate else 0.0)
                    lane.queue.append((lane.free_at + delay, chunk))
                    lane.ready.notify()
        except OSError:
            pass
        with lane.ready:
            lane.closed = True
            lane.ready.notify()

    @staticmethod
    def _deliver(dst: socket.socket, lane: _Direction) -> None:
        while True:
            with lane.ready:
                while not lane.queue and not lane.closed:
                    lane.ready.wait()
                if not lane.queue:
                    break
                due, chunk = lane.queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                dst.sendall(chunk)
            except OSError:
                break
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def window(self, start: float, end: float) -> Window:
        """The bytes and round trips of the chunks read in [start, end] (CLOCK_MONOTONIC s)."""
        with self._lock:
            events = [e for e in self.events if start <= e[0] <= end]
        out = Window()
        asked: float | None = None  # the first chunk of the main server's current burst
        last = DOWN
        for t, direction, n in events:
            if direction == UP:
                out.up_bytes += n
                if last == DOWN:
                    asked = t
            else:
                out.down_bytes += n
                if last == UP and asked is not None:
                    out.round_trips += 1
                    out.waited_s += t - asked
            last = direction
        return out


def _echo_server() -> tuple[socket.socket, str]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return

            def echo(c: socket.socket = conn) -> None:
                with c:
                    while data := c.recv(CHUNK):
                        c.sendall(data)

            threading.Thread(target=echo, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server, f"127.0.0.1:{server.getsockname()[1]}"


def measure(shape: Shape, bulk_bytes: int = 64 << 20, pings: int = 50) -> dict[str, float]:
    """The relay shaped as `shape`, measured against an echo server: the median round-trip time
    of one byte, and the rate of `bulk_bytes` sent one way and echoed back (bits per second, each
    way)."""
    server, target = _echo_server()
    try:
        with ShapedLink(target, shape) as link:
            host, port = link.endpoint.rsplit(":", 1)
            with socket.create_connection((host, int(port))) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                rtts = []
                for _ in range(pings):
                    t = time.monotonic()
                    sock.sendall(b"x")
                    sock.recv(1)
                    rtts.append(time.monotonic() - t)
                payload = bytes(CHUNK)
                t = time.monotonic()
                got = 0

                def drain() -> None:
                    nonlocal got
                    while got < bulk_bytes:
                        got += len(sock.recv(CHUNK))

                reader = threading.Thread(target=drain)
                reader.start()
                for _ in range(bulk_bytes // CHUNK):
                    sock.sendall(payload)
                reader.join()
                elapsed = time.monotonic() - t
    finally:
        server.close()
    return {"rtt_s": sorted(rtts)[len(rtts) // 2], "rate_bps": bulk_bytes * 8 / elapsed}
