"""The router's doors: the data port, the admin, probe and metrics listeners, as one value each,
bound by one function and served by one function.

A `Door` says where it binds, which flags move it (the `hint` a bind error names), and whether
it outlives the drain. Every door is bound before anything is served (`bind_door`; a port it
cannot have stops the start-up with `ListenError`, one line naming the door, the address, the
reason and the flags, never a traceback) and served by `serve_door`: hypercorn's trio connection
handling (`accept.py`) on its sockets, each request scope carrying the router's lifespan state
(`edge/router.py` puts its route table there), until its trigger.

- **data** (`--host`:`--port`): the whole router; TLS and HTTP/2 as configured, the client
  bounds and the connection cap; it closes at the drain.
- **admin** (`--admin-host`:`--admin-port`, `127.0.0.1:29001` by default, `none`: no door):
  the control plane's own door, in Envoy's shape. Without control-plane keys the changing
  routes (`POST /workers`, `DELETE /workers/{id}`, `POST /flush_cache`) are served here and only
  here: the data port refuses them whoever the TCP peer is (`edge/auth.py`), so a proxy in front
  of the data plane cannot pass a remote change through. It serves the control routes, the
  probes and `/metrics` through the same router (door "admin": no CORS, a request carrying
  `Origin` refused); who can connect is its protection, so it warns when bound beyond loopback
  without keys.
- **probes** (`--health-check-port`, on `--host`; SMG 1.13's probe listener): `/health`,
  `/liveness`, `/readiness` through the same router, a JSON 404 for anything else; its own
  socket and accept queue, so a saturated data plane does not starve a kubelet's probes (it
  shares the process's trio loop, where SMG runs it on a thread of its own).
- **metrics** (`--prometheus-host`:`--prometheus-port`, SMG's `0.0.0.0:29000`): `GET /metrics`
  and a JSON 404/405 for anything else. SMG panics on a taken port (`start_prometheus`,
  `.expect`); trio_pd stops with the reason. With `--workers N` the supervising parent serves
  it from a thread with the sum over the processes (`supervisor.MetricsThread`).

Every door but the data port outlives the drain: it answers until the process ends, so the
scrape, the probe and the admin call that show a drain's last requests still succeed. The side
doors are plain HTTP/1.1 (also with `--tls-cert-path`). With `--workers N` the supervisor binds
one copy of the data, admin and probe sockets per process (SO_REUSEPORT) before any process
exists, and each process serves its own.
"""

from __future__ import annotations

import ipaddress
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets

from trio_pd.asgi import Receive, Scope, Send
from trio_pd.config import RouterConfig
from trio_pd.errors import method_not_allowed, not_found
from trio_pd.observe.metrics import CONTENT_TYPE
from trio_pd.respond import Reply, Responder, deny_websocket
from trio_pd.serve.accept import ConnectionCap, bound_url, serve_app, wrap_asgi
from trio_pd.serve.connection import ClientTimeouts
from trio_pd.serve.listeners import (
    bind_one,
    close_sockets,
    hypercorn_config,
    make_sockets,
    side_listener_config,
    where,
)

log = logging.getLogger(__name__)

DoorName = Literal["data", "admin", "probes", "metrics"]
PROBE_PATHS = frozenset({"/health", "/liveness", "/readiness"})
HttpHandler = Callable[[Scope, Receive, Send], Awaitable[None]]


class ListenError(Exception):
    """A door cannot be bound (the port is taken, the address is not ours): the start stops."""


@attrs.frozen
class Door:
    """One listener of a router process: where it binds, what a bind error tells the operator,
    and whether it stays open through the drain."""

    name: DoorName
    serves: str  # for the log and the bind error: "the admin API", "probes", ...
    host: str
    port: int  # 0: a free one
    hint: str  # the flags that move (or close) it
    outlives_drain: bool
    # Its requests go through the router's routes, which exist once its lifespan started: it
    # opens then (connections wait in its backlog). The metrics page needs none: it opens first.
    routed: bool = True


def data_door(config: RouterConfig) -> Door:
    return Door("data", "requests", config.host, config.port, "--host, --port", False)


def side_doors(config: RouterConfig) -> tuple[Door, ...]:
    """The side doors `config` asks for, in the order they are bound (metrics first, as SMG)."""
    doors = []
    if config.prometheus_port is not None:
        host, port = config.prometheus_host, config.prometheus_port
        hint = "--prometheus-port, --prometheus-host"
        doors.append(Door("metrics", "metrics", host, port, hint, True, routed=False))
    if config.admin_port is not None:
        hint = "--admin-port, --admin-host; --admin-port none starts no admin listener"
        doors.append(
            Door("admin", "the admin API", config.admin_host, config.admin_port, hint, True)
        )
    if config.edges.health_check_port is not None:
        port = config.edges.health_check_port
        doors.append(Door("probes", "probes", config.host, port, "--health-check-port", True))
    return tuple(doors)


