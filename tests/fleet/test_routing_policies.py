"""SMG 1.13's routing policies as pure choices (issue 21): least_load, power_of_two's load
metrics, consistent_hashing, prefix_hash, sticky sessions on any policy, and PD pairing by KV
transfer backend. Seeded rngs; trio's clock (autojump) where a report's freshness matters."""

from __future__ import annotations

import random
from collections import Counter

import attrs
import pytest

from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import PolicyConfig, RouterConfig
from trio_pd.edge.routing_key import MAX_KEY_BYTES, RoutingKeys, strip_lineage
from trio_pd.fleet.consistent_hashing import ConsistentHashingPolicy
from trio_pd.fleet.hints import NO_HINTS, RouteHints
from trio_pd.fleet.least_load import LeastLoadPolicy
from trio_pd.fleet.loads import polled_roles
from trio_pd.fleet.manual import ManualPolicy
from trio_pd.fleet.policies import PowerOfTwoPolicy, RoundRobinPolicy, make_policy
from trio_pd.fleet.prefix_hash import PrefixHashPolicy
from trio_pd.fleet.registry import NO_COMPATIBLE_PAIR, Fleet
from trio_pd.fleet.reports import EngineLoad, RankLoad, ServerInfo
from trio_pd.fleet.sticky import STICKY_INFLIGHT_CAP, StickyPolicy
from trio_pd.fleet.worker import NoWorkerAvailable, Worker
from trio_pd.spec import WorkerSpec


def workers(n: int, role: str = "decode") -> list[Worker]:
    return [Worker(spec=WorkerSpec(f"http://w{i}:8000", role), id=f"{role}-{i}") for i in range(n)]


def report(worker: Worker, running: int = 0, waiting: int = 0, usage: float = 0.0) -> None:
    rank = RankLoad(running=running, waiting=waiting, token_usage=usage)
    worker.report_load(EngineLoad((rank,), "/v1/loads"))


def key(k: str, model: str | None = None) -> RouteHints:
    return RouteHints(key=k, model=model)


# -- least_load --------------------------------------------------------------------------------


async def test_least_load_takes_the_shortest_expected_wait(autojump_clock):
    ws = workers(3)
    report(ws[0], running=4)
    report(ws[1], running=1, waiting=2)
    report(ws[2], running=1)
    policy = LeastLoadPolicy(PolicyConfig(), random.Random(0))
    assert policy.choose(ws, NO_HINTS) is ws[2]


async def test_least_load_credits_what_it_sent_since_the_report(autojump_clock):
    """Equal reports: without the since-poll credit every request of a poll interval would go
    to one worker (the argmin never changes); with it they spread evenly."""
    ws = workers(3)
    for w in ws:
        report(w)
    policy = LeastLoadPolicy(PolicyConfig(), random.Random(1))
    picks = Counter(policy.choose(ws, NO_HINTS) for _ in range(30))
    assert sorted(picks.values()) == [10, 10, 10]


async def test_least_load_kv_barrier_steers_off_a_full_cache(autojump_clock):
    ws = workers(2)
    report(ws[0], running=0, usage=0.98)  # idle but its KV cache is nearly full
    report(ws[1], running=1, usage=0.1)
    policy = LeastLoadPolicy(PolicyConfig(), random.Random(0))
    assert policy.choose(ws, NO_HINTS) is ws[1]
    weightless = LeastLoadPolicy(PolicyConfig(least_load_kv_pressure_weight=0.0), random.Random(0))
    assert weightless.choose(ws, NO_HINTS) is ws[0]


async def test_least_load_waiting_cap_leaves_out_a_queued_worker(autojump_clock):
    ws = workers(2)
    report(ws[0], waiting=3)
    report(ws[1], running=12)  # a longer wait, but no queue
    capped = LeastLoadPolicy(PolicyConfig(least_load_max_waiting_requests=3), random.Random(0))
    assert capped.choose(ws, NO_HINTS) is ws[1]
    free = LeastLoadPolicy(PolicyConfig(), random.Random(0))
    assert free.choose(ws, NO_HINTS) is ws[0]
    report(ws[1], waiting=5)  # both at the cap: neither is left out
    assert capped.choose(ws, NO_HINTS) in ws


async def test_least_load_dark_fleet_joins_the_shortest_queue(autojump_clock):
    ws = workers(3)
    for w, n in zip(ws, (3, 1, 2), strict=True):
        w.in_flight = n
    policy = LeastLoadPolicy(PolicyConfig(), random.Random(0))
    assert all(policy.choose(ws, NO_HINTS) is ws[1] for _ in range(10))


