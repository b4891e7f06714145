"""Upstream HTTP for the two legs: keep-alive HTTP/1.1 connections to the workers.

The protocol work is httpcore2's (`AsyncHTTP11Connection`, h11 underneath); the pooling is ours,
because httpcore2's pool rescans every connection on each request and probes each idle socket
(a syscall apiece): at 64 connections that was a fifth of the router's CPU. Here each worker
origin has a LIFO stack of idle connections and only the connection taken is checked.

Ownership is explicit, as in the DESIGN notes: a connection belongs to the one `post()` that took
it until that context exits; it goes back to the stack only when its response was read to the
end, and is closed otherwise, so a cancelled leg always closes its connection. Request budgets
are trio deadlines; the only timeout here is the connect timeout.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import attrs
import httpcore2
import httpx2
import trio

KEEPALIVE_EXPIRY_SECS = 2.0  # below the engines' keep-alive, so we never reuse a closing socket
CONNECT_TIMEOUT_SECS = 10.0  # a black-holed worker fails the leg instead of eating the deadline
FORWARDED_HEADERS = frozenset(
    (b"authorization", b"x-correlation-id", b"traceparent", b"tracestate")
)
# Not relayed from an upstream answer: hop-by-hop headers, those hypercorn sets itself, and the
# request id, which the router sets on every response.
DROPPED_RESPONSE_HEADERS = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"date",
        b"server",
        b"x-request-id",
    )
)
_TIMEOUTS = httpcore2.TimeoutException
_TRANSPORT = (httpcore2.NetworkError, httpcore2.ProtocolError, httpcore2.UnsupportedProtocol)


class UpstreamError(Exception):
    """A leg's transport failed: `timeout` (connect) or `transport` (refused, reset, garbled)."""

    def __init__(self, kind: str, exc: BaseException) -> None:
        text = str(exc)
        super().__init__(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
        self.kind = kind


def _upstream_error(exc: BaseException) -> UpstreamError:
    return UpstreamError("timeout" if isinstance(exc, _TIMEOUTS) else "transport", exc)


@attrs.frozen
class Endpoint:
    """Where a worker URL points, precomputed once: origin, Host header, path prefix."""

    origin: httpcore2.Origin
    host_header: bytes
    prefix: bytes

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        scheme = parts.scheme.encode()
        default_port = 443 if parts.scheme == "https" else 80
        port = parts.port or default_port
        host = (parts.hostname or "").encode()
        return cls(
            origin=httpcore2.Origin(scheme, host, port),
            host_header=parts.netloc.encode(),
            prefix=parts.path.rstrip("/").encode(),
        )


@attrs.define(eq=False)
class UpstreamResponse:
    """Status, headers and body of one upstream answer; reading errors become UpstreamError."""

    status: int
    headers: list[tuple[bytes, bytes]]
    _raw: httpcore2.Response
    _connection: httpcore2.AsyncHTTP11Connection

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def relayable_headers(self) -> list[tuple[bytes, bytes]]:
        """Headers less hop-by-hop ones, those the server sets itself and the request id."""
        return [(k, v) for k, v in self.headers if k.lower() not in DROPPED_RESPONSE_HEADERS]

    def close_now(self) -> None:
        """Close the connection under this response at once, from any task (a task reading it
        gets an error). For a stream whose relay is stuck writing to a client that stopped
        reading: the engine must see the disconnect now, not when the write returns."""
        stream = getattr(self._connection, "_network_stream", None)
        raw = getattr(stream, "_stream", None)
        raw = getattr(raw, "transport_stream", raw)
        sock = getattr(raw, "socket", None)
        if sock is not None:
            sock.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._raw.aiter_stream():
                yield chunk
        except (_TIMEOUTS, *_TRANSPORT) as exc:
            raise _upstream_error(exc) from exc

    async def read(self, limit: int | None = None) -> bytes:
        parts = []
        size = 0
        async for chunk in self.chunks():
            parts.append(chunk)
            size += len(chunk)
            if limit is not None and size >= limit:
                break
        body = b"".join(parts)
        return body if limit is None else body[:limit]


class UpstreamPool:
    """Idle keep-alive connections per worker origin; one per process, shared by all requests."""

    def __init__(
        self,
        keepalive_expiry: float = KEEPALIVE_EXPIRY_SECS,
        connect_timeout: float = CONNECT_TIMEOUT_SECS,
    ) -> None:
        self.keepalive_expiry = keepalive_expiry
        self.connect_timeout = connect_timeout
        self._backend = httpcore2.TrioBackend()
        self._endpoints: dict[str, Endpoint] = {}
        # Keyed by worker base URL (httpcore2's Origin is unhashable).
        self._idle: dict[str, list[httpcore2.AsyncHTTP11Connection]] = {}
        self._busy: dict[httpcore2.AsyncHTTP11Connection, str] = {}

    def endpoint(self, url: str) -> Endpoint:
        found = self._endpoints.get(url)
        if found is None:
            found = self._endpoints[url] = Endpoint.parse(url)
        return found

    @asynccontextmanager
    async def post(
        self, url: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> AsyncIterator[UpstreamResponse]:
        """POST `body` to `url + path`; the connection is reused only if the answer was read."""
        endpoint = self.endpoint(url)
        connection = await self._checkout(url, endpoint.origin)
        self._busy[connection] = url
        raw = None
        try:
            request = httpcore2.Request(
                b"POST",
                httpcore2.URL(
                    scheme=endpoint.origin.scheme,
                    host=endpoint.origin.host,
                    port=endpoint.origin.port,
                    target=endpoint.prefix + path.encode(),
                ),
                headers=[
                    (b"host", endpoint.host_header),
                    (b"content-length", str(len(body)).encode()),
                    *headers,
                ],
                content=body,
            )
            try:
                raw = await connection.handle_async_request(request)
            except (_TIMEOUTS, *_TRANSPORT) as exc:
                raise _upstream_error(exc) from exc
            yield UpstreamResponse(raw.status, raw.headers, raw, connection)
        finally:
            del self._busy[connection]
            with trio.CancelScope(shield=True):
                if raw is not None:
                    await raw.aclose()  # an unfinished body marks the connection closed
                if connection.is_idle() and not connection.is_closed():
                    self._idle.setdefault(url, []).append(connection)
                else:
                    await connection.aclose()

    async def _checkout(
        self, url: str, origin: httpcore2.Origin
    ) -> httpcore2.AsyncHTTP11Connection:
        """The most recently used live idle connection to `url`, or a new one.

        Stale connections met on the way are taken off the stack first and closed afterwards,
        shielded: nothing awaits while the stack is being decided (httpcore's split between
        assigning connections and closing them).
        """
        stack = self._idle.get(url)
        stale = []
        found = None
        while stack:
            connection = stack.pop()  # LIFO: the most recently used is the least likely stale
            if connection.has_expired():  # past keep-alive, or the server closed it
                stale.append(connection)
            else:
                found = connection
                break
        await _close_all(stale)
        if found is not None:
            return found
        try:
            stream = await self._backend.connect_tcp(
                origin.host.decode("ascii"), origin.port, timeout=self.connect_timeout
            )
        except (_TIMEOUTS, *_TRANSPORT, OSError) as exc:
            raise _upstream_error(exc) from exc
        return httpcore2.AsyncHTTP11Connection(origin, stream, self.keepalive_expiry)

    async def prune(self) -> None:
        """Close idle connections past their keep-alive (the lifespan calls this periodically).

        Decided in one synchronous pass (no connection can be returned or taken meanwhile),
        then closed under a shield.
        """
        expired = []
        for stack in self._idle.values():
            keep = []
            for connection in stack:
                (expired if connection.has_expired() else keep).append(connection)
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


async def _close_all(connections: list[httpcore2.AsyncHTTP11Connection]) -> None:
    with trio.CancelScope(shield=True):
        for connection in connections:
            await connection.aclose()


def leg_headers(
    client_headers: list[tuple[bytes, bytes]], request_id: str
) -> list[tuple[bytes, bytes]]:
    """Headers sent to both legs: the forwarded ones, our request id and JSON content type."""
    headers = [
        (b"content-type", b"application/json"),
        (b"accept-encoding", b"identity"),
        (b"x-request-id", request_id.encode()),
    ]
    headers.extend((name, value) for name, value in client_headers if name in FORWARDED_HEADERS)
    return headers


def make_client() -> httpx2.AsyncClient:
    """The httpx2 client of the control plane (health probes, fan-out, admin), off the hot path."""
    return httpx2.AsyncClient(
        http1=True,
        http2=False,
        trust_env=False,
        follow_redirects=False,
        limits=httpx2.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_SECS),
        timeout=httpx2.Timeout(None, connect=CONNECT_TIMEOUT_SECS),
        headers={"user-agent": "trio-pd"},
    )
