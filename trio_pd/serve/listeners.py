"""The listening sockets of the data plane and the hypercorn Config serving them."""

from __future__ import annotations

import logging
import socket

from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets

from trio_pd.config import RouterConfig

KEEP_ALIVE_SECS = 5.0  # hypercorn holds a closed client socket (CLOSE_WAIT) until this runs out


GRACE_MARGIN_SECS = 5.0  # hypercorn's own graceful timeout: past ours, as a backstop


def hypercorn_config(config: RouterConfig) -> HypercornConfig:
    hc = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    if config.tls_cert_path:
        hc.certfile = config.tls_cert_path
        hc.keyfile = config.tls_key_path
    hc.keep_alive_timeout = KEEP_ALIVE_SECS
    hc.graceful_timeout = config.shutdown_grace_period_secs + GRACE_MARGIN_SECS
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.backlog = 4096
    return hc


def make_sockets(config: RouterConfig, hc: HypercornConfig) -> Sockets:
    """hypercorn's listening sockets, with TCP_USER_TIMEOUT set to the stream stall timeout.

    Accepted connections inherit it: the kernel then aborts a connection whose client has not
    acknowledged data (a zero receive window included) for that long. Hypercorn shields its
    socket writes, so this is what finally frees a task writing to a client that stopped
    reading, after the stream watchdog has already closed the decode leg (`attempt.py`).
    """
    sockets = hc.create_sockets()
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if user_timeout is not None:
        millis = int(config.timeouts.stream_stall_secs * 1000)
        for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
            sock.setsockopt(socket.IPPROTO_TCP, user_timeout, millis)
    return sockets
