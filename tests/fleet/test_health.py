import random
from collections import defaultdict

import trio
import trio.testing

from trio_pd.config import HealthConfig, RouterConfig, WorkerSpec
from trio_pd.fleet.health import run_health_checks
from trio_pd.fleet.workers import Fleet

CFG = HealthConfig(interval_secs=10, timeout_secs=2, failure_threshold=3, success_threshold=2)


class FakeProbe:
    """Answers from a per-url script of outcomes: True, False, "raise" or "hang"."""

    def __init__(self, default=True):
        self.scripts: dict[str, list] = defaultdict(list)
        self.calls: list[tuple[float, str]] = []
        self.default = default

    async def __call__(self, worker):
        self.calls.append((trio.current_time(), worker.id))
        script = self.scripts[worker.url]
        outcome = script.pop(0) if script else self.default
        if outcome == "raise":
            raise OSError("connection refused")
        if outcome == "hang":
            await trio.sleep_forever()
        return outcome

    def times(self, worker_id):
        return [t for t, w in self.calls if w == worker_id]


def fleet_of(*urls):
    cfg = RouterConfig(decode=tuple(WorkerSpec(u, "decode") for u in urls), health=CFG)
    return Fleet(cfg, random.Random(0))


async def watch(fleet, probe, worker, until):
    """Run the checker; sample `worker.healthy` at 5, 15, 25, ... while the time is < until."""
    states = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_health_checks, fleet, CFG, probe)
        await trio.sleep(5)  # sample mid-interval, after any probe (or its timeout) finished
        while trio.current_time() < until:
            states.append(worker.healthy)
            await trio.sleep(CFG.interval_secs)
        nursery.cancel_scope.cancel()
    return states


async def test_first_pass_makes_healthy_at_once_then_thresholds(autojump_clock):
    fleet = fleet_of("http://d:1")
    (w,) = fleet.workers()
    probe = FakeProbe()
    #                    t=0   10    20     30     40    50    60    70
    probe.scripts[w.url] = [True, False, False, False, True, True, True]
    states = await watch(fleet, probe, w, until=70)
    # up at once; two failures keep it up; the third takes it down; one pass is not enough
    # after having been up; the second consecutive pass brings it back.
    assert states == [True, True, True, False, False, True, True]
    assert probe.times(w.id) == [0, 10, 20, 30, 40, 50, 60, 70]


async def test_unhealthy_until_first_pass_even_if_late(autojump_clock):
    fleet = fleet_of("http://d:1")
    (w,) = fleet.workers()
    probe = FakeProbe()
    probe.scripts[w.url] = [False] * 8 + [True, False]
    states = await watch(fleet, probe, w, until=30)
    # Never passed yet: probed every JOIN_PROBE_SECS (1 s), not every interval (10 s), so an
    # engine that boots after the router joins within a second; then the interval applies.
    assert probe.times(w.id) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 18, 28]
    assert states == [False, True, True]


async def test_timeout_and_exception_count_as_failures(autojump_clock):
    fleet = fleet_of("http://d:1")
    (w,) = fleet.workers()
    probe = FakeProbe()
    probe.scripts[w.url] = [True, "hang", "raise", "hang", True]
    states = await watch(fleet, probe, w, until=40)
    assert states == [True, True, True, False]
    # A hung probe is abandoned after timeout_secs; the cadence stays start-to-start.
    assert probe.times(w.id) == [0, 10, 20, 30, 40]


async def test_worker_added_at_runtime_probed_at_once_and_removed_stops(autojump_clock):
    fleet = fleet_of("http://d:1")
    probe = FakeProbe()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_health_checks, fleet, CFG, probe)
        await trio.sleep(15)
        new = fleet.add(WorkerSpec("http://d:2", "decode"))
        assert not new.healthy
        await trio.testing.wait_all_tasks_blocked()
        assert new.healthy
        assert probe.times(new.id) == [15]
        await trio.sleep(11)
        assert probe.times(new.id) == [15, 25]
        fleet.remove(new.id)
        await trio.sleep(100)
        assert probe.times(new.id) == [15, 25]
        assert probe.times("decode-1") == list(range(0, 130, 10))
        nursery.cancel_scope.cancel()


async def test_removal_during_probe_does_not_flip(autojump_clock):
    fleet = fleet_of("http://d:1")
    (w,) = fleet.workers()
    release = trio.Event()

    async def slow_probe(worker):
        await release.wait()
        return True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_health_checks, fleet, CFG, slow_probe)
        await trio.testing.wait_all_tasks_blocked()
        fleet.remove(w.id)
        release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert not w.healthy
        nursery.cancel_scope.cancel()


async def test_each_worker_checked_independently(autojump_clock):
    fleet = fleet_of("http://a:1", "http://b:1")
    a, b = fleet.workers()
    probe = FakeProbe()
    probe.scripts[b.url] = ["hang"] * 10
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_health_checks, fleet, CFG, probe)
        await trio.sleep(1)
        assert a.healthy and not b.healthy  # b's hanging probe does not delay a
        nursery.cancel_scope.cancel()


async def test_removal_cancels_a_running_probe_at_once(autojump_clock):
    fleet = fleet_of("http://d:1")
    (w,) = fleet.workers()
    cancelled_at = []

    async def stuck_probe(worker):
        try:
            await trio.sleep_forever()
        finally:
            cancelled_at.append(trio.current_time())

    cfg = HealthConfig(interval_secs=10, timeout_secs=8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_health_checks, fleet, cfg, stuck_probe)
        await trio.sleep(3)
        fleet.remove(w.id)
        await trio.sleep(20)
        nursery.cancel_scope.cancel()
    assert cancelled_at == [3]
