"""The load polling of power_of_two (`--worker-startup-check-interval`, SMG's LoadMonitor), under
MockClock: which workers are asked, when, and what their answers change."""

import random

import trio

from trio_pd.config import PolicyConfig, RouterConfig
from trio_pd.fleet.loads import poll_loads, polled_roles
from trio_pd.fleet.registry import Fleet
from trio_pd.spec import WorkerSpec


def fleet_of(policy: PolicyConfig, interval: float = 30.0) -> Fleet:
    config = RouterConfig(
        prefill=(WorkerSpec("http://p:1", "prefill"), WorkerSpec("http://p:2", "prefill")),
        decode=(WorkerSpec("http://d:1", "decode"),),
        policy=policy,
        load_poll_interval_secs=interval,
    )
    fleet = Fleet(config, random.Random(0))
    for worker in fleet.workers():
        worker.healthy = True
    return fleet


class FakeLoads:
    def __init__(self) -> None:
        self.calls: list[tuple[float, str]] = []
        self.answers: dict[str, object] = {}

    async def __call__(self, worker):
        self.calls.append((trio.current_time(), worker.id))
        answer = self.answers.get(worker.id, 7)
        if answer == "hang":
            await trio.sleep_forever()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def times(self, worker_id: str) -> list[float]:
        return [t for t, w in self.calls if w == worker_id]


def test_only_power_of_two_roles_are_polled() -> None:
    assert polled_roles(PolicyConfig()) == ()  # cache_aware: SMG's monitor finds nothing to feed
    assert polled_roles(PolicyConfig(policy="power_of_two")) == ("prefill", "decode")
    mixed = PolicyConfig(prefill_policy="power_of_two", decode_policy="round_robin")
    assert polled_roles(mixed) == ("prefill",)


async def test_polls_at_once_then_every_interval_and_reports_the_load(autojump_clock) -> None:
    policy = PolicyConfig(prefill_policy="power_of_two")
    fleet = fleet_of(policy)
    fetch = FakeLoads()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll_loads, fleet, polled_roles(policy), 30.0, fetch)
        await trio.sleep(95)
        nursery.cancel_scope.cancel()
    assert fetch.times("prefill-1") == fetch.times("prefill-2") == [0, 30, 60, 90]
    assert fetch.times("decode-1") == []  # its policy does not use the engines' loads
    p1 = fleet.get("prefill-1")
    assert p1.reported_load == 7 and p1.reported_at == 90
    assert p1.load() == 7  # counted while fresh (above the router's own 0 legs)
    assert fleet.get("decode-1").reported_load is None


async def test_unhealthy_workers_are_not_asked_and_failures_keep_the_last_report(
    autojump_clock,
) -> None:
    policy = PolicyConfig(policy="power_of_two")
    fleet = fleet_of(policy, interval=10.0)
    fetch = FakeLoads()
    p1, p2 = fleet.workers("prefill")
    p2.healthy = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll_loads, fleet, polled_roles(policy), 10.0, fetch)
        await trio.sleep(5)
        assert p1.reported_load == 7
        fetch.answers["prefill-1"] = OSError("connection refused")
        await trio.sleep(10)
        assert (p1.reported_load, p1.reported_at) == (7, 0)  # the old report, going stale
        fetch.answers["prefill-1"] = "hang"
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert fetch.times("prefill-2") == []
    # A hung engine is abandoned after 5 s; the cadence stays start to start.
    assert fetch.times("prefill-1") == [0, 10, 20]
    assert fetch.times("decode-1") == [0, 10, 20]


async def test_a_report_counts_until_the_poll_after_next(autojump_clock) -> None:
    fleet = fleet_of(PolicyConfig(policy="power_of_two"), interval=300.0)
    worker = fleet.get("prefill-1")
    assert worker.load_fresh_secs == 600  # 2 x max(health interval 60, poll interval 300)
    worker.report_load(9)
    await trio.sleep(599)
    assert worker.load() == 9
    await trio.sleep(2)
    assert worker.load() == 0  # stale: back to the router's own count
