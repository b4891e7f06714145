"""CORS for browsers calling the router directly (`--cors-allowed-origins`).

SMG 0.3.2 puts tower-http's `CorsLayer` around every route (`create_cors_layer` in its
`src/server.rs`); this module gives the same answers:

- no origins configured (the default): any origin. Every response carries
  `Access-Control-Allow-Origin: *` and `Access-Control-Expose-Headers: *`; a preflight allows
  methods `*` and headers `*`.
- a list: an `Origin` equal to one of them (byte for byte) gets itself back in
  `Access-Control-Allow-Origin` and `Access-Control-Expose-Headers: x-request-id`; a preflight
  allows `GET,POST,OPTIONS` and the headers `content-type,authorization`.
- never `Access-Control-Allow-Credentials`; preflights are cached `3600` s (`Max-Age`).
- every response says `Vary: origin, access-control-request-method,
  access-control-request-headers`, so a cache never serves one origin's answer to another.
- any `OPTIONS` request on a route is a preflight: the router answers it `200` with an empty
  body itself, before authentication, admission or any worker.

Where trio_pd differs: a disallowed (or absent) origin gets no `Access-Control-*` header at all
(tower-http still sends the allowed methods, headers and max age, which grant nothing without
`Allow-Origin`); a preflight also carries `x-request-id` like every other answer; an `OPTIONS`
on an unknown path is the usual 404 envelope (SMG: an empty 404); and `Access-Control-*`
headers a worker sends are never relayed (`upstream.relayable_headers`), so an engine's own
`Allow-Origin: *` cannot widen the router's list.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from trio_pd.asgi import Receive, Scope
from trio_pd.respond import Reply, Responder

Headers = tuple[tuple[bytes, bytes], ...]

VARY = (b"vary", b"origin, access-control-request-method, access-control-request-headers")
MAX_AGE = (b"access-control-max-age", b"3600")
ALLOW_ORIGIN = b"access-control-allow-origin"
# With a list of origins (SMG's fixed choices):
LISTED_METHODS = (b"access-control-allow-methods", b"GET,POST,OPTIONS")
LISTED_HEADERS = (b"access-control-allow-headers", b"content-type,authorization")
LISTED_EXPOSE = (b"access-control-expose-headers", b"x-request-id")
# With any origin:
ANY_RESPONSE: Headers = (VARY, (ALLOW_ORIGIN, b"*"), (b"access-control-expose-headers", b"*"))
ANY_PREFLIGHT: Headers = (
    VARY,
    (ALLOW_ORIGIN, b"*"),
    (b"access-control-allow-methods", b"*"),
    (b"access-control-allow-headers", b"*"),
    MAX_AGE,
)
NOT_ALLOWED: Headers = (VARY,)


@attrs.frozen
class CorsPolicy:
    """Which CORS headers an answer carries, from the request's `Origin` (precomputed)."""

    allowed: frozenset[bytes] | None = None  # None: any origin

    @classmethod
    def from_origins(cls, origins: Sequence[str]) -> CorsPolicy:
        return cls(frozenset(o.encode("ascii") for o in origins) if origins else None)

    def response_headers(self, headers: list[tuple[bytes, bytes]]) -> Headers:
        """For every answer but a preflight (success, error or stream alike)."""
        if self.allowed is None:
            return ANY_RESPONSE
        origin = self._allowed_origin(headers)
        if origin is None:
            return NOT_ALLOWED
        return (VARY, (ALLOW_ORIGIN, origin), LISTED_EXPOSE)

    def preflight_headers(self, headers: list[tuple[bytes, bytes]]) -> Headers:
        if self.allowed is None:
            return ANY_PREFLIGHT
        origin = self._allowed_origin(headers)
        if origin is None:
            return NOT_ALLOWED
        return (VARY, (ALLOW_ORIGIN, origin), LISTED_METHODS, LISTED_HEADERS, MAX_AGE)

    def _allowed_origin(self, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        assert self.allowed is not None
        for name, value in headers:
            if name == b"origin":  # the first one, as tower-http reads it
                return value if value in self.allowed else None
        return None


async def handle_preflight(
    cors: CorsPolicy, scope: Scope, receive: Receive, responder: Responder
) -> None:
    """`OPTIONS` on a route: answered here, with the preflight's headers instead of the
    response headers every other answer gets."""
    responder.cors = cors.preflight_headers(scope["headers"])
    await responder.reply(Reply(200, [], b""))