# -- power_of_two's load metric ----------------------------------------------------------------


async def test_power_of_two_load_metrics_differ(autojump_clock):
    """ws[0]: nothing of this router in flight, but its engine reports a deep queue (other
    routers' work); ws[1]: one leg of ours, an idle engine. `requests` counts our legs only."""
    ws = workers(2)
    report(ws[0], waiting=10)
    report(ws[1], running=1)
    ws[1].in_flight = 1
    expected = PowerOfTwoPolicy(random.Random(0), "expected_wait")
    by_requests = PowerOfTwoPolicy(random.Random(0), "requests")
    assert all(expected.choose(ws, NO_HINTS) is ws[1] for _ in range(5))
    assert all(by_requests.choose(ws, NO_HINTS) is ws[0] for _ in range(5))


async def test_power_of_two_least_requests_scans_every_worker(autojump_clock):
    ws = workers(5)
    for w, n in zip(ws, (3, 3, 0, 3, 3), strict=True):
        w.in_flight = n
    least = PowerOfTwoPolicy(random.Random(0), "least_requests")
    assert all(least.choose(ws, NO_HINTS) is ws[2] for _ in range(20))
    sampled = PowerOfTwoPolicy(random.Random(0), "requests")
    assert {sampled.choose(ws, NO_HINTS) for _ in range(40)} - {ws[2]}  # a pair may miss it


def test_make_policy_passes_the_metric():
    policy = make_policy("power_of_two", PolicyConfig(power_of_two_load_metric="least_requests"))
    assert isinstance(policy, PowerOfTwoPolicy) and policy.metric == "least_requests"


# -- consistent_hashing ------------------------------------------------------------------------


def ring_of(ws: list[Worker]) -> ConsistentHashingPolicy:
    policy = ConsistentHashingPolicy(random.Random(0))
    for w in ws:
        policy.add_worker(w)
    return policy


def test_consistent_hashing_keeps_a_key_and_moves_only_a_leavers_keys():
    ws = workers(4)
    policy = ring_of(ws)
    keys = [f"user-{i}" for i in range(400)]
    before = {k: policy.choose(ws, key(k)) for k in keys}
    assert all(policy.choose(ws, key(k)) is before[k] for k in keys)
    assert len(set(before.values())) == 4
    assert min(Counter(before.values()).values()) > 50  # 150 points a worker: even enough
    gone = ws[1]
    rest = [w for w in ws if w is not gone]
    after = {k: policy.choose(rest, key(k)) for k in keys}  # gone is no candidate any more
    moved = [k for k in keys if after[k] is not before[k]]
    assert moved and all(before[k] is gone for k in moved)
    # Another process (or replica) with the same workers places every key the same way.
    theirs = workers(4)
    other = ring_of(theirs)
    assert all(other.choose(theirs, key(k)).url == before[k].url for k in keys)


def test_consistent_hashing_without_a_key_spreads():
    ws = workers(3)
    policy = ring_of(ws)
    assert {policy.choose(ws, NO_HINTS) for _ in range(60)} == set(ws)


def test_consistent_hashing_falls_back_to_the_client_affinity():
    ws = workers(4)
    policy = ring_of(ws)
    clients = [f"10.0.0.{i}" for i in range(40)]
    first = {c: policy.choose(ws, RouteHints(affinity=c)) for c in clients}
    assert all(policy.choose(ws, RouteHints(affinity=c)) is first[c] for c in clients)
    assert len(set(first.values())) > 1
    # A routing key outranks it.
    assert policy.choose(ws, RouteHints(key="k", affinity=clients[0])) is policy.choose(
        ws, key("k")
    )
    keys = RoutingKeys.of(PolicyConfig(policy="consistent_hashing"))
    assert keys is not None and keys.implicit
    headers = [(b"cookie", b"session=abc"), (b"x-forwarded-for", b"10.1.2.3")]
    assert keys.affinity(headers) == "10.1.2.3"  # x-forwarded-for first
    assert keys.affinity([(b"cookie", b"session=abc")]) == "session=abc"
    assert keys.affinity([(b"authorization", b"Bearer k")]) is None  # never a credential
    assert len(keys.affinity([(b"cookie", b"c" * 5000)]) or "") <= MAX_KEY_BYTES
    manual = RoutingKeys.of(PolicyConfig(policy="manual"))
    assert manual is not None and manual.affinity(headers) is None


