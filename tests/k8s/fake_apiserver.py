"""A fake Kubernetes API server for pods: the real wire format, scripted lifecycles and faults.

Start it from a test with ``fake = await nursery.start(serve_fake_apiserver)`` (options through
``functools.partial``); ``fake.url`` and ``fake.token`` are what a client needs, and the methods
below script pods and misbehaviour.

What it speaks (as kube-apiserver does, JSON only):

- ``GET /api/v1/pods`` and ``GET /api/v1/namespaces/{ns}/pods``: a ``PodList`` whose
  ``metadata.resourceVersion`` is the version of the snapshot; ``labelSelector`` (equality-based:
  ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, comma-separated); ``limit`` / ``continue`` paging
  with an opaque token naming the snapshot version and the next key, every page from the same
  snapshot, ``remainingItemCount`` on all pages but the last; a token older than the compaction
  floor answers ``410 Expired``.
- ``...?watch=1`` (or ``true``): HTTP 200, then newline-delimited JSON events ``ADDED``,
  ``MODIFIED``, ``DELETED``, ``BOOKMARK`` (with ``allowWatchBookmarks=true``, every
  ``bookmark_interval`` seconds) and ``ERROR`` (a ``Status``). ``resourceVersion=N`` streams the
  events after N; unset or ``0`` starts with a synthetic ``ADDED`` per existing pod; N older than
  the compaction floor gets one ``ERROR`` event with code 410 (``too old resource version``).
  A watch filtered by labels sees an object that stops matching as ``DELETED`` and one that
  starts matching as ``ADDED``, as the API server's watch cache does. ``timeoutSeconds`` ends the
  stream cleanly.
- ``Authorization: Bearer <token>`` against the current token set (401 ``Status`` otherwise);
  optional 403 for cluster-scope requests (a namespaced service account's RBAC).

Scripting: pods (`create_pod` Pending -> `run_pod` Running+Ready -> `set_ready(False)` ->
`delete_pod` (graceful: ``deletionTimestamp``, MODIFIED) -> `finish_delete` (DELETED);
`force_delete_pod` (DELETED at once); `set_labels`; `evict_pod`; a new pod on an old IP is
`create_pod` + `run_pod(ip=...)`), tokens (`rotate_token`), and faults (`sever_watches`,
`stall_watches`, `stall_next_watches`, `compact`, `expire_watches`, `gone_next_watches`,
`set_unavailable`, `fail_next`). Every request is logged in `requests` (kind, path, query, token,
answer status) so a test can check what the client really asked.
"""

from __future__ import annotations

import base64
import copy
import datetime
import itertools
import logging
import math
import secrets
import ssl
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import attrs
import orjson
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext

log = logging.getLogger("tests.k8s.fake_apiserver")

