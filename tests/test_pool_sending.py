"""`UpstreamPool.post(..., sending=...)`: the point from which an engine may hold a request.

The router asks an engine to abort only legs whose request may have reached it (`Leg.posted`).
A leg cancelled while its connection is still being made wrote nothing, so it needs no abort:
in a storm of prefills failing in a millisecond most decode legs are cancelled that early
(docs/benchmarks.md, "Aborts at storm rate"), and aborting them all would cost an abort POST
each for requests no engine ever saw.
"""

from __future__ import annotations

import socket
from functools import partial

import trio

from trio_pd.upstream.pool import UpstreamPool


def stuffed_listener() -> tuple[socket.socket, list[socket.socket]]:
    """A listener that never accepts, its accept queue full: the kernel drops new SYNs, so a
    connect to it hangs (until the first SYN retransmission, 1 s later)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(listener.getsockname())
        fillers.append(filler)
    return listener, fillers


async def test_a_post_cancelled_while_connecting_never_reaches_sending() -> None:
    listener, fillers = stuffed_listener()
    host, port = listener.getsockname()
    pool = UpstreamPool(connect_timeout=30)
    calls = []
    try:
        with trio.move_on_after(0.5) as scope:
            async with pool.post(
                f"http://{host}:{port}", "/generate", [], b"{}", lambda: calls.append(1)
            ):
                pass
        assert scope.cancelled_caught  # the connect really hung: cancelled inside post
        assert calls == []
    finally:
        await pool.aclose()
        for sock in (listener, *fillers):
            sock.close()


async def test_sending_is_called_once_before_the_request_is_written(nursery: trio.Nursery) -> None:
    order: list[str] = []
    served = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        data = await stream.receive_some(65536)
        order.append("engine got bytes" if data else "engine got nothing")
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        served.set()

    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    pool = UpstreamPool()
    try:
        async with pool.post(
            f"http://127.0.0.1:{port}", "/generate", [], b"{}", lambda: order.append("sending")
        ) as response:
            assert await response.read() == b"{}"
        await served.wait()
    finally:
        await pool.aclose()
    assert order == ["sending", "engine got bytes"]
