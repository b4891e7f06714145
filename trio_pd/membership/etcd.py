"""etcd as the membership store shared by router replicas, through etcd's v3 JSON gateway.

Every replica runs one `EtcdMembership`: a `MembershipSource` named "etcd" (it ranges the
workers prefix, reconciles the registry with the whole set, then watches from the next revision
and reconciles the whole set again on every change) and a `MembershipStore` (the admin API's
`add`/`remove` write through to etcd, so every replica sees them).

Key layout under ``--etcd-prefix`` (default ``/trio-pd``)::

    <prefix>/workers/<role>/<id>   {"url": ..., "bootstrap_port": int|null, "model_id": str|null}
    <prefix>/urls/<role>/<quoted url>   the id registered for that URL and role (the duplicate
                                        guard; written and deleted with the worker key)
    <prefix>/serial/<role>              the last id number handed out (never leased, never reused)

Only ``workers/`` is read as membership: a worker key written by another tool (with any id
segment) is a worker too. A per-worker ``api_key`` is never written to etcd: anyone who can read
etcd could read it, so `add` refuses a spec that carries one (`UnstorableSpec`), and a stored
``api_key`` field is ignored.

With ``--etcd-lease-ttl-secs N`` the keys written by `add` hang on this replica's lease, kept
alive by `run()`: when the replica dies, its workers vanish from every replica after N seconds.
While the replica lives, a lease lost anyway (an etcd outage longer than N, a revoke) is
replaced and the replica's workers are written again under their old ids, unless someone else
registered the URL meanwhile.

When etcd is unreachable the registry keeps the last membership (never reconciled to empty),
``source_status("etcd", False, why)`` says so, and `run()` retries with backoff, resuming the
watch from the last revision it applied (a full range when that revision was compacted).

Only the JSON gateway over HTTP(S) is spoken (no gRPC, no etcd auth, no client certificates).
"""

from __future__ import annotations

import base64
import collections
import logging
import random
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from typing import Any
from urllib.parse import quote, urlsplit

import attrs
import httpx2
import orjson
import trio

from trio_pd.config import EtcdConfig
from trio_pd.spec import ENGINES, Registry, Role, WorkerRecord, WorkerSpec

log = logging.getLogger("trio_pd.membership.etcd")

SOURCE = "etcd"
ROLES: tuple[Role, ...] = ("prefill", "decode")
ADD_ATTEMPTS = 50  # txn retries when replicas race for the same id counter


# -- errors -------------------------------------------------------------------------------------


class EtcdError(Exception):
    """etcd answered with an error (``code`` is the gRPC status code, when it gave one)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """No endpoint answered, or one failed mid-request."""


class EtcdCompacted(EtcdError):
    """The revision asked for was compacted away; ``compact_revision`` is the oldest kept."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message, 11)
        self.compact_revision = compact_revision


class LeaseNotFound(EtcdError):
    """The lease named in a request has expired or was revoked."""


class DuplicateWorker(ValueError):
    """A worker with this URL and role is already registered (the admin API answers 409)."""


class UnstorableSpec(ValueError):
    """The spec cannot be written to etcd as it is (a per-worker api_key)."""


# -- the JSON gateway client -------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The range end covering every key that starts with ``prefix`` (etcd's `WithPrefix`)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # every key


