"""Kubernetes pod discovery: prefill and decode workers from a LIST + WATCH of pods.

Flags follow SGLang's router (`--service-discovery`, `--prefill-selector`, `--decode-selector`,
`--selector`, `--service-discovery-port`, `--service-discovery-namespace`,
`--bootstrap-port-annotation`), plus `--kube-api-server`, `--kube-token-file` and
`--kube-ca-file` to point at an API server from outside a cluster (`api.py`).

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

Which pods are workers, and their ids, is `pods.py`'s.

When the API server cannot be reached the workers already known stay (reported through
`Registry.source_status`); discovery errors are logged and counted in `errors` (by kind) and
passed to `on_error`, for the integrator to turn into a metric.
"""

from __future__ import annotations

import collections
import logging
import os
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx2
import orjson
import trio

from trio_pd.config import KubernetesConfig
from trio_pd.membership.kubernetes.api import (
    ApiEndpoint,
    ApiError,
    BadResponse,
    DiscoveryStats,
    Gone,
    request_headers,
    resolve_endpoint,
    selector_params,
    ssl_context,
)
from trio_pd.membership.kubernetes.pods import (
    SOURCE,
    CachedPod,
    PodView,
    exclusion_reason,
    merge_records,
    pod_role,
    records_for_pod,
)
from trio_pd.spec import Registry, WorkerRecord

log = logging.getLogger("trio_pd.membership.kubernetes")


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

    async def _list(self) -> None:
        assert self._http is not None
        pods: dict[str, PodView] = {}
        rv = ""
        cont = ""
        while True:
            params = {**selector_params(self.config), "limit": str(self.config.page_size)}
            if cont:
                params["continue"] = cont
            response = await self._http.get(
                self.config.pods_path(),
                params=params,
                headers=await request_headers(self._endpoint),
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
            **selector_params(self.config),
            "watch": "true",
            "resourceVersion": self._rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(cfg.watch_timeout_secs),
        }
        timeout = httpx2.Timeout(cfg.request_timeout_secs, read=None)
        headers = await request_headers(self._endpoint)
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
