"""etcd as the membership store shared by router replicas: the source, its watch, the store.

Every replica runs one `EtcdMembership`: a `MembershipSource` named "etcd" (it ranges the
workers prefix, reconciles the registry with the whole set, then watches from the next revision
and reconciles the whole set again on every change) and a `MembershipStore` (the admin API's
`add`/`remove` write through to etcd, so every replica sees them). The keys are laid out as
`records.py` says. A per-worker ``api_key`` is never written to etcd: anyone who can read etcd
could read it, so `add` refuses a spec that carries one (`UnstorableSpec`).

With ``--etcd-lease-ttl-secs N`` the keys written by `add` hang on this replica's lease, kept
alive by `run()`: when the replica dies, its workers vanish from every replica after N seconds.
While the replica lives, a lease lost anyway (an etcd outage longer than N, a revoke) is
replaced and the replica's workers are written again under their old ids, unless someone else
registered the URL meanwhile.

When etcd is unreachable the registry keeps the last membership (never reconciled to empty),
``source_status("etcd", False, why)`` says so, and `run()` retries with backoff, resuming the
watch from the last revision it applied (a full range when that revision was compacted).
"""

from __future__ import annotations

import collections
import logging
import random
from collections.abc import Callable, Mapping

import attrs
import trio

from trio_pd.config import EtcdConfig
from trio_pd.membership.etcd.client import EtcdClient
from trio_pd.membership.etcd.errors import (
    DuplicateWorker,
    EtcdCompacted,
    EtcdError,
    EtcdUnavailable,
    LeaseNotFound,
    UnstorableSpec,
)
from trio_pd.membership.etcd.records import SOURCE, EtcdKeys, encode_spec
from trio_pd.membership.etcd.wire import (
    KeyValue,
    WatchEvent,
    cmp_created,
    cmp_modified,
    cmp_value,
    header_revision,
    op_delete,
    op_put,
    op_range,
    prefix_end,
    txn_deleted,
    txn_kvs,
)
from trio_pd.spec import ROLES, Registry, WorkerRecord, WorkerSpec

log = logging.getLogger("trio_pd.membership.etcd")

ADD_ATTEMPTS = 50  # txn retries when replicas race for the same id counter


@attrs.define
class _Owned:
    """A worker this replica registered on its lease (re-registered if the lease is lost)."""

    spec: WorkerSpec
    lease: int


