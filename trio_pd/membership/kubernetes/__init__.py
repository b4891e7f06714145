"""Kubernetes pod discovery: prefill and decode workers from a LIST + WATCH of pods.

`source.py` is the source (`KubernetesDiscovery`: the list, the watch, the reconciles),
`pods.py` which pods are workers and under which ids (pure), `api.py` where the API server is,
its TLS and its errors.
"""

from __future__ import annotations

from trio_pd.membership.kubernetes.api import (
    DEFAULT_CA_FILE,
    DEFAULT_TOKEN_FILE,
    SERVICE_ACCOUNT_DIR,
    USER_AGENT,
    ApiEndpoint,
    ApiError,
    BadResponse,
    DiscoveryStats,
    Gone,
    resolve_endpoint,
    ssl_context,
)
from trio_pd.membership.kubernetes.pods import (
    SOURCE,
    CachedPod,
    PodView,
    bootstrap_ports,
    desired_records,
    exclusion_reason,
    merge_records,
    model_id,
    pod_role,
    records_for_pod,
    worker_ports,
    worker_url,
)
from trio_pd.membership.kubernetes.source import KubernetesDiscovery

__all__ = [
    "DEFAULT_CA_FILE",
    "DEFAULT_TOKEN_FILE",
    "SERVICE_ACCOUNT_DIR",
    "SOURCE",
    "USER_AGENT",
    "ApiEndpoint",
    "ApiError",
    "BadResponse",
    "CachedPod",
    "DiscoveryStats",
    "Gone",
    "KubernetesDiscovery",
    "PodView",
    "bootstrap_ports",
    "desired_records",
    "exclusion_reason",
    "merge_records",
    "model_id",
    "pod_role",
    "records_for_pod",
    "resolve_endpoint",
    "ssl_context",
    "worker_ports",
    "worker_url",
]
