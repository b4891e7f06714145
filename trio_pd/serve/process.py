"""Serving a Router with hypercorn's trio worker: one process, or several sharing the sockets.

Every mode runs `serve`: hypercorn's trio connection handling (`accept.py`, with a fair accept loop)
on sockets made by `listeners.py` (so they get TCP_USER_TIMEOUT, see `make_sockets`) with the
router's drain as the shutdown trigger: the server drains through that trigger, never by having
`serve` cancelled from outside (`drain.py`).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import signal
import socket
import sys
from collections.abc import Mapping
from functools import partial
from typing import Any

import attrs
import trio
from hypercorn.config import Sockets

from trio_pd.config import RouterConfig
from trio_pd.edge.router import Router, build_router
from trio_pd.observe.logs import configure as configure_logging
from trio_pd.serve.accept import ConnectionCap, bound_url, run_lifespan, wrap_asgi
from trio_pd.serve.doors import (
    DataOptions,
    Door,
    DoorName,
    HttpOnly,
    bind_doors,
    data_door,
    is_loopback_host,
    metrics_page,
    probes_only,
    serve_door,
    side_doors,
)
from trio_pd.serve.fd_budget import client_connection_cap, raise_soft_limit
from trio_pd.serve.listeners import client_timeouts, close_sockets, hypercorn_config

log = logging.getLogger(__name__)


@attrs.frozen(eq=False)
class Serving:
    """What `serve` reports once every door is open: the router it built and the data port's
    URLs (port 0 picks a free one)."""

    router: Router
    urls: list[str]


def own_sockets(listening: Mapping[DoorName, Sockets]) -> list[socket.socket]:
    return [
        sock
        for bound in listening.values()
        for sock in (*bound.secure_sockets, *bound.insecure_sockets)
    ]


async def serve(
    config: RouterConfig,
    *,
    listening: Mapping[DoorName, Sockets] | None = None,
    signals: tuple[int, ...] = (),
    parent_sentinel: int | None = None,
    task_status: trio.TaskStatus[Serving] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Build the router `config` asks for and serve it on its doors until drained (on one of
    `signals`, or the parent's death) or cancelled.

    `listening`: the doors' sockets, bound already (`doors.bind_doors`; the supervisor's
    copies for a process of `--workers N`); without it every door `config` asks for is bound
    here first, a port it cannot have failing the start (ListenError). The router is built
    after the binding, so it knows every socket it serves (`build_router`)."""
    if listening is None:
        listening = bind_doors((*side_doors(config), data_door(config)), config)
    try:
        admin = listening.get("admin")
        router = build_router(
            config,
            own_sockets=own_sockets(listening),  # a worker URL naming any is the router itself
            admin_url=bound_url(admin.insecure_sockets[0], None) if admin is not None else None,
        )
        await serve_doors(router, listening, signals, parent_sentinel, task_status)
    finally:  # also a door never served (a start-up that failed): closing twice is harmless
        for bound in listening.values():
            close_sockets(bound)


