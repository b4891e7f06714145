"""The Kubernetes API server as discovery reaches it: where it is, TLS, its errors, the counts.

The explicit `--kube-api-server` (with `--kube-token-file`, `--kube-ca-file`), else the
in-cluster service and the service account's token and CA. RBAC: the router's service account
needs `list` and `watch` on `pods` (a Role in the namespace of `--service-discovery-namespace`,
or a ClusterRole when watching all namespaces).
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Mapping
from typing import Any

import attrs
import httpx2
import orjson
import trio

from trio_pd.config import KubernetesConfig

log = logging.getLogger("trio_pd.membership.kubernetes")

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_TOKEN_FILE = f"{SERVICE_ACCOUNT_DIR}/token"
DEFAULT_CA_FILE = f"{SERVICE_ACCOUNT_DIR}/ca.crt"
USER_AGENT = "trio-pd (kubernetes discovery)"


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


async def request_headers(endpoint: ApiEndpoint | None) -> dict[str, str]:
    """The headers of a request, with the token read anew (service-account tokens rotate)."""
    headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
    token_file = endpoint.token_file if endpoint else None
    if token_file:
        token = (await trio.Path(token_file).read_text()).strip()
        if token:
            headers["Authorization"] = f"Bearer {token}"
    return headers


def selector_params(config: KubernetesConfig) -> dict[str, str]:
    """The query's `labelSelector`, when the selectors give one."""
    selector = config.server_selector()
    return {"labelSelector": selector} if selector else {}
