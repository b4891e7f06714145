"""Upstream HTTP for the two legs: keep-alive HTTP/1.1 connections to the workers.

The protocol work is `http11.py` (httptools' llhttp parser over trio sockets); the pooling is
here. Each worker origin has a LIFO stack of idle connections and only the connection taken is
checked (one non-blocking poll), instead of a pool rescanning every connection per request.

Ownership is explicit, as in the DESIGN notes: a connection belongs to the one `post()` that took
it until that context exits; it goes back to the stack only when its response was read to the
end and the server allows keep-alive, and is closed otherwise, so a cancelled leg always closes
its connection. The pool decides what to close in a synchronous pass (nothing is returned or
taken meanwhile) and closes it afterwards under a shield, as httpcore's pool does. Request
budgets are trio deadlines; the only timeout here is the connect timeout.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

import attrs
import trio

from trio_pd.upstream import http11
from trio_pd.upstream.connect import connect
from trio_pd.upstream.destinations import Destinations
from trio_pd.upstream.http11 import Connection, Response

KEEPALIVE_EXPIRY_SECS = 2.0  # below the engines' keep-alive, so we never reuse a closing socket
CONNECT_TIMEOUT_SECS = 10.0  # a black-holed worker fails the leg instead of eating the deadline

# A leg's transport failed: kind "timeout" (connect) or "transport" (refused, reset, garbled).
UpstreamError = http11.TransportError
UpstreamResponse = Response


@attrs.frozen
class Endpoint:
    """Where a worker URL points, precomputed once: host, port, TLS, Host header, path prefix."""

    host: str
    port: int
    tls: bool
    host_header: bytes
    prefix: bytes

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        return cls(
            host=parts.hostname or "",
            port=parts.port or (443 if tls else 80),
            tls=tls,
            host_header=parts.netloc.encode(),
            prefix=parts.path.rstrip("/").encode(),
        )


class UpstreamPool:
    """Idle keep-alive connections per worker origin; one per process, shared by all requests.

    ``ssl_context`` verifies https workers (None: the system trust store, made on first use);
    ``destinations`` is checked at every connect (None: no check, for tests of the client).
    """

    def __init__(
        self,
        keepalive_expiry: float = KEEPALIVE_EXPIRY_SECS,
        connect_timeout: float = CONNECT_TIMEOUT_SECS,
        ssl_context: ssl.SSLContext | None = None,
        destinations: Destinations | None = None,
    ) -> None:
        self.keepalive_expiry = keepalive_expiry
        self.connect_timeout = connect_timeout
        self._ssl_context = ssl_context
        self.destinations = destinations
        self._endpoints: dict[str, Endpoint] = {}
        self._idle: dict[str, list[Connection]] = {}  # keyed by worker base URL
        self._busy: dict[Connection, str] = {}

    def endpoint(self, url: str) -> Endpoint:
        found = self._endpoints.get(url)
        if found is None:
            found = self._endpoints[url] = Endpoint.parse(url)
        return found

    @property
    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        return self._ssl_context

    def post(
        self,
        url: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        sending: Callable[[], None] | None = None,
    ) -> Exchange:
        """`async with pool.post(...) as response`: POST `body` to `url + path`; the connection
        is reused only if the answer was read to its end. `sending` is called once a connection
        is in hand, just before the request is written: a caller cancelled before that point
        sent nothing (the write begins with a cancel point), so the engine holds nothing."""
        return Exchange(self, url, path, headers, body, sending)

    def _release(self, url: str, connection: Connection) -> bool:
        """Take a connection back: True if it was pooled, False if the caller must close it."""
        del self._busy[connection]
        if connection.is_reusable():
            self._idle.setdefault(url, []).append(connection)
            return True
        return False

    async def _checkout(self, url: str, endpoint: Endpoint) -> Connection:
        """The most recently used live idle connection to `url`, or a new one.

        Stale connections met on the way are taken off the stack first and closed afterwards,
        shielded: nothing awaits while the stack is being decided.
        """
        stack = self._idle.get(url)
        stale = []
        found = None
        while stack:
            connection = stack.pop()  # LIFO: the most recently used is the least likely stale
            if connection.is_stale():  # past keep-alive, or the server closed it
                stale.append(connection)
            else:
                found = connection
                break
        if stale:
            await _close_all(stale)
        if found is not None:
            return found
        return await connect(
            endpoint.host,
            endpoint.port,
            ssl_context=self.ssl_context if endpoint.tls else None,
            connect_timeout=self.connect_timeout,
            keepalive_expiry=self.keepalive_expiry,
            destinations=self.destinations,
        )

    async def prune(self) -> None:
        """Close idle connections past their keep-alive (the lifespan calls this periodically).

        Decided in one synchronous pass (no connection can be returned or taken meanwhile),
        then closed under a shield.
        """
        expired: list[Connection] = []
        for stack in self._idle.values():
            keep: list[Connection] = []
            for connection in stack:
                (expired if connection.is_stale() else keep).append(connection)
            stack[:] = keep
        await _close_all(expired)

    async def aclose(self) -> None:
        """Close every connection, idle or busy (the lifespan's end)."""
        doomed = [c for stack in self._idle.values() for c in stack]
        self._idle.clear()
        doomed.extend(self._busy)
        await _close_all(doomed)

    def connections(self) -> list[tuple[str, str]]:
        """(worker URL, "idle" | "active") of every connection we hold: for metrics and tests."""
        result = [(url, "idle") for url, stack in self._idle.items() for _ in stack]
        result.extend((url, "active") for url in self._busy.values())
        return result


class Exchange:
    """One request/response on a pooled connection, owned from `__aenter__` to `__aexit__`.

    A class rather than an `@asynccontextmanager`: two of these per PD request, and the
    generator machinery cost more than the bookkeeping it wraps."""

    __slots__ = (
        "_body", "_connection", "_headers", "_path", "_pool", "_response", "_sending", "_url",
    )  # fmt: skip

    def __init__(
        self,
        pool: UpstreamPool,
        url: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        sending: Callable[[], None] | None = None,
    ) -> None:
        self._pool = pool
        self._sending = sending
        self._url = url
        self._path = path
        self._headers = headers
        self._body = body
        self._connection: Connection | None = None
        self._response: Response | None = None

    async def __aenter__(self) -> Response:
        pool, url, body = self._pool, self._url, self._body
        endpoint = pool.endpoint(url)
        connection = await pool._checkout(url, endpoint)
        pool._busy[connection] = url
        self._connection = connection
        if self._sending is not None:
            self._sending()
        try:
            self._response = await connection.request(
                b"POST",
                endpoint.prefix + self._path.encode(),
                [
                    (b"host", endpoint.host_header),
                    (b"content-length", str(len(body)).encode()),
                    *self._headers,
                ],
                body,
            )
        except BaseException:
            await self._release()
            raise
        return self._response

    async def __aexit__(self, *exc_info: object) -> None:
        await self._release()

    async def _release(self) -> None:
        connection = self._connection
        if connection is None:
            return
        self._connection = None
        if self._response is not None:
            await self._response.aclose()  # not a checkpoint; an unread body spends it
        if not self._pool._release(self._url, connection):
            await _close_all([connection])


async def _close_all(connections: list[Connection]) -> None:
    with trio.CancelScope(shield=True):
        for connection in connections:
            await connection.aclose()
