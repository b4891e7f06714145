"""The manual policy: sticky by routing key, each assignment mode, failover, idle eviction."""

import random
from collections import Counter

import pytest
import trio

from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import PolicyConfig, RouterConfig
from trio_pd.edge.routing_key import MAX_KEY_BYTES, routing_key
from trio_pd.fleet.hints import NO_HINTS, RouteHints
from trio_pd.fleet.manual import EVICT_BATCH, ManualPolicy
from trio_pd.fleet.policies import make_policy, run_eviction
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.worker import Tracked, Worker
from trio_pd.spec import WorkerSpec


def workers(n, role="decode"):
    return [Worker(spec=WorkerSpec(f"http://w{i}:8000", role), id=f"{role}-{i}") for i in range(n)]


def key(value):
    return RouteHints(key=value)


def manual_fleet(n=3, **policy):
    config = RouterConfig(
        prefill=(WorkerSpec("http://p0:8000", "prefill"),),
        decode=tuple(WorkerSpec(f"http://d{i}:8000", "decode") for i in range(n)),
        policy=PolicyConfig(policy="manual", **policy),
    )
    fleet = Fleet(config, random.Random(0))
    for w in fleet.workers():
        w.healthy = True
    return fleet


async def test_a_key_sticks_to_the_worker_it_was_given(autojump_clock):
    ws = workers(3)
    p = ManualPolicy()
    first = p.choose(ws, key("user-123"))
    assert p.branches["vacant"] == 1
    assert all(p.choose(ws, key("user-123")) is first for _ in range(10))
    assert p.branches["occupied_hit"] == 10
    # New workers take new keys only: the old key does not move.
    more = [*ws, *workers(6)[3:]]
    assert all(p.choose(more, key("user-123")) is first for _ in range(10))


async def test_random_mode_spreads_keys_and_processes_agree(autojump_clock):
    ws = workers(3)
    one, other = ManualPolicy(rng=random.Random(1)), ManualPolicy(rng=random.Random(2))
    placed = {f"user-{i}": one.choose(ws, key(f"user-{i}")) for i in range(300)}
    counts = Counter(placed.values())
    assert set(counts) == set(ws) and all(70 < c < 130 for c in counts.values())
    # A second process (another rng, another table) places every key on the same worker.
    assert all(other.choose(ws, key(k)) is w for k, w in placed.items())
    assert other.branches["vacant"] == 300


async def test_random_mode_ignores_load(autojump_clock):
    ws = workers(2)
    ws[0].in_flight = 50
    p = ManualPolicy("random")
    assert {p.choose(ws, key(f"k{i}")) for i in range(60)} == set(ws)


async def test_min_load_gives_a_new_key_the_least_loaded_worker_and_keeps_it(autojump_clock):
    ws = workers(3)
    for w, load in zip(ws, (2, 1, 0), strict=True):
        w.in_flight = load
    p = ManualPolicy("min_load")
    assert p.choose(ws, key("new")) is ws[2]
    ws[2].in_flight = 9  # the key is sticky, whatever the load becomes
    assert p.choose(ws, key("new")) is ws[2]
    assert p.choose(ws, key("newer")) is ws[1]
    ws[0].report_load(0)
    ws[0].in_flight = 0
    assert p.choose(ws, key("newest")) is ws[0]


async def test_min_group_counts_distinct_keys_in_flight(autojump_clock):
    ws = workers(3)
    # w0 runs three legs of one key, w1 one leg each of two keys, w2 two keyless legs.
    legs = [Tracked(ws[0], None, "a"), Tracked(ws[0], None, "a"), Tracked(ws[0], None, "a")]
    legs += [Tracked(ws[1], None, "b"), Tracked(ws[1], None, "c")]
    legs += [Tracked(ws[2], None, None), Tracked(ws[2], None, None)]
    for leg in legs:
        leg.__enter__()
    assert [len(w.active_keys) for w in ws] == [1, 2, 0]
    assert [w.in_flight for w in ws] == [3, 2, 2]
    group, load = ManualPolicy("min_group"), ManualPolicy("min_load")
    assert group.choose(ws, key("new")) is ws[2]  # no key in flight there
    ws[2].active_keys.update(y=1, z=1)
    assert group.choose(ws, key("newer")) is ws[0]  # one key (three legs) beats two keys
    assert load.choose(ws, key("newer")) is not ws[0]  # min_load sees its three legs
    for leg in legs:
        leg.__exit__(None, None, None)
    assert ws[0].active_keys == {} and ws[1].active_keys == {}


