"""Membership sources' configuration values: etcd (`--etcd-*`) and Kubernetes pod discovery
(`--service-discovery`, `--*-selector`, `--kube-*`).

Pure values with their validators, so the router's config can hold them without importing the
sources (which pull in httpx2 and their clients): the sources import these, never the reverse.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import attrs

from trio_pd.spec import Role

DEFAULT_WORKER_PORTS_ANNOTATION = "smg.ai/worker-ports"
DEFAULT_BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"


def _endpoints(value: str | Iterable[str]) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    return tuple(item.strip().rstrip("/") for item in items if item.strip())


def _check_endpoints(instance: Any, attribute: Any, endpoints: tuple[str, ...]) -> None:
    if not endpoints:
        raise ValueError("etcd endpoints: give at least one URL, e.g. http://127.0.0.1:2379")
    for endpoint in endpoints:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"etcd endpoint must be an http(s) URL: {endpoint!r}")


def _prefix(value: str) -> str:
    value = "/" + value.strip("/")
    return value if value != "/" else ""


@attrs.frozen
class EtcdConfig:
    """Where the shared membership lives and how to reach it.

    ``lease_ttl_secs`` 0: workers stay until removed. N > 0: the workers this replica adds live
    on a lease of N seconds that `run()` keeps alive, so they go when the replica dies.
    ``resync_secs``: a full range this often, repairing anything a watch could have missed.
    """

    endpoints: tuple[str, ...] = attrs.field(converter=_endpoints, validator=_check_endpoints)
    prefix: str = attrs.field(default="/trio-pd", converter=_prefix)
    lease_ttl_secs: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    dial_timeout_secs: float = attrs.field(default=2.0, validator=attrs.validators.gt(0))
    request_timeout_secs: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    resync_secs: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    retry_initial_secs: float = attrs.field(default=0.2, validator=attrs.validators.gt(0))
    retry_max_secs: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))


def _selector(value: Mapping[str, str] | Iterable[str] | None) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    return parse_selector(value)


def _positive(_instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, not {value}")


def _model_id_from(_instance: Any, _attribute: Any, value: str | None) -> None:
    if value is None or value == "namespace":
        return
    kind, _, key = value.partition(":")
    if kind not in ("label", "annotation") or not key:
        raise ValueError(
            f"model id source must be namespace, label:<key> or annotation:<key>, not {value!r}"
        )


@attrs.frozen
class KubernetesConfig:
    """What to watch and how. Selectors are equality-based `{label: value}` maps.

    A pod is a prefill worker when it carries every label of ``selector`` and of
    ``prefill_selector``, a decode worker likewise with ``decode_selector`` (prefill wins when
    both match, as in SMG). At least one role selector is required: trio_pd routes PD pairs.
    """

    prefill_selector: dict[str, str] = attrs.field(factory=dict, converter=_selector)
    decode_selector: dict[str, str] = attrs.field(factory=dict, converter=_selector)
    selector: dict[str, str] = attrs.field(factory=dict, converter=_selector)  # common to both
    namespace: str | None = None  # None: every namespace (cluster-scoped /api/v1/pods)
    port: int = 80  # worker port for pods without the worker-ports annotation
    bootstrap_port_annotation: str = DEFAULT_BOOTSTRAP_PORT_ANNOTATION
    worker_ports_annotation: str = DEFAULT_WORKER_PORTS_ANNOTATION
    model_id_from: str | None = attrs.field(default=None, validator=_model_id_from)
    # Where the API server is: None = in-cluster (KUBERNETES_SERVICE_HOST/PORT, service account).
    api_server: str | None = None
    token_file: str | None = None  # in-cluster default: the service account's token
    ca_file: str | None = None  # in-cluster default: the service account's ca.crt
    page_size: int = attrs.field(default=500, validator=_positive)
    watch_timeout_secs: int = attrs.field(default=300, validator=_positive)
    stall_timeout_secs: float = attrs.field(default=120.0, validator=_positive)
    resync_secs: float = attrs.field(default=30.0, validator=_positive)
    relist_secs: float = 900.0  # a fresh LIST at the end of the first watch after this; 0: never
    request_timeout_secs: float = attrs.field(default=10.0, validator=_positive)
    backoff_initial_secs: float = attrs.field(default=0.5, validator=_positive)
    backoff_max_secs: float = attrs.field(default=30.0, validator=_positive)
    engine: str = "sglang"  # the PD protocol of the pods found (--vllm-pd-disaggregation: vllm)

    def __attrs_post_init__(self) -> None:
        if not self.prefill_selector and not self.decode_selector:
            raise ValueError(
                "Kubernetes discovery needs --prefill-selector and/or --decode-selector "
                "(trio_pd routes prefill/decode pairs; --selector only narrows both)"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"service discovery port out of range: {self.port}")

    def role_selectors(self) -> list[tuple[Role, dict[str, str]]]:
        roles: list[tuple[Role, dict[str, str]]] = [
            ("prefill", self.prefill_selector),
            ("decode", self.decode_selector),
        ]
        return [(role, sel) for role, sel in roles if sel]

    def server_selector(self) -> str:
        """The `labelSelector` sent to the API server: the labels every worker pod must carry
        (the common selector and whatever the role selectors share). Each event is checked
        against the full selectors here anyway."""
        selectors = [sel for _, sel in self.role_selectors()]
        shared = {k: v for k, v in selectors[0].items() if all(s.get(k) == v for s in selectors)}
        shared.update(self.selector)
        return ",".join(f"{k}={v}" for k, v in sorted(shared.items()))

    def pods_path(self) -> str:
        if self.namespace:
            return f"/api/v1/namespaces/{self.namespace}/pods"
        return "/api/v1/pods"


def parse_selector(items: Iterable[str]) -> dict[str, str]:
    """`["app=sglang", "role=prefill,tier=a"]` -> a label map; ValueError on anything else."""
    out: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            key, eq, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not key or "=" in value or "!" in key:
                raise ValueError(f"label selector must be key=value, not {part!r}")
            out[key] = value
    return out
