"""Serving a Router with hypercorn's trio worker: one process, or several sharing the sockets."""

from __future__ import annotations

import logging
import multiprocessing
import signal
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from trio_pd.app import Router
from trio_pd.config import RouterConfig
from trio_pd.logs import configure as configure_logging

log = logging.getLogger("trio_pd.server")
KEEP_ALIVE_SECS = 5.0  # hypercorn holds a closed client socket (CLOSE_WAIT) until this runs out
GRACEFUL_SECS = 30.0  # in-flight requests get this long to finish on shutdown


def hypercorn_config(config: RouterConfig) -> HypercornConfig:
    hc = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    if config.prometheus_port is not None:
        # The same app on a second port: scrapers reach /metrics there, as with SGLang's router.
        hc.bind.append(f"{host}:{config.prometheus_port}")
    hc.keep_alive_timeout = KEEP_ALIVE_SECS
    hc.graceful_timeout = GRACEFUL_SECS
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.backlog = 4096
    return hc


async def serve(
    config: RouterConfig,
    *,
    router: Router | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; ``task_status`` gets the bound URLs (port 0 picks a free one)."""
    app = router if router is not None else Router(config)
    await hypercorn_serve(app, hypercorn_config(config), task_status=task_status)


async def wait_for_signal() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


def run(config: RouterConfig) -> None:
    """Blocking entry point of `trio-pd serve`."""
    configure_logging(config.log_level)
    if config.workers <= 1:
        trio.run(partial(_serve_until_signal, config))
        return
    _run_workers(config)


async def _serve_until_signal(config: RouterConfig) -> None:
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(partial(serve, config))
        log.info("trio-pd routing on %s", ", ".join(urls))
        await wait_for_signal()
        log.info("shutting down")
        nursery.cancel_scope.cancel()


def _run_workers(config: RouterConfig) -> None:
    """Several processes accept on the same sockets, each with its own trio loop and pool."""
    hc = hypercorn_config(config)
    sockets = hc.create_sockets()
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


def _worker_main(config: RouterConfig, sockets: object) -> None:
    configure_logging(config.log_level)
    hc = hypercorn_config(config)
    for sock in sockets.insecure_sockets:  # type: ignore[attr-defined]
        sock.listen(hc.backlog)
    app = wrap_app(Router(config), hc.wsgi_max_body_size, "asgi")
    trio.run(partial(worker_serve, app, hc, sockets=sockets, shutdown_trigger=wait_for_signal))