async def test_ties_in_min_modes_break_as_random_places_the_key(autojump_clock):
    ws = workers(4)
    plain = ManualPolicy("random")
    for mode in ("min_load", "min_group"):
        p = ManualPolicy(mode)
        assert all(p.choose(ws, key(f"k{i}")) is plain.choose(ws, key(f"k{i}")) for i in range(40))


async def test_a_request_without_a_key_is_placed_per_mode_and_remembered_nowhere(autojump_clock):
    ws = workers(2)
    p = ManualPolicy(rng=random.Random(3))
    assert {p.choose(ws, NO_HINTS) for _ in range(50)} == set(ws)
    assert p.routes == {} and p.branches["no_routing_id"] == 50
    ws[0].in_flight = 4
    least = ManualPolicy("min_load")
    assert all(least.choose(ws, NO_HINTS) is ws[1] for _ in range(10))


def test_the_routing_key_header():
    assert routing_key([(b"x-smg-routing-key", b"user-1")]) == "user-1"
    assert routing_key([(b"x-other", b"a")]) is None
    assert routing_key([(b"x-smg-routing-key", b"")]) is None  # empty: no key, as SMG
    first = [(b"x-smg-routing-key", b"one"), (b"x-smg-routing-key", b"two")]
    assert routing_key(first) == "one"
    assert routing_key([(b"x-smg-routing-key", b"caf\xe9")]) == "caf\xe9"  # bytes kept
    long = b"k" * (MAX_KEY_BYTES + 1)
    digest = routing_key([(b"x-smg-routing-key", long)])
    assert digest is not None and digest.startswith("blake2b:") and len(digest) < MAX_KEY_BYTES
    assert routing_key([(b"x-smg-routing-key", long)]) == digest
    assert routing_key([(b"x-smg-routing-key", long + b"x")]) != digest


async def test_a_key_moves_when_its_worker_cannot_take_it_and_comes_back(autojump_clock):
    ws = workers(3)
    p = ManualPolicy()
    home = p.choose(ws, key("sticky"))
    rest = [w for w in ws if w is not home]
    away = p.choose(rest, key("sticky"))
    assert away in rest and p.branches["occupied_miss"] == 1
    assert all(p.choose(rest, key("sticky")) is away for _ in range(5))
    # The first worker is first in the key's list: the key returns once it can take traffic.
    assert p.choose(ws, key("sticky")) is home
    # A third move forgets the oldest worker (two remembered, as SMG).
    third = [w for w in ws if w is not home and w is not away]
    assert p.choose(third, key("sticky")) is third[0]
    assert p.choose(ws, key("sticky")) is away
    assert p.routes["sticky"].urls == [away.url, third[0].url]


async def test_through_the_fleet_unhealthy_open_or_removed_workers_lose_their_keys(
    autojump_clock,
):
    fleet = manual_fleet(3)
    home = fleet.select("decode", key("s"))
    home.healthy = False
    moved = fleet.select("decode", key("s"))
    assert moved is not home
    home.healthy = True
    assert fleet.select("decode", key("s")) is home
    for _ in range(fleet.config.breaker.failure_threshold):
        fleet.record(home, ok=False)
    assert home.breaker.state == "open"
    assert fleet.select("decode", key("s")) is moved  # its second worker
    removed = fleet.remove(moved.id)
    again = fleet.select("decode", key("s"))
    assert again is not removed and again is not home
    # Re-registered under the same URL (a new worker object), it gets the key back: URLs name
    # workers, as in SMG.
    back = fleet.add(removed.spec)
    back.healthy = True
    assert fleet.select("decode", key("s")) is back


async def test_a_retry_avoiding_the_keys_worker_goes_elsewhere_and_the_key_stays(autojump_clock):
    fleet = manual_fleet(3)
    home = fleet.select("decode", key("s"))
    other = fleet.select("decode", key("s"), avoid=frozenset({home}))
    assert other is not home
    assert fleet.select("decode", key("s")) is home


async def test_idle_keys_are_forgotten_after_max_idle_secs(autojump_clock):
    ws = workers(3)
    p = ManualPolicy(max_idle_secs=100)
    p.choose(ws, key("old"))
    await trio.sleep(60)
    p.choose(ws, key("young"))
    await trio.sleep(39)
    p.evict()
    assert set(p.routes) == {"old", "young"}  # 99 s idle: kept
    p.choose(ws, key("young"))  # used again: its idle time starts over
    await trio.sleep(1)
    p.evict()
    assert set(p.routes) == {"young"}  # 100 s idle: forgotten
    await trio.sleep(98)
    p.evict()
    assert set(p.routes) == {"young"}  # idle 99 s
    await trio.sleep(1)
    p.evict()
    assert p.routes == {}


