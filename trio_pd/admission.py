"""Admission control: SMG's token bucket with a bounded FIFO line in front of it.

As in SMG 0.3.2 (`maybe_rate_limiter` in `src/app_context.rs`, `concurrency_limit_middleware`
in `src/middleware.rs`): with `--max-concurrent-requests` N > 0 a generation request must take a
token from a bucket of N tokens refilled at `--rate-limit-tokens-per-second` (default N; SMG
also turns 0 into N, trio_pd makes 0 a plain concurrency limit, see `token_bucket.py`) and gives
it back when its response has ended. Without a token it waits in line (at most
`--queue-size`, 0: no line) for at most `--queue-timeout-secs`:

- no room in line: 429, as SMG;
- the wait runs out: 408, as SMG (its queue answers `REQUEST_TIMEOUT`).

Both come with the JSON envelope and `Retry-After: 1` (SMG sends an empty body), before any
worker is touched. trio_pd's line is bounded and fair: SMG's queue is a channel its processor
drains at once into one waiting task per request, so neither its size nor the order holds, and a
waiter whose first computed wait passes without a token gets 408 before its timeout. A client
that leaves while in line simply leaves it: its wait is cancelled with the rest of its request.
"""

from __future__ import annotations

import trio
from prometheus_client import Histogram

from trio_pd.errors import RouterError
from trio_pd.token_bucket import TokenBucket

RETRY_AFTER_SECS = b"1"


def overloaded(message: str) -> RouterError:
    return RouterError(
        429, message, "rate_limit_error", headers=((b"retry-after", RETRY_AFTER_SECS),)
    )


def queue_timed_out(message: str) -> RouterError:
    return RouterError(408, message, "timeout_error", headers=((b"retry-after", RETRY_AFTER_SECS),))


def bucket_rate(max_concurrent: int, tokens_per_second: float | None) -> float:
    """The refill rate for a bucket of `max_concurrent` tokens: the flag, else the capacity."""
    return float(max_concurrent) if tokens_per_second is None else float(tokens_per_second)


class Admission:
    def __init__(
        self,
        max_concurrent: int,
        queue_size: int,
        queue_timeout_secs: float,
        waits: Histogram | None = None,
        tokens_per_second: float | None = None,
    ) -> None:
        self.bucket = (
            TokenBucket(max_concurrent, bucket_rate(max_concurrent, tokens_per_second))
            if max_concurrent > 0
            else None
        )
        self.queue_size = queue_size
        self.queue_timeout_secs = queue_timeout_secs
        self.waiting = 0
        self.waits = waits  # trio_pd_admission_wait_seconds{outcome}
        self._line = trio.Lock()  # fair: the longest waiter takes the next token

    def slot(self) -> Slot:
        """`async with admission.slot()`: hold one token for the block, or raise the 429 or
        408 to answer."""
        return Slot(self)

    async def _wait_in_line(self, bucket: TokenBucket) -> None:
        if self.waiting >= self.queue_size:
            self._observe("rejected", 0.0)
            if self.queue_size <= 0:
                raise overloaded("too many requests: no token left and no queue") from None
            raise overloaded(f"too many requests: {self.queue_size} already waiting") from None
        self.waiting += 1
        started = trio.current_time()
        outcome = "cancelled"  # the client left while queued
        try:
            with trio.move_on_after(self.queue_timeout_secs):
                async with self._line:
                    await bucket.take()
                outcome = "admitted"
                return
            outcome = "timed_out"
        finally:
            self.waiting -= 1
            self._observe(outcome, trio.current_time() - started)
        raise queue_timed_out(f"no capacity within {self.queue_timeout_secs:g}s in the queue")

    def _observe(self, outcome: str, waited: float) -> None:
        if self.waits is not None:
            self.waits.labels(outcome).observe(waited)


class Slot:
    """One admission (a class, not a generator: it is on every request's path)."""

    __slots__ = ("_admission", "_held")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held: TokenBucket | None = None

    async def __aenter__(self) -> None:
        admission = self._admission
        bucket = admission.bucket
        if bucket is None:
            return
        # Nobody in line and a token: take it. Otherwise queue behind those already waiting.
        if not (admission.waiting == 0 and bucket.try_take()):
            await admission._wait_in_line(bucket)
        self._held = bucket

    async def __aexit__(self, *exc_info: object) -> None:
        if self._held is not None:
            self._held.give_back()
            self._held = None
