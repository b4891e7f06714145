"""Admission control: a cap on requests in flight, an optional rate limit, and a bounded FIFO
line in front of both.

`--max-concurrent-requests` N > 0 is a cap: at most N generation requests run at once, each
holding its slot until its response has ended (a stream: until its last event). That is what
SGLang documents the flag to be and what an operator sets it for, protecting the engines. SMG
0.3.2 implements it as a token bucket (`maybe_rate_limiter` in `src/app_context.rs`,
`src/core/token_bucket.rs`): N tokens, each given back when its request ends, the bucket also
refilled at `--rate-limit-tokens-per-second` (default N). Its refill lets up to that many more
in every second while earlier requests still run, so SMG's cap holds only for the first second
of a burst; and beside a cap that holds, that bucket would have nothing left to do (a free slot
always finds a token).

So trio_pd splits the two meanings: the cap always holds, and `--rate-limit-tokens-per-second`
R > 0 (with a cap; SMG has no bucket without one) is a rate limit in front of it: a bucket of N
tokens refilled at R a second, one token spent per admitted request (`token_bucket.py`), so a
burst of N and then R requests a second. Without the flag, or with 0 (SGLang documents 0 as
"pure concurrency limiting"), there is no rate limit: the cap alone.

Without a slot or a token a request waits in line (at most `--queue-size`, 0: no line) for at
most `--queue-timeout-secs`:

- no room in line: 429, as SMG;
- the wait runs out: 408, as SMG (its queue answers `REQUEST_TIMEOUT`).

Both come with the JSON envelope and `Retry-After: 1` (SMG sends an empty body), before any
worker is touched. The line is bounded and fair (SMG's queue is a channel its processor drains
at once into one waiting task per request, so neither its size nor the order holds). A client
that leaves while in line simply leaves it: its wait is cancelled with the rest of its request.

The cap counts PD requests, not client requests: a request asking `n > 1` samples runs n PD
requests (`pd/samples.py`), so once its body is read it takes n - 1 slots more, at once or not
at all (`Slot.widen`): a 429 when they are not free now, a 400 when n exceeds the cap itself.
It never waits for them while holding its first slot (two such requests would each hold part
of what the other waits for). The rate limit counts client requests.
"""

from __future__ import annotations

import trio
from prometheus_client import Histogram

from trio_pd.edge.token_bucket import TokenBucket
from trio_pd.errors import RouterError, bad_request

RETRY_AFTER_SECS = b"1"


def overloaded(message: str) -> RouterError:
    return RouterError(
        429, message, "rate_limit_error", headers=((b"retry-after", RETRY_AFTER_SECS),)
    )


def queue_timed_out(message: str) -> RouterError:
    return RouterError(408, message, "timeout_error", headers=((b"retry-after", RETRY_AFTER_SECS),))


def rate_limit(max_concurrent: int, tokens_per_second: float | None) -> TokenBucket | None:
    """The bucket of `--rate-limit-tokens-per-second`, if it limits anything: a rate above 0
    beside a cap (its burst)."""
    if max_concurrent <= 0 or not tokens_per_second:
        return None
    return TokenBucket(max_concurrent, tokens_per_second)


class Admission:
    def __init__(
        self,
        max_concurrent: int,
        queue_size: int,
        queue_timeout_secs: float,
        waits: Histogram | None = None,
        tokens_per_second: float | None = None,
    ) -> None:
        self.limiter = trio.CapacityLimiter(max_concurrent) if max_concurrent > 0 else None
        self.bucket = rate_limit(max_concurrent, tokens_per_second)
        self.queue_size = queue_size
        self.queue_timeout_secs = queue_timeout_secs
        self.waiting = 0
        self.waits = waits  # trio_pd_admission_wait_seconds{outcome}
        self._line = trio.Lock()  # fair: the longest waiter takes the next slot and token

    def slot(self) -> Slot:
        """`async with admission.slot()`: hold a slot and a token for the block, or raise the
        429 or 408 to answer."""
        return Slot(self)

    def try_admit(self, limiter: trio.CapacityLimiter) -> bool:
        """A slot (and a token, with a rate limit) at once, or neither (never waits)."""
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:
            return False
        if self.bucket is None or self.bucket.try_take():
            return True
        limiter.release()
        return False

    async def _wait_in_line(self, limiter: trio.CapacityLimiter) -> None:
        if self.waiting >= self.queue_size:
            self._observe("rejected", 0.0)
            if self.queue_size <= 0:
                raise overloaded("too many requests: no room now and no queue") from None
            raise overloaded(f"too many requests: {self.queue_size} already waiting") from None
        self.waiting += 1
        started = trio.current_time()
        outcome = "cancelled"  # the client left while queued
        try:
            with trio.move_on_after(self.queue_timeout_secs):
                async with self._line:
                    await limiter.acquire()
                    if self.bucket is not None:
                        try:
                            await self.bucket.take()
                        except BaseException:
                            limiter.release()
                            raise
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

    __slots__ = ("_admission", "_extra", "_held")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held = False
        self._extra: list[object] = []  # the borrowers of the slots `widen` took

    def enter_now(self) -> bool:
        """Take the slot if that needs no wait (no cap, or room and nobody in line)."""
        admission = self._admission
        limiter = admission.limiter
        if limiter is None:
            return True
        if admission.waiting == 0 and admission.try_admit(limiter):
            self._held = True
            return True
        return False

    async def wait(self) -> None:
        """Wait in line for the slot (after `enter_now` said no), or raise the 429 or 408."""
        limiter = self._admission.limiter
        assert limiter is not None
        await self._admission._wait_in_line(limiter)
        self._held = True

    def widen(self, count: int) -> None:
        """Hold `count` slots in all (a request of `count` PD requests, `n` samples): the ones
        beyond this one taken now, never waited for; else a 429 (none taken), or a 400 when
        `count` exceeds the cap itself."""
        limiter = self._admission.limiter
        if limiter is None or count <= 1 or not self._held:
            return
        cap = int(limiter.total_tokens)
        if count > cap:
            raise bad_request(
                f"n is {count}, more than this router's --max-concurrent-requests {cap}: each "
                "sample is a PD request holding a slot"
            )
        taken: list[object] = []
        try:
            for _ in range(count - 1):
                borrower = object()
                limiter.acquire_on_behalf_of_nowait(borrower)
                taken.append(borrower)
        except trio.WouldBlock:
            for borrower in taken:
                limiter.release_on_behalf_of(borrower)
            self._admission._observe("rejected", 0.0)
            raise overloaded(
                f"too many requests: n = {count} samples need {count} request slots, "
                f"{len(taken) + 1} are free now (--max-concurrent-requests {cap})"
            ) from None
        self._extra.extend(taken)

    def release(self) -> None:
        limiter = self._admission.limiter
        if self._extra:
            assert limiter is not None
            extra, self._extra = self._extra, []
            for borrower in extra:
                limiter.release_on_behalf_of(borrower)
        if self._held:
            self._held = False
            assert limiter is not None
            limiter.release()  # a token, once spent, stays spent

    async def __aenter__(self) -> None:
        # Nobody in line and room: take it. Otherwise queue behind the waiters.
        if not self.enter_now():
            await self.wait()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()
