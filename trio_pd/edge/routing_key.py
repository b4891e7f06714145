"""The client's routing key: the `X-SMG-Routing-Key` header SGLang's router (SMG) defines.

Read only when a `manual` policy is configured (`PolicyConfig.uses_routing_key`), so other
policies pay no header scan. As in SMG, the first such header counts and an empty value is no
key. The value is an opaque name: its bytes are kept (latin-1, so any byte survives), except
that a value longer than `MAX_KEY_BYTES` is replaced by a digest of itself: the policy keeps
every key for hours, and a client must not make it keep kilobytes per request.
"""

from __future__ import annotations

import hashlib

ROUTING_KEY_HEADER = b"x-smg-routing-key"
MAX_KEY_BYTES = 128


def routing_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The routing key of a request's headers (names lowercase, as ASGI gives them), or None."""
    for name, value in headers:
        if name == ROUTING_KEY_HEADER:
            if not value:
                return None
            if len(value) > MAX_KEY_BYTES:
                return "blake2b:" + hashlib.blake2b(value, digest_size=16).hexdigest()
            return value.decode("latin-1")
    return None
