"""The engine's event log: bounded in memory, optionally mirrored to a JSON-lines file."""

from __future__ import annotations

import collections
import time
from typing import IO, Any

import orjson
import trio

MAX_RECORDS = 100_000


class EventLog:
    """Append-only record of what an engine did; tests and the demo read it.

    `emit` is synchronous so it can be called from any point (including `finally` blocks under
    cancellation). Waiters are woken through a trio.Event that is replaced on every emit.
    """

    def __init__(self, role: str, path: str | None = None, maxlen: int = MAX_RECORDS) -> None:
        self.role = role
        self._records: collections.deque[dict[str, Any]] = collections.deque(maxlen=maxlen)
        self._changed = trio.Event()
        self._file: IO[bytes] | None = open(path, "ab") if path else None  # noqa: SIM115

    def emit(self, event: str, *, rid: str | None = None, room: int | None = None, **fields: Any):
        record: dict[str, Any] = {
            "event": event,
            "t": time.monotonic(),
            "wall": time.time(),
            "role": self.role,
            "rid": rid,
            "room": room,
        }
        record.update(fields)
        self._records.append(record)
        if self._file is not None:
            self._file.write(orjson.dumps(record, default=str) + b"\n")
            self._file.flush()
        self._changed.set()
        self._changed = trio.Event()
        return record

    @property
    def records(self) -> list[dict[str, Any]]:
        return list(self._records)

    def find(self, event: str | None = None, **fields: Any) -> list[dict[str, Any]]:
        return [r for r in self._records if _matches(r, event, fields)]

    async def wait_for(
        self,
        event: str | None = None,
        timeout: float = 10.0,  # noqa: ASYNC109 - the public API the router tests use
        **fields: Any,
    ) -> dict[str, Any]:
        """The first record (past or future) matching; raises trio.TooSlowError after timeout."""
        with trio.fail_after(timeout):
            while True:
                for record in self._records:
                    if _matches(record, event, fields):
                        return record
                # no checkpoint between the scan and the wait, so no emit can be missed
                await self._changed.wait()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _matches(record: dict[str, Any], event: str | None, fields: dict[str, Any]) -> bool:
    if event is not None and record.get("event") != event:
        return False
    return all(k in record and record[k] == v for k, v in fields.items())
