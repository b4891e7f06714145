"""Bootstrap injection (PROTOCOL.md §2): where decode finds prefill's KV cache for a request."""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import urlsplit

MAX_ROOM = 2**63 - 1


def bootstrap_host(url: str) -> str:
    """The host part of a worker URL, unresolved; an IPv6 literal keeps its brackets."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def inject(
    payload: dict[str, Any],
    host: str,
    port: int | None,
    batch: int | None,
    rng: random.Random,
) -> None:
    """Overwrite the three bootstrap fields in place, with fresh random rooms.

    Client-supplied values are replaced on purpose: a duplicated room crashes engines.
    """
    if batch is None:
        payload["bootstrap_host"] = host
        payload["bootstrap_port"] = port
        payload["bootstrap_room"] = rng.randint(0, MAX_ROOM)
    else:
        payload["bootstrap_host"] = [host] * batch
        payload["bootstrap_port"] = [port] * batch
        payload["bootstrap_room"] = fresh_rooms(batch, rng)


def fresh_rooms(count: int, rng: random.Random) -> list[int]:
    """Distinct random rooms for one batch."""
    rooms: set[int] = set()
    while len(rooms) < count:
        rooms.add(rng.randint(0, MAX_ROOM))
    return list(rooms)
