"""The paced streams' client, in its own process: N keep-alive connections (uvloop +
httptools), each running one SSE stream after another and counting the events it receives in
shared counters (EVENTS, STREAMS, ERRORS, STARTED; STOP ends it). The server paces the events."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

import httptools
import orjson

from bench.harness.procs import HOST

STREAM_BODY = {
    "text": "Tell me a long story",
    "sampling_params": {"max_new_tokens": 64},
    "stream": True,
}
EVENTS, STREAMS, ERRORS, STARTED, STOP = range(5)


class _PacedStream(asyncio.Protocol):
    """One keep-alive connection running one stream after another, counting SSE events."""

    def __init__(self, request: bytes, counters: Any, done: asyncio.Future[None]) -> None:
        self.request = request
        self.counters = counters
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.pending = b""
        self.status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.send()

    def send(self) -> None:
        assert self.transport is not None
        if self.counters[STOP]:
            self.transport.close()
            return
        self.pending = b""
        self.counters[STARTED] += 1
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.counters[ERRORS] += 1
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        data = self.pending + body
        if b"\n\n" not in data:
            self.pending = data
            return
        *events, self.pending = data.split(b"\n\n")
        n = 0
        for event in events:
            if event.startswith(b"data:") and b"[DONE]" not in event[:16]:
                n += 1
        self.counters[EVENTS] += n

    def on_message_complete(self) -> None:
        if self.status == 200:
            self.counters[STREAMS] += 1
        else:
            self.counters[ERRORS] += 1
        self.parser = httptools.HttpResponseParser(self)
        self.send()


async def _paced_main(port: int, path: str, streams: int, counters: Any) -> None:
    body = orjson.dumps(STREAM_BODY)
    request = (
        f"POST {path} HTTP/1.1\r\nhost: {HOST}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()

    async def one() -> None:
        while not counters[STOP]:
            done: asyncio.Future[None] = loop.create_future()
            try:
                await loop.create_connection(
                    partial(_PacedStream, request, counters, done), HOST, port
                )
            except OSError:
                counters[ERRORS] += 1
                await asyncio.sleep(0.05)
                continue
            await done
            if not counters[STOP]:  # the router closed the connection
                counters[ERRORS] += 1
                await asyncio.sleep(0.01)

    tasks = [asyncio.ensure_future(one()) for _ in range(streams)]
    while not counters[STOP]:  # noqa: ASYNC110 - the flag is set by another process
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def client(port: int, path: str, streams: int, counters: Any) -> None:
    """The client process: `streams` connections, one stream after another on each."""
    import uvloop

    uvloop.run(_paced_main(port, path, streams, counters))
