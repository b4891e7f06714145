"""EtcdMembership against a real etcd: two instances, as two router replicas would run them.

Each instance feeds its own in-memory registry double; what one writes must reach the other's
registry through etcd (never through the instance's local view). Time bounds are loose (the
machine is shared), and every test first checks that what it provoked (an outage, an expired
lease, a compaction, a race) really happened before it checks the effect.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import attrs
import orjson
import pytest
import trio

from tests.etcd.conftest import EtcdServer, free_port
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import EtcdConfig
from trio_pd.membership.etcd import (
    DuplicateWorker,
    EtcdClient,
    EtcdMembership,
    EtcdUnavailable,
    UnstorableSpec,
    prefix_end,
)
from trio_pd.spec import WorkerRecord, WorkerSpec

PREFIX = "/test"
PROPAGATION_SECS = 10.0  # a hang guard: a watch delivers in milliseconds, and the fallback it would
# hide is the 30 s resync; the 1 s figure of the design is not asserted (a busy machine breaks it)
OUTAGE_SECS = 15.0  # noticing an outage or a restart, an expiring lease
EXPIRY_SECS = 15.0  # etcd deleting the keys of a lease it found expired


class FakeRegistry:
    """The registry double: the workers the source asked for last, and its status reports."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        self.statuses: list[tuple[bool, str]] = []
        self.reconciles = 0
        self.history: list[frozenset[str]] = []  # the ids of every reconcile, in order

    def reconcile(self, source: str, desired: Iterable[WorkerRecord]) -> None:
        assert source == "etcd"
        desired = list(desired)
        assert all(r.source == "etcd" for r in desired)
        self.workers = {r.id: r for r in desired}
        self.reconciles += 1
        self.history.append(frozenset(self.workers))

    def source_status(self, source: str, ok: bool, detail: str = "") -> None:
        assert source == "etcd"
        self.statuses.append((ok, detail))

    @property
    def ok(self) -> bool | None:
        return self.statuses[-1][0] if self.statuses else None


@attrs.define
class Replica:
    store: EtcdMembership
    registry: FakeRegistry
    scope: trio.CancelScope
    stopped: trio.Event

    async def stop(self) -> None:
        self.scope.cancel()
        await self.stopped.wait()


MakeReplica = Callable[..., Awaitable[Replica]]


@pytest.fixture
async def replicas(etcd_server: EtcdServer) -> AsyncIterator[MakeReplica]:
    """make(**config) -> a running EtcdMembership (run() started) on the test etcd."""
    made: list[EtcdMembership] = []
    async with trio.open_nursery() as nursery:

        async def make(
            *,
            endpoints: str | None = None,
            on_error: Callable[[str], None] | None = None,
            **options: Any,
        ) -> Replica:
            config = EtcdConfig(endpoints=endpoints or etcd_server.url, prefix=PREFIX, **options)
            store = EtcdMembership(config, on_error=on_error)
            made.append(store)
            registry, scope, stopped = FakeRegistry(), trio.CancelScope(), trio.Event()

            async def run(task_status: trio.TaskStatus[None]) -> None:
                try:
                    with scope:
                        await store.run(registry, task_status=task_status)
                finally:
                    stopped.set()

            await nursery.start(run)
            return Replica(store, registry, scope, stopped)

        yield make
        nursery.cancel_scope.cancel()
    for store in made:
        await store.aclose()


@pytest.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    """A plain client for looking at (and meddling with) etcd from outside the stores."""
    client = EtcdClient([etcd_server.url])
    yield client
    await client.aclose()


async def eventually(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.02)
        return
    pytest.fail(f"not within {timeout} s: {what}")


def spec(n: int, role: str = "prefill", **fields: Any) -> WorkerSpec:
    port = 8998 if role == "prefill" else None
    return WorkerSpec(f"http://10.1.0.{n}:30000", role, port, **fields)  # type: ignore[arg-type]


async def stored_json(etcd: EtcdClient, record: WorkerRecord) -> dict | None:
    _, kvs = await etcd.range(record.meta["etcd_key"].encode())
    return orjson.loads(kvs[0].value) if kvs else None


# -- writes through one replica reach the other ------------------------------------------------


