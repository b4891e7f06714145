"""Issue 28's audit survivors in the long-lived services, under trio's MockClock: the
ServiceGuard's crash window (more than `MAX_CRASHES` crashes *within* `CRASH_WINDOW_SECS`) and
its backoff reset after a steady run; the abort queue's caps (`MAX_PENDING_PER_WORKER`,
`MAX_PENDING`) at their real sizes."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_pd.edge.supervision import (
    CRASH_WINDOW_SECS,
    MAX_CRASHES,
    RESTART_BACKOFF_SECS,
    STEADY_SECS,
    ServiceGuard,
)
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.aborts import MAX_PENDING, MAX_PENDING_PER_WORKER, AbortJob, AbortService


class Service:
    """A service whose runs end as `plan(run)` says: after that many seconds, by a crash;
    None: it runs until cancelled. Records when each run started and ended."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.starts: list[float] = []
        self.ends: list[float] = []

    async def __call__(self) -> None:
        run = len(self.starts)
        self.starts.append(trio.current_time())
        secs = self.plan(run)
        if secs is None:
            await trio.sleep_forever()
        await trio.sleep(secs)
        self.ends.append(trio.current_time())
        raise RuntimeError(f"run {run} crashed")


def guard() -> tuple[ServiceGuard, list[str]]:
    fatal: list[str] = []
    return ServiceGuard(RouterMetrics(multiprocess_dir=""), on_fatal=fatal.append), fatal


async def test_crashes_spread_wider_than_the_window_are_never_fatal(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Break: every crash counted, whatever its age (`crashes + [now]`, the window's filter
    left out): the sixth crash, minutes after the first, would end the process."""
    assert (MAX_CRASHES, CRASH_WINDOW_SECS) == (5, 60.0)  # docs/behaviour.md's figures
    spacing = 13.0  # > 60 / 5: at most five crashes in any 60 s (a wider window holds more)
    service = Service(lambda run: spacing if run < 12 else None)
    g, fatal = guard()
    nursery.start_soon(g.supervised, "spread", service)
    with trio.fail_after(3600):
        while len(service.starts) < 13:
            await trio.sleep(1)
    assert len(service.ends) == 12 > MAX_CRASHES + 1  # the provoked thing: 12 crashes
    assert service.ends[-1] - service.ends[0] > 2 * CRASH_WINDOW_SECS
    assert fatal == [] and g.failed is None
    nursery.cancel_scope.cancel()


async def test_more_than_max_crashes_within_the_window_is_fatal(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Six crashes 11 s apart, within 60 s (a narrower window would hold fewer)."""
    service = Service(lambda run: 11.0)
    g, fatal = guard()
    nursery.start_soon(g.supervised, "flapping", service)
    with trio.fail_after(600):
        while not fatal:
            await trio.sleep(1)
    assert len(service.ends) == MAX_CRASHES + 1
    assert 50.0 < service.ends[-1] - service.ends[0] < 60.0
    assert "flapping" in fatal[0]
    nursery.cancel_scope.cancel()


async def test_a_steady_run_resets_the_backoff(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Break: the backoff is not reset after a run longer than `STEADY_SECS` (the reset line
    left out): the restart after it would wait 1.6 s, not the first delay again."""
    quick = 4
    service = Service(lambda run: 0.0 if run < quick else STEADY_SECS + 1 if run == quick else None)
    g, fatal = guard()
    nursery.start_soon(g.supervised, "steady", service)
    with trio.fail_after(3600):
        while len(service.starts) < quick + 2:
            await trio.sleep(0.01)
    first = RESTART_BACKOFF_SECS[0]
    delays = [start - end for end, start in zip(service.ends, service.starts[1:], strict=False)]
    doubling = [first * 2**n for n in range(quick)]  # 0.1, 0.2, 0.4, 0.8
    assert delays[:quick] == pytest.approx(doubling)
    assert service.ends[quick] - service.starts[quick] > STEADY_SECS  # the provoked steady run
    assert delays[quick] == pytest.approx(first)
    assert fatal == []
    nursery.cancel_scope.cancel()


def test_the_abort_queue_holds_65536_posts_and_drops_the_rest() -> None:
    """Break: another cap (`MAX_PENDING_PER_WORKER` changed, or the check gone): exactly 65,536
    POSTs wait for one worker (every rid of the job queued, none sent: the service is not
    running) and the rest are dropped and counted; four more workers' full queues stop at the
    all-workers cap of 262,144 (`MAX_PENDING`)."""
    assert (MAX_PENDING_PER_WORKER, MAX_PENDING) == (65_536, 262_144)
    service = AbortService(RouterMetrics(multiprocess_dir=""))

    async def fill(url: str) -> None:
        rids = tuple(f"{url}-r{i}" for i in range(MAX_PENDING_PER_WORKER + 3))
        service.request(AbortJob("decode", url, rids, delay=5))

    trio.run(fill, "http://d0")
    dropped = service.metrics.aborts.labels("decode", "dropped")._value.get()
    assert (service.pending, dropped) == (65_536, 3)
    for n in range(1, 5):
        trio.run(fill, f"http://d{n}")
    dropped = service.metrics.aborts.labels("decode", "dropped")._value.get()
    assert service.pending == 262_144
    assert dropped == 5 * (MAX_PENDING_PER_WORKER + 3) - 262_144
