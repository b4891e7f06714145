"""The client side of a request: ASGI response sending that knows whether bytes went out, and
the request's outcome, built once when it ends from what the responder saw and was told."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import attrs

from trio_pd.errors import RouterError

Send = Callable[[dict[str, Any]], Awaitable[None]]
JSON_HEADERS = [(b"content-type", b"application/json")]
DONE_FRAME = b"data: [DONE]\n\n"
EVENT_ENDS = (b"\n\n", b"\r\n\r\n")  # what the last bytes of a whole SSE event are
CLIENT_GONE_STATUS = 499  # nginx's convention for "the client closed the request"


@attrs.define
class RequestNotes:
    """What handling a request learned on its way, for its outcome (None: never learned).

    Written as it happens, so a request cut short (a 499, an error) still tells what it had
    reached: the generation handler (`edge/generation.py`) notes why it was cancelled and the
    error it answered, dispatch (`pd/dispatch.py`) the route. The route's fields describe the
    last attempt: its pair, and how many attempts the request ran in all (a retry or a resume
    replaces the pair; a resume continues the count). With `n > 1` each sample is dispatched
    with notes of its own and the request's take the route of the sample that decided the
    answer (`pd/samples.py`: the first to fail, else sample 0).
    """

    model: str | None = None  # "-": the router serves one model
    client_rid: str | None = None  # the client's own `rid`, never sent to an engine
    prefill: str | None = None  # worker ids
    decode: str | None = None
    attempts: int | None = None
    migrations: int | None = None  # resumes on a fresh pair after decode broke (`resume.py`)
    samples: int | None = None  # n of an `n > 1` request
    cancel_cause: str | None = None  # `RequestCancel.cause`, when it was cancelled
    error: str | None = None  # the message of the router's error the request ended with

    def take_route(self, other: RequestNotes) -> None:
        """The route `other` (one sample's notes) took, as this request's."""
        self.model, self.prefill, self.decode = other.model, other.prefill, other.decode
        self.attempts, self.migrations = other.attempts, other.migrations


@attrs.frozen
class RequestOutcome:
    """How one request ended, as one value: built once, by `RequestOutcome.of` when the request
    ends (`edge/router.py`), and all that its metrics, access line and span read.

    ``status`` is the one final status: what the client got once its answer was complete,
    499 when the client left before (a stream cut by the router after its start counts the
    status it started with; ``inband_status`` then says which error event ended it, when the
    router sent that event itself: the keep-alive's early headers, or an internal error).
    """

    status: int
    bytes_sent: int  # body bytes
    inband_status: int | None
    model: str | None
    client_rid: str | None
    prefill: str | None
    decode: str | None
    attempts: int | None
    migrations: int | None
    samples: int | None
    cancel_cause: str | None
    error: str | None

    @classmethod
    def of(cls, responder: Responder) -> RequestOutcome:
        """The outcome of the request `responder` answered, now that it has ended."""
        notes, status = responder.notes, responder.status
        return cls(
            # The one final status: 499 unless the client's answer was complete.
            status=status if responder.finished and status is not None else CLIENT_GONE_STATUS,
            bytes_sent=responder.bytes_sent,
            inband_status=responder.inband_status,
            model=notes.model,
            client_rid=notes.client_rid,
            prefill=notes.prefill,
            decode=notes.decode,
            attempts=notes.attempts,
            migrations=notes.migrations,
            samples=notes.samples,
            cancel_cause=notes.cancel_cause,
            error=notes.error,
        )

    def access_fields(self) -> dict[str, object]:
        """The access line's fields after method, path, status, ms and bytes, in this order,
        each only when known (operators parse the line: the order is kept)."""
        fields = {
            "client_rid": self.client_rid,
            "model": self.model,
            "prefill": self.prefill,
            "decode": self.decode,
            "attempts": self.attempts,
            "migrations": self.migrations,
            "samples": self.samples,
            "inband_status": self.inband_status,
        }
        return {key: value for key, value in fields.items() if value is not None}


class RequestSpan(Protocol):
    """The request's span (`edge/tracing.py`, with `--enable-trace`), ended with its outcome."""

    def end(self, outcome: RequestOutcome) -> None: ...


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
    notes: RequestNotes = attrs.Factory(RequestNotes)  # the route, the cause: for the outcome
    # The status of the error event the router itself ended a started stream with: the early
    # headers' error reply (below), or an internal error (`edge/router.py`).
    inband_status: int | None = None
    span: RequestSpan | None = None  # ended with the outcome by the router, after the answer
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
            self.inband_status = reply.status
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