async def test_added_worker_appears_in_the_other_replica_and_removal_too(
    replicas: MakeReplica, etcd: EtcdClient
) -> None:
    a, b = await replicas(), await replicas()
    assert (a.registry.ok, b.registry.ok) == (True, True)
    assert b.registry.workers == {}

    record = await a.store.add(spec(1, model_id="llama"))
    assert record.id.startswith("etcd-prefill-")
    assert record.meta["etcd_key"] == f"{PREFIX}/workers/prefill/{record.id}"
    assert a.store.records()[record.id] == record  # written through: shown at once
    assert await stored_json(etcd, record) == {
        "url": "http://10.1.0.1:30000",
        "bootstrap_port": 8998,
        "model_id": "llama",
    }

    await eventually(lambda: record.id in b.registry.workers, PROPAGATION_SECS, "B sees the add")
    seen = b.registry.workers[record.id]
    assert seen.spec == spec(1, model_id="llama")
    assert seen.meta["etcd_key"] == record.meta["etcd_key"]

    removed = await b.store.remove(record.id)  # through the other replica
    assert removed.id == record.id
    assert await stored_json(etcd, record) is None
    await eventually(
        lambda: record.id not in a.registry.workers, PROPAGATION_SECS, "A sees the removal"
    )
    assert record.id not in a.store.records()
    with pytest.raises(KeyError):
        await a.store.remove(record.id)


async def test_duplicate_url_and_role_refused_by_every_replica(
    replicas: MakeReplica, etcd_server: EtcdServer
) -> None:
    a = await replicas()
    first = await a.store.add(spec(2, "decode"))
    with pytest.raises(DuplicateWorker, match=first.id):
        await a.store.add(spec(2, "decode"))  # refused from A's own view

    # An instance that never read etcd (no run()): only etcd's own guard can refuse it.
    blind = EtcdMembership(EtcdConfig(endpoints=etcd_server.url, prefix=PREFIX))
    try:
        assert blind.records() == {}
        with pytest.raises(DuplicateWorker, match=first.id):
            await blind.add(spec(2, "decode"))
        other_role = await blind.add(spec(2, "prefill"))  # same URL, other role: allowed
        assert other_role.spec.role == "prefill"
    finally:
        await blind.aclose()

    with pytest.raises(UnstorableSpec):
        await a.store.add(spec(3, api_key="secret"))

    await a.store.remove(first.id)
    again = await a.store.add(spec(2, "decode"))  # the URL is free again; the id is new
    assert again.id != first.id


async def test_ids_unique_under_concurrent_adds_from_both_replicas(replicas: MakeReplica) -> None:
    a, b = await replicas(), await replicas()
    added: list[WorkerRecord] = []

    async def add(store: EtcdMembership, n: int) -> None:
        added.append(await store.add(spec(n)))

    async with trio.open_nursery() as nursery:
        for n in range(10):
            nursery.start_soon(add, a.store, n)
            nursery.start_soon(add, b.store, 100 + n)

    assert a.store.id_races + b.store.id_races > 0, "the adds never raced for an id"
    ids = sorted(r.id for r in added)
    assert len(set(ids)) == 20
    assert sorted(int(i.rsplit("-", 1)[1]) for i in ids) == list(range(1, 21))
    for replica in (a, b):
        await eventually(
            lambda r=replica: sorted(r.registry.workers) == ids,
            PROPAGATION_SECS,
            "each replica sees all 20",
        )


async def test_periodic_resync_repairs_a_view_that_missed_a_change(replicas: MakeReplica) -> None:
    a = await replicas()
    b = await replicas(resync_secs=0.5)
    record = await a.store.add(spec(1))
    await eventually(lambda: record.id in b.registry.workers, PROPAGATION_SECS, "B sees it")

    b.store._kvs.clear()  # as if B had missed the PUT: nothing in etcd changes after this
    b.store._rebuild()
    assert b.registry.workers == {}
    syncs = b.store.full_syncs
    await eventually(lambda: record.id in b.registry.workers, 3.0, "repaired by a resync")
    assert b.store.full_syncs > syncs


# -- outages -----------------------------------------------------------------------------------


