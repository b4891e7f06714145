"""Small ASGI helpers: reading the body, JSON / SSE responses, watching for a disconnect."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import trio

MAX_BODY = 64 * 1024 * 1024

JSON = b"application/json"
SSE = b"text/event-stream"


ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}


def error_body(message: str, code: int) -> dict[str, Any]:
    """The envelope of the simulator's own errors and injected faults (no engine sends it)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(code, "Error"), "code": code}}


class BodyTooLarge(Exception):
    pass


async def read_body(receive: Any, limit: int = MAX_BODY) -> bytes | None:
    """The whole request body, or None if the client went away first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class Responder:
    """Sends one response; remembers what was sent. Calls `on_start(status)` once.

    `on_start` may be replaced before the response starts (once the request's Call exists).
    Once `closed` (the client went away) sends are dropped: the engine's work may go on (an
    abort it could not deliver), but nothing reaches the client any more. Several items of one
    request may send at once: messages go out one at a time, in call order, and nothing after
    the last one.
    """

    def __init__(
        self,
        send: Any,
        request_id: str | None = None,
        on_start: Callable[[int], object] | None = None,
    ) -> None:
        self._send = send
        self._request_id = request_id
        self.on_start = on_start
        self.status: int | None = None
        self.streaming = False
        self.completed = False
        self.closed = False
        self._lock = trio.StrictFIFOLock()
        self._ended = False  # the final body message went out

    @property
    def started(self) -> bool:
        return self.status is not None

    async def _send_message(self, message: dict[str, Any]) -> None:
        async with self._lock:
            if self.closed or self._ended:
                return
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._ended = True
            await self._send(message)

    async def _start(self, status: int, content_type: bytes, extra: list[tuple[bytes, bytes]]):
        headers = [(b"content-type", content_type), *extra]
        if self._request_id:
            headers.append((b"x-request-id", self._request_id.encode("latin-1")))
        self.status = status
        if self.on_start is not None:
            self.on_start(status)
        await self._send_message(
            {"type": "http.response.start", "status": status, "headers": headers}
        )

    async def json(self, status: int, body: Any) -> None:
        data = orjson.dumps(body)
        await self._start(status, JSON, [(b"content-length", str(len(data)).encode())])
        self.completed = True  # before the send: hypercorn reports the stream closed inside it
        await self._send_message({"type": "http.response.body", "body": data, "more_body": False})

    async def text(
        self, status: int, text: str, content_type: bytes = b"text/plain; charset=utf-8"
    ):
        data = text.encode()
        await self._start(status, content_type, [(b"content-length", str(len(data)).encode())])
        self.completed = True
        await self._send_message({"type": "http.response.body", "body": data, "more_body": False})

    async def empty(self, status: int = 200) -> None:
        await self.text(status, "")

    async def error(self, status: int, message: str) -> None:
        """A JSON error answer, or an in-band SSE error frame if a stream already started."""
        if self.streaming:
            await self.event(error_body(message, status))
            await self.done()
        else:
            await self.json(status, error_body(message, status))

    async def start_stream(self) -> None:
        if not self.started:
            self.streaming = True
            await self._start(200, SSE, [(b"cache-control", b"no-cache")])

    async def event(self, obj: Any) -> None:
        await self.start_stream()
        data = b"data: " + orjson.dumps(obj) + b"\n\n"
        await self._send_message({"type": "http.response.body", "body": data, "more_body": True})

    async def done(self) -> None:
        await self.start_stream()
        self.completed = True
        await self._send_message({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
