"""Serving a Router with hypercorn's trio worker: one process, or several sharing the sockets.

Every mode runs `serve`: hypercorn's trio connection handling (`serving.py`, with a fair accept
loop) on sockets made here (so they get TCP_USER_TIMEOUT, see `make_sockets`) with the router's
drain as the shutdown trigger: the server drains through that trigger, never by having `serve`
cancelled from outside (`drain.py`).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import signal
import socket
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.utils import wrap_app

from trio_pd.app import Router
from trio_pd.config import RouterConfig
from trio_pd.logs import LogDirError
from trio_pd.logs import configure as configure_logging
from trio_pd.metrics_listener import MetricsListenError, bind_metrics, close_sockets, serve_metrics
from trio_pd.serving import serve_app

log = logging.getLogger("trio_pd.server")
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


async def serve(
    config: RouterConfig,
    *,
    router: Router | None = None,
    sockets: Sockets | None = None,
    metrics_sockets: Sockets | None = None,
    signals: tuple[int, ...] = (),
    parent_sentinel: int | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until drained (on one of `signals`, or the parent's death) or cancelled;
    ``task_status`` gets the bound URLs (port 0 picks a free one).

    With `config.prometheus_port` the metrics listener is bound first (as SMG does; a port it
    cannot have fails the start: MetricsListenError) and served until the router is done."""
    app = router if router is not None else Router(config)
    hc = hypercorn_config(config)
    if metrics_sockets is None and config.prometheus_port is not None:
        metrics_sockets = bind_metrics(config.prometheus_host, config.prometheus_port)
    if sockets is None:
        try:
            sockets = make_sockets(config, hc)
        except BaseException:
            if metrics_sockets is not None:
                close_sockets(metrics_sockets)
            raise
    for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
        sock.listen(hc.backlog)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        if signals or parent_sentinel is not None:
            nursery.start_soon(app.drain.run, stop, signals, parent_sentinel)
        if metrics_sockets is not None:  # until the router is done: it outlives the drain
            render = app.metrics.render
            await nursery.start(serve_metrics, render, metrics_sockets, trio.sleep_forever)
        wrapped = wrap_app(app, hc.wsgi_max_body_size, "asgi")
        await serve_app(wrapped, hc, sockets, stop.wait, task_status=task_status)
        nursery.cancel_scope.cancel(reason="served")


def run(config: RouterConfig) -> int:
    """Blocking entry point of `trio-pd serve`; the exit status. A start-up failure of the
    environment (a log directory, a port) exits with its reason, not a traceback."""
    try:
        configure_logging(config.log_level, json_lines=config.log_json, log_dir=config.log_dir)
        for warning in config.startup_warnings:
            log.warning("%s", warning)
        if config.workers <= 1:
            metrics_sockets = None
            if config.prometheus_port is not None:
                metrics_sockets = bind_metrics(config.prometheus_host, config.prometheus_port)
            trio.run(partial(_serve_main, config, metrics_sockets=metrics_sockets))
            return 0
        from trio_pd.processes import Supervisor

        return Supervisor(config).run()
    except (LogDirError, MetricsListenError) as exc:
        raise SystemExit(f"trio-pd serve: error: {exc}") from None


GC_THRESHOLDS = (20_000, 50, 100)  # Python's default is (700, 10, 10)


def tune_gc() -> None:
    """After startup: freeze what is alive (the app, imports, config) out of the collector's
    sight, and collect the youngest generation every 20,000 allocations instead of 700.

    Each request leaves short cycles behind (trio's cancellation exceptions and their
    tracebacks), so the collector ran every few requests; measured on the router-bound bench
    (c=32/c=256, four alternating runs each) CPU per request fell by about a fifth. Memory
    stays bounded: a young collection still runs every 20,000 net allocations."""
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
) -> None:
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            partial(
                serve,
                config,
                sockets=sockets,
                metrics_sockets=metrics_sockets,
                signals=signals,
                parent_sentinel=parent_sentinel,
            )
        )
        log.info("trio-pd routing on %s", ", ".join(urls))
        tune_gc()
        if ready is not None:
            ready.set()  # the parent may forward SIGTERM now: the drain handles it
    log.info("trio-pd stopped")


def worker_main(config: RouterConfig, sockets: Sockets, index: int, ready: Any) -> None:
    """A router process of `--workers N` (spawned by `processes.Supervisor`).

    It answers SIGTERM only: a terminal's Ctrl-C reaches the parent, which forwards SIGTERM
    (were SIGINT taken here too, one Ctrl-C would count as two signals). If the parent dies,
    the process drains and exits as on a signal.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(config.log_level, json_lines=config.log_json, log_dir=config.log_dir)
    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None else None
    trio.run(partial(_serve_main, config, sockets, (signal.SIGTERM,), sentinel, ready))
