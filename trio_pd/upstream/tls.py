"""TLS to workers, with SGLang's router flag names: the system trust store, `--ca-cert-paths`
for a private CA, `--client-cert-path` / `--client-key-path` for mutual TLS.

One SSL context serves the hot path (`upstream.UpstreamPool`) and the control plane (httpx2:
health probes, fan-out), so a worker whose certificate does not verify fails its health checks
and its requests alike (a clear 502), instead of looking healthy while every request fails.
"""

from __future__ import annotations

import ssl

from trio_pd.config import RouterConfig


def worker_ssl_context(config: RouterConfig) -> ssl.SSLContext:
    context = ssl.create_default_context()
    for path in config.ca_cert_paths:
        context.load_verify_locations(cafile=path)
    if config.client_cert_path:
        context.load_cert_chain(config.client_cert_path, config.client_key_path)
    return context
