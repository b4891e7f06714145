"""SMG's token bucket (`src/core/token_bucket.rs` at sglang-router 0.3.2), on trio's clock.

It is SMG's whole admission control: `--max-concurrent-requests` is the capacity, the bucket
starts full, `--rate-limit-tokens-per-second` (default: the capacity) refills it continuously,
never beyond the capacity. A request takes one token when it is admitted and gives it back when
its response has ended (SMG's `TokenGuardBody`: after the last byte of a stream). So the bucket
bounds requests in flight only for the first second of a burst: every second, refill lets in
up to `rate` more even while all earlier requests still run. A token given back to a full
bucket is lost, as in SMG.

A rate of 0 is a plain semaphore: tokens come back only when requests end (SMG documents 0 as
"pure concurrency limiting" in this file and in its config validation, but 0.3.2's
`app_context.rs` replaces it with the capacity; see `admission.py`).

Time is `trio.current_time()`, so tests drive refill with trio's MockClock.
"""

from __future__ import annotations

import math

import trio

# Floating point: a refill computed for exactly one token may land a hair below 1.0.
_EPSILON = 1e-9


class TokenBucket:
    def __init__(self, capacity: float, rate: float) -> None:
        if capacity <= 0 or rate < 0:
            raise ValueError(f"token bucket needs capacity > 0 and rate >= 0: {capacity}, {rate}")
        self.capacity = float(capacity)
        self.rate = float(rate)
        self._tokens = float(capacity)
        self._refilled_at: float | None = None  # set on first use, inside trio
        self._returned = trio.lowlevel.ParkingLot()  # waiters woken by a token given back

    @property
    def tokens(self) -> float:
        """Tokens available now (after refill)."""
        self._refill()
        return self._tokens

    def try_take(self) -> bool:
        """Take one token if there is one; never waits."""
        self._refill()
        if self._tokens >= 1.0 - _EPSILON:
            self._tokens -= 1.0
            return True
        return False

    async def take(self) -> None:
        """Take one token, waiting for refill or for one given back (callers bound the wait).

        Meant for one waiter at a time (admission queues the others behind a fair lock)."""
        while not self.try_take():
            missing = 1.0 - self._tokens
            wait = missing / self.rate if self.rate > 0 else math.inf
            with trio.move_on_after(wait):
                await self._returned.park()

    def give_back(self) -> None:
        """A request ended: its token returns (capped at the capacity). Synchronous, so it also
        runs in cancelled or shielded code."""
        self._refill()
        self._tokens = min(self.capacity, self._tokens + 1.0)
        self._returned.unpark_all()

    def _refill(self) -> None:
        now = trio.current_time()
        if self._refilled_at is not None and self.rate > 0:
            self._tokens = min(self.capacity, self._tokens + (now - self._refilled_at) * self.rate)
        self._refilled_at = now
