"""The listening sockets of the data plane and the hypercorn Config serving them; the binding
of the side listeners (metrics, admin) and their Config."""

from __future__ import annotations

import logging
import math
import socket

from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets

from trio_pd.config import RouterConfig
from trio_pd.serve.connection import ClientTimeouts

GRACE_MARGIN_SECS = 5.0  # hypercorn's own graceful timeout: past ours, as a backstop
SIDE_KEEP_ALIVE_SECS = 5.0  # the metrics and admin listeners
SIDE_GRACE_SECS = 1.0  # a scrape or an admin call still being answered when the process ends
SIDE_BACKLOG = 128
# The kernel's TCP_USER_TIMEOUT on client connections is the stall timeout plus this much (at
# least `USER_TIMEOUT_MARGIN_SECS`): the stream watchdog, which looks a few times per stall
# timeout, always acts first (`make_sockets`).
USER_TIMEOUT_MARGIN_SECS = 2.0
USER_TIMEOUT_MARGIN_SHARE = 0.5


def hypercorn_config(config: RouterConfig) -> HypercornConfig:
    hc = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    if config.tls_cert_path:
        hc.certfile = config.tls_cert_path
        hc.keyfile = config.tls_key_path
    # Without --enable-http2 TLS clients are offered HTTP/1.1 only (`connection.py`).
    hc.alpn_protocols = ["h2", "http/1.1"] if config.enable_http2 else ["http/1.1"]
    hc.ssl_handshake_timeout = config.tls_handshake_timeout_secs
    # What hypercorn itself reads of it (HTTP/2); HTTP/1.1 connections use `client_timeouts`.
    hc.keep_alive_timeout = config.edges.idle_connection_timeout_secs or math.inf
    hc.graceful_timeout = config.shutdown_grace_period_secs + GRACE_MARGIN_SECS
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.backlog = 4096
    return hc


def client_timeouts(config: RouterConfig) -> ClientTimeouts:
    """The data plane's bounds on a client connection: `--header-read-timeout-secs` on a
    request head, `--idle-connection-timeout-secs` between requests (`connection.py`)."""
    edges = config.edges
    return ClientTimeouts(edges.header_read_timeout_secs, edges.idle_connection_timeout_secs)


def user_timeout_secs(stall_secs: float) -> float:
    """The TCP_USER_TIMEOUT of client connections for a given `--stream-stall-timeout-secs`."""
    return stall_secs + max(USER_TIMEOUT_MARGIN_SECS, stall_secs * USER_TIMEOUT_MARGIN_SHARE)


def make_sockets(config: RouterConfig, hc: HypercornConfig) -> Sockets:
    """hypercorn's listening sockets, with TCP_USER_TIMEOUT set a little past the stream stall
    timeout (`user_timeout_secs`).

    Accepted connections inherit it: the kernel then aborts a connection whose client has not
    acknowledged data (a zero receive window included) for that long. Hypercorn shields its
    socket writes, so this is what finally frees a task writing to a client that stopped
    reading, after the stream watchdog has already closed the decode leg (`attempt.py`); were
    the two equal, the kernel could end the connection first and the leg would be cancelled as
    "client gone" instead of "stall".
    """
    sockets = hc.create_sockets()
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if user_timeout is not None:
        millis = int(user_timeout_secs(config.timeouts.stream_stall_secs) * 1000)
        for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
            sock.setsockopt(socket.IPPROTO_TCP, user_timeout, millis)
    return sockets


def where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_one(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening, non-blocking TCP socket on `host:port` (port 0: a free one). `reuse_port`:
    SO_REUSEPORT, for the copies the processes of `--workers N` share. OSError if it cannot."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(SIDE_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def side_listener_config() -> HypercornConfig:
    """hypercorn's Config of the metrics and admin listeners: plain HTTP/1.1, short grace."""
    hc = HypercornConfig()
    hc.keep_alive_timeout = SIDE_KEEP_ALIVE_SECS
    hc.graceful_timeout = SIDE_GRACE_SECS
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


def close_sockets(sockets: Sockets) -> None:
    for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
        sock.close()
