import random
from collections import defaultdict

import attrs
import trio
import trio.testing

from trio_pd.config import HealthConfig, RouterConfig
from trio_pd.fleet.health import run_health_checks
from trio_pd.fleet.registry import Fleet
from trio_pd.spec import WorkerSpec

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


# -- start-up: --worker-startup-timeout-secs and --disable-health-check ---------------------------

STARTUP = attrs.evolve(CFG, startup_timeout_secs=30)


async def run_checks_for(fleet, cfg, probe, seconds):
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_health_checks, fleet, cfg, probe)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()


async def test_a_worker_that_never_passes_is_given_up_at_the_startup_timeout(autojump_clock):
    fleet = fleet_of("http://d:1")
    (w,) = fleet.workers()
    probe = FakeProbe(default=False)
    await run_checks_for(fleet, STARTUP, probe, 200)
    times = probe.times(w.id)
    # Join probes every second up to the timeout, the first failure at or past it gives up,
    # and nothing probes it afterwards (SMG: its registration failed, it is never checked).
    assert times == list(range(0, 31))
    assert w.startup_timed_out and not w.healthy
    assert w.to_json()["startup_timed_out"] is True
    assert fleet.workers() == [w]  # still listed (given up), not silently dropped


async def test_hung_probes_still_give_up_at_the_startup_timeout(autojump_clock):
    fleet = fleet_of("http://d:1")
    (w,) = fleet.workers()
    probe = FakeProbe(default="hang")  # each probe abandoned after timeout_secs (2 s)
    given_up_at = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_health_checks, fleet, STARTUP, probe)
        await trio.sleep(0.25)  # sample between the probes' whole seconds
        while not w.startup_timed_out:
            await trio.sleep(0.5)
        given_up_at.append(trio.current_time())
        await trio.sleep(100)
        nursery.cancel_scope.cancel()
    # The probe started at 28 is abandoned at 30: the give-up comes then, no probe after.
    assert probe.times(w.id) == list(range(0, 29, 2))
    assert given_up_at == [30.25]


async def test_a_late_first_pass_within_the_timeout_joins_and_keeps_being_checked(
    autojump_clock,
):
    fleet = fleet_of("http://d:1")
    (w,) = fleet.workers()
    probe = FakeProbe()
    probe.scripts[w.url] = [False] * 29 + [True]  # passes at t=29, inside the 30 s
    await run_checks_for(fleet, STARTUP, probe, 100)
    assert w.healthy and not w.startup_timed_out
    assert probe.times(w.id)[28:] == [28, 29, 39, 49, 59, 69, 79, 89, 99]
    assert "startup_timed_out" not in w.to_json()


async def test_the_timeout_counts_from_when_the_worker_was_added(autojump_clock):
    fleet = fleet_of()
    probe = FakeProbe(default=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_health_checks, fleet, STARTUP, probe)
        await trio.sleep(100)
        late = fleet.add(WorkerSpec("http://d:9", "decode"))  # POST /workers, a new pod...
        await trio.sleep(29.5)
        assert not late.startup_timed_out
        await trio.sleep(1)
        assert late.startup_timed_out
        nursery.cancel_scope.cancel()
    assert probe.times(late.id) == list(range(100, 131))


async def test_periodic_checks_disabled_check_until_the_first_pass_only(autojump_clock):
    fleet = fleet_of("http://d:1")
    (w,) = fleet.workers()
    probe = FakeProbe(default=False)
    probe.scripts[w.url] = [False, False, True]  # comes up at t=2, then fails every probe
    cfg = attrs.evolve(STARTUP, periodic=False)
    await run_checks_for(fleet, cfg, probe, 500)
    assert probe.times(w.id) == [0, 1, 2]  # the start-up check, nothing after its pass
    assert w.healthy  # trusted from then on


async def test_periodic_checks_disabled_still_give_up_at_the_startup_timeout(autojump_clock):
    fleet = fleet_of("http://d:1")
    (w,) = fleet.workers()
    probe = FakeProbe(default=False)
    await run_checks_for(fleet, attrs.evolve(STARTUP, periodic=False), probe, 200)
    assert probe.times(w.id) == list(range(0, 31))
    assert w.startup_timed_out and not w.healthy
