import random

import pytest
import trio
import trio.testing

from trio_pd.config import BreakerConfig, PolicyConfig, RouterConfig
from trio_pd.fleet.hints import NO_HINTS, RouteHints
from trio_pd.fleet.policies import CacheAwarePolicy
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.worker import NoWorkerAvailable
from trio_pd.spec import WorkerSpec


def hint(text):
    return RouteHints(text=text)


def make_fleet(n_prefill=2, n_decode=2, policy="round_robin", healthy=True, **kw):
    cfg = RouterConfig(
        prefill=tuple(WorkerSpec(f"http://p{i}:8000", "prefill", 8998) for i in range(n_prefill)),
        decode=tuple(WorkerSpec(f"http://d{i}:8000", "decode") for i in range(n_decode)),
        policy=PolicyConfig(policy=policy),
        **kw,
    )
    fleet = Fleet(cfg, random.Random(0))
    for w in fleet.workers():
        w.healthy = healthy
    return fleet


def test_registers_config_workers_with_stable_ids():
    fleet = make_fleet()
    assert [w.id for w in fleet.workers()] == ["prefill-1", "prefill-2", "decode-1", "decode-2"]
    p = fleet.get("prefill-1")
    assert (p.url, p.role, p.bootstrap_port) == ("http://p0:8000", "prefill", 8998)
    assert [w.id for w in fleet.workers("decode")] == ["decode-1", "decode-2"]
    assert not Fleet(make_fleet().config).workers()[0].healthy  # unhealthy until first pass


def test_policy_per_role():
    cfg = RouterConfig(policy=PolicyConfig(policy="cache_aware", decode_policy="round_robin"))
    fleet = Fleet(cfg)
    assert fleet.policies["prefill"].name == "cache_aware"
    assert fleet.policies["decode"].name == "round_robin"


def test_add_duplicate_rejected_and_ids_not_reused():
    fleet = make_fleet()
    with pytest.raises(ValueError, match="already registered"):
        fleet.add(WorkerSpec("http://p0:8000/", "prefill"))
    same_url_other_role = fleet.add(WorkerSpec("http://p0:8000", "decode"))
    assert same_url_other_role.id == "decode-3"
    fleet.remove("decode-3")
    assert fleet.add(WorkerSpec("http://p0:8000", "decode")).id == "decode-4"


def test_remove_marks_and_drops():
    fleet = make_fleet()
    v = fleet.version
    w = fleet.remove("decode-1")
    assert w.removed and not w.available()
    assert fleet.version == v + 1
    with pytest.raises(KeyError):
        fleet.get("decode-1")
    with pytest.raises(KeyError):
        fleet.remove("decode-1")
    assert all(fleet.select("decode", NO_HINTS) is not w for _ in range(5))


async def test_select_skips_unhealthy_and_open_breakers(autojump_clock):
    fleet = make_fleet(n_decode=3, breaker=BreakerConfig(failure_threshold=1))
    d1, d2, d3 = fleet.workers("decode")
    d1.healthy = False
    fleet.record(d2, ok=False)
    assert d2.breaker.state == "open"
    assert fleet.available("decode") == [d3]
    assert {fleet.select("decode", hint("hi")) for _ in range(6)} == {d3}


async def test_no_worker_available_messages(autojump_clock):
    fleet = make_fleet(n_prefill=0, n_decode=2, breaker=BreakerConfig(failure_threshold=1))
    with pytest.raises(NoWorkerAvailable) as e:
        fleet.select_pair(hint("x"))
    assert e.value.role == "prefill" and e.value.reason == "none_registered"
    assert "no prefill worker is registered" in str(e.value)

    fleet.add(WorkerSpec("http://p:1", "prefill")).healthy = True
    d1, d2 = fleet.workers("decode")
    d1.healthy = d2.healthy = False
    with pytest.raises(NoWorkerAvailable) as e:
        fleet.select_pair(hint("x"))
    assert e.value.role == "decode" and e.value.reason == "all_unhealthy"
    assert str(e.value) == "no available decode worker: all 2 are unhealthy"

    d1.healthy = d2.healthy = True
    fleet.record(d1, ok=False)
    fleet.record(d2, ok=False)
    assert fleet.available("decode") == []
    # Every breaker open: panic routing among the healthy ones, counted, instead of a 503.
    assert {fleet.select("decode", NO_HINTS) for _ in range(20)} == {d1, d2}
    assert fleet.panics["decode"] == 20

    d1.healthy = False
    assert fleet.select("decode", NO_HINTS) is d2  # unhealthy workers stay out, even in a panic

    await trio.sleep(fleet.config.breaker.timeout_duration_secs)  # d2 goes half-open
    assert fleet.available("decode") == [d2]
    assert fleet.select("decode", NO_HINTS) is d2
    assert fleet.panics["decode"] == 21