@attrs.frozen
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0

    @classmethod
    def from_json(cls, kv: Mapping[str, Any]) -> KeyValue:
        return cls(
            key=unb64(kv.get("key")),
            value=unb64(kv.get("value")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            version=int(kv.get("version", 0)),
            lease=int(kv.get("lease", 0)),
        )


@attrs.frozen
class WatchEvent:
    type: str  # "PUT" or "DELETE"
    kv: KeyValue


def header_revision(body: Mapping[str, Any]) -> int:
    return int(body.get("header", {}).get("revision", 0))


class EtcdClient:
    """The few etcd v3 calls membership needs, as JSON over HTTP, with endpoint failover.

    A call goes to the endpoint that answered last; when that one cannot be reached it tries the
    next ones in turn. A request that may have reached etcd (the connection broke after it was
    sent, or etcd answered 5xx) is retried elsewhere only when it is safe to repeat (reads,
    keepalives); a write raises `EtcdUnavailable` instead, since it may have been applied.
    """

    def __init__(
        self,
        endpoints: Iterable[str],
        *,
        dial_timeout_secs: float = 2.0,
        request_timeout_secs: float = 5.0,
    ) -> None:
        self.endpoints = tuple(e.rstrip("/") for e in endpoints)
        if not self.endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self._current = 0
        self._timeout = httpx2.Timeout(request_timeout_secs, connect=dial_timeout_secs)
        self._watch_timeout = httpx2.Timeout(
            request_timeout_secs, connect=dial_timeout_secs, read=None
        )
        self._http = httpx2.AsyncClient(timeout=self._timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    def _order(self) -> list[int]:
        n = len(self.endpoints)
        return [(self._current + i) % n for i in range(n)]

    async def call(self, path: str, body: Mapping[str, Any], *, idempotent: bool) -> dict:
        """POST ``body`` to ``path`` (e.g. ``/v3/kv/range``); the decoded JSON answer."""
        failures: list[str] = []
        for index in self._order():
            endpoint = self.endpoints[index]
            try:
                response = await self._http.post(f"{endpoint}{path}", json=body)
            except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
                failures.append(f"{endpoint}: {exc!r}")
                continue
            except httpx2.TransportError as exc:
                failures.append(f"{endpoint}: {exc!r}")
                if idempotent:
                    continue
                raise EtcdUnavailable(
                    f"{path} failed after sending: {'; '.join(failures)}"
                ) from exc
            if response.status_code >= 500 and idempotent:
                failures.append(f"{endpoint}: HTTP {response.status_code} {response.text[:200]}")
                continue
            self._current = index
            return decode_answer(path, response)
        raise EtcdUnavailable(f"no etcd endpoint answered {path}: {'; '.join(failures)}")

    async def range(
        self, key: bytes, range_end: bytes | None = None, *, revision: int = 0
    ) -> tuple[int, list[KeyValue]]:
        """(the store's revision, the keys in [key, range_end)) as of ``revision`` (0: now)."""
        body: dict[str, Any] = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        if revision:
            body["revision"] = str(revision)
        answer = await self.call("/v3/kv/range", body, idempotent=True)
        return header_revision(answer), [KeyValue.from_json(kv) for kv in answer.get("kvs", ())]

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return header_revision(await self.call("/v3/kv/put", body, idempotent=True))

    async def delete_range(self, key: bytes, range_end: bytes | None = None) -> tuple[int, int]:
        """(revision, how many keys were deleted)."""
        body: dict[str, Any] = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        answer = await self.call("/v3/kv/deleterange", body, idempotent=True)
        return header_revision(answer), int(answer.get("deleted", 0))

    async def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: Iterable[dict[str, Any]] = (),
    ) -> dict:
        """One transaction; build its parts with `cmp_*` and `op_*`. Not retried once sent."""
        body = {"compare": compare, "success": success, "failure": list(failure)}
        answer = await self.call("/v3/kv/txn", body, idempotent=False)
        answer["succeeded"] = bool(answer.get("succeeded", False))
        return answer

    async def compact(self, revision: int) -> None:
        await self.call("/v3/kv/compaction", {"revision": str(revision)}, idempotent=True)

    async def lease_grant(self, ttl_secs: int) -> tuple[int, int]:
        """(lease id, granted TTL)."""
        answer = await self.call("/v3/lease/grant", {"TTL": str(ttl_secs)}, idempotent=False)
        if answer.get("error"):
            raise EtcdError(f"lease grant refused: {answer['error']}")
        return int(answer["ID"]), int(answer.get("TTL", ttl_secs))

    async def lease_keepalive(self, lease: int) -> int:
        """Refresh ``lease`` once; its new TTL, 0 when the lease no longer exists."""
        answer = await self.call("/v3/lease/keepalive", {"ID": str(lease)}, idempotent=True)
        return int(answer.get("result", answer).get("TTL", 0))

    async def lease_time_to_live(self, lease: int) -> int:
        """Seconds ``lease`` has left; -1 when it no longer exists."""
        answer = await self.call("/v3/lease/timetolive", {"ID": str(lease)}, idempotent=True)
        return int(answer.get("TTL", -1))

    async def lease_revoke(self, lease: int) -> None:
        """Revoke ``lease`` (its keys are deleted); a lease already gone is not an error."""
        with suppress(LeaseNotFound):
            await self.call("/v3/lease/revoke", {"ID": str(lease)}, idempotent=True)

    @asynccontextmanager
    async def watch(
        self, key: bytes, range_end: bytes | None, *, start_revision: int
    ) -> AsyncIterator[AsyncIterator[list[WatchEvent]]]:
        """A watch of [key, range_end) from ``start_revision``: yields an iterator of event
        batches (one per revision or more). Raises `EtcdCompacted` when that revision is gone,
        `EtcdUnavailable` when the stream cannot be opened or breaks."""
        create: dict[str, Any] = {"key": b64(key), "start_revision": str(start_revision)}
        if range_end is not None:
            create["range_end"] = b64(range_end)
        body = {"create_request": create}
        failures: list[str] = []
        for index in self._order():
            endpoint = self.endpoints[index]
            async with AsyncExitStack() as stack:
                try:
                    response = await stack.enter_async_context(
                        self._http.stream(
                            "POST", f"{endpoint}/v3/watch", json=body, timeout=self._watch_timeout
                        )
                    )
                except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
                    failures.append(f"{endpoint}: {exc!r}")
                    continue
                except httpx2.TransportError as exc:
                    raise EtcdUnavailable(f"watch on {endpoint} failed: {exc!r}") from exc
                if response.status_code != 200:
                    await response.aread()
                    try:
                        decode_answer("/v3/watch", response)  # raises for any non-200
                    except EtcdUnavailable as exc:
                        failures.append(f"{endpoint}: {exc}")
                        continue
                self._current = index
                try:
                    yield watch_batches(response)
                except httpx2.TransportError as exc:
                    raise EtcdUnavailable(f"watch on {endpoint} broke: {exc!r}") from exc
                return
        raise EtcdUnavailable(f"no etcd endpoint accepted a watch: {'; '.join(failures)}")


async def watch_batches(response: httpx2.Response) -> AsyncIterator[list[WatchEvent]]:
    """The gateway's watch stream (one JSON object a line) as batches of events."""
    async for line in response.aiter_lines():
        if not line.strip():
            continue
        try:
            message = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise EtcdError(f"watch stream sent a line that is not JSON: {line[:200]!r}") from exc
        if "error" in message:
            error = message["error"]
            detail = error.get("message", error) if isinstance(error, dict) else error
            raise EtcdUnavailable(f"watch stream error: {detail}")
        result = message.get("result", {})
        if result.get("canceled"):
            compacted = int(result.get("compact_revision", 0))
            if compacted:
                raise EtcdCompacted(f"watch revision compacted (oldest {compacted})", compacted)
            raise EtcdError(f"watch canceled: {result.get('cancel_reason', 'no reason given')}")
        events = [
            WatchEvent(e.get("type", "PUT"), KeyValue.from_json(e.get("kv", {})))
            for e in result.get("events", ())
        ]
        if events:
            yield events
    raise EtcdUnavailable("watch stream ended")


def decode_answer(path: str, response: httpx2.Response) -> dict:
    try:
        answer = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        answer = None
    if response.status_code == 200 and isinstance(answer, dict):
        return answer
    message = answer.get("message") or answer.get("error") if isinstance(answer, dict) else None
    message = str(message or response.text[:200] or f"HTTP {response.status_code}")
    code = answer.get("code") if isinstance(answer, dict) else None
    if "lease not found" in message:
        raise LeaseNotFound(message, code)
    if code == 11 and "compacted" in message:
        raise EtcdCompacted(message, 0)
    if response.status_code >= 500 or code == 14:  # 14: UNAVAILABLE
        raise EtcdUnavailable(f"{path}: {message}", code)
    raise EtcdError(f"{path}: {message}", code)


def cmp_created(key: bytes, revision: int) -> dict[str, Any]:
    """Compare: the key's create revision is ``revision`` (0: the key does not exist)."""
    return {
        "key": b64(key),
        "target": "CREATE",
        "result": "EQUAL",
        "create_revision": str(revision),
    }


def cmp_modified(key: bytes, revision: int) -> dict[str, Any]:
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def cmp_value(key: bytes, value: bytes) -> dict[str, Any]:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def op_put(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {"request_put": put}


def op_range(key: bytes) -> dict[str, Any]:
    return {"request_range": {"key": b64(key)}}


def op_delete(key: bytes) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(key)}}


