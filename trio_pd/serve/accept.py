"""Running the router's ASGI app on hypercorn's trio connection handling, with a fair accept loop.

This is hypercorn's own trio worker (`hypercorn.trio.run.worker_serve`: lifespan startup, one
handler per connection, a `shutdown_trigger`, a graceful timeout for the connections still open,
lifespan shutdown) with three changes. The lifespan is run once per process around every door
(`run_lifespan`), not once per listener, and each door's requests see its state. Each
connection is served by `connection.Connection` (hypercorn's TCPServer with strict HTTP/1.1,
and HTTP/2 off unless asked). And the accept loop:
`trio.serve_listeners` accepts one connection per turn of the scheduler; on a busy router a turn
runs every ready task, so 256 connections arriving together waited up to ~2 s for their turn to
be accepted (the p99 of a c=256 run of the bare stack was 1.3 s against a p50 of 0.3 s). Here
each wake-up of a listening socket accepts everything that is waiting (up to `ACCEPT_BURST`),
measured: p99 0.31 s, and 25 % more requests per second at c=256.

Draining still goes through the shutdown trigger: it stops the accept loops and closes the
listening sockets (new connections are refused), marks the worker context terminated (hypercorn
then closes idle keep-alive connections and answers no further request on a connection once its
current response is done), and gives the connections still open `graceful_timeout` to finish.
A connection whose handler fails is logged and closed; it never takes the server down.

With a `ConnectionCap` (the data plane's: `--max-client-connections`, `fd_budget.py`) a
connection accepted while the cap's count is open is refused on the spot, in the accept loop:
what the client already sent is read (so the close is a FIN, not a reset that could discard
the answer), a fixed 503 envelope with `Connection: close` is written without waiting (TLS
connections are closed without it: no handshake is spent on them), and the socket is closed.
It costs no task, no timer and no descriptor past that moment (issue 26, N6).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, cast

import attrs
import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ASGIFramework, ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app

from trio_pd.errors import error_body
from trio_pd.serve.connection import ClientTimeouts, Connection

log = logging.getLogger(__name__)
REFUSED_BODY = error_body(
    "too many client connections are open (--max-client-connections); retry",
    "service_unavailable",
    503,
)
REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n" % len(REFUSED_BODY)
) + REFUSED_BODY
REFUSAL_LOG_SECS = 10.0  # one warning line at most this often while connections are refused
ACCEPT_BURST = 512  # connections accepted per wake-up of a listening socket, at most
# Out of file descriptors or memory: wait a little before accepting again (as trio does).
RESOURCE_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
RESOURCE_PAUSE_SECS = 0.1


@attrs.define(eq=False)
class ConnectionCap:
    """At most `limit` connections of a server open at once; `refused` is called for each one
    turned away (the data plane counts them in a metric)."""

    limit: int
    refused: Callable[[], None] = lambda: None
    open: int = 0
    _unlogged: int = 0
    _logged_at: float = -math.inf

    def turn_away(self) -> None:
        self.refused()
        self._unlogged += 1
        now = trio.current_time()
        if now - self._logged_at >= REFUSAL_LOG_SECS:
            log.warning(
                "refused %d client connection(s): %d open (--max-client-connections %d)",
                self._unlogged, self.open, self.limit,
            )  # fmt: skip
            self._unlogged, self._logged_at = 0, now


def refuse(conn: socket.socket, tls: bool) -> None:
    """Answer a connection over the cap with the 503 (plain HTTP only) and close it, never
    waiting: a client that is not reading gets what fits in its socket buffer."""
    try:
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.recv(65536)  # read what came, so that the close is not a reset
        if not tls:
            with contextlib.suppress(OSError):
                conn.send(REFUSED)
    finally:
        conn.close()


def wrap_asgi(app: object, config: Config) -> AppWrapper:
    """hypercorn's wrapper for a bare ASGI app. Our apps type their scope as a plain dict, where
    hypercorn's types name every scope and event: the cast says they are the same callable."""
    return wrap_app(cast(ASGIFramework, app), config.wsgi_max_body_size, "asgi")


