"""SGLang request ids (the body field `rid`) and the table of the ids an engine holds.

SGLang names each request by `rid`: the client's (a string, or a list for a batch: one per item)
or one the engine generates. The engine refuses a new request whose rid it already holds
("Duplicate request ID: ...", 400), and POST /abort_request finds requests by it. It is not the
`x-request-id` header, which stays the simulator's event key (the `rid` field of events).
"""

from __future__ import annotations

import uuid
from typing import Any, Generic, TypeVar

from trio_pd.testing.engine.workload import BadRequest

Owner = TypeVar("Owner")


class DuplicateRid(Exception):
    """A request carries a rid the engine already holds."""

    def __init__(self, rid: str) -> None:
        super().__init__(f"Duplicate request ID: {rid}")
        self.rid = rid


def parse_rids(value: Any, size: int, is_batch: bool) -> tuple[str, ...]:
    """One rid per item, as SGLang normalizes them (GenerateReqInput._normalize_rid).

    Absent: generated (uuid4 hex, cannot collide). A string on a batch becomes `<rid>_<i>`.
    A list must have one string per item. Ids repeated inside one request are refused.
    """
    if value is None:
        return tuple(uuid.uuid4().hex for _ in range(size))
    if isinstance(value, str):
        rids = (value,) if not is_batch else tuple(f"{value}_{i}" for i in range(size))
    elif isinstance(value, list) and all(isinstance(r, str) for r in value):
        if len(value) != size:
            raise BadRequest(f"rid must be a list of {size} strings for this request")
        rids = tuple(value)
    else:
        raise BadRequest("rid must be a string or a list of strings")
    if len(set(rids)) != len(rids):
        raise BadRequest(f"rid values must be distinct within one request: {list(rids)}")
    return rids


class RidTable(Generic[Owner]):
    """The rids of the requests an engine currently holds, each mapped to its request."""

    def __init__(self) -> None:
        self._held: dict[str, Owner] = {}

    def claim(self, rids: tuple[str, ...], owner: Owner) -> None:
        """Hold all of `rids` for `owner`, or none of them (DuplicateRid names the first held)."""
        for rid in rids:
            if rid in self._held:
                raise DuplicateRid(rid)
        for rid in rids:
            self._held[rid] = owner

    def release(self, rids: tuple[str, ...], owner: Owner) -> None:
        for rid in rids:
            if self._held.get(rid) is owner:
                del self._held[rid]

    def get(self, rid: str) -> Owner | None:
        return self._held.get(rid)

    def owners(self) -> list[Owner]:
        """Every request held, once each, oldest first."""
        seen: dict[int, Owner] = {}
        for owner in self._held.values():
            seen.setdefault(id(owner), owner)
        return list(seen.values())

    def __len__(self) -> int:
        return len(self._held)