async def test_an_evicted_key_is_assigned_afresh(autojump_clock):
    ws = workers(2)
    ws[0].in_flight = 1
    p = ManualPolicy("min_load", max_idle_secs=10)
    assert p.choose(ws, key("k")) is ws[1]
    ws[0].in_flight, ws[1].in_flight = 0, 1
    assert p.choose(ws, key("k")) is ws[1]
    await trio.sleep(10)
    p.evict()
    assert p.choose(ws, key("k")) is ws[0]
    assert p.branches["vacant"] == 2


async def test_the_eviction_task_forgets_idle_keys_at_its_interval(autojump_clock):
    fleet = manual_fleet(2, max_idle_secs=300, eviction_interval_secs=60)
    policy = fleet.policies["decode"]
    assert isinstance(policy, ManualPolicy)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_eviction, fleet, 60)
        fleet.select("decode", key("k"))
        await trio.sleep(299)
        assert "k" in policy.routes
        await trio.sleep(61)  # idle 300 s at the eviction of t=300
        assert policy.routes == {}
        nursery.cancel_scope.cancel()


async def test_zero_max_idle_or_interval_keeps_keys(autojump_clock):
    p = ManualPolicy(max_idle_secs=0)
    p.choose(workers(2), key("k"))
    await trio.sleep(10**6)
    p.evict()
    assert "k" in p.routes
    fleet = manual_fleet(2, max_idle_secs=1, eviction_interval_secs=0)
    fleet.select("decode", key("k"))
    with trio.move_on_after(100):
        await run_eviction(fleet, 0)  # off: sleeps, never spins
    assert "k" in fleet.policies["decode"].routes


async def test_the_table_is_bounded_least_recently_used_first(autojump_clock):
    ws = workers(2)
    p = ManualPolicy(max_keys=3)
    for k in ("a", "b", "c"):
        p.choose(ws, key(k))
    p.choose(ws, key("a"))  # a is now the most recently used
    p.choose(ws, key("d"))
    assert list(p.routes) == ["c", "a", "d"]


def test_flags_follow_sglang_router():
    args = build_parser().parse_args(["serve", "--policy", "manual"])
    policy = router_config(args).policy
    assert (policy.for_role("prefill"), policy.for_role("decode")) == ("manual", "manual")
    assert (policy.max_idle_secs, policy.manual_assignment_mode) == (14_400, "random")
    assert policy.assignment_mode is None  # SMG 1.13: random for manual, delegate for the override
    assert policy.sticky_assignment_mode == "delegate"
    assert policy.uses_routing_key
    args = build_parser().parse_args(
        ["serve", "--decode-policy", "manual", "--assignment-mode", "min_group",
         "--max-idle-secs", "60"]
    )  # fmt: skip
    policy = router_config(args).policy
    assert (policy.for_role("prefill"), policy.for_role("decode")) == ("cache_aware", "manual")
    assert (policy.max_idle_secs, policy.assignment_mode) == (60, "min_group")
    assert not PolicyConfig().uses_routing_key
    made = make_policy("manual", policy)
    assert isinstance(made, ManualPolicy)
    assert (made.assignment_mode, made.max_idle_secs) == ("min_group", 60)
    for bad in (["--assignment-mode", "least"], ["--max-idle-secs", "-1"]):
        with pytest.raises(SystemExit):
            router_config(build_parser().parse_args(["serve", *bad]))


async def test_a_full_table_going_idle_is_forgotten_in_batches(autojump_clock):
    """Each batch is one synchronous pass; the eviction task checkpoints between them, so a
    full table going idle at once does not stall the event loop, and it is all gone in the end."""
    fleet = manual_fleet(2, max_idle_secs=300, eviction_interval_secs=60)
    policy = fleet.policies["decode"]
    assert isinstance(policy, ManualPolicy)
    for n in range(EVICT_BATCH * 2 + 5):
        fleet.select("decode", key(f"k{n}"))
    await trio.sleep(300)
    assert policy.evict() is True
    assert len(policy.routes) == EVICT_BATCH + 5  # one batch, and more are due
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_eviction, fleet, 60)
        await trio.sleep(60.5)  # one eviction run: two more batches
        assert policy.routes == {}
        nursery.cancel_scope.cancel()
