"""The fields the router writes into a client's body for one attempt (PROTOCOL.md §2, §10, §11).

`bootstrap_host`, `bootstrap_port` and a fresh random `bootstrap_room` per attempt (lists of the
batch's length for batches, distinct rooms), and the request's `rid` on the legs. They are
written as bytes just before the body's closing brace: the client's own bytes pass through
untouched (`payload.inspect_body` already removed any key the router owns), so every value a
client sent reaches the workers exactly as sent.
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import urlsplit

import orjson

MAX_ROOM = 2**63 - 1


def bootstrap_host(url: str) -> str:
    """The host part of a worker URL, unresolved; an IPv6 literal keeps its brackets."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def rooms_for(batch: int | None, rng: random.Random) -> int | list[int]:
    """A fresh room, or distinct fresh rooms for a batch."""
    if batch is None:
        return rng.randint(0, MAX_ROOM)
    rooms: set[int] = set()
    while len(rooms) < batch:
        rooms.add(rng.randint(0, MAX_ROOM))
    return list(rooms)


def bootstrap_fields(
    host: str, port: int | None, rooms: int | list[int], batch: int | None
) -> dict[str, Any]:
    if batch is None:
        return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": rooms}
    return {"bootstrap_host": [host] * batch, "bootstrap_port": [port] * batch,
            "bootstrap_room": rooms}  # fmt: skip


def splice(body: bytes, empty: bool, fields: dict[str, Any]) -> bytes:
    """`body` (a JSON object's bytes) with `fields` added as its last members."""
    end = body.rstrip().rindex(b"}")
    members = orjson.dumps(fields)[1:-1]  # `"k":v,...` without the braces
    return b"".join((body[:end], b"" if empty else b",", members, b"}"))
