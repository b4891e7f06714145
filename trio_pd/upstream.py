"""The one pooled upstream HTTP client of a router process, and the headers legs carry.

HTTP/1.1 only, no connection cap (concurrency is bounded by trio primitives in the app), idle
connections expire before the engines' keep-alive does, and no read timeout: a request's total
budget is a trio deadline, so cancellation is the only way a leg ends early. A cancelled leg's
connection is closed by httpx2 instead of going back to the pool.
"""

from __future__ import annotations

import httpx2

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


def make_client() -> httpx2.AsyncClient:
    return httpx2.AsyncClient(
        http1=True,
        http2=False,
        trust_env=False,
        follow_redirects=False,
        limits=httpx2.Limits(
            max_connections=None,
            max_keepalive_connections=None,
            keepalive_expiry=KEEPALIVE_EXPIRY_SECS,
        ),
        timeout=httpx2.Timeout(None, connect=CONNECT_TIMEOUT_SECS),
        headers={"accept-encoding": "identity", "user-agent": "trio-pd"},
    )


def leg_headers(
    client_headers: list[tuple[bytes, bytes]], request_id: str
) -> list[tuple[bytes, bytes]]:
    """Headers sent to both legs: the forwarded ones, our request id and JSON content type."""
    headers = [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())]
    headers.extend((name, value) for name, value in client_headers if name in FORWARDED_HEADERS)
    return headers


def response_headers(upstream: httpx2.Headers) -> list[tuple[bytes, bytes]]:
    """An upstream response's headers less hop-by-hop ones (and those the server sets itself)."""
    return [
        (name, value)
        for name, value in upstream.raw
        if name.lower() not in DROPPED_RESPONSE_HEADERS
    ]


def pool_connections(client: httpx2.AsyncClient) -> list[tuple[str, str]]:
    """(origin, state) of every connection in the pool: for /metrics, tests and leak checks."""
    pool = client._transport._pool  # httpx2 keeps its httpcore2 pool here
    result = []
    for connection in pool.connections:
        origin = connection._origin
        host = origin.host.decode()
        state = "idle" if connection.is_idle() else "closed" if connection.is_closed() else "active"
        result.append((f"{origin.scheme.decode()}://{host}:{origin.port}", state))
    return result
