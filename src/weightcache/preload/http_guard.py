"""A guard in front of uvicorn's HTTP protocol: slow or idle clients cannot hold the supervisor's descriptors.

uvicorn keeps a connection whose request head never completes open forever (its keep-alive timer starts only
after a response), and accepts as many connections as the process has descriptors. The guard wraps whatever
protocol uvicorn picked (h11 or httptools) and

* closes a connection whose request head (up to the blank line) has not arrived ``head_timeout`` seconds
  after it opened, and any connection still open ``request_timeout`` seconds after its head;
* holds at most ``max_connections``: beyond that, a new connection closes the oldest one still sending its
  head (a slow client loses its place, a new /health request gets in); when every one is busy with a
  request, the new one is closed at once.

Each connection serves one request (the app answers ``Connection: close``), so a finished request cannot
start a second, slow one on the same connection. The cap is derived from RLIMIT_NOFILE so that the
supervisor keeps most of its descriptors for its daemons, whatever HTTP clients do.
"""

from __future__ import annotations

import asyncio
import resource

HEAD_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 64
NOFILE_SHARE = 8  # HTTP may use at most 1/8 of the descriptors for open connections (and as much for a burst)


def connection_cap(wanted: int = MAX_CONNECTIONS) -> int:
    """`wanted`, or fewer when RLIMIT_NOFILE is low: the rest stays with the supervisor."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(2, min(wanted, soft // NOFILE_SHARE))


class Guard:
    """The open connections of one server (oldest first) and what was closed, and why."""

    def __init__(self, max_connections: int, head_timeout: float, request_timeout: float):
        if max_connections < 1 or not head_timeout > 0 or not request_timeout > 0:
            raise ValueError("the HTTP guard needs max_connections >= 1 and positive timeouts")
        self.max_connections = max_connections
        self.head_timeout, self.request_timeout = head_timeout, request_timeout
        self.open: dict[GuardedProtocol, None] = {}  # insertion order: oldest first
        self.refused = self.evicted = self.timed_out = 0

    def admit(self, conn: GuardedProtocol) -> bool:
        if len(self.open) >= self.max_connections:
            slow = next((c for c in self.open if not c.head_done), None)
            if slow is None:
                self.refused += 1
                return False
            self.evicted += 1
            slow.drop()
        self.open[conn] = None
        return True

    def forget(self, conn: GuardedProtocol) -> None:
        self.open.pop(conn, None)

    def protocol(self, inner: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
        """A protocol class for uvicorn's Config(http=...) that guards `inner`."""
        return type("GuardedHTTP", (GuardedProtocol,), {"guard": self, "inner_class": inner})


class GuardedProtocol(asyncio.Protocol):
    guard: Guard
    inner_class: type[asyncio.Protocol]

    def __init__(self, *args, **kwargs):
        self.inner = self.inner_class(*args, **kwargs)
        self.transport: asyncio.Transport | None = None
        self.head_done = False
        self.admitted = False
        self._tail = b""
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.guard.admit(self):
            transport.abort()
            return
        self.admitted = True
        self._arm(self.guard.head_timeout)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if not self.head_done:
            seen = self._tail + data
            if b"\r\n\r\n" in seen or b"\n\n" in seen:  # the blank line ends the head
                self.head_done = True
                self._arm(self.guard.request_timeout)
            else:
                self._tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.admitted else None

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self.guard.forget(self)
        if self._timer is not None:
            self._timer.cancel()
        if self.admitted:
            self.inner.connection_lost(exc)

    def drop(self) -> None:
        """Close now, without a response; the descriptor is freed on the loop's next turn."""
        self.guard.forget(self)
        if self.transport is not None:
            self.transport.abort()

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self.guard.timed_out += 1
        self.drop()


def close_after_response(app):
    """The ASGI app, answering every HTTP request with ``Connection: close`` (one request per connection)."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_closing(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        return await app(scope, receive, send_closing)

    return wrapped