async def test_outage_keeps_workers_reports_status_and_watch_resumes(
    replicas: MakeReplica, etcd_server: EtcdServer
) -> None:
    a = await replicas(retry_max_secs=1.0, resync_secs=600)
    b = await replicas(retry_max_secs=1.0, resync_secs=600)
    before = await a.store.add(spec(1))
    await eventually(lambda: before.id in b.registry.workers, PROPAGATION_SECS, "B sees the add")

    etcd_server.stop()
    assert not etcd_server.running
    for r in (a, b):
        await eventually(lambda r=r: r.registry.ok is False, OUTAGE_SECS, "outage reported")
    assert b.registry.statuses[-1][1]  # says why
    assert b.store.errors["unavailable"] >= 1
    assert list(b.registry.workers) == [before.id]  # kept, not reconciled to empty
    assert list(a.registry.workers) == [before.id]
    with pytest.raises(EtcdUnavailable):
        await a.store.add(spec(2))
    syncs = b.store.full_syncs

    etcd_server.start()
    for r in (a, b):
        await eventually(lambda r=r: r.registry.ok is True, OUTAGE_SECS, "reconnected")
    after = await a.store.add(spec(2))
    await eventually(
        lambda: after.id in b.registry.workers, PROPAGATION_SECS, "a change after the restart"
    )
    await a.store.remove(before.id)
    await eventually(
        lambda: before.id not in b.registry.workers, PROPAGATION_SECS, "a removal after it"
    )
    assert b.store.full_syncs == syncs, "B ranged anew instead of resuming its watch"


async def test_watch_resumes_with_a_full_range_when_its_revision_was_compacted(
    replicas: MakeReplica, etcd_server: EtcdServer, etcd: EtcdClient
) -> None:
    a = await replicas(resync_secs=600)
    # B waits 5 s (+-20%) before reconnecting: time to change and compact etcd behind its back.
    b = await replicas(retry_initial_secs=5.0, retry_max_secs=5.0, resync_secs=600)
    gone = await a.store.add(spec(1))
    await eventually(lambda: gone.id in b.registry.workers, PROPAGATION_SECS, "B sees the add")
    watched_to = b.store.revision

    etcd_server.stop()
    await eventually(lambda: b.registry.ok is False, OUTAGE_SECS, "B notices the outage")
    etcd_server.start()
    new = await a.store.add(spec(2))
    await a.store.remove(gone.id)
    revision, _ = await etcd.range(b"/")
    await etcd.compact(revision)
    assert b.registry.ok is False, "B reconnected before etcd was compacted"
    assert b.store.revision == watched_to

    await eventually(lambda: b.store.errors["compacted"] >= 1, OUTAGE_SECS, "B hits compaction")
    await eventually(
        lambda: sorted(b.registry.workers) == [new.id], PROPAGATION_SECS, "B ranged anew"
    )
    assert b.registry.ok is True


async def test_unreachable_at_start_reports_and_reconciles_nothing(replicas: MakeReplica) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    reported: list[str] = []
    r = await replicas(endpoints=dead, dial_timeout_secs=0.5, on_error=reported.append)
    # started() came back after the first attempt failed
    assert r.registry.statuses and r.registry.ok is False
    assert "no etcd endpoint answered" in r.registry.statuses[-1][1]
    assert r.registry.reconciles == 0
    assert reported[0] == "unavailable"
    assert r.store.errors["unavailable"] == len(reported)
    await r.stop()


