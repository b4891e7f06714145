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
import sys
from functools import partial
from typing import Any

import trio
from hypercorn.config import Sockets

from trio_pd.config import RouterConfig
from trio_pd.edge.router import Router
from trio_pd.observe.logs import configure as configure_logging
from trio_pd.serve.accept import ConnectionCap, serve_app, wrap_asgi
from trio_pd.serve.admin_listener import admin_url, bind_admin, serve_admin
from trio_pd.serve.fd_budget import client_connection_cap, raise_soft_limit
from trio_pd.serve.listeners import (
    client_timeouts,
    close_sockets,
    hypercorn_config,
    make_sockets,
)
from trio_pd.serve.metrics_listener import bind_metrics, serve_metrics
from trio_pd.serve.probe_listener import bind_probes, serve_probes

log = logging.getLogger(__name__)


async def serve(
    config: RouterConfig,
    *,
    router: Router | None = None,
    sockets: Sockets | None = None,
    metrics_sockets: Sockets | None = None,
    admin_sockets: Sockets | None = None,
    probe_sockets: Sockets | None = None,
    signals: tuple[int, ...] = (),
    parent_sentinel: int | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until drained (on one of `signals`, or the parent's death) or cancelled;
    ``task_status`` gets the data plane's bound URLs (port 0 picks a free one).

    With `config.prometheus_port` the metrics listener, and with `config.admin_port` the admin
    listener, and with `config.edges.health_check_port` the probe listener, are bound first (a
    port they cannot have fails the start: MetricsListenError, AdminListenError,
    ProbeListenError) and served until the router is done: they outlive the drain."""
    app = router if router is not None else Router(config)
    hc = hypercorn_config(config)
    side: list[Sockets] = []
    try:
        if metrics_sockets is None and config.prometheus_port is not None:
            metrics_sockets = bind_metrics(config.prometheus_host, config.prometheus_port)
        side += [metrics_sockets] if metrics_sockets is not None else []
        if admin_sockets is None and config.admin_port is not None:
            admin_sockets = bind_admin(config.admin_host, config.admin_port)[0]
        side += [admin_sockets] if admin_sockets is not None else []
        probe_port = config.edges.health_check_port
        if probe_sockets is None and probe_port is not None:
            probe_sockets = bind_probes(config.host, probe_port)[0]
        side += [probe_sockets] if probe_sockets is not None else []
        if sockets is None:
            sockets = make_sockets(config, hc)
    except BaseException:
        for made in side:
            close_sockets(made)
        raise
    listening = [*sockets.secure_sockets, *sockets.insecure_sockets]
    for sock in listening:
        sock.listen(hc.backlog)
    if admin_sockets is not None:
        app.access.admin_url = admin_url(admin_sockets)
    # A worker URL naming any of these is the router itself (`upstream/destinations.py`).
    for bound in (sockets, metrics_sockets, admin_sockets, probe_sockets):
        if bound is not None:
            app.destinations.add_own_sockets((*bound.secure_sockets, *bound.insecure_sockets))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        # Always: besides the signals, the drain is how a process that gave up on itself
        # (`edge/supervision.py`) stops.
        nursery.start_soon(app.drain.run, stop, signals, parent_sentinel)
        if metrics_sockets is not None:  # until the router is done: it outlives the drain
            render = app.metrics.render
            await nursery.start(serve_metrics, render, metrics_sockets, trio.sleep_forever)
        wrapped = wrap_asgi(app, hc)

        # The probe, admin and metrics listeners keep the descriptors the cap leaves over.
        limit = client_connection_cap(config.edges.max_client_connections)
        cap = ConnectionCap(limit, app.metrics.connections_refused.inc)

        async def data_plane(task_status: trio.TaskStatus[list[str]]) -> None:
            await serve_app(
                wrapped, hc, sockets, stop.wait, http2=config.enable_http2,
                timeouts=client_timeouts(config), cap=cap, task_status=task_status,
            )  # fmt: skip
            nursery.cancel_scope.cancel(reason="served")  # the side listeners end with it

        urls = await nursery.start(data_plane)  # the lifespan has started
        if admin_sockets is not None:  # until the router is done, as the metrics listener
            await nursery.start(serve_admin, app, admin_sockets, trio.sleep_forever)
        if probe_sockets is not None:  # the same: probes answer through the drain
            await nursery.start(serve_probes, app, probe_sockets, trio.sleep_forever)
        task_status.started(urls)


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
    sockets: Sockets | None = None,
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
    parent_sentinel: int | None = None,
    ready: Any = None,
    *,
    metrics_sockets: Sockets | None = None,
    admin_sockets: Sockets | None = None,
    probe_sockets: Sockets | None = None,
) -> int:
    """Serve one router process until it drained; its exit status (1: it gave up on itself)."""
    raise_soft_limit()  # before the cap is derived from it (`fd_budget.py`)
    router = Router(config)
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            partial(
                serve,
                config,
                router=router,
                sockets=sockets,
                metrics_sockets=metrics_sockets,
                admin_sockets=admin_sockets,
                probe_sockets=probe_sockets,
                signals=signals,
                parent_sentinel=parent_sentinel,
            )
        )
        log.info("trio-pd routing on %s", ", ".join(urls))
        tune_gc()
        if ready is not None:
            ready.set()  # the parent may forward SIGTERM now: the drain handles it
    log.info("trio-pd stopped")
    return router.drain.exit_status


def worker_main(
    config: RouterConfig,
    sockets: Sockets,
    index: int,
    ready: Any,
    admin_sockets: Sockets | None = None,
    probe_sockets: Sockets | None = None,
) -> None:
    """A router process of `--workers N` (spawned by `supervisor.Supervisor`).

    It answers SIGTERM only: a terminal's Ctrl-C reaches the parent, which forwards SIGTERM
    (were SIGINT taken here too, one Ctrl-C would count as two signals). If the parent dies,
    the process drains and exits as on a signal.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(config.log_level, json_lines=config.log_json, log_dir=config.log_dir)
    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None else None
    main = partial(_serve_main, config, sockets, (signal.SIGTERM,), sentinel, ready)
    status = trio.run(partial(main, admin_sockets=admin_sockets, probe_sockets=probe_sockets))
    if status:
        sys.exit(status)  # the supervisor restarts a process that gave up on itself
