"""Admission control: `--max-concurrent-requests` with a bounded FIFO queue in front of it.

Beyond the limit a request waits in line (at most `--queue-size` of them, each at most
`--queue-timeout-secs`); a full queue or a wait that runs out is answered 429 with Retry-After,
before any worker is touched. A client that leaves while queued simply leaves the line: its wait
is cancelled with the rest of its request.
"""

from __future__ import annotations

import trio
from prometheus_client import Histogram

from trio_pd.errors import RouterError

RETRY_AFTER_SECS = b"1"


def overloaded(message: str) -> RouterError:
    return RouterError(
        429, message, "rate_limit_error", headers=((b"retry-after", RETRY_AFTER_SECS),)
    )


class Admission:
    def __init__(
        self,
        max_concurrent: int,
        queue_size: int,
        queue_timeout_secs: float,
        waits: Histogram | None = None,
    ) -> None:
        self.limiter = trio.CapacityLimiter(max_concurrent) if max_concurrent > 0 else None
        self.queue_size = queue_size
        self.queue_timeout_secs = queue_timeout_secs
        self.waiting = 0
        self.waits = waits  # trio_pd_admission_wait_seconds{outcome}

    def slot(self) -> Slot:
        """`async with admission.slot()`: hold one of the concurrent slots for the block, or
        raise the 429 to answer."""
        return Slot(self)

    async def _wait_in_line(self, limiter: trio.CapacityLimiter) -> None:
        if self.waiting >= self.queue_size:
            self._observe("rejected", 0.0)
            raise overloaded(f"too many requests: {self.queue_size} already waiting") from None
        self.waiting += 1
        started = trio.current_time()
        outcome = "cancelled"  # the client left while queued
        try:
            with trio.move_on_after(self.queue_timeout_secs):
                await limiter.acquire()
                outcome = "admitted"
                return
            outcome = "timed_out"
        finally:
            self.waiting -= 1
            self._observe(outcome, trio.current_time() - started)
        raise overloaded(f"no capacity within {self.queue_timeout_secs:g}s in the queue")

    def _observe(self, outcome: str, waited: float) -> None:
        if self.waits is not None:
            self.waits.labels(outcome).observe(waited)


class Slot:
    """One admission (a class, not a generator: it is on every request's path)."""

    __slots__ = ("_admission", "_held")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held: trio.CapacityLimiter | None = None

    async def __aenter__(self) -> None:
        limiter = self._admission.limiter
        if limiter is None:
            return
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:
            await self._admission._wait_in_line(limiter)
        self._held = limiter

    async def __aexit__(self, *exc_info: object) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None
