"""The headers of the legs and of relayed answers (PROTOCOL.md §3).

One place decides what a worker is sent (the forwarded tracing headers, the router's request
id, the worker's authorization) and what of a worker's answer reaches the client (less
hop-by-hop headers and those the router sets itself).
"""

from __future__ import annotations

from trio_pd.spec import WorkerSpec
from trio_pd.upstream.http11 import Response

# X-SMG-Routing-Key too: SGLang's router (SMG) forwards it to the workers as well.
FORWARDED_HEADERS = frozenset(
    (b"x-correlation-id", b"traceparent", b"tracestate", b"x-smg-routing-key")
)


FORWARDED_PREFIX = b"x-request-id-"  # SMG forwards `x-request-id-*` too (`header_utils.rs`)


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


def relayable_headers(response: Response) -> list[tuple[bytes, bytes]]:
    """Headers less hop-by-hop ones, those the server sets itself, the request id and a
    worker's own CORS answer (the router's `cors.py` decides that one)."""
    return [
        (k, v)
        for k, v in response.headers
        if k not in DROPPED_RESPONSE_HEADERS and not k.startswith(b"access-control-")
    ]


def leg_headers(
    client_headers: list[tuple[bytes, bytes]], request_id: bytes
) -> list[tuple[bytes, bytes]]:
    """Headers sent to both legs, less authorization (`worker_authorization` adds it per leg):
    the forwarded tracing headers, our request id and the JSON content type."""
    headers = [
        (b"content-type", b"application/json"),
        (b"accept-encoding", b"identity"),
        (b"x-request-id", request_id),
    ]
    headers.extend(forwarded_headers(client_headers))
    return headers


def forwarded_headers(client_headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's tracing headers a worker also gets (the request id is the router's own)."""
    return [
        (name, value)
        for name, value in client_headers
        if name in FORWARDED_HEADERS or name.startswith(FORWARDED_PREFIX)
    ]


def client_authorization(client_headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in client_headers:
        if name == b"authorization":
            return value
    return None


def usable_key(key: str | None) -> bool:
    """Whether a worker key can go into `worker_authorization`'s header as it is (visible
    ASCII: a CR/LF would inject headers of its own). Keys are checked where they come in."""
    return key is None or all(0x21 <= ord(c) <= 0x7E for c in key)


def generation_key(spec: WorkerSpec, router_key: str | None) -> str | None:
    """The key a worker's generation, info and health routes get: its own, else `--api-key`."""
    return spec.api_key or router_key


def admin_key(spec: WorkerSpec, router_admin_key: str | None, router_key: str | None) -> str | None:
    """The key a worker's `/abort_request` gets: its admin key, else `--worker-admin-api-key`,
    else its generation key. SGLang guards that route ADMIN_OPTIONAL (`utils/auth.py`): open
    without keys, the API key with only `--api-key`, and only the admin key once the engine has
    `--admin-api-key`."""
    return spec.admin_api_key or router_admin_key or generation_key(spec, router_key)


def worker_authorization(
    worker_key: str | None, client_value: bytes | None
) -> list[tuple[bytes, bytes]]:
    """The authorization a worker gets: its key (the worker's own, else `--api-key`) replacing
    the client's header; without a key, the client's header as it came (PROTOCOL.md §3)."""
    if worker_key:
        return [(b"authorization", b"Bearer " + worker_key.encode())]
    if client_value:
        return [(b"authorization", client_value)]
    return []