async def test_failover_to_the_next_endpoint(
    replicas: MakeReplica, etcd_server: EtcdServer
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    a = await replicas(endpoints=f"{dead},{etcd_server.url}", dial_timeout_secs=0.5)
    b = await replicas()
    assert a.registry.ok is True
    record = await a.store.add(spec(7, "decode"))
    await eventually(lambda: record.id in b.registry.workers, PROPAGATION_SECS, "B sees it")
    await eventually(lambda: record.id in a.registry.workers, PROPAGATION_SECS, "A's watch too")


# -- leases ------------------------------------------------------------------------------------


async def test_lease_expiry_removes_the_workers_of_a_stopped_replica(
    replicas: MakeReplica, etcd: EtcdClient
) -> None:
    a = await replicas(lease_ttl_secs=2)
    b = await replicas()
    leased = await a.store.add(spec(1))
    kept = await b.store.add(spec(2))  # B has no lease: its worker stays
    lease = a.store.lease
    assert lease and leased.meta["lease"] == f"{lease:x}"
    await eventually(lambda: leased.id in b.registry.workers, PROPAGATION_SECS, "B sees it")

    await trio.sleep(3.5)  # longer than the TTL: A's keepalives hold the lease
    assert await etcd.lease_time_to_live(lease) > 0
    assert leased.id in b.registry.workers

    await a.stop()
    with trio.fail_after(OUTAGE_SECS):
        while await etcd.lease_time_to_live(lease) > 0:
            await trio.sleep(0.1)
    # etcd deletes an expired lease's keys in its next pass over expired leases, a second or
    # so after timetolive already calls the lease gone.
    await eventually(lambda: leased.id not in b.registry.workers, EXPIRY_SECS, "B sees the expiry")
    assert list(b.registry.workers) == [kept.id]


async def test_lease_lost_while_running_is_renewed_and_workers_written_again(
    replicas: MakeReplica, etcd: EtcdClient
) -> None:
    a = await replicas(lease_ttl_secs=2)
    b = await replicas()
    record = await a.store.add(spec(1))
    await eventually(lambda: record.id in b.registry.workers, PROPAGATION_SECS, "B sees it")
    first_lease = a.store.lease
    seen = len(b.registry.history)

    await etcd.lease_revoke(first_lease)  # behind A's back, as an expiry in an outage would
    assert await etcd.lease_time_to_live(first_lease) < 0
    # A may write it again before a poll could see the gap: look for it in B's reconciles.
    await eventually(
        lambda: any(record.id not in ids for ids in b.registry.history[seen:]),
        PROPAGATION_SECS,
        "gone at B with the lease",
    )
    await eventually(
        lambda: record.id in b.registry.workers, OUTAGE_SECS, "written again under its id"
    )
    assert a.store.errors["lease_lost"] >= 1
    assert a.store.lease not in (0, first_lease)
    assert b.registry.workers[record.id].meta["lease"] == f"{a.store.lease:x}"

    # Removed through B while A's lease lives: A must not write it back when its lease goes.
    assert a.store.owned() == {record.id}
    await b.store.remove(record.id)
    await eventually(lambda: record.id not in a.store.owned(), PROPAGATION_SECS, "A disowns it")
    second_lease = a.store.lease
    await etcd.lease_revoke(second_lease)
    await eventually(lambda: a.store.errors["lease_lost"] >= 2, OUTAGE_SECS, "A loses lease 2")
    await trio.sleep(0.5)
    assert record.id not in b.registry.workers


# -- what is in etcd, and the flags ------------------------------------------------------------


async def test_keys_written_by_others_are_read_and_bad_ones_ignored(
    replicas: MakeReplica, etcd: EtcdClient
) -> None:
    b = await replicas()
    external = {"url": "http://10.2.0.1:8000", "bootstrap_port": None, "api_key": "x"}
    await etcd.put(f"{PREFIX}/workers/decode/node-a".encode(), orjson.dumps(external))
    await etcd.put(f"{PREFIX}/workers/prefill/broken".encode(), b"{not json")
    await etcd.put(f"{PREFIX}/workers/other/x".encode(), orjson.dumps(external))
    await eventually(lambda: "node-a" in b.registry.workers, PROPAGATION_SECS, "B reads it")
    await eventually(lambda: b.store.errors["bad_record"] == 2, PROPAGATION_SECS, "bad counted")
    assert list(b.registry.workers) == ["node-a"]
    worker = b.registry.workers["node-a"].spec
    assert worker == WorkerSpec("http://10.2.0.1:8000", "decode")
    assert worker.api_key is None  # never taken from etcd

    await etcd.delete_range(f"{PREFIX}/".encode(), prefix_end(f"{PREFIX}/".encode()))
    await eventually(lambda: b.registry.workers == {}, PROPAGATION_SECS, "all deleted")


def etcd_config(*argv: str) -> EtcdConfig | None:
    """The etcd config `trio-pd serve` builds from these flags (the flag table's rows)."""
    return router_config(build_parser().parse_args(["serve", *argv])).etcd


def test_flags_make_the_config() -> None:
    assert etcd_config() is None
    config = etcd_config(
        "--etcd-endpoints", "http://10.0.0.1:2379/, http://10.0.0.2:2379",
        "--etcd-prefix", "/prod/router/", "--etcd-lease-ttl-secs", "10",
    )  # fmt: skip
    assert config == EtcdConfig(
        endpoints=("http://10.0.0.1:2379", "http://10.0.0.2:2379"),
        prefix="/prod/router",
        lease_ttl_secs=10,
    )
    assert EtcdConfig(endpoints="http://e:2379").prefix == "/trio-pd"
    with pytest.raises(ValueError, match="http"):
        EtcdConfig(endpoints="e:2379")
    with pytest.raises(ValueError):
        EtcdConfig(endpoints="http://e:2379", lease_ttl_secs=-1)