def bind_door(door: Door, config: RouterConfig, copies: int = 1) -> list[Sockets]:
    """`copies` listening sockets for `door`, bound now (SO_REUSEPORT when more than one: one
    per process of `--workers N`; port 0 picks a free port, the same for every copy).
    ListenError, with every socket made so far closed, if it cannot."""
    sockets: list[Sockets] = []
    port = door.port
    try:
        for _ in range(copies):
            if door.name == "data":  # TLS, TCP_USER_TIMEOUT, hypercorn's backlog
                hc = hypercorn_config(attrs.evolve(config, port=port))
                hc.workers = copies  # hypercorn sets SO_REUSEPORT when more than one
                made = make_sockets(config, hc)
                for sock in (*made.secure_sockets, *made.insecure_sockets):
                    sock.listen(hc.backlog)
                first = (*made.secure_sockets, *made.insecure_sockets)[0]
            else:
                first = bind_one(door.host, port, reuse_port=copies > 1)
                made = Sockets(secure_sockets=[], insecure_sockets=[first], quic_sockets=[])
            port = first.getsockname()[1]
            sockets.append(made)
    except OSError as exc:
        for made in sockets:
            close_sockets(made)
        message = (
            f"cannot listen for {door.serves} on {where(door.host, port)}: {exc} ({door.hint})"
        )
        raise ListenError(message) from exc
    return sockets


def bind_doors(doors: tuple[Door, ...], config: RouterConfig) -> dict[DoorName, Sockets]:
    """Each door bound once, in order; the first that cannot be stops it all (ListenError),
    the ones already bound closed."""
    bound: dict[DoorName, Sockets] = {}
    try:
        for door in doors:
            bound[door.name] = bind_door(door, config)[0]
    except ListenError:
        for made in bound.values():
            close_sockets(made)
        raise
    return bound


# -- the side doors' apps ------------------------------------------------------------------


class HttpOnly:
    """A door's ASGI app: `handle` for HTTP, the envelope for a WebSocket handshake. The
    router's lifespan runs once per process (`process.serve`), never through a side door."""

    def __init__(self, handle: HttpHandler) -> None:
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.handle(scope, receive, send)
        elif scope["type"] == "websocket":
            await deny_websocket(send)


def probes_only(handle: HttpHandler) -> HttpHandler:
    """The probe paths through `handle`, a JSON 404 for anything else."""

    async def probes(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] in PROBE_PATHS:
            await handle(scope, receive, send)
        else:
            await Responder(send, b"-").error(not_found(scope["path"]))

    return probes


def metrics_page(render: Callable[[], bytes]) -> HttpHandler:
    """`GET /metrics` rendered by `render`, 404/405 otherwise."""

    async def page(scope: Scope, receive: Receive, send: Send) -> None:
        responder = Responder(send, uuid.uuid4().hex.encode())
        if scope["path"] != "/metrics":
            await responder.error(not_found(scope["path"]))
        elif scope["method"] != "GET":
            await responder.error(method_not_allowed(scope["method"], "/metrics", ("GET",)))
        else:
            await responder.reply(Reply(200, [(b"content-type", CONTENT_TYPE)], render()))

    return page


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- serving ---------------------------------------------------------------------------------


@attrs.frozen
class DataOptions:
    """What only the data port has: its hypercorn Config (TLS, backlog, grace), HTTP/2, the
    client bounds and the connection cap."""

    hc: HypercornConfig
    http2: bool
    timeouts: ClientTimeouts
    cap: ConnectionCap


async def serve_door(
    door: Door,
    app: Any,
    sockets: Sockets,
    shutdown_trigger: Callable[[], Awaitable[None]],
    *,
    state: dict[str, Any] | None = None,
    data: DataOptions | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on `door`'s `sockets` until `shutdown_trigger` returns (or cancelled); each
    request's scope carries `state` (the router's lifespan state: read when the request comes,
    so a door opened before the lifespan started sees what it put there). `data`: the data
    port's own settings; a side door gets plain HTTP/1.1 with a short grace."""
    hc = data.hc if data is not None else side_listener_config()
    wrapped = wrap_asgi(app, hc)
    urls = [bound_url(sock, None) for sock in sockets.insecure_sockets]
    if door.name == "metrics":
        log.info("metrics on %s", ", ".join(f"{url}/metrics" for url in urls))
    elif door.name == "admin":
        log.info("admin API on %s (the control plane's own door)", ", ".join(urls))
    elif door.name == "probes":
        log.info("probes on %s", ", ".join(urls))
    extra: dict[str, Any] = {}
    if data is not None:
        extra = {"http2": data.http2, "timeouts": data.timeouts, "cap": data.cap}
    await serve_app(
        wrapped, hc, sockets, shutdown_trigger, state=state, task_status=task_status, **extra
    )