# -- prefix_hash -------------------------------------------------------------------------------


def prefix_policy(ws: list[Worker], **knobs: object) -> PrefixHashPolicy:
    policy = PrefixHashPolicy(PolicyConfig(**knobs))  # type: ignore[arg-type]
    for w in ws:
        policy.add_worker(w)
    return policy


def test_prefix_hash_groups_by_the_head_of_the_prompt():
    ws = workers(4)
    policy = prefix_policy(ws, prefix_token_count=8)  # 32 characters
    heads = [f"system prompt number {i:04d} ........" for i in range(40)]
    assert all(len(h) >= 32 for h in heads)
    for head in heads:
        first = policy.choose(ws, RouteHints(text=head + " tail A"))
        assert policy.choose(ws, RouteHints(text=head + " another tail")) is first
    assert len({policy.choose(ws, RouteHints(text=h)) for h in heads}) > 1


def test_prefix_hash_escapes_an_overloaded_target():
    ws = workers(3)
    policy = prefix_policy(ws, prefix_hash_load_factor=1.25, prefix_hash_balance_abs_threshold=2)
    hints = RouteHints(text="the same long prompt head " * 10)
    target = policy.choose(ws, hints)
    target.in_flight = 6  # mean (6 + 1) / 3: limit max(2.9, 4.3); 6 is over both
    others = [w for w in ws if w is not target]
    others[0].in_flight = 1
    assert policy.choose(ws, hints) is others[1]
    target.in_flight = 4  # under the absolute margin: it keeps its prefix
    assert policy.choose(ws, hints) is target


# -- sticky sessions ---------------------------------------------------------------------------


async def test_sticky_delegates_then_pins_on_round_robin(autojump_clock):
    ws = workers(3)
    policy = make_policy("round_robin", PolicyConfig(routing_key_override=True))
    assert isinstance(policy, StickyPolicy) and policy.name == "round_robin"
    first = policy.choose(ws, key("conv"))
    assert all(policy.choose(ws, key("conv")) is first for _ in range(10))
    # Without a key the policy itself decides: round robin goes on cycling.
    assert len({policy.choose(ws, NO_HINTS) for _ in range(3)}) == 3
    # A pinned worker that is no candidate: the key moves, and stays where it moved.
    rest = [w for w in ws if w is not first]
    moved = policy.choose(rest, key("conv"))
    assert moved is not first and policy.choose(rest, key("conv")) is moved
    # Models stick independently.
    assert policy.branches["vacant"] == 1
    policy.choose(ws, key("conv", model="m2"))
    assert policy.branches["vacant"] == 2


async def test_sticky_respills_a_key_stacking_on_its_worker(autojump_clock):
    ws = workers(2)
    policy = StickyPolicy(RoundRobinPolicy(), "delegate", rng=random.Random(0))
    pinned = policy.choose(ws, key("k"))
    pinned.active_keys["k"] = STICKY_INFLIGHT_CAP
    other = policy.choose(ws, key("k"))
    assert other is not pinned and policy.branches["cap_respill"] == 1
    pinned.active_keys.clear()
    assert policy.choose(ws, key("k")) is other  # re-pinned: the other worker was under the cap


async def test_sticky_is_bounded_and_leaves_keyed_policies_alone(autojump_clock):
    config = PolicyConfig(routing_key_override=True)
    assert isinstance(make_policy("manual", config), ManualPolicy)
    assert isinstance(make_policy("consistent_hashing", config), ConsistentHashingPolicy)
    ws = workers(2)
    policy = StickyPolicy(RoundRobinPolicy(), max_keys=100)
    for i in range(1000):
        policy.choose(ws, key(f"client-{i}"))
    assert len(policy.pins.routes) == 100


async def test_sticky_assignment_mode_other_than_delegate(autojump_clock):
    ws = workers(3)
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 2, 0, 1
    config = PolicyConfig(routing_key_override=True, assignment_mode="min_load")
    policy = make_policy("round_robin", config)
    assert policy.choose(ws, key("a")) is ws[1]  # min_load places it, not round robin


