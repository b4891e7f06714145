"""Serving a Router with hypercorn's trio worker: one process, or several sharing the sockets.

Every mode runs `serve`: hypercorn's `worker_serve` on sockets made here (so they get
TCP_USER_TIMEOUT, see `make_sockets`) with the router's drain as `shutdown_trigger`: hypercorn
drains through that trigger, never by having `serve` cancelled from outside (`drain.py`).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from trio_pd.app import Router
from trio_pd.config import RouterConfig
from trio_pd.logs import configure as configure_logging

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
    if config.prometheus_port is not None:
        # Scrapers get /metrics there, and only that (Router.__call__), over plain HTTP.
        metrics_bind = f"{host}:{config.prometheus_port}"
        (hc.insecure_bind if config.tls_cert_path else hc.bind).append(metrics_bind)
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
    signals: bool = False,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until drained (``signals``: on SIGTERM/SIGINT) or cancelled; ``task_status`` gets
    the bound URLs (port 0 picks a free one)."""
    app = router if router is not None else Router(config)
    hc = hypercorn_config(config)
    if sockets is None:
        sockets = make_sockets(config, hc)
    for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
        sock.listen(hc.backlog)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        if signals:
            nursery.start_soon(app.drain.run_signals, stop)
        wrapped = wrap_app(app, hc.wsgi_max_body_size, "asgi")
        await worker_serve(
            wrapped, hc, sockets=sockets, shutdown_trigger=stop.wait, task_status=task_status
        )
        nursery.cancel_scope.cancel(reason="served")


def run(config: RouterConfig) -> None:
    """Blocking entry point of `trio-pd serve`."""
    configure_logging(config.log_level)
    if config.workers <= 1:
        trio.run(partial(_serve_main, config))
        return
    _run_workers(config)


async def _serve_main(config: RouterConfig, sockets: Sockets | None = None) -> None:
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(partial(serve, config, sockets=sockets, signals=True))
        log.info("trio-pd routing on %s", ", ".join(urls))
    log.info("trio-pd stopped")


def _run_workers(config: RouterConfig) -> None:
    """Several processes accept on the same sockets, each with its own trio loop and pool."""
    hc = hypercorn_config(config)
    sockets = make_sockets(config, hc)
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_worker_main, args=(config, sockets), daemon=False)
        for _ in range(config.workers)
    ]
    for process in processes:
        process.start()
    log.info("trio-pd routing on %s:%d with %d workers", config.host, config.port, config.workers)

    def forward(signum: int, frame: object) -> None:
        for process in processes:
            if process.is_alive() and process.pid is not None:
                process.terminate()

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for process in processes:
        process.join()
    for sock in sockets.insecure_sockets:
        sock.close()


def _worker_main(config: RouterConfig, sockets: Sockets) -> None:
    configure_logging(config.log_level)
    trio.run(partial(_serve_main, config, sockets))
