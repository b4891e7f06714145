"""The fields the router writes into a client's body for one attempt (docs/protocol.md §2, §10,
§11).

`bootstrap_host`, `bootstrap_port` and a fresh random `bootstrap_room` per attempt (lists of the
batch's length for batches, distinct rooms), the request's `rid` on the legs, and with
`--dp-aware` the DP ranks (SGLang's names: prefill `routed_dp_rank`; decode `routed_dp_rank`
and `disagg_prefill_dp_rank`, the prefill rank holding its KV cache). They are
written as bytes just before the body's closing brace: the client's own bytes pass through
untouched (`payload.inspect_body` already removed any key the router owns), so every value a
client sent reaches the workers exactly as sent.
"""

from __future__ import annotations

import random
import secrets
from typing import Any
from urllib.parse import urlsplit

import orjson

MAX_ROOM = 2**63 - 1  # rooms are drawn from [1, MAX_ROOM]: 0 is the decode's "not yet" sentinel
RID_PREFIX = "trio-pd-"
RID_LENGTH = len(RID_PREFIX) + 32  # a fixed length: no attempt's rid is a prefix of another's


def bootstrap_host(url: str) -> str:
    """The host part of a worker URL, unresolved; an IPv6 literal keeps its brackets."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def rooms_for(
    batch: int | None, rng: random.Random, dp_size: int = 1, rank: int = 0
) -> int | list[int]:
    """A fresh room, or distinct fresh rooms for a batch.

    With a prefill of `dp_size` ranks and a chosen `rank`, every room satisfies
    `room % dp_size == rank` (engines that derive the rank from the room then agree with the
    rank the router pinned); the other bits stay random."""
    if batch is None:
        return _room(rng, dp_size, rank)
    rooms: set[int] = set()
    while len(rooms) < batch:
        rooms.add(_room(rng, dp_size, rank))
    return list(rooms)


def _room(rng: random.Random, dp_size: int, rank: int) -> int:
    """A room in [1, MAX_ROOM] (SGLang's decode reads room 0 as "metadata not yet written",
    `disaggregation/utils.py`), `room % dp_size == rank` when aligned."""
    if dp_size <= 1:
        return rng.randint(1, MAX_ROOM)
    # Multiples of dp_size plus rank; for rank 0 the lowest multiple is skipped (room 0).
    low = 1 if rank == 0 else 0
    return rng.randrange(low, MAX_ROOM // dp_size) * dp_size + rank


def attempt_rids(batch: int | None) -> str | list[str]:
    """The SGLang `rid` of one attempt's legs: the router's own, fresh for every attempt.

    The engine matches an abort by prefix (`req.rid.startswith(abort.rid)`,
    `managers/scheduler.py`), so no live rid may be a prefix of another: a single request gets
    `trio-pd-<32 random hex>`, a fixed length no other rid of that form can extend; a batch
    gets one rid per item, `<base>-<i>` with the index zero-padded to one width, so no item
    extends another and no item can extend another request's rid (its base is random). The
    client's own `rid` never reaches an engine: another client could otherwise collide with
    it or have the router abort it (docs/protocol.md §10)."""
    base = RID_PREFIX + secrets.token_hex(16)
    if batch is None:
        return base
    width = len(str(max(batch - 1, 0)))
    return [f"{base}-{i:0{width}d}" for i in range(batch)]


def bootstrap_fields(
    host: str, port: int | None, rooms: int | list[int], batch: int | None
) -> dict[str, Any]:
    if batch is None:
        return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": rooms}
    return {"bootstrap_host": [host] * batch, "bootstrap_port": [port] * batch,
            "bootstrap_room": rooms}  # fmt: skip


def splice(body: bytes, empty: bool, fields: dict[str, Any]) -> bytes:
    """`body` (a JSON object's bytes) with `fields` added as its last members."""
    end = body.rindex(b"}")  # a JSON object's closing brace: only whitespace may follow it
    members = orjson.dumps(fields)[1:-1]  # `"k":v,...` without the braces
    return b"".join((memoryview(body)[:end], b"" if empty else b",", members, b"}"))


DP_KEYS = frozenset(("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"))


def dp_fields(
    prefill_dp: int, prefill_rank: int, decode_dp: int, decode_rank: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rank fields of each leg, for workers that have ranks (SMG's injection)."""
    prefill: dict[str, Any] = {}
    decode: dict[str, Any] = {}
    if prefill_dp > 1:
        prefill["routed_dp_rank"] = prefill_rank
        decode["disagg_prefill_dp_rank"] = prefill_rank
    if decode_dp > 1:
        decode["routed_dp_rank"] = decode_rank
    return prefill, decode