def test_routing_keys_headers_in_order_and_rid_lineage():
    keys = RoutingKeys((b"x-session", b"x-smg-routing-key"), lineage=True)
    both = [(b"x-smg-routing-key", b"b"), (b"x-session", b"a")]
    assert keys.key(both) == "a"
    assert keys.key([(b"x-session", b""), (b"x-smg-routing-key", b"b")]) == "b"
    assert keys.key([], "conv_t2_r1") == "conv"
    assert keys.key([], "conv_t3") == "conv"
    assert keys.key([(b"x-session", b"conv_t4")], "other") == "conv"  # header first, stripped
    assert keys.key([], ["a", "b"]) is None  # a batch's rid list is no session
    assert len(keys.key([], "x" * 10_000) or "") <= MAX_KEY_BYTES  # bounded
    plain = RoutingKeys()
    assert plain.key([(b"x-smg-routing-key", b"conv_t2")], "conv_t1") == "conv_t2"
    assert strip_lineage("_t1") == "_t1" and strip_lineage("a_tx") == "a_tx"
    assert RoutingKeys.of(PolicyConfig(policy="round_robin")) is None  # no header scan


# -- pairing by KV transfer backend -------------------------------------------------------------


def pd_fleet(backends: tuple[tuple[str | None, ...], tuple[str | None, ...]]) -> Fleet:
    prefills = tuple(WorkerSpec(f"http://p{i}:1", "prefill", 8998) for i in range(len(backends[0])))
    decodes = tuple(WorkerSpec(f"http://d{i}:1", "decode") for i in range(len(backends[1])))
    fleet = Fleet(RouterConfig(prefill=prefills, decode=decodes), random.Random(0))
    for role, names in zip(("prefill", "decode"), backends, strict=True):
        for worker, name in zip(fleet.workers(role), names, strict=True):  # type: ignore[arg-type]
            worker.healthy = True
            worker.server_info = attrs.evolve(ServerInfo(), transfer_backend=name)
    return fleet


def test_pairs_share_a_transfer_backend():
    fleet = pd_fleet((("mooncake", "nixl"), ("nixl", "nixl")))
    for _ in range(30):
        prefill, decode = fleet.select_pair()
        assert prefill.server_info.transfer_backend == "nixl"  # mooncake has no partner
        assert decode.server_info.transfer_backend == "nixl"
    assert not fleet.incompatible_backends()
    mixed = pd_fleet((("mooncake", "nixl"), ("nixl", "mooncake")))
    for _ in range(30):
        prefill, decode = mixed.select_pair()
        assert prefill.server_info.transfer_backend == decode.server_info.transfer_backend


def test_no_compatible_pair_is_its_own_failure():
    fleet = pd_fleet((("mooncake",), ("nixl",)))
    assert fleet.incompatible_backends()
    with pytest.raises(NoWorkerAvailable) as raised:
        fleet.select_pair()
    assert raised.value.reason == NO_COMPATIBLE_PAIR
    unknown = pd_fleet(((None,), ("nixl",)))  # a backend not reported pairs with any
    assert not unknown.incompatible_backends()
    unknown.select_pair()


def test_least_load_roles_are_polled_for_engine_loads():
    assert polled_roles(PolicyConfig(policy="least_load")) == ("prefill", "decode")
    assert polled_roles(PolicyConfig(policy="round_robin", decode_policy="least_load")) == (
        "decode",
    )


@pytest.mark.parametrize(
    "bad",
    [
        ["--power-of-two-load-metric", "tokens"],
        ["--prefix-hash-load-factor", "0.5"],
        ["--prefix-token-count", "0"],
        ["--least-load-default-throughput", "0"],
        ["--least-load-kv-pressure-weight", "-1"],
        ["--least-load-mean-prefill-tokens", "0"],
        ["--least-load-max-waiting-requests", "-1"],
        ["--routing-key-headers", "bad header"],
        ["--assignment-mode", "sticky"],
    ],
)
def test_routing_flags_refuse_what_smg_refuses(bad):
    with pytest.raises(SystemExit):
        router_config(build_parser().parse_args(["serve", *bad]))


def test_routing_flags_reach_the_policies():
    args = build_parser().parse_args(
        ["serve", "--prefill-policy", "prefix_hash", "--decode-policy", "least_load",
         "--sticky-sessions", "--routing-key-headers", "X-Session"]
    )  # fmt: skip
    policy = router_config(args).policy
    assert policy.routing_key_override and policy.routing_key_headers == ("X-Session",)
    assert policy.sticky_assignment_mode == "delegate"
    assert RoutingKeys.of(policy) == RoutingKeys((b"x-session",), lineage=True)
    prefill, decode = make_policy("prefix_hash", policy), make_policy("least_load", policy)
    assert isinstance(prefill, StickyPolicy) and isinstance(prefill.inner, PrefixHashPolicy)
    assert isinstance(decode, StickyPolicy) and isinstance(decode.inner, LeastLoadPolicy)
