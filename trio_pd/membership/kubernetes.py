"""Kubernetes pod discovery: prefill and decode workers from a LIST + WATCH of pods.

Flags follow SGLang's router (`--service-discovery`, `--prefill-selector`, `--decode-selector`,
`--selector`, `--service-discovery-port`, `--service-discovery-namespace`,
`--bootstrap-port-annotation`), plus `--kube-api-server`, `--kube-token-file` and
`--kube-ca-file` to point at an API server from outside a cluster.

The client is the informer pattern written out by hand:

- a paged LIST (`limit`, `continue`; no `resourceVersion`, so a consistent read that cannot hand
  back a version the watch cache has already forgotten) fills a pod cache;
- a WATCH from the list's `resourceVersion` with `allowWatchBookmarks=true` and `timeoutSeconds`
  keeps it current; a stream that ends (timeout) or breaks is watched again from the last
  version seen, so no event is lost;
- `410 Gone` (an HTTP 410 or an `ERROR` event carrying a 410 Status) means the version was
  compacted away: LIST again, after a backoff that grows while relists make no progress;
- a watchdog restarts a watch that delivers nothing (no event, no bookmark) for
  `stall_timeout_secs`; the service-account token is read again before every request (tokens
  rotate); the in-cluster CA is trusted for https;
- every change to the cache that changes the desired worker set, every relist, and a periodic
  resync hand the registry the whole set (`Registry.reconcile`): a missed DELETE is repaired by
  the next relist, never by replaying deltas.

Membership rules (`exclusion_reason` says which one keeps a pod out): a pod is a worker while it
matches the selectors (checked here on every event, not only by the API server's
`labelSelector`), has no `deletionTimestamp`, is in phase `Running`, its `Ready` condition is
`True` and it has a `podIP`. Ready=False takes it out of rotation at once: the aggregate Ready
condition is the operator's own statement (readiness probes, readiness gates) and what a Service
uses to admit traffic; the router's health checker stays a second, independent judge. A DELETED
event, a relist without the pod, a selector mismatch, or a new pod (another uid) holding the same
URL remove it too; a worker whose pod keeps its name but gets a new uid is removed and added
again (two reconcile calls), so its breaker and health start afresh.

Worker ids come from pod names so every router replica agrees: `prefill-<pod>` (`<namespace>.<pod>`
when watching all namespaces, where names can repeat), with `-<port>` appended when the pod lists
several ports in the `smg.ai/worker-ports` annotation (comma-separated, one worker per port, as
SMG reads it). A prefill's bootstrap port comes from the `sglang.ai/bootstrap-port` annotation:
one port for every worker of the pod, or a list aligned with the worker ports.

RBAC: the router's service account needs `list` and `watch` on `pods` (a Role in the namespace
of `--service-discovery-namespace`, or a ClusterRole when watching all namespaces).

When the API server cannot be reached the workers already known stay (reported through
`Registry.source_status`); discovery errors are logged and counted in `errors` (by kind) and
passed to `on_error`, for the integrator to turn into a metric.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import random
import ssl
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import httpx2
import orjson
import trio

from trio_pd.config import KubernetesConfig
from trio_pd.spec import Registry, Role, WorkerRecord, WorkerSpec

log = logging.getLogger("trio_pd.membership.kubernetes")

SOURCE = "kubernetes"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_TOKEN_FILE = f"{SERVICE_ACCOUNT_DIR}/token"
DEFAULT_CA_FILE = f"{SERVICE_ACCOUNT_DIR}/ca.crt"
USER_AGENT = "trio-pd (kubernetes discovery)"


# -- pods as the rules see them -----------------------------------------------------------------


@attrs.frozen
class PodView:
    """The part of a Pod object discovery reads (the cache keeps only this)."""

    namespace: str
    name: str
    uid: str
    labels: dict[str, str]
    annotations: dict[str, str]
    phase: str
    pod_ip: str | None
    ready: bool
    deleting: bool
    created: str
    resource_version: str

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], annotation_keys: Iterable[str] = ()) -> PodView:
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        annotations = meta.get("annotations") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or ()
        )
        return cls(
            namespace=meta.get("namespace") or "",
            name=meta.get("name") or "",
            uid=meta.get("uid") or "",
            labels=dict(meta.get("labels") or {}),
            annotations={k: annotations[k] for k in annotation_keys if k in annotations},
            phase=status.get("phase") or "Unknown",
            pod_ip=status.get("podIP") or None,
            ready=ready,
            deleting=bool(meta.get("deletionTimestamp")),
            created=meta.get("creationTimestamp") or "",
            resource_version=meta.get("resourceVersion") or "",
        )

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def _matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_role(pod: PodView, config: KubernetesConfig) -> Role | None:
    """The pod's role by its labels, or None if it matches no selector."""
    if not _matches(pod.labels, config.selector):
        return None
    for role, sel in config.role_selectors():
        if _matches(pod.labels, sel):
            return role
    return None


