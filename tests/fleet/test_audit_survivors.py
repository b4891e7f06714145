"""Issue 28's audit survivors that are guarantees of a data structure: each test here failed with
the one-line break the audit made (its docstring names it) and passes without it.

- the hash ring places workers by URL: a worker re-registered under a new id keeps its keys;
- the sticky table forgets the least recently used key, a use through the sticky override
  (`ManualPolicy.pinned`) counting as a use;
- the prefill admission line is first in, first out: a newcomer never takes a slot while
  someone waits;
- when every candidate is over the overload thresholds, the least loaded takes the request.
"""

from __future__ import annotations

import random

import trio

from trio_pd.config import OverloadConfig, PolicyConfig, RouterConfig
from trio_pd.fleet.consistent_hashing import ConsistentHashingPolicy
from trio_pd.fleet.gates import AtCapacity, PrefillGate
from trio_pd.fleet.hints import RouteHints
from trio_pd.fleet.manual import ManualPolicy
from trio_pd.fleet.overload import veto
from trio_pd.fleet.policies import RoundRobinPolicy
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.reports import EngineLoad, RankLoad
from trio_pd.fleet.sticky import StickyPolicy
from trio_pd.fleet.worker import Worker
from trio_pd.spec import WorkerSpec


def worker(url: str, id: str, role: str = "decode") -> Worker:
    return Worker(spec=WorkerSpec(url, role), id=id)  # type: ignore[arg-type]


def key(value: str) -> RouteHints:
    return RouteHints(key=value)


def test_a_worker_re_registered_under_a_new_id_keeps_its_keys_on_the_ring() -> None:
    """Break: the ring's points hashed from `w.id` instead of `w.url`."""
    urls = [f"http://w{i}:8000" for i in range(4)]
    before = [worker(url, f"decode-{i + 1}") for i, url in enumerate(urls)]
    policy = ConsistentHashingPolicy(random.Random(0))
    for w in before:
        policy.add_worker(w)
    keys = [f"user-{i}" for i in range(400)]
    placed = {k: policy.choose(before, key(k)).url for k in keys}
    assert len(set(placed.values())) == 4
    # The pod of w1 is replaced: same URL, a new worker id (as a discovery source names it).
    gone = before[1]
    policy.remove_worker(gone)
    back = worker(gone.url, "decode-9")
    policy.add_worker(back)
    after = [w for w in before if w is not gone] + [back]
    moved = [k for k in keys if policy.choose(after, key(k)).url != placed[k]]
    assert moved == []
    # And a router whose workers carry other ids altogether places every key the same way.
    other = ConsistentHashingPolicy(random.Random(1))
    theirs = [worker(url, f"pod-{n}") for n, url in enumerate(reversed(urls))]
    for w in theirs:
        other.add_worker(w)
    assert all(other.choose(theirs, key(k)).url == placed[k] for k in keys)


async def test_the_sticky_table_forgets_the_least_recently_used_key(autojump_clock) -> None:
    """Break: `self.routes.move_to_end(key)` left out of a use (`choose`, or `pinned`, which the
    sticky override reads the table through): the oldest-inserted key would go instead."""
    ws = [worker(f"http://w{i}:8000", f"decode-{i}") for i in range(2)]
    manual = ManualPolicy(max_keys=3)
    for k in ("a", "b", "c"):
        manual.choose(ws, key(k))
    manual.choose(ws, key("a"))  # a used again: b is the least recently used now
    manual.choose(ws, key("d"))
    assert list(manual.routes) == ["c", "a", "d"]

    sticky = StickyPolicy(RoundRobinPolicy(), "delegate", rng=random.Random(0), max_keys=3)
    first = {k: sticky.choose(ws, key(k)) for k in ("a", "b", "c")}
    assert sticky.choose(ws, key("a")) is first["a"]  # a used again, through `pinned`
    sticky.choose(ws, key("d"))  # the table is full: b, the least recently used, goes
    assert [k.rsplit(":", 1)[1] for k in sticky.pins.routes] == ["c", "a", "d"]
    assert sticky.choose(ws, key("a")) is first["a"]  # still pinned where it was


async def test_nobody_overtakes_the_prefill_line(autojump_clock) -> None:
    """Break: `admit` tries a slot even while others wait (`_try(select)` without
    `if not self.line`): a request arriving just as a slot frees takes it from the head."""
    gate = PrefillGate(cap=1, size=10, timeout_secs=60.0)
    prefill = worker("http://p:1", "prefill-1", "prefill")

    def select(has_room):
        if not has_room(prefill):
            raise AtCapacity("prefill")
        return prefill

    held = await gate.admit(select)
    order: list[str] = []

    async def take(name: str) -> None:
        slot = await gate.admit(select)
        order.append(name)
        await trio.sleep(1.0)
        slot.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, "waiting")
        await trio.sleep(0.5)
        assert gate.waiting == 1  # the provoked state: one in line, the slot held
        held.release()  # the slot is free, the head woken but not yet run...
        slot = await gate.admit(select)  # ...when a newcomer arrives (no checkpoint between)
        order.append("newcomer")
        slot.release()
    assert order == ["waiting", "newcomer"]


def overloaded_fleet(loads: list[int]) -> Fleet:
    config = RouterConfig(
        prefill=(WorkerSpec("http://p:1", "prefill"),),
        decode=tuple(WorkerSpec(f"http://d:{i}", "decode") for i in range(len(loads))),
        policy=PolicyConfig(policy="round_robin"),
        overload=OverloadConfig(),
    )
    fleet = Fleet(config, random.Random(0))
    for w in fleet.workers():
        w.healthy = True
    for w, queued in zip(fleet.workers("decode"), loads, strict=True):
        w.report_load(EngineLoad((RankLoad(waiting=queued),), "/v1/loads"))
    return fleet


async def test_when_every_candidate_is_over_the_least_loaded_takes_it(autojump_clock) -> None:
    """Break: `least_loaded` takes the first (or the most loaded) of the candidates."""
    for loads, least in (([30, 9, 20], 1), ([9, 30, 20], 0), ([30, 20, 9], 2)):
        fleet = overloaded_fleet(loads)
        decodes = fleet.workers("decode")
        left, vetoed, fell_back = veto("decode", decodes, fleet.config.overload)
        assert fell_back and len(vetoed) == 3  # the provoked state: every one is over
        assert left == [decodes[least]], loads
        picks = {fleet.select("decode").id for _ in range(4)}
        assert picks == {decodes[least].id}, loads
