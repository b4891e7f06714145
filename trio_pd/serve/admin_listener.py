"""`--admin-host`:`--admin-port`: the control plane's own door (Envoy's admin listener shape).

Without control-plane keys, the changing control routes (`POST /workers`, `DELETE
/workers/{id}`, `POST /flush_cache`) are served here and only here: the data-plane port refuses
them whoever the TCP peer is (`edge/auth.py`), so a proxy or sidecar in front of the data plane
cannot pass a remote client's change through, while the operator on the router's host can still
change membership at runtime. The listener binds 127.0.0.1:29001 by default (the CLI's; port 0
takes a free one, `none` starts none); who can connect to it is its protection, so it warns when
bound beyond loopback without keys. With keys configured they are required here too.

It serves the control routes (read and write), `/health`, `/readiness`, `/liveness` and
`/metrics`, with the same Router (one fleet, one membership store) through `Router.handle_http`
with door "admin": generation and `/v1/models` are the data plane's. Plain HTTP/1.1 only, also
with `--tls-cert-path` (as the metrics listener; it is meant for loopback), no CORS, and a
request carrying `Origin` is refused: a browser page cannot drive it.

Like the metrics listener it is bound before the router starts (a port it cannot have stops the
start-up with the reason), and it stays up through the drain until the process ends, so an
operator can still look and act while requests finish. With `--workers N` every process serves
its own copy of the socket (SO_REUSEPORT, made by the supervisor as the data plane's are), and
a change through any of them lands in the membership file they share.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Sockets

from trio_pd.asgi import Receive, Scope, Send
from trio_pd.edge.router import Router
from trio_pd.respond import deny_websocket
from trio_pd.serve.accept import bound_url, serve_app, wrap_asgi
from trio_pd.serve.listeners import bind_one, side_listener_config, where

log = logging.getLogger(__name__)


class AdminListenError(Exception):
    """The admin listener cannot be bound (the port is taken, the address is not ours)."""


def bind_admin(host: str, port: int, copies: int = 1) -> list[Sockets]:
    """`copies` listening sockets on `host:port`, bound now (SO_REUSEPORT when more than one:
    one per process of `--workers N`); port 0 picks a free port, the same for every copy."""
    sockets: list[Sockets] = []
    try:
        for _ in range(copies):
            sock = bind_one(host, port, reuse_port=copies > 1)
            port = sock.getsockname()[1]
            sockets.append(Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[]))
    except OSError as exc:
        for made in sockets:
            made.insecure_sockets[0].close()
        hint = " (--admin-port, --admin-host; --admin-port none starts no admin listener)"
        message = f"cannot listen for the admin API on {where(host, port)}: {exc}{hint}"
        raise AdminListenError(message) from exc
    return sockets


def admin_url(sockets: Sockets) -> str:
    return bound_url(sockets.insecure_sockets[0], None)


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AdminDoor:
    """The listener's ASGI app: the Router's requests through door "admin". The Router's own
    lifespan runs on the data plane's server; this one has nothing to start."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        elif scope["type"] == "http":
            await self.router.handle_http(scope, receive, send, "admin")
        elif scope["type"] == "websocket":
            await deny_websocket(send)


async def serve_admin(
    router: Router,
    sockets: Sockets,
    shutdown_trigger: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin door of `router` on `sockets` until `shutdown_trigger` returns (or
    cancelled). Start it once the router's lifespan has started (its control client is open)."""
    hc = side_listener_config()
    app = wrap_asgi(AdminDoor(router), hc)
    url = admin_url(sockets)
    log.info("admin API on %s (the control plane's own door)", url)
    host = router.config.admin_host
    if router.access.keyless and not is_loopback_host(host):
        log.warning(
            "the admin listener %s is bound beyond loopback (--admin-host %s) and no "
            "control-plane keys are configured: anyone who reaches it can change membership",
            url, host,
        )  # fmt: skip
    await serve_app(app, hc, sockets, shutdown_trigger, task_status=task_status)