async def serve_doors(
    router: Router,
    listening: Mapping[DoorName, Sockets],
    signals: tuple[int, ...],
    parent_sentinel: int | None,
    task_status: trio.TaskStatus[Serving],
) -> None:
    """Every door of `router`, each served by `doors.serve_door`, around one lifespan.

    A door that does not route through the router (the metrics page) opens first, so a scrape
    answers during start-up; the others once the lifespan started and handed the requests its
    route table. The data port closes at the drain (its trigger), after which the lifespan shuts
    down (`Router.lifespan`); the doors that outlive the drain close when the process is done."""
    config = router.config
    doors = {door.name: door for door in (data_door(config), *side_doors(config))}
    hc = hypercorn_config(config)
    # The side doors keep the descriptors the cap leaves over.
    limit = client_connection_cap(config.edges.max_client_connections)
    data = DataOptions(
        hc, config.enable_http2, client_timeouts(config),
        ConnectionCap(limit, router.metrics.connections_refused.inc),
    )  # fmt: skip
    admin = doors.get("admin")
    if admin is not None and router.access.keyless and not is_loopback_host(admin.host):
        log.warning(
            "the admin listener on %s is bound beyond loopback (--admin-host %s) and no "
            "control-plane keys are configured: anyone who reaches it can change membership",
            router.access.admin_url, admin.host,
        )  # fmt: skip
    state: dict[str, Any] = {}  # the lifespan's: every request of every door reads it
    stop = trio.Event()

    async def open_door(name: DoorName, nursery: trio.Nursery) -> list[str]:
        door = doors[name]
        trigger = trio.sleep_forever if door.outlives_drain else stop.wait
        serving = partial(
            serve_door, door, door_app(door, router), listening[name], trigger, state=state,
            data=data if name == "data" else None,
        )  # fmt: skip
        urls: list[str] = await nursery.start(serving)
        return urls

    async with trio.open_nursery() as nursery:
        # Always: besides the signals, the drain is how a process that gave up on itself
        # (`edge/supervision.py`) stops.
        nursery.start_soon(router.drain.run, stop, signals, parent_sentinel)
        for name in listening:
            if not doors[name].routed:
                await open_door(name, nursery)
        lifespan = run_lifespan(wrap_asgi(router, hc), hc, state)
        async with lifespan, trio.open_nursery() as drained:  # the doors the drain closes
            for name in listening:
                door = doors[name]
                if door.routed and name != "data":
                    await open_door(name, nursery if door.outlives_drain else drained)
            urls = await open_door("data", drained)  # the last: clients come now
            task_status.started(Serving(router, urls))
        nursery.cancel_scope.cancel(reason="served")  # the other doors end with the process


def door_app(door: Door, router: Router) -> Any:
    """What `door` serves of `router` (the side doors through door "admin": no CORS, no
    `Origin`)."""
    if door.name == "data":
        return router
    through_admin = partial(router.handle_http, door="admin")
    if door.name == "admin":
        return HttpOnly(through_admin)
    if door.name == "probes":
        return HttpOnly(probes_only(through_admin))
    return HttpOnly(metrics_page(router.metrics.render))


GC_THRESHOLDS = (20_000, 50, 100)  # Python's default is (700, 10, 10)


def tune_gc() -> None:
    """After startup: freeze what is alive (the app, imports, config) out of the collector's
    sight, and collect the youngest generation every 20,000 allocations instead of 700.

    Each request leaves short cycles behind (trio's cancellation exceptions and their
    tracebacks), so the collector ran every few requests; measured on the router-bound bench
    (c=32/c=256, four alternating runs each) CPU per request fell by about a fifth. A cycle
    that survives a young collection is then rarely freed, so nothing a request holds may wait
    for one: a refused body is freed by reference counting when its answer goes out (the
    answered error keeps no frames, `errors.without_frames`), which
    tests/router/test_containment4_memory.py checks with the collector off."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _serve_main(
    config: RouterConfig,
    listening: Mapping[DoorName, Sockets],
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
    parent_sentinel: int | None = None,
    ready: Any = None,
) -> int:
    """Serve one router process until it drained; its exit status (1: it gave up on itself)."""
    raise_soft_limit()  # before the cap is derived from it (`fd_budget.py`)
    async with trio.open_nursery() as nursery:
        serving: Serving = await nursery.start(
            partial(
                serve,
                config,
                listening=listening,
                signals=signals,
                parent_sentinel=parent_sentinel,
            )
        )
        log.info("trio-pd routing on %s", ", ".join(serving.urls))
        tune_gc()
        if ready is not None:
            ready.set()  # the parent may forward SIGTERM now: the drain handles it
    log.info("trio-pd stopped")
    return serving.router.drain.exit_status


def worker_main(
    config: RouterConfig, listening: dict[DoorName, Sockets], index: int, ready: Any
) -> None:
    """A router process of `--workers N` (spawned by `supervisor.Supervisor`), serving its
    copies of the doors' sockets (`listening`).

    It answers SIGTERM only: a terminal's Ctrl-C reaches the parent, which forwards SIGTERM
    (were SIGINT taken here too, one Ctrl-C would count as two signals). If the parent dies,
    the process drains and exits as on a signal.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(config.log_level, json_lines=config.log_json, log_dir=config.log_dir)
    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None else None
    status = trio.run(partial(_serve_main, config, listening, (signal.SIGTERM,), sentinel, ready))
    if status:
        sys.exit(status)  # the supervisor restarts a process that gave up on itself