async def serve_app(
    app: Any,
    config: Config,
    sockets: Sockets,
    shutdown_trigger: Callable[[], Awaitable[None]],
    *,
    state: dict[str, Any] | None = None,
    http2: bool = False,
    timeouts: ClientTimeouts | None = None,
    cap: ConnectionCap | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` (already wrapped by `wrap_asgi`) on `sockets` until
    `shutdown_trigger` returns; `task_status` gets the bound URLs. Connections are served by
    `connection.Connection` (strict HTTP/1.1; HTTP/2 only with `http2`; its head and idle
    bounds `timeouts`, by default the header bound's default and the config's keep-alive);
    with `cap`, at most that many at once. Every request's scope gets a copy of `state` as it
    is when the request comes (the app's lifespan runs elsewhere, once: `run_lifespan`)."""
    if timeouts is None:
        timeouts = ClientTimeouts(idle_secs=config.keep_alive_timeout)
    config.set_statsd_logger_class(StatsdLogger)
    context = WorkerContext(None)
    async with trio.open_nursery() as connections:
        shared = ConnectionState(state if state is not None else {})  # not a copy: see above
        handler = partial(Connection, app, config, context, shared, http2=http2, timeouts=timeouts)
        ssl_context = config.create_ssl_context()
        listening = [(s, ssl_context) for s in sockets.secure_sockets]
        listening += [(s, None) for s in sockets.insecure_sockets]
        try:
            async with trio.open_nursery() as accepting:
                for sock, tls in listening:
                    accepting.start_soon(accept_in_bursts, sock, tls, handler, connections, cap)
                task_status.started([bound_url(sock, tls) for sock, tls in listening])
                await shutdown_trigger()
                accepting.cancel_scope.cancel(reason="shutdown trigger")
        finally:
            for sock, _ in listening:
                sock.close()  # new connections are refused from now on
            await context.terminated.set()
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout


@asynccontextmanager
async def run_lifespan(app: Any, config: Config, state: dict[str, Any]) -> AsyncIterator[None]:
    """hypercorn's lifespan protocol around the body: startup before, shutdown after. The app
    fills `state` at startup (the ASGI lifespan state, which every request's scope copies)."""
    config.set_statsd_logger_class(StatsdLogger)
    lifespan = Lifespan(app, config, state)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        yield
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel(reason="lifespan done")


def bound_url(sock: socket.socket, tls: ssl.SSLContext | None) -> str:
    address = repr_socket_addr(sock.family, sock.getsockname())
    return f"{'https' if tls else 'http'}://{address}"


async def accept_in_bursts(
    sock: socket.socket,
    tls: ssl.SSLContext | None,
    handler: Callable[[Any], Any],
    connections: trio.Nursery,
    cap: ConnectionCap | None = None,
) -> None:
    """Accept every connection waiting on `sock` each time it is readable; past `cap`, refuse
    each at once."""
    sock.setblocking(False)
    while True:
        await trio.lowlevel.wait_readable(sock)
        for _ in range(ACCEPT_BURST):
            try:
                conn, _ = sock.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno not in RESOURCE_ERRORS:
                    raise
                log.error("cannot accept connections (%s); pausing", exc.strerror)
                await trio.sleep(RESOURCE_PAUSE_SECS)
                break
            if cap is not None and cap.open >= cap.limit:
                refuse(conn, tls is not None)
                cap.turn_away()
                continue
            conn.setblocking(False)
            stream: Any = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
            if tls is not None:
                stream = trio.SSLStream(stream, tls, server_side=True, https_compatible=True)
            if cap is not None:
                cap.open += 1
            connections.start_soon(run_connection, handler, stream, cap)
        await trio.lowlevel.checkpoint()  # between bursts, everyone else gets a turn


async def run_connection(
    handler: Callable[[Any], Any], stream: Any, cap: ConnectionCap | None = None
) -> None:
    try:
        await handler(stream)
    except Exception:
        log.exception("a client connection ended with an error")
    finally:
        try:
            await trio.aclose_forcefully(stream)
        finally:
            if cap is not None:
                cap.open -= 1
