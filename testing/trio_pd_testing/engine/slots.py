"""Decode slots: max_running KV preallocations per DP rank, a FIFO queue beyond them."""

from __future__ import annotations

import collections

import trio


class SlotPool:
    """A FIFO counting semaphore that reports how many slots are taken and how many wait.

    A released slot is handed straight to the oldest waiter, so later arrivals never overtake.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("max_running must be at least 1")
        self.size = size
        self.running = 0
        self._waiters: collections.deque[trio.Event] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.running < self.size and not self._waiters:
            self.running += 1
            await trio.lowlevel.checkpoint()
            return
        granted = trio.Event()
        self._waiters.append(granted)
        try:
            await granted.wait()
        except BaseException:
            if granted.is_set():  # handed over, but we are leaving: pass it on
                self.release()
            else:
                self._waiters.remove(granted)
            raise

    def release(self) -> None:
        if self._waiters:
            self._waiters.popleft().set()  # the slot changes hands; `running` stays
        else:
            self.running -= 1
