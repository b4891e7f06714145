"""The client's routing key: `X-SMG-Routing-Key` (or `--routing-key-headers`), else, with sticky
sessions on, the lineage of the body's `rid`.

Read only when a policy routes by it (`PolicyConfig.uses_routing_key`: manual,
consistent_hashing, prefix_hash, or `--routing-key-override`), so other policies pay no header
scan. As in SMG 1.13 the configured header names are tried in their order and the first one
present with a value wins (the first such header counts; an empty value is no key, the next name
is tried). The value is an opaque name: its bytes are kept (latin-1, so any byte survives),
except that a value longer than `MAX_KEY_BYTES` is replaced by a digest of itself: a policy
keeps keys for hours, and a client must not make it keep kilobytes per request.

With the sticky override (SMG's `RoutingKeyOverrideConfig`), a request without a header key is
keyed by its body's `rid` (a string only), and both kinds lose one trailing `_r<n>` (a retry)
and then one `_t<n>` (a turn): `conv_t2_r1` and `conv_t3` are the conversation `conv`, so every
turn of it goes to the same worker. A `rid` that is nothing but such a suffix keys as itself.
A key read from the `rid` is a `RidKey` (`fleet/hints.py`): the override pins it only once it
is seen again (`fleet/sticky.py`), since most rids are one request's own.

For consistent_hashing alone a request without a key is hashed by its `x-forwarded-for`, else its
`cookie` (`affinity`, SMG's implicit key), bounded the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import attrs

from trio_pd.config import PolicyConfig
from trio_pd.fleet.hints import RidKey

ROUTING_KEY_HEADER = b"x-smg-routing-key"
MAX_KEY_BYTES = 128
# consistent_hashing's implicit key without a routing key (SMG 1.13): headers that name a client
# or a session, never a credential (every client sharing an API key would land on one worker).
AFFINITY_HEADERS = (b"x-forwarded-for", b"cookie")


def _bounded(value: bytes) -> str:
    if len(value) > MAX_KEY_BYTES:
        return "blake2b:" + hashlib.blake2b(value, digest_size=16).hexdigest()
    return value.decode("latin-1")


def _raw_key(headers: list[tuple[bytes, bytes]], names: Sequence[bytes]) -> bytes | None:
    for wanted in names:
        for name, value in headers:
            if name == wanted:
                if value:
                    return value
                break  # the first such header counts: empty, so try the next name
    return None


def routing_key(
    headers: list[tuple[bytes, bytes]], names: Sequence[bytes] = (ROUTING_KEY_HEADER,)
) -> str | None:
    """The routing key of a request's headers (names lowercase, as ASGI gives them), or None."""
    raw = _raw_key(headers, names)
    return None if raw is None else _bounded(raw)


def strip_lineage(rid: str) -> str:
    """`conv_t2_r1` -> `conv`: one trailing `_r<n>`, then one trailing `_t<n>` (SMG's
    `strip_lineage_suffixes`); a value that would be left empty is kept whole."""
    stripped = _strip_tag(_strip_tag(rid, "r"), "t")
    return stripped or rid


def _strip_tag(value: str, tag: str) -> str:
    head, sep, tail = value.rpartition("_")
    if sep and tail[:1] == tag and len(tail) > 1 and tail[1:].isascii() and tail[1:].isdigit():
        return head
    return value


@attrs.frozen
class RoutingKeys:
    """How one router finds a request's routing key: which headers, and whether the `rid`
    lineage stands in for a missing one (the sticky override)."""

    names: tuple[bytes, ...] = (ROUTING_KEY_HEADER,)
    lineage: bool = False
    implicit: bool = False  # consistent_hashing reads `affinity` too

    @classmethod
    def of(cls, policy: PolicyConfig) -> RoutingKeys | None:
        """None when no policy reads a key (no header is scanned then)."""
        if not policy.uses_routing_key:
            return None
        names = tuple(name.strip().lower().encode("latin-1") for name in policy.routing_key_headers)
        roles = (policy.for_role("prefill"), policy.for_role("decode"))
        return cls(names, policy.routing_key_override, "consistent_hashing" in roles)

    def key(self, headers: list[tuple[bytes, bytes]], rid: object = None) -> str | None:
        raw = _raw_key(headers, self.names)
        if not self.lineage:
            return None if raw is None else _bounded(raw)
        if raw is not None:
            return _bounded(strip_lineage(raw.decode("latin-1")).encode("latin-1"))
        if isinstance(rid, str) and rid:
            return RidKey(_bounded(strip_lineage(rid).encode("utf-8", "surrogatepass")))
        return None

    def affinity(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """consistent_hashing's implicit key: `x-forwarded-for`, else `cookie` (None unless
        that policy is used)."""
        if not self.implicit:
            return None
        raw = _raw_key(headers, AFFINITY_HEADERS)
        return None if raw is None else _bounded(raw)