def exclusion_reason(pod: PodView, config: KubernetesConfig) -> str:
    """Why the pod is not a worker now, or "" when it is one."""
    if pod_role(pod, config) is None:
        return "labels match no selector"
    if pod.deleting:
        return "terminating (deletionTimestamp set)"
    if pod.phase != "Running":
        return f"phase {pod.phase}"
    if not pod.ready:
        return "not Ready"
    if not pod.pod_ip:
        return "no podIP"
    if not pod.uid:
        return "no uid"
    return ""


def _port_list(raw: str) -> list[int] | None:
    ports: list[int] = []
    for part in raw.split(","):
        try:
            port = int(part.strip())
        except ValueError:
            return None
        if not 0 < port < 65536:
            return None
        ports.append(port)
    return ports


def worker_ports(pod: PodView, config: KubernetesConfig) -> list[int]:
    """The worker-ports annotation (deduplicated, in order), else the configured port."""
    raw = pod.annotations.get(config.worker_ports_annotation)
    if raw is None:
        return [config.port]
    ports = _port_list(raw)
    if not ports:
        log.warning(
            "pod %s: invalid %s annotation %r, using port %d",
            pod.key,
            config.worker_ports_annotation,
            raw,
            config.port,
        )
        return [config.port]
    return list(dict.fromkeys(ports))


def bootstrap_ports(pod: PodView, config: KubernetesConfig, count: int) -> list[int | None]:
    """Bootstrap port per worker port: one value for all, or a list aligned with the ports."""
    raw = pod.annotations.get(config.bootstrap_port_annotation)
    if raw is None:
        return [None] * count
    ports = _port_list(raw)
    if ports and len(ports) == 1:
        return [ports[0]] * count
    if ports and len(ports) == count:
        return list(ports)
    log.warning(
        "pod %s: %s annotation %r does not fit %d worker port(s), ignored",
        pod.key,
        config.bootstrap_port_annotation,
        raw,
        count,
    )
    return [None] * count


def model_id(pod: PodView, config: KubernetesConfig) -> str | None:
    source = config.model_id_from
    if source is None:
        return None
    if source == "namespace":
        return pod.namespace or None
    kind, _, key = source.partition(":")
    values = pod.labels if kind == "label" else pod.annotations
    return values.get(key) or None


def worker_url(ip: str, port: int) -> str:
    try:
        bracket = ipaddress.ip_address(ip).version == 6
    except ValueError:
        bracket = False
    return f"http://[{ip}]:{port}" if bracket else f"http://{ip}:{port}"


def records_for_pod(pod: PodView, config: KubernetesConfig) -> list[WorkerRecord]:
    """The workers a pod stands for (none unless it passes every rule)."""
    if exclusion_reason(pod, config):
        return []
    role = pod_role(pod, config)
    assert role is not None and pod.pod_ip is not None
    ports = worker_ports(pod, config)
    boots = bootstrap_ports(pod, config, len(ports)) if role == "prefill" else [None] * len(ports)
    base = f"{role}-{pod.name}" if config.namespace else f"{role}-{pod.namespace}.{pod.name}"
    records = []
    for port, boot in zip(ports, boots, strict=True):
        spec = WorkerSpec(
            url=worker_url(pod.pod_ip, port),
            role=role,
            bootstrap_port=boot,
            model_id=model_id(pod, config),
            engine="vllm" if config.engine == "vllm" else "sglang",
        )
        meta = {"pod": pod.name, "namespace": pod.namespace, "uid": pod.uid, "ip": pod.pod_ip}
        worker_id = f"{base}-{port}" if len(ports) > 1 else base
        records.append(WorkerRecord(id=worker_id, spec=spec, source=SOURCE, meta=meta))
    return records


