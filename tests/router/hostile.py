"""A hostile worker for router tests: a few lines of raw trio HTTP/1.1 on 127.0.0.1.

It answers every GET (health checks, server info) with `200 {}` and hands every POST to a
script, which writes whatever bytes it likes: an SSE event that never ends, a deeply nested
answer, a stream to a request that asked for none. It records what it was sent and when each
connection closed, so a test can check what the worker saw, not only what the client got.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import attrs
import trio

OK_JSON = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def json_answer(body: bytes, status: bytes = b"200 OK") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


@attrs.define(eq=False)
class Posted:
    """One POST the worker received, and the connection's fate."""

    path: str
    body: bytes
    closed: trio.Event = attrs.Factory(trio.Event)


Script = Callable[[Posted, trio.SocketStream], Awaitable[None]]


@attrs.define(eq=False)
class HostileWorker:
    script: Script
    port: int = 0
    posts: list[Posted] = attrs.Factory(list)
    bootstrap_port: int | None = None  # none: a fake prefill's KV goes nowhere

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, stream: trio.SocketStream) -> None:
        buffer = b""
        current: Posted | None = None
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, target, _ = lines[0].split(b" ", 2)
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buffer) < length:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buffer += data
                body, buffer = buffer[:length], buffer[length:]
                if method != b"POST":
                    await stream.send_all(OK_JSON)
                    continue
                current = Posted(target.decode(), body)
                self.posts.append(current)
                await self.script(current, stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if current is not None:
                current.closed.set()
            stream.socket.close()


async def start_hostile(nursery: trio.Nursery, script: Script) -> HostileWorker:
    worker = HostileWorker(script)
    listeners = await nursery.start(partial(trio.serve_tcp, worker.handle, 0, host="127.0.0.1"))
    worker.port = listeners[0].socket.getsockname()[1]
    return worker


async def answer_ok(posted: Posted, stream: trio.SocketStream) -> None:
    """A prefill that succeeds at once (its KV cache is of no interest to a fake decode)."""
    await stream.send_all(json_answer(b'{"text":"","meta_info":{"id":"p"}}'))


async def until_closed(stream: trio.SocketStream) -> None:
    """Wait until the router closes the connection (its reads return nothing)."""
    try:
        while await stream.receive_some(65536):
            pass
    except trio.BrokenResourceError:
        pass


async def hang(posted: Posted, stream: trio.SocketStream) -> None:
    """A worker that never answers (until the router closes the connection)."""
    await until_closed(stream)
