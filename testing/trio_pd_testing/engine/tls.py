"""The engine's HTTPS settings: `--ssl-certfile`, `--ssl-keyfile`, `--ssl-ca-certs` (SGLang's).

The certificate and key serve the HTTP API over TLS; a CA bundle additionally makes the engine
require a client certificate signed by it (mutual TLS), so a router without one is refused at the
handshake. Only HTTP/1.1 is offered, like the plain port.
"""

from __future__ import annotations

import ssl

from trio_pd_testing.engine.config import EngineConfig


def server_ssl_context(config: EngineConfig) -> ssl.SSLContext | None:
    if not config.ssl_certfile:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    context.set_alpn_protocols(["http/1.1"])
    if config.ssl_ca_certs:
        context.load_verify_locations(config.ssl_ca_certs)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
