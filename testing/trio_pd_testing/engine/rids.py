"""SGLang request ids (the body field `rid`): how the engine normalizes them, and the table of
the ids its tokenizer manager holds.

Normalization (`managers/io_struct.py` `_normalize_rid`, `_validate_rid_uniqueness`):
- a single request (one scalar prompt, n == 1): the rid as given, else a fresh uuid4 hex;
- a batch (a list of prompts, or n > 1): a string `X` becomes `X_0 ... X_<num-1>` where num is
  batch_size x n; a list must have exactly batch_size entries (the number of PROMPTS, not n:
  "The specified rids length mismatch with the batch_size for batch processing."); absent,
  num uuids. Ids repeated inside one request are refused.

Registration (`tokenizer_manager.py` `_init_req_state`): every normalized rid is registered at
once, and a rid already registered is refused ("Duplicate request ID detected: <rid>"). With
n > 1 SGLang then runs each prompt's samples under REGENERATED rids (`regenerate_rid`, uuid4
hex) and drops the registered ones, so an abort by the client's rid cannot reach the samples.

The table maps each registered rid to its state: which item of which request, whether the
request reached the scheduler (`dispatched`) and whether an abort was already sent for it
(`abort_sent`, the latch of tokenizer_manager.abort_request: see tokenizer.py).
"""

from __future__ import annotations

import collections
import uuid
from typing import Any, Generic, TypeVar

import attrs

from trio_pd_testing.engine.workload import BadRequest, Refused, Workload

Owner = TypeVar("Owner")


class DuplicateRid(Refused):
    """A request carries a rid the engine already holds."""

    def __init__(self, rid: str) -> None:
        super().__init__(f"Duplicate request ID detected: {rid}")
        self.rid = rid


class UnhashableRid(Exception):
    """A list rid on a single request: SGLang's `rid in rid_to_state` raises TypeError (500)."""


def new_rid() -> str:
    return uuid.uuid4().hex


def normalize_rids(value: Any, workload: Workload) -> tuple[str, ...]:
    """The rids the engine registers for this request (see the module docstring)."""
    if value is not None and not (
        isinstance(value, str)
        or (isinstance(value, list) and all(isinstance(r, str) for r in value))
    ):
        raise BadRequest("rid must be a string or a list of strings")
    if not workload.is_batch:
        if isinstance(value, list):
            raise UnhashableRid("unhashable type: 'list'")
        return (value if value is not None else new_rid(),)
    num = workload.size
    if value is None:
        return tuple(new_rid() for _ in range(num))
    if isinstance(value, str):
        rids = tuple(f"{value}_{i}" for i in range(num))
    else:
        if len(value) != workload.batch_size:
            raise Refused(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        rids = tuple(value)
    counts = collections.Counter(rids)
    duplicates = [rid for rid, count in counts.items() if count > 1]
    if duplicates:
        raise Refused(f"Duplicate request IDs detected within the request: {duplicates}")
    return rids


@attrs.define(eq=False)
class RidState(Generic[Owner]):
    owner: Owner
    dispatched: bool = False  # the request reached the scheduler
    abort_sent: bool = False  # an abort for this rid went to the scheduler: later ones are dropped


class RidTable(Generic[Owner]):
    """The rids the tokenizer manager holds, each with its state."""

    def __init__(self) -> None:
        self._held: dict[str, RidState[Owner]] = {}

    def register(self, pairs: list[tuple[str, Owner]]) -> None:
        """Hold every (rid, owner), or none of them (DuplicateRid names the first held)."""
        for rid, _ in pairs:
            if rid in self._held:
                raise DuplicateRid(rid)
        for rid, owner in pairs:
            self._held[rid] = RidState(owner)

    def release(self, rids: tuple[str, ...] | list[str], owner: Owner) -> None:
        for rid in rids:
            state = self._held.get(rid)
            if state is not None and state.owner is owner:
                del self._held[rid]

    def get(self, rid: str) -> RidState[Owner] | None:
        return self._held.get(rid)

    def __contains__(self, rid: str) -> bool:
        return rid in self._held

    def __len__(self) -> int:
        return len(self._held)
