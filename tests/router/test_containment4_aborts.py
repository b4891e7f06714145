"""Containment, part 4 (issue 26): aborts per worker, an abandoned batch's aborts coalesced.

- N11: 32 abort senders were shared by all workers: one worker whose `/abort_request` hangs plus
  one abandoned 1,024-batch to it held them all, and another worker's abort went out 64.6 s
  late. Each worker now has a lane of its own: what the victim engine saw is checked by order
  (how many of the hanging worker's aborts had arrived when the victim's did), not by a clock.
- F5: 40 abandoned 1,024-batches (81,920 rids, both legs) overflowed the one 65,536 queue: 16,375
  aborts dropped, 16,375 warning lines. Now nothing is dropped and the log is a few lines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from tests.conftest import Cluster, cluster_of, start_engine
from tests.router.helpers import generate_body
from tests.router.hostile import HostileWorker, hang, start_hostile
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.aborts import (
    SENDERS_PER_WORKER,
    TIMEOUT_SECS,
    WARN_EVERY_SECS,
    AbortJob,
    AbortService,
)
from trio_pd_testing.engine import EngineHandle

ROLES = ("prefill", "decode")
BATCH = 1024  # --max-batch-size's default: the largest batch a client may send


def batch_body(size: int = BATCH) -> dict[str, Any]:
    """A batch whose prefill hangs: both legs stay in flight until the client leaves."""
    body = generate_body(sim_fault="prefill:hang")
    body["text"] = [f"prompt {i}" for i in range(size)]
    return body


async def abandon(
    cluster: Cluster, body: dict[str, Any], request_id: str, held: Callable[[], bool] | None = None
) -> None:
    """Send `body`, wait until both engines hold it (`held`, by default both simulators
    logged its start), then leave (the client closes)."""

    def both_hold() -> bool:
        return all(
            any(e.events.find("request_start", rid=request_id) for e in role)
            for role in (cluster.prefills, cluster.decodes)
        )

    async def send() -> None:
        await cluster.client.post("/generate", json=body, headers={"x-request-id": request_id})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        with trio.fail_after(30):
            while not (held or both_hold)():
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


def holder(engines: list[EngineHandle], request_id: str) -> EngineHandle:
    (engine,) = [e for e in engines if e.events.find("request_start", rid=request_id)]
    return engine


async def test_a_hanging_workers_aborts_do_not_delay_another_workers(
    nursery: trio.Nursery,
) -> None:
    prefills = [await start_engine(nursery, "prefill") for _ in range(2)]
    decode = await start_engine(nursery, "decode")
    cluster = await cluster_of(nursery, prefills, [decode])
    # The batch goes to one prefill (round robin), whose /abort_request hangs; the other's
    # is made to answer again before the victim's request.
    for engine in prefills:
        engine.state.abort_hangs = True
    await abandon(cluster, batch_body(), "the-batch")
    wedged = holder(prefills, "the-batch")
    for engine in prefills:
        engine.state.abort_hangs = engine is wedged
    await wedged.events.wait_for("abort_hung", timeout=30)
    assert not wedged.events.find("abort_request")  # every abort it got hung (provoked)
    with trio.fail_after(30):
        while len(wedged.events.find("abort_hung")) < SENDERS_PER_WORKER:
            await trio.sleep(0.01)
    # The victim: the next request goes to the other prefill, and is abandoned too.
    await abandon(cluster, generate_body(sim_fault="prefill:hang"), "the-victim")
    victim = holder(prefills, "the-victim")
    assert victim is not wedged
    sglang_rid = victim.events.find("request_start", rid="the-victim")[0]["sglang_rid"]
    seen = await victim.events.wait_for("abort_request", timeout=60, sglang_rid=sglang_rid)
    assert seen["matched"]  # the victim engine freed the request on the abort
    hung_before = [e for e in wedged.events.find("abort_hung") if e["t"] < seen["t"]]
    # One shared queue sent the victim's abort after the batch's 1,024 (64 s); a lane of its
    # own sends it while the wedged worker still holds its first few.
    assert len(hung_before) < BATCH // 4, len(hung_before)
    decode_rids = decode.events.find("request_start", rid="the-victim")[0]["sglang_rids"]
    await decode.events.wait_for("abort_request", timeout=60, sglang_rid=decode_rids[0])
    await cluster.client.aclose()
    await cluster.admin.aclose()


async def test_forty_abandoned_batches_drop_no_abort_and_log_a_few_lines(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """Two workers that take every POST and never answer (a wedged engine: its generation
    legs and its /abort_request alike), so the aborts of all 40 batches wait at once: 40,960
    rids a worker, 81,920 in all. (Raw workers: a simulator holding 40,960 live requests
    would take minutes.)"""
    prefill = await start_hostile(nursery, hang)
    decode = await start_hostile(nursery, hang)
    cluster = await cluster_of(nursery, [prefill], [decode])  # type: ignore[list-item]
    aborts = cluster.router.aborts
    assert aborts is not None
    caplog.set_level(logging.WARNING, logger="trio_pd.pd.aborts")

    def legs(worker: HostileWorker) -> int:
        return sum(p.path == "/generate" for p in worker.posts)

    started = trio.current_time()
    for i in range(40):
        await abandon(
            cluster, batch_body(), f"batch-{i}", lambda n=i + 1: legs(prefill) == legs(decode) == n
        )
    cancelled = cluster.router.metrics.legs_cancelled
    with trio.fail_after(30):
        while sum(cancelled.labels(r, "client_gone")._value.get() for r in ROLES) < 80:
            await trio.sleep(0.05)
    took = trio.current_time() - started
    counted = cluster.router.metrics.aborts
    hung = [p for w in (prefill, decode) for p in w.posts if p.path == "/abort_request"]
    assert len(hung) >= SENDERS_PER_WORKER  # provoked: the workers hold the aborts
    assert aborts.pending >= 40 * BATCH * 2 - len(hung)  # every rid of both legs is to go
    for role in ROLES:
        assert counted.labels(role, "dropped")._value.get() == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "trio_pd.pd.aborts"]
    assert not [line for line in lines if "not queued" in line]
    # A line per worker per WARN_EVERY_SECS at most (the timeouts of the hanging POSTs).
    assert len(lines) <= 2 * (took / WARN_EVERY_SECS + 1), lines
    await cluster.client.aclose()
    await cluster.admin.aclose()


class FailingPool:
    """Every abort POST answered 500 (a worker that refuses its aborts)."""

    class Answer:
        status = 500

        async def read(self, limit: int) -> bytes:
            return b""

    def __init__(self) -> None:
        self.sent = 0

    def post(self, url: str, path: str, headers: Any, body: bytes) -> Any:
        pool = self

        class Context:
            async def __aenter__(self) -> FailingPool.Answer:
                pool.sent += 1
                await trio.sleep(0.001)
                return FailingPool.Answer()

            async def __aexit__(self, *exc: object) -> None:
                return None

        return Context()


async def test_failed_aborts_are_a_line_every_few_seconds_with_the_count(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """F5's other half: 10,240 failing POSTs (and their two repeats) are not 30,720 lines."""
    caplog.set_level(logging.WARNING, logger="trio_pd.pd.aborts")
    service = AbortService(RouterMetrics(multiprocess_dir=""))
    pool = FailingPool()
    await nursery.start(service.run, pool)
    started = trio.current_time()
    for i in range(10):
        service.request(AbortJob("decode", "http://d", tuple(f"b{i}-{j}" for j in range(BATCH))))
    while service.pending:
        await trio.sleep(0.5)
    assert pool.sent == 3 * 10 * BATCH  # provoked: every POST went out and failed
    assert service.metrics.aborts.labels("decode", "failed")._value.get() == pool.sent
    lines = [r.getMessage() for r in caplog.records if r.name == "trio_pd.pd.aborts"]
    took = trio.current_time() - started + TIMEOUT_SECS
    assert len(lines) <= took / WARN_EVERY_SECS + 2, lines
    reported = sum(int(line.split(": ")[1].split()[0]) for line in lines)
    assert reported == pool.sent  # every failure is in a line's count


async def test_one_workers_full_queue_leaves_room_for_the_others(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The bounds: `max_pending_per_worker` for one worker, `max_pending` for all; a worker
    past its own bound drops the rest of its job (counted), another worker's job still fits."""
    metrics = RouterMetrics(multiprocess_dir="")
    service = AbortService(metrics, max_pending=25, max_pending_per_worker=10)
    await nursery.start(service.run, FailingPool())
    later = 60.0  # not due during the test: everything stays queued
    service.request(AbortJob("prefill", "http://a", tuple(f"a{i}" for i in range(15)), delay=later))
    assert metrics.aborts.labels("prefill", "dropped")._value.get() == 5
    service.request(AbortJob("decode", "http://b", tuple(f"b{i}" for i in range(10)), delay=later))
    assert metrics.aborts.labels("decode", "dropped")._value.get() == 0  # its own room
    service.request(AbortJob("decode", "http://c", tuple(f"c{i}" for i in range(10)), delay=later))
    assert metrics.aborts.labels("decode", "dropped")._value.get() == 5  # the total's bound
    assert service.pending == 25
