"""A token bucket on trio's clock: `--rate-limit-tokens-per-second` (see `admission.py`).

SMG's bucket (`src/core/token_bucket.rs` at sglang-router 0.3.2) is the model: it starts full at
its capacity (`--max-concurrent-requests`) and refills continuously at `rate` tokens a second,
never beyond the capacity. Here a token is spent, never given back: the bucket limits how fast
requests are admitted (a burst of `capacity`, then `rate` a second), and the concurrency cap
beside it bounds how many run. SMG gives each token back when its request ends, which makes the
bucket a concurrency limit that refill loosens; `admission.py` says why trio_pd splits the two.

Time is `trio.current_time()`, so tests drive refill with trio's MockClock.
"""

from __future__ import annotations

import trio

# Floating point: a refill computed for exactly one token may land a hair below 1.0.
_EPSILON = 1e-9


class TokenBucket:
    def __init__(self, capacity: float, rate: float) -> None:
        if capacity <= 0 or rate <= 0:
            raise ValueError(f"token bucket needs capacity > 0 and rate > 0: {capacity}, {rate}")
        self.capacity = float(capacity)
        self.rate = float(rate)
        self._tokens = float(capacity)
        self._refilled_at: float | None = None  # set on first use, inside trio

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
        """Take one token, waiting for the refill that brings it (callers bound the wait).

        Meant for one taker at a time (admission queues the others behind a fair lock and takes
        nothing past them), so the token refilled during the wait is this caller's."""
        missing = 1.0 - self.tokens
        if missing > _EPSILON:
            await trio.sleep(missing / self.rate)
            self._refill()
        self._tokens -= 1.0

    def _refill(self) -> None:
        now = trio.current_time()
        if self._refilled_at is not None:
            self._tokens = min(self.capacity, self._tokens + (now - self._refilled_at) * self.rate)
        self._refilled_at = now
