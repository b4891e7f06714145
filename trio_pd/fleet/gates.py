"""Admission gates on the PD path (docs/overload.md): the per-prefill in-flight cap with its FIFO
queue (`--prefill-max-inflight-requests-per-worker`) and the decode's running-window gate
(`--pd-admission-wait-secs`). Bookkeeping on trio time; no HTTP.

Both hand out a `Slot` whose `release()` is idempotent: the leg it covers releases it when it
ends (`Tracked`), the attempt once more in case the leg never started, so nothing leaks on any
way out (a cancelled wait takes its place out of the line in a `finally`).

Prefill: selection happens at the head of the line. A request that finds nobody waiting and a
prefill with a free slot goes at once; otherwise it queues (at most `--prefill-queue-size`),
and only the head selects, among the workers with a free slot, whenever a slot is released or
`HEAD_RECHECK_SECS` passed (SMG's HEAD_RECHECK_INTERVAL: membership and health change too).
The slot covers the prefill leg only: it is freed when the prefill phase ends, not when the
decode does.

Decode: a dispatch claims its rooms (1, or the batch's size) in the decode's running window,
`max_running_requests` x DP width as the engine reports it (`/server_info`). The window's use
is the router's own claims, or the engine's reported running requests when they are more
(other routers' requests), while that report is fresh and younger than this router's last
release on the decode (an older one still counts the released request). A claim that does not
fit waits, first come first served per decode, for `--pd-admission-wait-secs`; 0, or an engine
that reports no window, is no gate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

from trio_pd.config import OverloadConfig
from trio_pd.fleet.worker import Worker

HEAD_RECHECK_SECS = 1.0


class QueueFull(Exception):
    """The prefill line is full (429)."""


class QueueTimeout(Exception):
    """No prefill slot freed within `--prefill-queue-timeout-secs` (429)."""


class WindowFull(Exception):
    """No place in the decode's running window freed within the wait (503)."""

    def __init__(self, worker: Worker, window: int, rooms: int) -> None:
        super().__init__(
            f"decode worker {worker.id} could not admit {rooms} request(s) within its running "
            f"window of {window}"
        )


class Slot:
    """Places held on one worker in one gate; `release()` gives them back (once)."""

    __slots__ = ("_count", "_gate", "worker")

    def __init__(self, gate: _Counted, worker: Worker, count: int) -> None:
        self._gate: _Counted | None = gate
        self.worker = worker
        self._count = count
        gate.held[worker] = gate.held.get(worker, 0) + count

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            left = gate.held.get(self.worker, 0) - self._count
            if left > 0:
                gate.held[self.worker] = left
            else:
                gate.held.pop(self.worker, None)
            gate.released_at[self.worker] = trio.current_time()
            gate.wake(self.worker)


class _Counted:
    """What a gate counts per worker, and the line of waits it wakes."""

    def __init__(self) -> None:
        self.held: dict[Worker, int] = {}
        self.released_at: dict[Worker, float] = {}  # the last release of a place on a worker
        self.line: deque[tuple[Worker | None, trio.Event]] = deque()

    def wake(self, worker: Worker | None) -> None:
        """Wake the head of the line (of `worker`'s, for a per-worker line)."""
        for waiting_for, event in self.line:
            if worker is None or waiting_for is None or waiting_for is worker:
                event.set()
                return


Select = Callable[[Callable[[Worker], bool]], Worker]


