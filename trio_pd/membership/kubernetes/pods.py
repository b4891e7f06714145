"""Pods as discovery's rules see them, and the workers a pod stands for: pure, no I/O.

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
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from trio_pd.config import KubernetesConfig
from trio_pd.spec import Role, WorkerRecord, WorkerSpec

log = logging.getLogger("trio_pd.membership.kubernetes")

SOURCE = "kubernetes"


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