def txn_kvs(answer: Mapping[str, Any], index: int) -> list[KeyValue]:
    """The keys a txn's ``index``-th operation (a range) found."""
    responses = answer.get("responses", [])
    found = responses[index].get("response_range", {}) if index < len(responses) else {}
    return [KeyValue.from_json(kv) for kv in found.get("kvs", ())]


def txn_deleted(answer: Mapping[str, Any], index: int) -> int:
    responses = answer.get("responses", [])
    found = responses[index].get("response_delete_range", {}) if index < len(responses) else {}
    return int(found.get("deleted", 0))


# -- configuration -----------------------------------------------------------------------------


# -- the membership source and store -----------------------------------------------------------


@attrs.define
class _Owned:
    """A worker this replica registered on its lease (re-registered if the lease is lost)."""

    spec: WorkerSpec
    lease: int


def encode_spec(spec: WorkerSpec) -> bytes:
    engine = {"engine": spec.engine} if spec.engine != "sglang" else {}
    return orjson.dumps(
        {"url": spec.url, "bootstrap_port": spec.bootstrap_port, "model_id": spec.model_id,
         **engine}
    )  # fmt: skip


def decode_spec(role: Role, value: bytes) -> WorkerSpec:
    """The stored JSON as a WorkerSpec; ValueError saying what is wrong."""
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    url = data.get("url")
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be an http(s) URL: {url!r}")
    port = data.get("bootstrap_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
        raise ValueError(f"bootstrap_port must be an integer or null: {port!r}")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"bootstrap_port out of range: {port}")
    model_id = data.get("model_id")
    if model_id is not None and not isinstance(model_id, str):
        raise ValueError(f"model_id must be a string or null: {model_id!r}")
    engine = data.get("engine", "sglang")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}: {engine!r}")
    # a stored api_key is ignored on purpose
    return WorkerSpec(url, role, port, model_id, engine=engine)


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
        self._workers_prefix = f"{config.prefix}/workers/".encode()
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

    # -- keys ------------------------------------------------------------------------------

    def worker_key(self, role: Role, worker_id: str) -> bytes:
        return self._workers_prefix + f"{role}/{worker_id}".encode()

    def url_key(self, role: Role, url: str) -> bytes:
        return f"{self.config.prefix}/urls/{role}/{quote(url, safe='')}".encode()

    def serial_key(self, role: Role) -> bytes:
        return f"{self.config.prefix}/serial/{role}".encode()

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
        rest = kv.key[len(self._workers_prefix) :].decode("utf-8", "replace")
        role, _, worker_id = rest.partition("/")
        try:
            if role not in ROLES:
                raise ValueError(f"role must be prefill or decode: {role!r}")
            if not worker_id or "/" in worker_id:
                raise ValueError(f"bad worker id {worker_id!r}")
            spec = decode_spec(role, kv.value)
        except ValueError as exc:
            if (kv.key, kv.mod_revision) not in self._bad:
                self._bad.add((kv.key, kv.mod_revision))
                self._count("bad_record")
                log.warning("etcd key %r ignored: %s", kv.key.decode(errors="replace"), exc)
            return None
        meta = {
            "etcd_key": kv.key.decode(errors="replace"),
            "create_revision": str(kv.create_revision),
            "mod_revision": str(kv.mod_revision),
        }
        if kv.lease:
            meta["lease"] = f"{kv.lease:x}"
        return WorkerRecord(worker_id, spec, SOURCE, meta)

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
            self._workers_prefix, prefix_end(self._workers_prefix)
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
            self._workers_prefix, prefix_end(self._workers_prefix), start_revision=start
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
            key, url_key = self.worker_key(spec.role, worker_id), self.url_key(spec.role, spec.url)
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

    async def revoke_lease(self) -> None:
        """Revoke this replica's lease now (its workers vanish everywhere at once); for a
        graceful shutdown that should not wait for the TTL."""
        lease, self._lease = self._lease, 0
        self._owned.clear()
        if lease:
            await self.client.lease_revoke(lease)

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
        serial_key, url_key = self.serial_key(spec.role), self.url_key(spec.role, spec.url)
        value = encode_spec(spec)
        for _ in range(ADD_ATTEMPTS):
            _, found = await self.client.range(serial_key)
            last = int(found[0].value) if found else 0
            guard = cmp_modified(serial_key, found[0].mod_revision) if found else None
            worker_id = f"etcd-{spec.role}-{last + 1}"
            key = self.worker_key(spec.role, worker_id)
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
                _, still = await self.client.range(self.worker_key(spec.role, other))
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
        url_key = self.url_key(record.spec.role, record.spec.url)
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
