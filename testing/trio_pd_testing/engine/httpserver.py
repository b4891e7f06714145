"""Serves an ASGI app with hypercorn's HTTP/1.1 machinery over a listener we own.

hypercorn.trio.serve() hides the accepted sockets, but the simulator needs them: to count open
client connections exactly (EngineHandle.open_connections) and to drop a connection without any
response (the `close` fault; raising from an ASGI app makes hypercorn answer 500 instead). So this
module runs its own accept loop (trio.serve_listeners) and hands each accepted stream to
hypercorn's per-connection TCPServer, the same object hypercorn.trio.serve uses. Cancelling the
surrounding scope closes the listener and every connection.

HTTPS: given an SSLContext, each accepted stream is wrapped in a trio.SSLStream before TCPServer
gets it (TCPServer runs the handshake, and a failed one just ends the connection). The registry
keeps the raw TCP stream, so `drop` still closes the socket without any TLS goodbye.
"""

from __future__ import annotations

import logging
import socket as stdlib_socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, cast

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIFramework

log = logging.getLogger("trio_pd_testing.engine.http")
ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class ConnectionRegistry:
    """Open client connections of one listener, keyed by the peer address (ASGI scope 'client')."""

    def __init__(self) -> None:
        self._streams: dict[tuple[str, int], trio.SocketStream] = {}
        self.total = 0  # connections accepted since start
        self._changed = trio.Event()
        self.dead = False  # the engine died (`EngineState.die`): connections close on accept

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, stream: trio.SocketStream) -> tuple[str, int] | None:
        try:
            peer = stream.socket.getpeername()[:2]
        except OSError:
            return None
        self._streams[peer] = stream
        self.total += 1
        self._notify()
        return peer

    def discard(self, peer: tuple[str, int] | None) -> None:
        if peer is not None and self._streams.pop(peer, None) is not None:
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_count(self, count: int) -> None:
        """Return once exactly `count` connections are open."""
        while len(self._streams) != count:
            await self._changed.wait()

    async def drop(self, client: Any) -> bool:
        """Close the client's TCP connection at once, without sending anything (a FIN).

        hypercorn's reader then sees ClosedResourceError and winds the connection down; the
        client sees the connection end without a response (httpx: RemoteProtocolError).
        """
        if not client:
            return False
        stream = self._streams.get((client[0], client[1]))
        if stream is None:
            return False
        await stream.aclose()
        return True

    async def drop_all(self) -> int:
        """Close every open connection at once (a dead engine's); how many there were."""
        streams = list(self._streams.values())
        for stream in streams:
            await stream.aclose()
        return len(streams)


def hypercorn_config(keep_alive_secs: float, log_level: str = "warning") -> Config:
    config = Config()
    config.keep_alive_timeout = keep_alive_secs
    config.accesslog = None
    config.errorlog = logging.getLogger("trio_pd_testing.engine.hypercorn")
    config.loglevel = log_level.upper()
    return config


async def serve_asgi(
    app: ASGIApp,
    host: str,
    port: int,
    registry: ConnectionRegistry,
    *,
    keep_alive_secs: float = 5.0,
    listen: bool = True,
    ssl_context: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on host:port (0 = ephemeral); reports the bound port through task_status.

    listen=False binds the port but never listens on it, so clients get "connection refused"
    (the `refuse` fault) while the port number stays reserved.
    """
    if not listen:
        sock = stdlib_socket.socket(stdlib_socket.AF_INET, stdlib_socket.SOCK_STREAM)
        try:
            # Like trio's listeners: rebinding a port whose old connections sit in TIME_WAIT works.
            sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            task_status.started(sock.getsockname()[1])
            await trio.sleep_forever()
        finally:
            sock.close()
    config = hypercorn_config(keep_alive_secs)
    wrapped = ASGIWrapper(cast(ASGIFramework, app))  # a bare ASGI app with dict-typed scopes
    context = WorkerContext(None)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]

    async def handle(stream: trio.SocketStream) -> None:
        if registry.dead:  # a dead engine: the connection ends before a byte is read
            await stream.aclose()
            return
        peer = registry.add(stream)
        served: trio.abc.Stream = stream
        if ssl_context is not None:
            served = trio.SSLStream(stream, ssl_context, server_side=True, https_compatible=True)
        try:
            # TCPServer reads and writes any trio Stream; it types the TLS case only.
            await TCPServer(
                wrapped, config, context, {}, cast(trio.SSLStream[trio.SocketStream], served)
            )
        except Exception as exc:
            # One broken connection must not take the engine down: hypercorn 0.18 can raise
            # trio.BusyResourceError when an HTTP/2 prior-knowledge probe (SGLang's router sends
            # gRPC health probes) closes mid-send.
            log.warning("connection from %s ended with %r", peer, exc)
        finally:
            registry.discard(peer)
            await stream.aclose()  # TCPServer leaves it open after a failed TLS handshake

    try:
        async with trio.open_nursery() as nursery:
            task_status.started(bound)
            await trio.serve_listeners(handle, listeners, handler_nursery=nursery)
    finally:
        for listener in listeners:
            with trio.CancelScope(shield=True):
                await listener.aclose()