JSON = [(b"content-type", b"application/json")]
Pod = dict[str, Any]


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_object(code: int, reason: str, message: str, **extra: Any) -> dict[str, Any]:
    """A metav1.Status, the body of every API error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": extra.pop("metadata", {}),
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
        **extra,
    }


# -- label selectors ----------------------------------------------------------------------------


def parse_label_selector(text: str) -> list[tuple[str, str, str]]:
    """Equality-based requirements as (key, op, value); ValueError for what we do not parse."""
    reqs: list[tuple[str, str, str]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "(" in part or " in " in part or " notin " in part:
            raise ValueError(f"set-based requirement not supported by the fake: {part!r}")
        for op in ("!=", "==", "="):
            if op in part:
                key, value = (s.strip() for s in part.split(op, 1))
                if not key or "=" in value or "!" in value:
                    raise ValueError(f"invalid requirement {part!r}")
                reqs.append((key, "!=" if op == "!=" else "=", value))
                break
        else:
            if part.startswith("!"):
                reqs.append((part[1:].strip(), "!", ""))
            else:
                reqs.append((part, "exists", ""))
    return reqs


def selector_matches(reqs: list[tuple[str, str, str]], labels: dict[str, str]) -> bool:
    for key, op, value in reqs:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "!" and key in labels:
            return False
    return True


# -- records ------------------------------------------------------------------------------------


@attrs.define
class RequestRecord:
    """One request as the fake saw it."""

    kind: str  # "list", "watch", "get", "other"
    path: str
    params: dict[str, str]
    token: str | None
    at: float
    status: int | None = None  # HTTP status answered (None: dropped without an answer)
    note: str = ""  # what the fake did: "gone", "stalled", "severed", "timeout", ...


@attrs.frozen
class Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    obj: Pod
    prev: Pod | None


@attrs.frozen
class _Control:
    what: str  # "stall", "expire"


@attrs.define(eq=False)
class ActiveWatch:
    request: RequestRecord
    client: tuple[str, int] | None
    namespace: str | None
    selector: list[tuple[str, str, str]]
    send: trio.MemorySendChannel[Event | _Control]
    receive: trio.MemoryReceiveChannel[Event | _Control]
    position: int
    stalled: bool = False
    disconnected: bool = False


def _key(obj: Pod) -> tuple[str, str]:
    meta = obj["metadata"]
    return meta["namespace"], meta["name"]


def _encode_continue(rv: int, start: str) -> str:
    raw = orjson.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start})
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_continue(token: str) -> tuple[int, str]:
    raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    data = orjson.loads(raw)
    return int(data["rv"]), str(data["start"])


class BadRequest(Exception):
    pass


class FakeApiServer:
    """Pods, their event history, the open watches, and the scripted faults."""

    def __init__(
        self,
        *,
        token: str = "fake-token-0",
        bookmark_interval: float = 1.0,
        default_watch_timeout: float = 1800.0,
        max_events: int | None = None,
        forbid_cluster_scope: bool = False,
    ) -> None:
        self.tokens = {token}
        self.token = token
        self.bookmark_interval = bookmark_interval
        self.default_watch_timeout = default_watch_timeout
        self.max_events = max_events  # keep at most this many events (older RVs: 410)
        self.forbid_cluster_scope = forbid_cluster_scope
        self.url = ""
        self.rv = 1000  # resourceVersions are opaque to clients; ours count up from here
        self.floor = self.rv  # a watch from an RV below this is too old (410)
        self.pods: dict[tuple[str, str], Pod] = {}
        self.events: list[Event] = []
        self.watches: list[ActiveWatch] = []
        self.requests: list[RequestRecord] = []
        self.unavailable = False
        # Called with each request's record before it is answered (scripting mid-list changes).
        self.before_request: Callable[[RequestRecord], None] | None = None
        self._stall_next = 0
        self._gone_next = 0.0
        self._fail_next: list[tuple[str | None, int]] = []
        self._ips = itertools.count(2)
        self._conns: dict[tuple[str, int], trio.abc.Stream] = {}
        self._changed = trio.Event()

    # -- waiting on the fake from a test ------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds (checked after every request and change)."""
        while not predicate():
            await self._changed.wait()

    def requests_of(self, kind: str) -> list[RequestRecord]:
        return [r for r in self.requests if r.kind == kind]

    # -- pods ---------------------------------------------------------------------------------

    def _bump(self, kind: str, obj: Pod, prev: Pod | None) -> Pod:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        key = _key(obj)
        if kind == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = obj
        event = Event(self.rv, kind, copy.deepcopy(obj), copy.deepcopy(prev) if prev else None)
        self.events.append(event)
        if self.max_events is not None and len(self.events) > self.max_events:
            dropped = self.events[: len(self.events) - self.max_events]
            self.events = self.events[len(dropped) :]
            self.floor = dropped[-1].rv
        for watch in self.watches:
            watch.send.send_nowait(event)
        self._notify()
        return copy.deepcopy(obj)

    def pod(self, name: str, namespace: str = "default") -> Pod:
        return copy.deepcopy(self.pods[(namespace, name)])

    def _mutate(self, name: str, namespace: str, change: Callable[[Pod], None]) -> Pod:
        prev = self.pods[(namespace, name)]
        obj = copy.deepcopy(prev)
        change(obj)
        return self._bump("MODIFIED", obj, prev)

    def create_pod(
        self,
        name: str,
        *,
        namespace: str = "default",
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        uid: str | None = None,
        container_port: int = 8000,
    ) -> Pod:
        """A new pod, Pending and not yet scheduled (no IP): ADDED."""
        if (namespace, name) in self.pods:
            raise ValueError(f"pod {namespace}/{name} exists")
        obj: Pod = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": uid or str(uuid.uuid4()),
                "resourceVersion": "",
                "creationTimestamp": now_rfc3339(),
                "labels": dict(labels or {}),
                "annotations": dict(annotations or {}),
            },
            "spec": {
                "containers": [
                    {
                        "name": "sglang",
                        "image": "lmsysorg/sglang:latest",
                        "ports": [{"containerPort": container_port, "protocol": "TCP"}],
                    }
                ],
                "restartPolicy": "Always",
            },
            "status": {"phase": "Pending", "qosClass": "BestEffort"},
        }
        return self._bump("ADDED", obj, None)

    def run_pod(
        self, name: str, *, namespace: str = "default", ip: str | None = None, ready: bool = True
    ) -> Pod:
        """Scheduled and started: phase Running, a podIP, Ready as given: MODIFIED."""
        ip = ip or f"10.244.0.{next(self._ips)}"
        stamp = now_rfc3339()

        def change(obj: Pod) -> None:
            obj["spec"]["nodeName"] = "node-1"
            flag = "True" if ready else "False"
            obj["status"] = {
                "phase": "Running",
                "hostIP": "172.18.0.2",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "startTime": stamp,
                "qosClass": "BestEffort",
                "conditions": [
                    {"type": "Initialized", "status": "True", "lastTransitionTime": stamp},
                    {"type": "Ready", "status": flag, "lastTransitionTime": stamp},
                    {"type": "ContainersReady", "status": flag, "lastTransitionTime": stamp},
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
                ],
            }

        return self._mutate(name, namespace, change)

    def add_ready_pod(self, name: str, *, ip: str | None = None, **create: Any) -> Pod:
        """create_pod then run_pod: two events, as a real pod start gives (more, really)."""
        self.create_pod(name, **create)
        return self.run_pod(name, namespace=create.get("namespace", "default"), ip=ip)

    def set_ready(self, name: str, ready: bool, *, namespace: str = "default") -> Pod:
        """The kubelet's readiness probe flips Ready (and ContainersReady): MODIFIED."""

        def change(obj: Pod) -> None:
            for cond in obj["status"].get("conditions", []):
                if cond["type"] in ("Ready", "ContainersReady"):
                    cond["status"] = "True" if ready else "False"
                    cond["lastTransitionTime"] = now_rfc3339()

        return self._mutate(name, namespace, change)

    def set_labels(self, name: str, labels: dict[str, str], *, namespace: str = "default") -> Pod:
        """Replace the pod's labels (kubectl label --overwrite / a controller): MODIFIED."""
        return self._mutate(
            name, namespace, lambda obj: obj["metadata"].__setitem__("labels", dict(labels))
        )

    def set_annotations(
        self, name: str, annotations: dict[str, str], *, namespace: str = "default"
    ) -> Pod:
        return self._mutate(
            name,
            namespace,
            lambda obj: obj["metadata"].__setitem__("annotations", dict(annotations)),
        )

    def evict_pod(self, name: str, *, namespace: str = "default") -> Pod:
        """Node-pressure eviction: phase Failed, reason Evicted, podIP cleared: MODIFIED."""

        def change(obj: Pod) -> None:
            status = obj["status"]
            status.update(phase="Failed", reason="Evicted", message="The node was low on memory.")
            status.pop("podIP", None)
            status.pop("podIPs", None)
            for cond in status.get("conditions", []):
                if cond["type"] in ("Ready", "ContainersReady"):
                    cond["status"] = "False"

        return self._mutate(name, namespace, change)

    def delete_pod(self, name: str, *, namespace: str = "default", grace_period: int = 30) -> Pod:
        """A graceful delete: deletionTimestamp and deletionGracePeriodSeconds set, MODIFIED;
        the pod stays until `finish_delete` (the kubelet done stopping it)."""

        def change(obj: Pod) -> None:
            when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=grace_period)
            obj["metadata"]["deletionTimestamp"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
            obj["metadata"]["deletionGracePeriodSeconds"] = grace_period

        return self._mutate(name, namespace, change)

    def finish_delete(self, name: str, *, namespace: str = "default") -> Pod:
        """The pod object is removed: DELETED (carrying its last state)."""
        prev = self.pods[(namespace, name)]
        return self._bump("DELETED", copy.deepcopy(prev), prev)

    def force_delete_pod(self, name: str, *, namespace: str = "default") -> Pod:
        """`kubectl delete --grace-period=0 --force`: DELETED at once, no MODIFIED before."""
        prev = self.pods[(namespace, name)]
        obj = copy.deepcopy(prev)
        obj["metadata"]["deletionTimestamp"] = now_rfc3339()
        obj["metadata"]["deletionGracePeriodSeconds"] = 0
        return self._bump("DELETED", obj, prev)

    # -- tokens and faults --------------------------------------------------------------------

    def rotate_token(self) -> str:
        """A new token; the old one stops working at once. Returns the new one."""
        self.token = f"fake-token-{secrets.token_hex(8)}"
        self.tokens = {self.token}
        return self.token

    def compact(self) -> None:
        """Forget the event history (etcd compaction): watches and continue tokens from any
        older resourceVersion now get 410."""
        self.floor = self.rv
        self.events.clear()
        self._notify()

    def sever_watches(self) -> int:
        """Cut every open watch's TCP connection mid-stream; returns how many."""
        count = 0
        for watch in list(self.watches):
            watch.request.note = "severed"
            if self._drop(watch.client):
                count += 1
        self._notify()
        return count

    def stall_watches(self) -> int:
        """Open watches go silent (no events, no bookmarks, no end) but stay connected."""
        for watch in self.watches:
            watch.send.send_nowait(_Control("stall"))
        return len(self.watches)

    def stall_next_watches(self, count: int = 1) -> None:
        """The next ``count`` watches answer 200, then stay silent."""
        self._stall_next += count

    def expire_watches(self) -> int:
        """Open watches get an ERROR event with a 410 Status and end (watch cache reset)."""
        for watch in self.watches:
            watch.send.send_nowait(_Control("expire"))
        return len(self.watches)

    def gone_next_watches(self, count: float = 1) -> None:
        """The next ``count`` watches (math.inf: all) answer an ERROR 410 event at once."""
        self._gone_next = count

    def fail_next(self, count: int = 1, *, code: int = 500, kind: str | None = None) -> None:
        """The next ``count`` requests (of ``kind`` "list" or "watch", or any) answer ``code``."""
        self._fail_next.extend([(kind, code)] * count)

    def set_unavailable(self, unavailable: bool = True) -> None:
        """An outage: every connection is cut and new requests are dropped unanswered."""
        self.unavailable = unavailable
        if unavailable:
            for client in list(self._conns):
                self._drop(client)
        self._notify()

    def _drop(self, client: tuple[str, int] | None) -> bool:
        stream = self._conns.get(client) if client else None
        if stream is None:
            return False
        transport = getattr(stream, "transport_stream", stream)
        transport.socket.close()  # abrupt: no TLS close_notify, no last chunk
        return True

    # -- state as of a resourceVersion --------------------------------------------------------

    def _state_at(self, rv: int) -> dict[tuple[str, str], Pod]:
        """The pods as they were at ``rv`` (rv >= floor): undo the events after it."""
        state = dict(self.pods)
        for event in reversed(self.events):
            if event.rv <= rv:
                break
            key = _key(event.obj)
            if event.prev is None:
                state.pop(key, None)
            else:
                state[key] = event.prev
        return state

    # -- HTTP ---------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                pass
            return
        if scope["type"] != "http":
            return
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
        auth = ""
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value.decode("latin-1")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        path = scope["path"]
        is_watch = query.get("watch", "").lower() in ("1", "true")
        kind = "watch" if is_watch else "list" if path.endswith("/pods") else "other"
        record = RequestRecord(kind, path, query, token, trio.current_time())
        self.requests.append(record)
        self._notify()
        client = tuple(scope["client"]) if scope.get("client") else None
        if self.before_request is not None:
            self.before_request(record)
        if self.unavailable:
            record.note = "dropped"
            self._drop(client)  # type: ignore[arg-type]
            return

        async def reply(code: int, body: dict[str, Any]) -> None:
            record.status = code
            data = orjson.dumps(body)
            headers = [*JSON, (b"content-length", str(len(data)).encode())]
            await send({"type": "http.response.start", "status": code, "headers": headers})
            await send({"type": "http.response.body", "body": data})
            self._notify()

        if token is None or token not in self.tokens:
            await reply(401, status_object(401, "Unauthorized", "Unauthorized"))
            return
        for i, (fail_kind, code) in enumerate(self._fail_next):
            if fail_kind in (None, kind):
                del self._fail_next[i]
                reason = {500: "InternalError", 503: "ServiceUnavailable"}.get(code, "Unknown")
                await reply(code, status_object(code, reason, f"scripted failure {code}"))
                return
        if scope["method"] != "GET":
            await reply(405, status_object(405, "MethodNotAllowed", "the fake only reads"))
            return
        parts = path.strip("/").split("/")
        namespace: str | None
        if parts == ["api", "v1", "pods"]:
            namespace = None
        elif (
            len(parts) in (5, 6) and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods"
        ):
            namespace = parts[3]
        elif path in ("/healthz", "/readyz", "/livez"):
            record.status = 200
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        else:
            await reply(
                404,
                status_object(404, "NotFound", "the server could not find the requested resource"),
            )
            return
        if namespace is None and self.forbid_cluster_scope:
            verb = "watch" if is_watch else "list"
            message = (
                f'pods is forbidden: User "system:serviceaccount:default:trio-pd" cannot {verb} '
                'resource "pods" in API group "" at the cluster scope'
            )
            await reply(403, status_object(403, "Forbidden", message, details={"kind": "pods"}))
            return
        if len(parts) == 6:
            record.kind = "get"
            pod = self.pods.get((parts[3], parts[5]))
            if pod is None:
                await reply(404, status_object(404, "NotFound", f'pods "{parts[5]}" not found'))
            else:
                await reply(200, pod)
            return
        try:
            selector = parse_label_selector(query.get("labelSelector", ""))
        except ValueError as exc:
            await reply(
                400, status_object(400, "BadRequest", f"unable to parse requirement: {exc}")
            )
            return
        if is_watch:
            await self._watch(record, client, namespace, selector, query, receive, send)  # type: ignore[arg-type]
        else:
            code, body = self._list(namespace, selector, query)
            await reply(code, body)

    def _matches(self, obj: Pod | None, namespace: str | None, selector: list) -> bool:  # type: ignore[type-arg]
        if obj is None:
            return False
        meta = obj["metadata"]
        if namespace is not None and meta["namespace"] != namespace:
            return False
        return selector_matches(selector, meta.get("labels") or {})

    def _list(
        self,
        namespace: str | None,
        selector: list,
        query: dict[str, str],  # type: ignore[type-arg]
    ) -> tuple[int, dict[str, Any]]:
        try:
            limit = int(query.get("limit") or 0)
        except ValueError:
            return 400, status_object(400, "BadRequest", "limit must be an integer")
        start = ""
        rv = self.rv
        if query.get("continue"):
            try:
                rv, start = _decode_continue(query["continue"])
            except (ValueError, KeyError, orjson.JSONDecodeError):
                return 400, status_object(400, "BadRequest", "continue key is not valid")
            if rv < self.floor:
                message = (
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter, or use "
                    "the continue token in this response to retrieve the remainder of the "
                    "results. Continuing with the provided token results in an inconsistent "
                    "list - objects that were created, modified, or deleted between the time "
                    "the first chunk was returned and now may show up in the list."
                )
                meta = {"continue": _encode_continue(self.rv, start)}
                return 410, status_object(410, "Expired", message, metadata=meta)
        state = self._state_at(rv)
        keys = sorted(k for k, obj in state.items() if self._matches(obj, namespace, selector))
        keys = [k for k in keys if f"{k[0]}/{k[1]}" >= start]
        page = keys[:limit] if limit > 0 else keys
        rest = keys[len(page) :]
        items = []
        for key in page:
            item = copy.deepcopy(state[key])
            item.pop("kind", None)  # list items carry no kind/apiVersion, as the real server
            item.pop("apiVersion", None)
            items.append(item)
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if rest:
            last = page[-1]
            meta["continue"] = _encode_continue(rv, f"{last[0]}/{last[1]}\x00")
            meta["remainingItemCount"] = len(rest)
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items}

    async def _watch(
        self,
        record: RequestRecord,
        client: tuple[str, int] | None,
        namespace: str | None,
        selector: list,  # type: ignore[type-arg]
        query: dict[str, str],
        receive: Any,
        send: Any,
    ) -> None:
        rv_param = query.get("resourceVersion", "")
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("1", "true")
        try:
            timeout = float(query.get("timeoutSeconds") or self.default_watch_timeout)
        except ValueError:
            timeout = self.default_watch_timeout
        backlog: list[dict[str, Any]] = []
        gone: dict[str, Any] | None = None
        if rv_param in ("", "0"):
            position = self.rv
            for key in sorted(self.pods):
                obj = self.pods[key]
                if self._matches(obj, namespace, selector):
                    backlog.append({"type": "ADDED", "object": copy.deepcopy(obj)})
        else:
            try:
                since = int(rv_param)
            except ValueError:
                since = -1
            if since < self.floor or self._gone_next > 0:
                if self._gone_next > 0:
                    self._gone_next -= 1
                message = f"too old resource version: {since} ({self.floor})"
                gone = status_object(410, "Expired", message)
            position = max(since, self.rv)
            for event in self.events:
                if event.rv > since:
                    line = self._filter(event, namespace, selector)
                    if line is not None:
                        backlog.append(line)
        send_channel, receive_channel = trio.open_memory_channel[Event | _Control](math.inf)
        watch = ActiveWatch(
            record, client, namespace, selector, send_channel, receive_channel, position
        )
        if self._stall_next > 0:
            self._stall_next -= 1
            watch.stalled = True
        self.watches.append(watch)
        record.status = 200
        self._notify()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": JSON})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._until_disconnect, receive, nursery.cancel_scope, watch)
                await self._pump(watch, send, backlog, gone, timeout, bookmarks)
                nursery.cancel_scope.cancel()
            if not watch.disconnected:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.watches.remove(watch)
            self._notify()

    async def _until_disconnect(
        self, receive: Any, scope: trio.CancelScope, watch: ActiveWatch
    ) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        watch.disconnected = True
        watch.request.note = watch.request.note or "client closed"
        scope.cancel()

    def _filter(self, event: Event, namespace: str | None, selector: list) -> dict[str, Any] | None:  # type: ignore[type-arg]
        """The event as this watch sees it (the watch cache's filtering), or None."""
        now = self._matches(event.obj, namespace, selector)
        before = self._matches(event.prev, namespace, selector)
        if event.type == "ADDED":
            kind = "ADDED" if now else None
        elif event.type == "DELETED":
            kind = "DELETED" if before else None
        elif now and before:
            kind = "MODIFIED"
        elif now:
            kind = "ADDED"
        elif before:
            kind = "DELETED"
        else:
            kind = None
        return {"type": kind, "object": copy.deepcopy(event.obj)} if kind else None

    async def _pump(
        self,
        watch: ActiveWatch,
        send: Any,
        backlog: list[dict[str, Any]],
        gone: dict[str, Any] | None,
        timeout: float,
        bookmarks: bool,
    ) -> None:
        async def line(obj: dict[str, Any]) -> None:
            body = orjson.dumps(obj) + b"\n"
            await send({"type": "http.response.body", "body": body, "more_body": True})

        if watch.stalled:
            watch.request.note = "stalled"
            await trio.sleep_forever()
        if gone is not None:
            watch.request.note = "gone"
            await line({"type": "ERROR", "object": gone})
            return
        for item in backlog:
            await line(item)
        deadline = trio.current_time() + timeout
        next_bookmark = trio.current_time() + self.bookmark_interval
        while True:
            wake = min(deadline, next_bookmark) if bookmarks else deadline
            item: Event | _Control | None = None
            with trio.move_on_at(wake):
                item = await watch.receive.receive()
            if isinstance(item, _Control):
                if item.what == "stall":
                    watch.stalled = True
                    watch.request.note = "stalled"
                    await trio.sleep_forever()
                watch.request.note = "expired"
                message = f"too old resource version: {watch.position} ({self.rv})"
                await line({"type": "ERROR", "object": status_object(410, "Expired", message)})
                return
            if isinstance(item, Event):
                watch.position = item.rv
                shown = self._filter(item, watch.namespace, watch.selector)
                if shown is not None:
                    await line(shown)
                continue
            now = trio.current_time()
            if now >= deadline:
                watch.request.note = "timeout"
                return
            if bookmarks and now >= next_bookmark:
                next_bookmark = now + self.bookmark_interval
                meta = {"resourceVersion": str(watch.position)}
                await line(
                    {
                        "type": "BOOKMARK",
                        "object": {"kind": "Pod", "apiVersion": "v1", "metadata": meta},
                    }
                )

    # -- serving ------------------------------------------------------------------------------

    async def serve(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        task_status: trio.TaskStatus[FakeApiServer] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled; ``task_status.started(self)`` once listening."""
        config = Config()
        config.keep_alive_timeout = 30
        config.accesslog = None
        config.errorlog = logging.getLogger("tests.k8s.fake_apiserver.hypercorn")
        app = ASGIWrapper(self)
        context = WorkerContext(None)
        listeners: list[Any] = list(await trio.open_tcp_listeners(port, host=host))
        bound = listeners[0].socket.getsockname()[1]
        if ssl_context is not None:
            listeners = [
                trio.SSLListener(lst, ssl_context, https_compatible=True) for lst in listeners
            ]
        self.url = f"{'https' if ssl_context else 'http'}://{host}:{bound}"

        async def handle(stream: trio.abc.Stream) -> None:
            transport = getattr(stream, "transport_stream", stream)
            try:
                peer = tuple(transport.socket.getpeername()[:2])
            except OSError:
                return
            self._conns[peer] = stream  # type: ignore[index]
            try:
                await TCPServer(app, config, context, {}, stream)  # type: ignore[arg-type]
            except Exception as exc:  # a cut connection must not stop the server
                log.debug("connection %s ended with %r", peer, exc)
            finally:
                self._conns.pop(peer, None)  # type: ignore[arg-type]

        try:
            async with trio.open_nursery() as nursery:
                task_status.started(self)
                await trio.serve_listeners(handle, listeners, handler_nursery=nursery)
        finally:
            for listener in listeners:
                with trio.CancelScope(shield=True):
                    await listener.aclose()


async def serve_fake_apiserver(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[FakeApiServer] = trio.TASK_STATUS_IGNORED,
    **options: Any,
) -> None:
    """``fake = await nursery.start(serve_fake_apiserver)``; ``options`` go to FakeApiServer."""
    fake = FakeApiServer(**options)
    await fake.serve(host=host, port=port, ssl_context=ssl_context, task_status=task_status)
