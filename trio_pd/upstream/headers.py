"""The headers of the legs and of relayed answers (docs/protocol.md §3).

One place decides what a worker is sent (the forwarded tracing headers, the router's request
id, the worker's authorization) and what of a worker's answer reaches the client (less
hop-by-hop headers and those the router sets itself).

Two rules hold both ways:
- hop-by-hop headers (RFC 9110 §7.6.1) stop at the router: the fixed ones, `Proxy-Connection`,
  and every header a `Connection` (or `Proxy-Connection`) header names, from the client to a
  worker and from a worker to the client;
- the router's own keys (`--control-plane-api-keys`, `--data-plane-api-keys`, `--api-key` as
  a client key) never reach a worker: a client header whose value holds one of them anywhere
  (bare, as `<scheme> <key>`, inside a list or a `k=<key>` member, inside `Basic` credentials)
  is not forwarded at all, on generation legs and fan-out alike (probes, load polls and aborts
  carry no client header at all). The headers a worker may get from a client are only these:
  `FORWARDED_HEADERS`, `x-request-id-*`, and `Authorization` when the worker has no key of its
  own (`worker_authorization`). A header is dropped whole, never edited: a trace header with
  a hole cut in it would mislead whoever reads it. Only `Basic` is decoded: a client that
  percent- or otherwise encodes a key it holds gives it away on purpose, and could as well
  send it to the worker itself. The search is a substring search (C speed,
  not constant time): its outcome is never told to the client, and a constant-time search
  over every window of a 16 KiB head would cost milliseconds per request.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable

import attrs

from trio_pd.config import RouterConfig
from trio_pd.spec import WorkerSpec
from trio_pd.upstream.http11 import Response

# X-SMG-Routing-Key too: SGLang's router (SMG) forwards it to the workers as well.
FORWARDED_HEADERS = frozenset(
    (b"x-correlation-id", b"traceparent", b"tracestate", b"x-smg-routing-key")
)


FORWARDED_PREFIX = b"x-request-id-"  # SMG forwards `x-request-id-*` too (`header_utils.rs`)


# Hop-by-hop headers (RFC 9110 §7.6.1, and RFC 9112's Proxy-Connection and Keep-Alive).
HOP_BY_HOP = frozenset(
    (
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    )
)
_NAMING = (b"connection", b"proxy-connection")  # headers whose value names hop-by-hop ones

# Not relayed from an upstream answer: hop-by-hop headers, those hypercorn sets itself, and the
# request id, which the router sets on every response.
DROPPED_RESPONSE_HEADERS = HOP_BY_HOP | frozenset(
    (b"content-length", b"date", b"server", b"x-request-id")
)


def connection_named(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The header names a `Connection` or `Proxy-Connection` header lists (lower-cased)."""
    named: set[bytes] = set()
    for name, value in headers:
        if name in _NAMING:
            named.update(token.strip().lower() for token in value.split(b","))
    return frozenset(named)


@attrs.frozen
class RouterKeys:
    """The router's own keys, as bytes: none of them is ever forwarded to a worker."""

    keys: tuple[bytes, ...] = attrs.field(default=(), repr=False)

    @classmethod
    def of(cls, config: RouterConfig) -> RouterKeys:
        found = [k.key for k in config.control_plane_api_keys]
        found.extend(config.data_plane_api_keys)
        if config.api_key:
            found.append(config.api_key)
        return cls(tuple(dict.fromkeys(k.encode() for k in found if k)))

    def carried_by(self, value: bytes) -> bool:
        """Whether `value` holds one of the keys anywhere in it: bare, after a scheme
        (`Bearer <key>`), inside a list or a member (`Bearer <key>,x`, `tracestate: k=<key>`),
        or inside `Basic` credentials (base64 of `user:<key>`)."""
        if not self.keys:
            return False
        candidates = (value, basic_credentials(value))
        found = False
        for key in self.keys:  # no early exit: the time taken does not say which key matched
            for candidate in candidates:
                found |= key in candidate
        return found


def basic_credentials(value: bytes) -> bytes:
    """The decoded credentials of `Basic <base64>` (b"" for anything else)."""
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"basic":
        return b""
    try:
        return base64.b64decode(token.strip(), validate=False)
    except ValueError:
        return b""


NO_KEYS = RouterKeys()


def relayable_headers(response: Response) -> list[tuple[bytes, bytes]]:
    """Headers less hop-by-hop ones (those `Connection` names too), those the server sets
    itself, the request id and a worker's own CORS answer (the router's `cors.py` decides
    that one)."""
    headers = response.headers
    named = connection_named(headers)
    return [
        (k, v)
        for k, v in headers
        if k not in DROPPED_RESPONSE_HEADERS
        and k not in named
        and not k.startswith(b"access-control-")
    ]


def leg_headers(
    client_headers: list[tuple[bytes, bytes]], request_id: bytes, keys: RouterKeys = NO_KEYS
) -> list[tuple[bytes, bytes]]:
    """Headers sent to both legs, less authorization (`worker_authorization` adds it per leg):
    the forwarded tracing headers, our request id and the JSON content type."""
    headers = [
        (b"content-type", b"application/json"),
        (b"accept-encoding", b"identity"),
        (b"x-request-id", request_id),
    ]
    headers.extend(forwarded_headers(client_headers, keys))
    return headers


def forwarded_headers(
    client_headers: list[tuple[bytes, bytes]], keys: RouterKeys = NO_KEYS
) -> list[tuple[bytes, bytes]]:
    """The client's tracing headers a worker also gets (the request id is the router's own),
    less those the client's `Connection` names and any carrying one of the router's keys."""
    named = connection_named(client_headers)
    return [
        (name, value)
        for name, value in client_headers
        if (name in FORWARDED_HEADERS or name.startswith(FORWARDED_PREFIX))
        and name not in named
        and not keys.carried_by(value)
    ]


def client_authorization(
    client_headers: list[tuple[bytes, bytes]], keys: RouterKeys = NO_KEYS
) -> bytes | None:
    """The client's `Authorization`, forwarded to a worker without a key of its own; never
    when it carries one of the router's keys or the client's `Connection` names it."""
    for name, value in client_headers:
        if name == b"authorization":
            if keys.carried_by(value) or b"authorization" in connection_named(client_headers):
                return None
            return value
    return None


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
    the client's header; without a key, the client's header as it came (docs/protocol.md §3)."""
    if worker_key:
        return [(b"authorization", b"Bearer " + worker_key.encode())]
    if client_value:
        return [(b"authorization", client_value)]
    return []