@attrs.frozen
class CachedPod:
    """A pod in the cache, with its workers worked out once (when the pod changed)."""

    pod: PodView
    records: tuple[WorkerRecord, ...]
    seen: int  # when its uid was first seen here: tells the newer of two same-second pods

    @property
    def age_key(self) -> tuple[str, int]:
        return (self.pod.created, self.seen)


def merge_records(entries: Iterable[CachedPod]) -> dict[str, WorkerRecord]:
    """The whole desired set by id. Two pods claiming one URL (a new pod on a deleted pod's IP
    whose DELETE has not arrived yet): the newer pod keeps it."""
    by_url: dict[str, WorkerRecord] = {}
    for entry in sorted(entries, key=lambda e: e.age_key):
        for record in entry.records:
            by_url[record.spec.url] = record  # a newer pod replaces an older one
    return {r.id: r for r in by_url.values()}


def desired_records(pods: Iterable[PodView], config: KubernetesConfig) -> dict[str, WorkerRecord]:
    """`merge_records` for bare pods (newer by creation time, then by position)."""
    entries = (CachedPod(p, tuple(records_for_pod(p, config)), i) for i, p in enumerate(pods))
    return merge_records(entries)


# -- the API client -----------------------------------------------------------------------------


class ApiError(Exception):
    """An API server answer that is not what we asked for (a Status object, usually)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}".strip())
        self.code = code
        self.reason = reason
        self.message = message

    @classmethod
    def from_status(cls, status: Mapping[str, Any], default_code: int = 0) -> ApiError:
        code = int(status.get("code") or default_code)
        kind = Gone if code == 410 else ApiError
        return kind(code, str(status.get("reason") or ""), str(status.get("message") or ""))

    @classmethod
    def from_response(cls, response: httpx2.Response) -> ApiError:
        try:
            status = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            status = None
        if not isinstance(status, dict) or status.get("kind") != "Status":
            status = {"message": response.content[:200].decode("utf-8", "replace")}
        status.setdefault("reason", response.reason_phrase)
        return cls.from_status(status, response.status_code)


class Gone(ApiError):
    """410: the resource version (or continue token) is older than the server keeps."""


class BadResponse(Exception):
    """The API server sent something that is not a list or a watch event."""


@attrs.frozen
class ApiEndpoint:
    url: str
    token_file: str | None
    ca_file: str | None


def resolve_endpoint(config: KubernetesConfig, environ: Mapping[str, str]) -> ApiEndpoint:
    """The explicit `--kube-api-server`, else the in-cluster service and service account."""
    if config.api_server:
        return ApiEndpoint(config.api_server.rstrip("/"), config.token_file, config.ca_file)
    host = environ.get("KUBERNETES_SERVICE_HOST")
    port = environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ValueError(
            "Kubernetes discovery outside a cluster (KUBERNETES_SERVICE_HOST/PORT unset): "
            "give --kube-api-server"
        )
    if ":" in host:
        host = f"[{host}]"
    return ApiEndpoint(
        f"https://{host}:{port}",
        config.token_file or DEFAULT_TOKEN_FILE,
        config.ca_file or DEFAULT_CA_FILE,
    )


def ssl_context(endpoint: ApiEndpoint) -> ssl.SSLContext | bool:
    """Trust the cluster CA when there is one, else the system store."""
    if not endpoint.url.startswith("https://"):
        return True
    if endpoint.ca_file and os.path.exists(endpoint.ca_file):
        return ssl.create_default_context(cafile=endpoint.ca_file)
    if endpoint.ca_file and endpoint.ca_file != DEFAULT_CA_FILE:
        raise ValueError(f"Kubernetes CA file not found: {endpoint.ca_file}")
    if endpoint.ca_file:
        log.warning("no %s: trusting the system CA store for %s", endpoint.ca_file, endpoint.url)
    return ssl.create_default_context()


@attrs.define
class DiscoveryStats:
    """What the client did, for tests and for the integrator's metrics."""

    lists: int = 0  # complete LISTs (all pages)
    pages: int = 0
    watches: int = 0  # watch requests answered 200
    events: int = 0  # ADDED, MODIFIED, DELETED
    bookmarks: int = 0
    expired: int = 0  # 410s (HTTP or ERROR event)
    stalls: int = 0  # watches the watchdog ended
    severed: int = 0  # watch streams that broke after the server answered
    reconciles: int = 0