class PrefillGate(_Counted):
    def __init__(self, cap: int, size: int, timeout_secs: float) -> None:
        super().__init__()
        self.cap, self.size, self.timeout_secs = cap, size, timeout_secs

    def has_room(self, worker: Worker) -> bool:
        return self.held.get(worker, 0) < self.cap

    @property
    def waiting(self) -> int:
        return len(self.line)

    async def admit(self, select: Select) -> Slot:
        """A slot on the worker `select` picks among those with room; `select` raises when
        none has room (`AtCapacity`) or none can take the request at all (passed on)."""
        from_head = self._try(select) if not self.line else None
        if from_head is not None:
            return from_head
        if len(self.line) >= self.size:
            raise QueueFull(f"{self.size} requests already wait for a prefill slot")
        place: tuple[Worker | None, trio.Event] = (None, trio.Event())
        self.line.append(place)
        try:
            with trio.move_on_after(self.timeout_secs):
                while True:
                    if self.line[0] is place:
                        slot = self._try(select)
                        if slot is not None:
                            return slot
                    with trio.move_on_after(HEAD_RECHECK_SECS):
                        await place[1].wait()
                    place = self._renew(place)
            raise QueueTimeout(f"no prefill slot freed within {self.timeout_secs:g}s")
        finally:
            self._leave(place)

    def _try(self, select: Select) -> Slot | None:
        try:
            worker = select(self.has_room)
        except AtCapacity:
            return None
        return Slot(self, worker, 1)

    def _renew(self, place: tuple[Worker | None, trio.Event]) -> tuple[Worker | None, trio.Event]:
        fresh = (place[0], trio.Event())
        index = self.line.index(place)
        self.line[index] = fresh
        return fresh

    def _leave(self, place: tuple[Worker | None, trio.Event]) -> None:
        if place in self.line:
            was_head = self.line[0] is place
            self.line.remove(place)
            if was_head:
                self.wake(None)  # the next one is the head now


class AtCapacity(Exception):
    """No candidate prefill has a free slot (raised by the selection the gate hands over)."""


class DecodeGate(_Counted):
    def __init__(self, wait_secs: float) -> None:
        super().__init__()
        self.wait_secs = wait_secs

    @staticmethod
    def window(worker: Worker) -> int | None:
        per_rank = worker.server_info.max_running_requests
        return per_rank * max(1, worker.dp_size) if per_rank else None

    def used(self, worker: Worker) -> int:
        """The router's claims, or the engine's running requests while fresh and taken after
        this router's last release on the decode, the larger. A figure from before that release
        still counts the request released: read, it would keep the freed place closed until the
        next poll (or the whole wait)."""
        claimed = self.held.get(worker, 0)
        load, at = worker.engine_load, worker.reported_at
        released = self.released_at.get(worker)
        if (
            load is not None
            and at is not None
            and trio.current_time() - at < worker.load_fresh_secs
            and (released is None or at >= released)
        ):
            return max(claimed, sum(rank.running for rank in load.ranks))
        return claimed

    def fits(self, worker: Worker, window: int, rooms: int) -> bool:
        # A claim wider than the whole window goes alone (an idle window), never forever out.
        used = self.used(worker)
        return used + rooms <= window or (used == 0 and self.held.get(worker, 0) == 0)

    async def admit(self, worker: Worker, rooms: int) -> Slot | None:
        """Rooms claimed on `worker`, waiting first come first served for them; None: no gate
        (off, or the engine reports no window)."""
        window = self.window(worker)
        if self.wait_secs <= 0 or window is None:
            return None
        ahead = any(w is worker for w, _ in self.line)
        if not ahead and self.fits(worker, window, rooms):
            return Slot(self, worker, rooms)
        place: tuple[Worker | None, trio.Event] = (worker, trio.Event())
        self.line.append(place)
        try:
            with trio.move_on_after(self.wait_secs):
                while True:
                    first = next(p for p in self.line if p[0] is worker)
                    if first is place and self.fits(worker, window, rooms):
                        return Slot(self, worker, rooms)
                    # Engine-reported running falls with no release here: look again.
                    with trio.move_on_after(HEAD_RECHECK_SECS / 20):
                        await place[1].wait()
                    index = self.line.index(place)
                    place = (worker, trio.Event())
                    self.line[index] = place
            raise WindowFull(worker, window, rooms)
        finally:
            if place in self.line:
                self.line.remove(place)
                self.wake(worker)


class Gates:
    """One process's gates, from its config."""

    def __init__(self, config: OverloadConfig) -> None:
        cap = config.prefill_cap
        self.prefill = PrefillGate(cap, *config.prefill_line) if cap is not None else None
        self.decode = DecodeGate(config.pd_admission_wait_secs)
