"""`--health-check-port`: the probes on a listener of their own (SMG 1.13's probe listener).

SMG 1.13 serves `/liveness`, `/readiness` and `/health` also on this port, so an orchestrator's
probes are not starved by the request path: a kubelet whose liveness probe times out behind a
saturated data plane kills a router that could still serve. Here the probes get their own
socket, accept queue and connections: a data port whose backlog is full, whose admission line is
long or whose connections are all busy does not delay them. They are the same handlers as on the
data port (`edge/probes.py`; the routes stay there too), answered by the same Router, so
readiness is that of the process answering (`/readiness` says 503 "draining" here too, while
`/health` stays 200 through a drain). Anything else is a JSON 404.

What differs from SMG: its listener runs on an OS thread with its own runtime; this one shares
the process's trio loop (the probes read the fleet, which belongs to that loop), so a loop kept
busy by CPU work delays it as it delays everything. It is plain HTTP/1.1 (also with
`--tls-cert-path`), bound on `--host` before the router starts (a port it cannot have stops
the start-up with the reason, as the metrics and admin listeners), and it is up until the
process ends, through the drain. With `--workers N` every process serves its own copy of the
socket (SO_REUSEPORT, made by the supervisor as the admin listener's are).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Sockets

from trio_pd.asgi import Receive, Scope, Send
from trio_pd.edge.router import Router
from trio_pd.errors import not_found
from trio_pd.respond import Responder, deny_websocket
from trio_pd.serve.accept import bound_url, serve_app, wrap_asgi
from trio_pd.serve.listeners import bind_one, side_listener_config, where

log = logging.getLogger(__name__)
PROBE_PATHS = frozenset({"/health", "/liveness", "/readiness"})


class ProbeListenError(Exception):
    """The probe listener cannot be bound (the port is taken, the address is not ours)."""


def bind_probes(host: str, port: int, copies: int = 1) -> list[Sockets]:
    """`copies` listening sockets on `host:port`, bound now (SO_REUSEPORT when more than one:
    one per process of `--workers N`)."""
    sockets: list[Sockets] = []
    try:
        for _ in range(copies):
            sock = bind_one(host, port, reuse_port=copies > 1)
            port = sock.getsockname()[1]
            sockets.append(Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[]))
    except OSError as exc:
        for made in sockets:
            made.insecure_sockets[0].close()
        message = f"cannot listen for probes on {where(host, port)}: {exc} (--health-check-port)"
        raise ProbeListenError(message) from exc
    return sockets


class ProbeDoor:
    """The listener's ASGI app: the probe paths through the Router (door "admin": no CORS, no
    `Origin`), a 404 for anything else. The Router's lifespan runs on the data plane's server."""

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
            if scope["path"] in PROBE_PATHS:
                await self.router.handle_http(scope, receive, send, "admin")
            else:
                responder = Responder(send, b"-")
                await responder.error(not_found(scope["path"]))
        elif scope["type"] == "websocket":
            await deny_websocket(send)


async def serve_probes(
    router: Router,
    sockets: Sockets,
    shutdown_trigger: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the probes of `router` on `sockets` until `shutdown_trigger` returns (or cancelled)."""
    hc = side_listener_config()
    app = wrap_asgi(ProbeDoor(router), hc)
    log.info("probes on %s", bound_url(sockets.insecure_sockets[0], None))
    await serve_app(app, hc, sockets, shutdown_trigger, task_status=task_status)
