"""The control plane's HTTP client (httpx2): health probes, fan-out, admin checks, aborts.

Off the hot path on purpose: the legs use `pool.py`'s httptools client. One per router process,
opened by the lifespan; no redirects, no proxies from the environment, HTTP/1.1 only.
"""

from __future__ import annotations

import ssl

import httpx2

from trio_pd.upstream.pool import CONNECT_TIMEOUT_SECS, KEEPALIVE_EXPIRY_SECS


def make_client(ssl_context: ssl.SSLContext | None = None) -> httpx2.AsyncClient:
    """The httpx2 client of the control plane (health probes, fan-out, admin), off the hot path."""
    return httpx2.AsyncClient(
        verify=ssl_context if ssl_context is not None else True,
        http1=True,
        http2=False,
        trust_env=False,
        follow_redirects=False,
        limits=httpx2.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_SECS),
        timeout=httpx2.Timeout(None, connect=CONNECT_TIMEOUT_SECS),
        headers={"user-agent": "trio-pd"},
    )
