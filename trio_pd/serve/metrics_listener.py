"""`--prometheus-port` and `--prometheus-host`: `/metrics` and nothing else, on its own listener.

SMG 0.3.2 always starts its Prometheus exporter (default 0.0.0.0:29000) before anything else and
panics when the port cannot be bound (`observability/metrics.rs: start_prometheus`, `.expect`):
the router does not start. trio_pd fails the same way, with a clear message instead of a panic
(`bind_metrics` raises MetricsListenError before any other socket or process exists): a router
that runs without the metrics its operators scrape would be found out only when they are needed.

The listener is not part of the data-plane server, so it keeps answering while the router drains
(the drain closes the main sockets at once) and closes only when the process is done: the scrape
that shows a drain's last requests still succeeds. Scrapers get plain HTTP (also with
`--tls-cert-path`), `GET /metrics` and a JSON 404/405 for anything else.

One process serves it from its own trio run (`server.serve`); with `--workers N` the supervising
parent serves it from a thread (`MetricsThread`) with the sum over the processes read from the
multiprocess directory, so it stays up while a router process restarts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable
from functools import partial

import trio
from hypercorn.config import Sockets

from trio_pd.asgi import Receive, Scope, Send
from trio_pd.errors import method_not_allowed, not_found
from trio_pd.observe.metrics import CONTENT_TYPE
from trio_pd.respond import Reply, Responder, deny_websocket
from trio_pd.serve.accept import bound_url, serve_app, wrap_asgi
from trio_pd.serve.listeners import (
    SIDE_GRACE_SECS,
    bind_one,
    close_sockets,
    side_listener_config,
    where,
)

log = logging.getLogger(__name__)
THREAD_START_SECS = 10.0

Render = Callable[[], bytes]


class MetricsListenError(Exception):
    """The metrics listener cannot be bound (the port is taken, the address is not ours)."""


def bind_metrics(host: str, port: int) -> Sockets:
    """A listening socket for the metrics listener, bound now; port 0 picks a free one."""
    try:
        sock = bind_one(host, port)
    except OSError as exc:
        hint = " (--prometheus-port, --prometheus-host)"
        message = f"cannot listen for metrics on {where(host, port)}: {exc}{hint}"
        raise MetricsListenError(message) from exc
    return Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[])


class MetricsOnlyApp:
    """The ASGI app of the listener: `GET /metrics` rendered by `render`, 404/405 otherwise."""

    def __init__(self, render: Render) -> None:
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] == "websocket":
            await deny_websocket(send)
        if scope["type"] != "http":
            return
        responder = Responder(send, uuid.uuid4().hex.encode())
        if scope["path"] != "/metrics":
            await responder.error(not_found(scope["path"]))
        elif scope["method"] != "GET":
            await responder.error(method_not_allowed(scope["method"], "/metrics", ("GET",)))
        else:
            await responder.reply(Reply(200, [(b"content-type", CONTENT_TYPE)], self.render()))


async def serve_metrics(
    render: Render,
    sockets: Sockets,
    shutdown_trigger: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `render()` on `sockets` until `shutdown_trigger` returns (or cancelled)."""
    hc = side_listener_config()
    app = wrap_asgi(MetricsOnlyApp(render), hc)
    urls = [bound_url(sock, None) for sock in sockets.insecure_sockets]
    log.info("metrics on %s", ", ".join(f"{url}/metrics" for url in urls))  # already listening
    await serve_app(app, hc, sockets, shutdown_trigger, task_status=task_status)


class MetricsThread:
    """The supervisor's listener (`--workers N`): its own trio run in a daemon thread.

    The parent's main thread waits on its children with `multiprocessing`, not trio; a thread
    keeps the listener independent of it. `render` must be thread-safe (the parent's renders
    the multiprocess files, which the children write)."""

    def __init__(self, render: Render, sockets: Sockets) -> None:
        self.render = render
        self.sockets = sockets
        self.urls: list[str] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._up = threading.Event()
        self._thread = threading.Thread(target=self._main, name="trio-pd-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._up.wait(THREAD_START_SECS):
            raise MetricsListenError("the metrics listener did not start")

    def stop(self) -> None:
        token, stop = self._token, self._stop
        if token is not None and stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(stop.set, trio_token=token)
        self._thread.join(SIDE_GRACE_SECS + 5)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except Exception:
            log.exception("the metrics listener failed")
        finally:
            self._up.set()  # (also when it failed before it was up: start() must not hang)
            close_sockets(self.sockets)

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.urls = await nursery.start(
                partial(serve_metrics, self.render, self.sockets, self._stop.wait)
            )
            self._up.set()