class EtcdMembership:
    """Membership shared through etcd: `MembershipSource` and `MembershipStore` named "etcd".

    ``errors`` counts failures by kind ("unavailable", "compacted", "watch", "keepalive",
    "lease_lost", "bad_record", "reregister"); ``on_error(kind)``, when given, is called on each,
    e.g. to increment a Prometheus counter. ``ok`` is the last status reported.
    """

    name = SOURCE

    def __init__(
        self,
        config: EtcdConfig,
        *,
        on_error: Callable[[str], None] | None = None,
        client: EtcdClient | None = None,
    ) -> None:
        self.config = config
        self.client = client or EtcdClient(
            config.endpoints,
            dial_timeout_secs=config.dial_timeout_secs,
            request_timeout_secs=config.request_timeout_secs,
        )
        self.on_error = on_error
        self.errors: collections.Counter[str] = collections.Counter()
        self.ok: bool | None = None
        self.full_syncs = 0  # complete ranges of the prefix (start, resync, after compaction)
        self.id_races = 0  # adds that lost the id counter to another add and went again
        self.keys = EtcdKeys(config.prefix)
        self._kvs: dict[bytes, KeyValue] = {}
        self._records: dict[str, WorkerRecord] = {}
        self._bad: set[tuple[bytes, int]] = set()  # malformed keys already logged
        self._revision = 0  # every change up to this revision is in _kvs
        self._local_revision = 0  # our newest write shown in _kvs before the watch brought it
        self._registry: Registry | None = None
        self._lease = 0
        self._lease_lock = trio.Lock()
        self._owned: dict[str, _Owned] = {}

    async def aclose(self) -> None:
        await self.client.aclose()

    async def __aenter__(self) -> EtcdMembership:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- the view --------------------------------------------------------------------------

    def records(self) -> Mapping[str, WorkerRecord]:
        return dict(self._records)

    @property
    def revision(self) -> int:
        """The etcd revision the view is current to."""
        return self._revision

    def owned(self) -> frozenset[str]:
        """Ids of the workers this replica registered on its lease (written again if the lease
        is lost while the replica runs)."""
        return frozenset(self._owned)

    @property
    def lease(self) -> int:
        """This replica's lease id (0: none granted yet, or no lease configured)."""
        return self._lease

    def _count(self, kind: str) -> None:
        self.errors[kind] += 1
        if self.on_error is not None:
            try:
                self.on_error(kind)
            except Exception:
                log.exception("etcd on_error callback failed")

    def _set_status(self, ok: bool, detail: str = "") -> None:
        if ok == self.ok:
            return
        self.ok = ok
        if ok:
            log.info("etcd membership: connected to etcd (revision %d)", self._revision)
        else:
            log.warning("etcd membership: etcd unreachable, keeping the last workers: %s", detail)
        if self._registry is not None:
            self._registry.source_status(SOURCE, ok, detail)

    def _record_of(self, kv: KeyValue) -> WorkerRecord | None:
        try:
            return self.keys.record_of(kv)
        except ValueError as exc:
            if (kv.key, kv.mod_revision) not in self._bad:
                self._bad.add((kv.key, kv.mod_revision))
                self._count("bad_record")
                log.warning("etcd key %r ignored: %s", kv.key.decode(errors="replace"), exc)
            return None

    def _rebuild(self) -> None:
        """Records from the raw keys, then the registry reconciled with all of them."""
        records: dict[str, WorkerRecord] = {}
        for key in sorted(self._kvs):
            record = self._record_of(self._kvs[key])
            if record is None:
                continue
            if record.id in records:
                kv = self._kvs[key]
                if (kv.key, kv.mod_revision) not in self._bad:
                    self._bad.add((kv.key, kv.mod_revision))
                    self._count("bad_record")
                    log.warning("etcd key %r ignored: id %r is taken", key.decode(), record.id)
                continue
            records[record.id] = record
        live = set(self._kvs)
        self._bad = {bad for bad in self._bad if bad[0] in live}
        self._records = records
        if self._registry is not None:
            self._registry.reconcile(SOURCE, list(records.values()))

    async def _forget_removed(self) -> None:
        """Owned workers whose keys went while their lease lives were removed on purpose (by
        another replica or by hand): stop owning them. Those that went with their lease stay
        owned, for `_reregister` to write again."""
        for worker_id in [w for w in self._owned if w not in self._records]:
            owned = self._owned.get(worker_id)
            if owned is not None and await self.client.lease_time_to_live(owned.lease) > 0:
                self._owned.pop(worker_id, None)

    async def _full_sync(self) -> None:
        revision, kvs = await self.client.range(
            self.keys.workers_prefix, prefix_end(self.keys.workers_prefix)
        )
        self.full_syncs += 1
        newest = max(self._revision, self._local_revision)
        if revision < newest:
            # The watch (or a write of ours) got ahead while the range was on its way: the view
            # is newer than this answer, and the watch brings whatever follows.
            log.debug("etcd range at revision %d older than the view (%d)", revision, newest)
            return
        self._kvs = {kv.key: kv for kv in kvs}
        self._revision = max(self._revision, revision)
        self._rebuild()
        await self._forget_removed()

    async def _apply_events(self, events: list[WatchEvent]) -> None:
        fresh = [e for e in events if e.kv.mod_revision > self._revision]
        if not fresh:
            return
        for event in fresh:
            if event.type == "DELETE":
                self._kvs.pop(event.kv.key, None)
            else:
                self._kvs[event.kv.key] = event.kv
        self._rebuild()
        self._revision = max(e.kv.mod_revision for e in fresh)
        await self._forget_removed()

    def _apply_local(self, kv: KeyValue | None, key: bytes, revision: int) -> None:
        """Our own write at ``revision``, shown before the watch brings it (unless the view
        is already past it)."""
        current = self._kvs.get(key)
        if revision <= self._revision or (current and current.mod_revision >= revision):
            return
        self._local_revision = max(self._local_revision, revision)
        if kv is None:
            self._kvs.pop(key, None)
        else:
            self._kvs[key] = kv
        self._rebuild()

    # -- the source ------------------------------------------------------------------------

    async def run(
        self, registry: Registry, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep ``registry``'s "etcd" workers equal to etcd's, forever (see the module doc)."""
        self._registry = registry
        async with trio.open_nursery() as nursery:
            if self.config.lease_ttl_secs:
                nursery.start_soon(self._lease_loop)
            nursery.start_soon(self._resync_loop)
            await self._watch_loop(registry, task_status)

    async def _watch_loop(self, registry: Registry, task_status: trio.TaskStatus[None]) -> None:
        started = False
        need_range = True
        backoff = self.config.retry_initial_secs
        while True:
            try:
                if need_range:
                    await self._full_sync()
                    need_range = False
                    self._set_status(True)
                if not started:
                    task_status.started()
                    started = True
                await self._watch(on_open=lambda: self._set_status(True))
            except EtcdCompacted as exc:
                self._count("compacted")
                log.warning("etcd watch from revision %d: %s; ranging anew", self._revision, exc)
                need_range = True
                continue
            except EtcdError as exc:
                self._count("unavailable" if isinstance(exc, EtcdUnavailable) else "watch")
                self._set_status(False, str(exc))
                if not started:
                    task_status.started()
                    started = True
                log.debug("etcd watch: %s; retrying in %.1f s", exc, backoff)
                await trio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, self.config.retry_max_secs)
                continue
            backoff = self.config.retry_initial_secs

    async def _watch(self, on_open: Callable[[], None]) -> None:
        start = self._revision + 1
        async with self.client.watch(
            self.keys.workers_prefix, prefix_end(self.keys.workers_prefix), start_revision=start
        ) as batches:
            on_open()
            log.debug("etcd watch open from revision %d", start)
            async for events in batches:
                await self._apply_events(events)
                self._set_status(True)  # after a failed resync, events say etcd is back

    async def _resync_loop(self) -> None:
        while True:
            await trio.sleep(self.config.resync_secs)
            try:
                await self._full_sync()
                self._set_status(True)
            except EtcdError as exc:
                self._count("unavailable")
                self._set_status(False, f"resync: {exc}")

    # -- leases ----------------------------------------------------------------------------

    async def _ensure_lease(self) -> int:
        async with self._lease_lock:
            if not self._lease:
                self._lease, ttl = await self.client.lease_grant(self.config.lease_ttl_secs)
                log.info("etcd lease %x granted (TTL %d s)", self._lease, ttl)
            return self._lease

    def _drop_lease(self, lease: int) -> None:
        if self._lease == lease:
            self._lease = 0

    async def _lease_loop(self) -> None:
        interval = max(self.config.lease_ttl_secs / 3, 0.2)
        while True:
            try:
                await self._reregister()
                lease = self._lease
                if lease and await self.client.lease_keepalive(lease) <= 0:
                    self._count("lease_lost")
                    log.warning("etcd lease %x expired: writing this replica's workers anew", lease)
                    self._drop_lease(lease)
                    continue
            except EtcdError as exc:
                self._count("keepalive")
                log.debug("etcd lease keepalive: %s", exc)
            await trio.sleep(interval)

    async def _reregister(self) -> None:
        """Write again the owned workers whose lease is gone, under a new lease."""
        orphans = [w for w, o in self._owned.items() if not self._lease or o.lease != self._lease]
        if not orphans:
            return
        lease = await self._ensure_lease()
        for worker_id in orphans:
            owned = self._owned.get(worker_id)
            if owned is None or owned.lease == lease:
                continue
            spec = owned.spec
            key = self.keys.worker_key(spec.role, worker_id)
            url_key = self.keys.url_key(spec.role, spec.url)
            value = encode_spec(spec)
            try:
                answer = await self.client.txn(
                    [cmp_created(key, 0), cmp_created(url_key, 0)],
                    [op_put(key, value, lease), op_put(url_key, worker_id.encode(), lease)],
                )
            except LeaseNotFound:
                self._drop_lease(lease)
                return
            if answer["succeeded"]:
                owned.lease = lease
                revision = header_revision(answer)
                kv = KeyValue(key, value, revision, revision, 1, lease)
                self._apply_local(kv, key, revision)
                log.info("worker %s (%s %s) written again", worker_id, spec.role, spec.url)
            else:
                self._owned.pop(worker_id, None)
                self._count("reregister")
                log.warning(
                    "worker %s (%s %s) not written again: its key or URL is taken meanwhile",
                    worker_id,
                    spec.role,
                    spec.url,
                )

    # -- the store -------------------------------------------------------------------------

    async def add(self, spec: WorkerSpec) -> WorkerRecord:
        """Register ``spec`` in etcd under a new id ``etcd-<role>-<n>`` (n from a counter in
        etcd, so unique across replicas and never reused); on this replica's lease when one
        is configured. DuplicateWorker if a worker with this URL and role exists; UnstorableSpec
        for a spec with an api_key. EtcdError when etcd cannot be written."""
        if spec.api_key or spec.admin_api_key:
            raise UnstorableSpec(
                "a per-worker api_key or admin_api_key is not stored in etcd (anyone reading "
                "etcd would see it); register the worker without one, the router-wide "
                "--api-key / --worker-admin-api-key apply"
            )
        if spec.role not in ROLES:
            raise ValueError(f"role must be prefill or decode: {spec.role!r}")
        for record in self._records.values():
            if record.spec.role == spec.role and record.spec.url == spec.url:
                raise DuplicateWorker(
                    f"{spec.role} worker {spec.url} is already registered as {record.id}"
                )
        lease = await self._ensure_lease() if self.config.lease_ttl_secs else 0
        serial_key = self.keys.serial_key(spec.role)
        url_key = self.keys.url_key(spec.role, spec.url)
        value = encode_spec(spec)
        for _ in range(ADD_ATTEMPTS):
            _, found = await self.client.range(serial_key)
            last = int(found[0].value) if found else 0
            guard = cmp_modified(serial_key, found[0].mod_revision) if found else None
            worker_id = f"etcd-{spec.role}-{last + 1}"
            key = self.keys.worker_key(spec.role, worker_id)
            try:
                answer = await self.client.txn(
                    [guard or cmp_created(serial_key, 0), cmp_created(url_key, 0)],
                    [
                        op_put(serial_key, str(last + 1).encode()),
                        op_put(key, value, lease),
                        op_put(url_key, worker_id.encode(), lease),
                    ],
                    [op_range(url_key)],
                )
            except LeaseNotFound:
                self._drop_lease(lease)
                lease = await self._ensure_lease()
                continue
            if answer["succeeded"]:
                revision = header_revision(answer)
                kv = KeyValue(key, value, revision, revision, 1, lease)
                if lease:
                    self._owned[worker_id] = _Owned(spec, lease)
                self._apply_local(kv, key, revision)
                log.info("worker %s added to etcd: %s %s", worker_id, spec.role, spec.url)
                added = self._records.get(worker_id) or self._record_of(kv)
                assert added is not None
                return added
            taken = txn_kvs(answer, 0)
            if taken:
                other = taken[0].value.decode()
                _, still = await self.client.range(self.keys.worker_key(spec.role, other))
                if still:
                    raise DuplicateWorker(
                        f"{spec.role} worker {spec.url} is already registered as {other}"
                    )
                # The URL guard outlived its worker key (deleted by hand): clear it, go again.
                await self.client.txn(
                    [cmp_modified(url_key, taken[0].mod_revision)], [op_delete(url_key)]
                )
                continue
            self.id_races += 1  # another add took this number
            await trio.sleep(random.uniform(0, 0.02))
        raise EtcdError(f"could not allocate an id for {spec.role} worker {spec.url}")

    async def remove(self, worker_id: str) -> WorkerRecord:
        """Delete the worker's key (and its URL guard); KeyError if it is not in the view or
        already gone from etcd."""
        record = self._records[worker_id]  # KeyError if unknown
        key = record.meta["etcd_key"].encode()
        url_key = self.keys.url_key(record.spec.role, record.spec.url)
        answer = await self.client.txn(
            [cmp_value(url_key, worker_id.encode())],
            [op_delete(key), op_delete(url_key)],
            [op_delete(key)],
        )
        self._owned.pop(worker_id, None)
        self._apply_local(None, key, header_revision(answer))
        if not txn_deleted(answer, 0):
            raise KeyError(worker_id)
        log.info("worker %s removed from etcd: %s %s", worker_id, record.spec.role, record.spec.url)
        return record