class _Stalled(Exception):
    """The watchdog ended a watch that went silent."""


class _Severed(Exception):
    """An established watch stream broke (the server answered; the stream did not end well)."""


class KubernetesDiscovery:
    """A MembershipSource keeping the registry's "kubernetes" workers equal to the ready pods.

    ``run`` lists then watches forever; ``errors`` counts discovery errors by kind
    (`unreachable`, `unauthorized`, `forbidden`, `http_<code>`, `expired`, `stalled`,
    `severed`, `bad_response`, `token`) and ``on_error(kind)`` is called for each.
    """

    name = SOURCE

    def __init__(
        self,
        config: KubernetesConfig,
        *,
        environ: Mapping[str, str] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self._environ = os.environ if environ is None else environ
        self._on_error = on_error
        self.errors: collections.Counter[str] = collections.Counter()
        self.stats = DiscoveryStats()
        self._pods: dict[str, CachedPod] = {}  # by namespace/name: pods matching a selector
        self._seq = 0
        self._rv = ""
        self._listed = False
        self._progress = False  # the current watch delivered an event or a bookmark
        self._published: dict[str, WorkerRecord] = {}
        self._ok: bool | None = None
        self._registry: Registry | None = None
        self._http: httpx2.AsyncClient | None = None
        self._endpoint: ApiEndpoint | None = None
        self._annotation_keys = [config.bootstrap_port_annotation, config.worker_ports_annotation]
        if config.model_id_from and config.model_id_from.startswith("annotation:"):
            self._annotation_keys.append(config.model_id_from.partition(":")[2])

    # -- public view -----------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        return self._rv

    def workers(self) -> dict[str, WorkerRecord]:
        """The desired set as last handed to the registry."""
        return dict(self._published)

    # -- the task ---------------------------------------------------------------------------

    async def run(
        self, registry: Registry, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        endpoint = resolve_endpoint(self.config, self._environ)
        verify = ssl_context(endpoint)
        self._registry = registry
        self._endpoint = endpoint
        log.info(
            "kubernetes discovery: %s%s labelSelector=%r prefill=%s decode=%s",
            endpoint.url,
            self.config.pods_path(),
            self.config.server_selector(),
            self.config.prefill_selector or "-",
            self.config.decode_selector or "-",
        )
        timeout = httpx2.Timeout(self.config.request_timeout_secs)
        async with (
            httpx2.AsyncClient(
                base_url=endpoint.url, verify=verify, timeout=timeout, trust_env=False
            ) as http,
            trio.open_nursery() as nursery,
        ):
            self._http = http
            nursery.start_soon(self._resync_loop)
            await self._list_and_watch(task_status)

    async def _list_and_watch(self, task_status: trio.TaskStatus[None]) -> None:
        started = False
        need_list = True
        failures = 0  # consecutive list/watch cycles whose watch delivered nothing
        last_list = -float("inf")
        while True:
            self._progress = False
            try:
                if need_list:
                    await self._list()
                    need_list = False
                    last_list = trio.current_time()
                if not started:
                    task_status.started()
                    started = True
                await self._watch()
                if self._progress:
                    failures = 0  # it ended as watches end (its timeout): watch again at once
                    relist_due = trio.current_time() - last_list >= self.config.relist_secs
                    need_list = self.config.relist_secs > 0 and relist_due
                    continue
                # A watch that ended without a single event or bookmark: back off below.
            except Gone as exc:
                self._error("expired", f"{exc}; listing again", warn=False)
                self.stats.expired += 1
                need_list = True
            except _Stalled:
                self.stats.stalls += 1
                self._error(
                    "stalled",
                    f"watch silent for {self.config.stall_timeout_secs:g} s; watching again "
                    f"from resourceVersion {self._rv}",
                )
            except _Severed as exc:
                self.stats.severed += 1
                self._error(
                    "severed",
                    f"watch stream broke ({exc}); watching again from resourceVersion {self._rv}",
                )
            except ApiError as exc:
                kind = {401: "unauthorized", 403: "forbidden"}.get(exc.code, f"http_{exc.code}")
                self._error(kind, str(exc))
                self._status(False, f"{self._endpoint_url()}: {exc}")
            except httpx2.HTTPError as exc:
                self._error("unreachable", f"{type(exc).__name__}: {exc}")
                self._status(False, f"{self._endpoint_url()} unreachable: {exc}")
            except OSError as exc:
                self._error("token", f"cannot read the token: {exc}")
                self._status(False, f"cannot read the token: {exc}")
            except (BadResponse, orjson.JSONDecodeError, ValueError, TypeError) as exc:
                self._error("bad_response", f"{type(exc).__name__}: {exc}")
            if not started:
                task_status.started()  # the first attempt ended: reported unreachable
                started = True
            # The backoff grows while cycles deliver nothing (a relist that always meets a 410,
            # a server that drops every watch); a watch that delivered costs one short wait.
            failures = 1 if self._progress else failures + 1
            await trio.sleep(self._backoff(failures))

    def _backoff(self, failures: int) -> float:
        cfg = self.config
        delay = cfg.backoff_initial_secs * 2 ** min(failures - 1, 30)
        return min(cfg.backoff_max_secs, delay) * random.uniform(0.8, 1.2)

    async def _resync_loop(self) -> None:
        while True:
            await trio.sleep(self.config.resync_secs)
            if self._listed:
                self._publish("resync", force=True)

    # -- LIST -------------------------------------------------------------------------------

    async def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        token_file = self._endpoint.token_file if self._endpoint else None
        if token_file:
            token = (await trio.Path(token_file).read_text()).strip()
            if token:
                headers["Authorization"] = f"Bearer {token}"
        return headers

    def _base_params(self) -> dict[str, str]:
        selector = self.config.server_selector()
        return {"labelSelector": selector} if selector else {}

    async def _list(self) -> None:
        assert self._http is not None
        pods: dict[str, PodView] = {}
        rv = ""
        cont = ""
        while True:
            params = {**self._base_params(), "limit": str(self.config.page_size)}
            if cont:
                params["continue"] = cont
            response = await self._http.get(
                self.config.pods_path(), params=params, headers=await self._headers()
            )
            if response.status_code != 200:
                raise ApiError.from_response(response)
            body = orjson.loads(response.content)
            if not isinstance(body, dict) or not isinstance(body.get("items", []), list):
                raise BadResponse(f"not a list: {response.content[:200]!r}")
            meta = body.get("metadata") or {}
            rv = rv or str(meta.get("resourceVersion") or "")
            for item in body.get("items") or ():
                pod = PodView.from_json(item, self._annotation_keys)
                if pod_role(pod, self.config) is not None:
                    pods[pod.key] = pod
            self.stats.pages += 1
            cont = meta.get("continue") or ""
            if not cont:
                break
        if not rv:
            raise BadResponse("list without metadata.resourceVersion")
        self.stats.lists += 1
        self._status(True)
        gone = set(self._pods) - set(pods)
        self._pods = {key: self._cached(pod) for key, pod in pods.items()}
        self._rv = rv
        self._listed = True
        log.debug("listed %d matching pods at resourceVersion %s", len(pods), rv)
        self._publish("relist" + (f" ({len(gone)} pod(s) absent)" if gone else ""), force=True)

    def _cached(self, pod: PodView) -> CachedPod:
        """The cache entry for a pod's new state (keeping when its uid was first seen)."""
        old = self._pods.get(pod.key)
        if old is not None and old.pod.uid == pod.uid:
            seen = old.seen
        else:
            self._seq += 1
            seen = self._seq
        return CachedPod(pod, tuple(records_for_pod(pod, self.config)), seen)

    # -- WATCH ------------------------------------------------------------------------------

    async def _watch(self) -> None:
        """One watch from the current resourceVersion until the server ends it (``_progress``
        tells whether it delivered anything). Raises Gone, ApiError, _Stalled, _Severed, and
        httpx2 errors from before the answer (the server is unreachable)."""
        assert self._http is not None
        cfg = self.config
        params = {
            **self._base_params(),
            "watch": "true",
            "resourceVersion": self._rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(cfg.watch_timeout_secs),
        }
        timeout = httpx2.Timeout(cfg.request_timeout_secs, read=None)
        headers = await self._headers()
        with trio.CancelScope(deadline=trio.current_time() + cfg.stall_timeout_secs) as watchdog:
            async with self._http.stream(
                "GET", cfg.pods_path(), params=params, headers=headers, timeout=timeout
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise ApiError.from_response(response)
                self.stats.watches += 1
                self._status(True)
                try:
                    async for line in response.aiter_lines():
                        watchdog.deadline = trio.current_time() + cfg.stall_timeout_secs
                        if line.strip():
                            self._on_event(orjson.loads(line))
                except httpx2.TransportError as exc:
                    raise _Severed(f"{type(exc).__name__}: {exc}") from exc
        if watchdog.cancelled_caught:
            raise _Stalled

    def _on_event(self, event: Any) -> None:
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            raise BadResponse(f"not a watch event: {str(event)[:200]}")
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            raise ApiError.from_status(obj, 500)
        rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        self._progress = True
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            self._rv = rv or self._rv
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            raise BadResponse(f"unknown watch event type {kind!r}")
        self.stats.events += 1
        pod = PodView.from_json(obj, self._annotation_keys)
        if kind == "DELETED" or pod_role(pod, self.config) is None:
            changed = self._pods.pop(pod.key, None) is not None
            why = "DELETED" if kind == "DELETED" else "labels no longer match"
        else:
            changed = True
            why = kind
            self._pods[pod.key] = self._cached(pod)
        self._rv = rv or self._rv
        if changed:
            self._publish(f"{why} {pod.key}")

    # -- publishing -------------------------------------------------------------------------

    def _publish(self, why: str, *, force: bool = False) -> None:
        assert self._registry is not None
        desired = merge_records(self._pods.values())
        if not force and desired == self._published:
            return
        renewed = [
            wid
            for wid, rec in desired.items()
            if wid in self._published and self._published[wid].meta.get("uid") != rec.meta["uid"]
        ]
        if renewed:
            # Same name, new pod: take the old worker out first so the new one starts afresh.
            keep = [rec for wid, rec in desired.items() if wid not in renewed]
            self._reconcile(keep)
        self._reconcile(desired.values())
        self._log_changes(why, desired, renewed)
        self._published = desired

    def _reconcile(self, records: Iterable[WorkerRecord]) -> None:
        assert self._registry is not None
        self.stats.reconciles += 1
        self._registry.reconcile(SOURCE, list(records))

    def _log_changes(self, why: str, desired: dict[str, WorkerRecord], renewed: list[str]) -> None:
        for wid in sorted(set(self._published) - set(desired)):
            old = self._published[wid]
            entry = self._pods.get(f"{old.meta['namespace']}/{old.meta['pod']}")
            pod = entry.pod if entry else None
            if pod is None:
                reason = "pod gone"
            elif pod.uid != old.meta["uid"]:
                reason = f"pod replaced (uid {pod.uid})"
            else:
                reason = exclusion_reason(pod, self.config) or f"another pod holds {old.spec.url}"
            log.info("worker %s (%s) leaves: %s [%s]", wid, old.spec.url, reason, why)
        for wid in sorted(set(desired) - set(self._published)):
            log.info("worker %s (%s) joins [%s]", wid, desired[wid].spec.url, why)
        for wid in renewed:
            log.info("worker %s renewed: new pod uid %s [%s]", wid, desired[wid].meta["uid"], why)

    # -- status and errors ------------------------------------------------------------------

    def _endpoint_url(self) -> str:
        return self._endpoint.url if self._endpoint else "?"

    def _status(self, ok: bool, detail: str = "") -> None:
        if ok == self._ok:
            return
        self._ok = ok
        assert self._registry is not None
        self._registry.source_status(SOURCE, ok, detail)
        if ok:
            log.info("kubernetes API server %s reachable", self._endpoint_url())

    def _error(self, kind: str, message: str, *, warn: bool = True) -> None:
        self.errors[kind] += 1
        (log.warning if warn else log.info)("kubernetes discovery: %s", message)
        if self._on_error is not None:
            self._on_error(kind)


# -- command line -------------------------------------------------------------------------------
