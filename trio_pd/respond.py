"""The client side of a request: ASGI response sending that knows whether bytes went out."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from trio_pd.errors import RouterError

Send = Callable[[dict[str, Any]], Awaitable[None]]
JSON_HEADERS = [(b"content-type", b"application/json")]
DONE_FRAME = b"data: [DONE]\n\n"
EVENT_ENDS = (b"\n\n", b"\r\n\r\n")  # what the last bytes of a whole SSE event are
CLIENT_GONE_STATUS = 499  # nginx's convention for "the client closed the request"


def final_status(responder: Responder) -> int:
    """The status a request ended with, as its metrics, access-log line and span all count it:
    what the client got once its answer was complete, 499 when the client left before."""
    if responder.finished and responder.status is not None:
        return responder.status
    return CLIENT_GONE_STATUS


@attrs.frozen
class Reply:
    """A whole (non-streamed) answer."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def error_reply(error: RouterError) -> Reply:
    return Reply(error.status, [*JSON_HEADERS, *error.headers], error.body())


@attrs.define(eq=False)
class Responder:
    """Sends one response; ``started`` tells retries and the outcome logic that bytes went out."""

    send_message: Send
    request_id: bytes
    cors: tuple[tuple[bytes, bytes], ...] = ()  # `cors.py`: on every answer, errors included
    started: bool = False
    finished: bool = False
    status: int | None = None
    audit: str = ""  # what a control-plane change did, for the audit log
    bytes_sent: int = 0  # body bytes, for the access log
    route_info: dict[str, object] = attrs.Factory(dict)  # workers, attempts: the access log
    # The SSE keep-alive (`edge/keepalive.py`) reads these: body writes begun and finished (a
    # write under way when they differ; counters, as no clock is read per chunk) and the last
    # chunk written (whether it ended an event is looked at only when a comment is due);
    # `early` is set once it sent the headers itself, before the answer's start (then `start`
    # sends nothing more, and an error reply becomes an in-band error event).
    writes: int = 0
    written: int = 0
    last_chunk: bytes = b"\n\n"
    early: bool = False

    @property
    def at_boundary(self) -> bool:
        """Whether the body written so far ends on a whole SSE event (or nothing was)."""
        return self.last_chunk.endswith(EVENT_ENDS)

    async def start_early(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Send a stream's 200 and `headers` before its answer is known (the keep-alive)."""
        self.early = True
        self.status = 200
        await self.send_message(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*headers, (b"x-request-id", self.request_id), *self.cors],
            }
        )

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        if self.early:  # the keep-alive sent 200 and the stream's headers already
            return
        self.status = status
        await self.send_message(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*headers, (b"x-request-id", self.request_id), *self.cors],
            }
        )

    async def send(self, chunk: bytes) -> None:
        if chunk:
            self.bytes_sent += len(chunk)
            self.last_chunk = chunk
            self.writes += 1
            await self.send_message(
                {"type": "http.response.body", "body": chunk, "more_body": True}
            )
            self.written += 1

    async def finish_stream(self, last: bytes) -> None:
        if not self.finished:
            self.finished = True
            self.bytes_sent += len(last)
            await self.send_message({"type": "http.response.body", "body": last})

    async def reply(self, reply: Reply) -> None:
        if self.early:  # the stream's 200 is out: the answer (an error envelope) is an event
            self.started = True
            data = reply.body.replace(b"\n", b"\ndata: ")  # a line break stays in the data
            self.route_info["inband_status"] = reply.status
            await self.finish_stream(b"data: " + data + b"\n\n" + DONE_FRAME)
            return
        headers = [*reply.headers, (b"content-length", str(len(reply.body)).encode())]
        await self.start(reply.status, headers)
        self.finished = True
        self.bytes_sent += len(reply.body)
        await self.send_message({"type": "http.response.body", "body": reply.body})

    async def error(self, error: RouterError, *, close: bool = False) -> None:
        """The envelope; `close`: and `Connection: close` (the request's body was not read)."""
        reply = error_reply(error)
        if close and not any(name == b"connection" for name, _ in reply.headers):
            reply = Reply(reply.status, [*reply.headers, (b"connection", b"close")], reply.body)
        await self.reply(reply)


WEBSOCKET_REFUSED = RouterError(
    400,
    "the router does not serve WebSocket; send the request without Upgrade",
    "invalid_request_error",
)


async def deny_websocket(send: Send) -> None:
    """Refuse a WebSocket handshake with the envelope (ASGI's `websocket.http.response`; else
    hypercorn answers an empty 500)."""
    reply = error_reply(WEBSOCKET_REFUSED)
    headers = [*reply.headers, (b"content-length", str(len(reply.body)).encode())]
    await send(
        {"type": "websocket.http.response.start", "status": reply.status, "headers": headers}
    )
    await send({"type": "websocket.http.response.body", "body": reply.body})
