"""The abort service's timing and bounds (issue 19, findings 1, 5 and 10), under trio's MockClock.

The service is driven through its public face (`request`, `run`, `flush`) with a recording pool
in place of the HTTP/1.1 pool: what is measured here is when each POST goes out. That it reaches
a real engine and frees a slot is tests/router/test_aborts.py's business, over real sockets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import trio
import trio.testing

from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.aborts import (
    EARLY_REPEAT_SECS,
    REPEAT_SECS,
    SENDERS_PER_WORKER,
    AbortJob,
    AbortService,
)


class Answer:
    status = 200

    async def read(self, limit: int) -> bytes:
        return b""


class RecordingPool:
    """Every POST with the (mock) time it was sent; each takes `latency` seconds."""

    def __init__(self, latency: float = 0.001) -> None:
        self.latency = latency
        self.sent: list[tuple[float, str, str]] = []  # (time, url, rid)

    @asynccontextmanager
    async def post(self, url: str, path: str, headers: Any, body: bytes) -> AsyncIterator[Answer]:
        assert path == "/abort_request"
        self.sent.append((trio.current_time(), url, orjson.loads(body)["rid"]))
        await trio.sleep(self.latency)
        yield Answer()


def counted(metrics: RouterMetrics, role: str, result: str) -> float:
    return metrics.aborts.labels(role, result)._value.get()


async def started(nursery: trio.Nursery, **options: Any) -> tuple[AbortService, RecordingPool]:
    metrics = RouterMetrics(multiprocess_dir="")
    service = AbortService(metrics, **options)
    pool = RecordingPool()
    await nursery.start(service.run, pool)
    return service, pool


async def test_the_repeat_does_not_hold_a_sender(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Ten times more abandoned legs than a worker's senders: every first POST goes out at once,
    not in waves every REPEAT_SECS (the old service held its slot through the repeat)."""
    service, pool = await started(nursery)
    legs = SENDERS_PER_WORKER * 10
    for i in range(legs):
        service.request(AbortJob("decode", "http://d", (f"rid-{i}",)))
    await trio.sleep(EARLY_REPEAT_SECS / 2)
    first = [t for t, _, _ in pool.sent]
    assert len(first) == legs  # provoked: all of them were sent ...
    assert max(first) < EARLY_REPEAT_SECS / 2  # ... within milliseconds, not seconds
    await trio.sleep(REPEAT_SECS / 2)
    assert len(pool.sent) == 2 * legs  # each once more, EARLY_REPEAT_SECS later
    early = [t for t, _, _ in pool.sent[legs:]]
    assert min(early) >= EARLY_REPEAT_SECS and max(early) < REPEAT_SECS / 2
    await trio.sleep(REPEAT_SECS)
    assert len(pool.sent) == 3 * legs  # and a last time, REPEAT_SECS after the first
    repeats = [t for t, _, _ in pool.sent[2 * legs :]]
    assert min(repeats) >= REPEAT_SECS
    assert counted(service.metrics, "decode", "sent") == 3 * legs
    assert counted(service.metrics, "decode", "dropped") == 0


async def test_equal_jobs_are_coalesced_and_never_crash_the_service(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Finding 1: two equal jobs (two requests with the same client rid, under the old rids)
    made the old service's CapacityLimiter raise and killed the lifespan."""
    service, pool = await started(nursery)
    job = AbortJob("decode", "http://d", ("same",))
    service.request(job)
    service.request(job)
    service.request(AbortJob("decode", "http://d", ("same", "other")))
    await trio.sleep(REPEAT_SECS * 3)
    rids = sorted(rid for _, _, rid in pool.sent)
    assert rids == ["other"] * 3 + ["same"] * 3  # each rid: its POST and its two repeats
    assert counted(service.metrics, "decode", "coalesced") == 2
    # Once retired, the same rid may be aborted again (a new leg, later).
    service.request(job)
    await trio.sleep(0.01)
    assert [rid for _, _, rid in pool.sent].count("same") == 4


async def test_a_delayed_first_abort_waits_and_the_others_do_not(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    service, pool = await started(nursery)
    service.request(AbortJob("decode", "http://d", ("latched",), delay=1.0))
    service.request(AbortJob("decode", "http://d", ("plain",)))
    await trio.sleep(0.5)
    assert [rid for _, _, rid in pool.sent] == ["plain", "plain"]  # its POST, its early repeat
    await trio.sleep(0.6)
    assert [rid for _, _, rid in pool.sent] == ["plain", "plain", "latched"]
    latched_at = next(t for t, _, rid in pool.sent if rid == "latched")
    assert latched_at >= 1.0


async def test_a_full_queue_drops_and_counts(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    service, _ = await started(nursery, max_pending=10)
    service.request(AbortJob("decode", "http://d", tuple(f"r{i}" for i in range(15)), delay=5))
    assert counted(service.metrics, "decode", "dropped") == 5
    assert service.pending == 10


async def test_flush_sends_every_pending_first_post_and_drops_the_repeats(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Finding 10: requests the end of a drain cut are aborted before the process exits."""
    service, pool = await started(nursery)
    service.request(AbortJob("decode", "http://d", ("sent-early",)))
    await trio.sleep(EARLY_REPEAT_SECS / 2)  # its first POST went, its repeats are pending
    service.request(AbortJob("decode", "http://d", tuple(f"cut-{i}" for i in range(100)), delay=1))
    with trio.fail_after(1):  # mock time: the flush itself takes no second
        await service.flush()
    rids = [rid for _, _, rid in pool.sent]
    assert rids.count("sent-early") == 1  # its repeats were dropped
    assert sorted(r for r in rids if r.startswith("cut-")) == sorted(f"cut-{i}" for i in range(100))
    assert service.pending == 0
