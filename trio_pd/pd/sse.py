"""Server-Sent Events out of a worker's byte stream, each byte scanned once, each event bounded.

A worker's events arrive in network reads that need not end where events do. The reader keeps
the partial event and remembers how far it has already looked for the blank line that ends an
event, so a new read is scanned only from there (less the three bytes a terminator can straddle):
reading an event of N bytes in pieces costs O(N), not the O(N²) of re-scanning (and re-copying)
the whole buffer on every read. A partial event larger than the reader's limit
(`--max-sse-event-bytes`) raises `EventTooLarge`: the worker's fault, and the end of its leg. The
partial event is charged to the request's memory budget as it grows (`budget.Holding`).

Events end with a blank line, `\\n\\n` or `\\r\\n\\r\\n` (what engines send; SGLang writes
`data: <json>\\n\\n`, one JSON object an event).
"""

from __future__ import annotations

from trio_pd.pd.budget import Account, Holding


class EventTooLarge(Exception):
    """A worker's SSE event grew beyond the limit before it ended."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"an SSE event larger than {limit} bytes (--max-sse-event-bytes)")
        self.limit = limit


def event_end(data: bytes | bytearray, start: int) -> int:
    """The index just past the first event terminator at or after `start`, or -1."""
    lf = data.find(b"\n\n", start)
    # A CRLF terminator that ends first must begin before the LF one: look only up to there, so
    # bytes after the first event are not scanned once per event.
    crlf = data.find(b"\r\n\r\n", start, len(data) if lf == -1 else lf + 4)
    if crlf != -1:
        return crlf + 4
    return -1 if lf == -1 else lf + 2


class EventReader:
    """Complete events out of successive chunks; the partial rest is kept for the next one."""

    __slots__ = ("_holding", "_pending", "_scanned", "limit")

    def __init__(self, limit: int, account: Account | None = None) -> None:
        self.limit = limit
        self._pending = bytearray()
        self._scanned = 0  # bytes of _pending already searched for a terminator
        self._holding = Holding(account)

    @property
    def pending(self) -> bytes:
        """The bytes after the last complete event."""
        return bytes(self._pending)

    def feed(self, chunk: bytes, first_only: bool = False) -> list[bytes]:
        """The events `chunk` completes, in order, each with its terminator (with `first_only`,
        at most one: the rest stays in `pending`). Raises EventTooLarge, or the budget's
        OverBudget when the partial event cannot be held."""
        pending = self._pending
        if pending:
            pending += chunk
            data: bytes | bytearray = pending
            start = max(0, self._scanned - 3)
        else:
            data = chunk
            start = 0
        events: list[bytes] = []
        begin = 0
        limit = self.limit
        while True:
            cut = event_end(data, start)
            if cut == -1:
                break
            if cut - begin > limit:
                raise EventTooLarge(limit)
            with memoryview(data) as view:  # one copy of the event, not two
                events.append(bytes(view[begin:cut]))
            begin = start = cut
            if first_only:
                break
        rest = len(data) - begin
        if data is chunk:
            if rest:
                pending += memoryview(chunk)[begin:]
        elif begin:
            del pending[:begin]
        if first_only and events:
            self._scanned = 0  # the rest is not scanned yet (the caller relays it raw)
            return events
        # Past the last event found, nothing before the end was a terminator.
        self._scanned = rest
        if rest > limit:
            raise EventTooLarge(limit)
        self._holding.resize(rest)
        return events

    def close(self) -> None:
        """Drop the partial event (and give its budget back)."""
        self._pending = bytearray()
        self._scanned = 0
        self._holding.drop()