def test_avoid_prefers_others_but_falls_back():
    fleet = make_fleet(n_decode=3)
    d1, d2, d3 = fleet.workers("decode")
    picks = {fleet.select("decode", NO_HINTS, avoid=frozenset({d1, d2})) for _ in range(5)}
    assert picks == {d3}
    assert fleet.select("decode", NO_HINTS, avoid=frozenset({d1, d2, d3})) in (d1, d2, d3)
    p, d = fleet.select_pair(NO_HINTS, avoid=frozenset({fleet.get("prefill-1"), d1, d3}))
    assert (p.id, d.id) == ("prefill-2", "decode-2")


def test_track_counts_in_flight_even_on_error():
    fleet = make_fleet()
    w = fleet.get("decode-1")
    with fleet.track(w):
        with fleet.track(w):
            assert w.in_flight == 2 and w.load() == 2
        assert w.in_flight == 1
    with pytest.raises(RuntimeError), fleet.track(w):
        raise RuntimeError
    assert w.in_flight == 0


async def test_load_uses_fresh_reported_load(autojump_clock):
    fleet = make_fleet()
    w = fleet.get("decode-1")
    assert w.load_fresh_secs == 2 * fleet.config.health.interval_secs
    w.report_load(7)
    assert w.load() == 7
    w.in_flight = 9
    assert w.load() == 9
    w.in_flight = 0
    await trio.sleep(w.load_fresh_secs)
    assert w.load() == 0


async def test_record_drives_breaker_and_json(autojump_clock):
    fleet = make_fleet(breaker=BreakerConfig(failure_threshold=2))
    w = fleet.get("prefill-1")
    fleet.record(w, ok=False)
    fleet.record(w, ok=False)
    j = w.to_json()
    assert j == {
        "id": "prefill-1",
        "url": "http://p0:8000",
        "worker_type": "prefill",
        "bootstrap_port": 8998,
        "is_healthy": True,
        "status": "ready",
        "http2": False,
        "circuit_breaker": "open",
        "load": 0,
        "in_flight": 0,
        "source": "static",
    }


def test_cache_aware_fleet_forgets_removed_worker():
    fleet = make_fleet(policy="cache_aware")
    policy = fleet.policies["decode"]
    assert isinstance(policy, CacheAwarePolicy)
    w = fleet.select("decode", hint("some long prompt " * 10))
    assert policy.tree.size(w) > 0
    fleet.remove(w.id)
    assert policy.tree.size(w) == 0 and w not in policy.tree.tenants()


async def test_wait_changed_wakes_on_membership_change():
    fleet = make_fleet()
    seen = fleet.version
    result = []

    async def waiter():
        result.append(await fleet.wait_changed(seen))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert result == []
        fleet.add(WorkerSpec("http://new:1", "decode"))
    assert result == [seen + 1]


def test_reconcile_is_level_triggered_and_per_source():
    from trio_pd.spec import WorkerRecord

    fleet = make_fleet(n_prefill=1, n_decode=0)
    static = fleet.get("prefill-1")
    a = WorkerRecord("disc-a", WorkerSpec("http://a:1", "decode"), "disc", {"pod": "a"})
    b = WorkerRecord("disc-b", WorkerSpec("http://b:1", "decode"), "disc")
    fleet.reconcile("disc", [a, b])
    assert {w.id for w in fleet.workers()} == {"prefill-1", "disc-a", "disc-b"}
    assert fleet.get("disc-a").meta == {"pod": "a"} and fleet.get("disc-a").source == "disc"
    first_b = fleet.get("disc-b")
    # A changed spec replaces the worker; an absent one goes; other sources are untouched.
    b2 = WorkerRecord("disc-b", WorkerSpec("http://b:2", "decode"), "disc")
    fleet.reconcile("disc", [b2])
    assert {w.id for w in fleet.workers()} == {"prefill-1", "disc-b"}
    assert fleet.get("disc-b") is not first_b and first_b.removed
    assert fleet.get("prefill-1") is static and not static.removed
    # A record colliding with another source's worker is skipped, not stolen.
    clash = WorkerRecord("other-p", WorkerSpec("http://p0:8000", "prefill"), "disc")
    fleet.reconcile("disc", [b2, clash])
    assert {w.id for w in fleet.workers()} == {"prefill-1", "disc-b"}
    version = fleet.version
    fleet.reconcile("disc", [b2])  # nothing changed: no membership bump
    assert fleet.version == version
    fleet.reconcile("disc", [])
    assert {w.id for w in fleet.workers()} == {"prefill-1"}
