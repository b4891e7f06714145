"""HTTP/1.1 client connections on httptools (llhttp, in C) over trio.

One `Connection` carries one request at a time. The caller's task does every read itself: no
helper task, no channel. A read is one 64 KiB receive fed to the parser, whose callbacks collect
headers and body pieces into lists; the body iterator hands over everything one read produced
as a single `bytes`, so SSE events that arrived together go on as one piece. Plain TCP sockets
are driven with trio's low-level waits (`PlainStream`); TLS goes through `trio.SSLStream`. Opening
a connection (TCP, TLS, socket options) is `connect.py`'s.

Ownership stays with the caller (the pool): a connection may carry another request only when
`is_reusable()` says so, i.e. its last response was read to the end and the server allows
keep-alive; anything else (an error, a cancelled read, a body left unread, `Connection: close`,
a close-delimited body) makes it unusable, and the owner closes it. `close_now()` is synchronous
and wakes a task blocked on the socket with a `TransportError`, so closing never waits, shielded
or not.

What leaves this module: `TransportError` (kind "transport" or "timeout") for everything the
network or the server did; `trio.Cancelled` as usual; `RuntimeError` or `ValueError` only for
a caller's mistake (a request on a busy or spent connection, CR/LF in a header).
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
from collections.abc import Sequence
from typing import Literal

import httptools
import trio

RECEIVE_SIZE = 65536
# A body up to this size goes out in the same `send_all` as the head; a bigger one separately,
# so a large body is not copied just to save one system call.
JOIN_BODY_LIMIT = 65536
# A worker's answer head is bounded like Envoy bounds an upstream's (100 headers, ~60 KiB by
# default): an engine sends a handful (uvicorn: about five), and whatever a hostile one sends
# beyond would be held, then relayed to the client. Beyond either bound the response is a
# transport failure of the worker (502, counted against it).
MAX_HEAD_BYTES = 64 * 1024  # status line and headers (with any 1xx before them)
MAX_RESPONSE_HEADERS = 100  # header lines of one response head (trailers too)


class TransportError(Exception):
    """The connection or the server failed: `kind` is "transport" (refused, reset, closed,
    garbled response, TLS failure) or "timeout" (the connect timeout passed)."""

    def __init__(self, kind: Literal["transport", "timeout"], message: str) -> None:
        super().__init__(message)
        self.kind: Literal["transport", "timeout"] = kind


class _StopParsing(Exception):
    """Raised from a parser callback to stop llhttp (after a HEAD response's head, or a 101)."""


def describe_error(exc: BaseException) -> str:
    """A short reason for a stream error: trio wraps the OSError or SSLError as the cause."""
    if isinstance(exc, trio.ClosedResourceError):
        return "connection closed locally"
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    if isinstance(cause, OSError) and cause.strerror and not isinstance(cause, ssl.SSLError):
        return cause.strerror
    text = str(cause)
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


class PlainStream:
    """A plain TCP socket driven with trio's low-level waits.

    trio.SocketStream costs a few wrappers and, on every send, a trip through the scheduler;
    for one request and one response that was a quarter of the client's CPU. The checkpoint
    rules here: `receive_some` is a cancel point and a schedule point, as in trio;
    `send_all` is only a cancel point when the socket takes the data at once, which is fine
    because `Connection.request` always reads next.
    """

    __slots__ = ("_sock",)

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    async def send_all(self, data: bytes) -> None:
        sock = self._sock
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        rest = memoryview(data)[sent:]
        while rest:
            await trio.lowlevel.wait_writable(sock)
            with contextlib.suppress(BlockingIOError):
                rest = rest[sock.send(rest) :]

    async def receive_some(self, max_bytes: int) -> bytes:
        sock = self._sock
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            data = sock.recv(max_bytes)
        except BlockingIOError:
            pass
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return data
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                return sock.recv(max_bytes)
            except BlockingIOError:
                pass


class Connection:
    """One HTTP/1.1 connection; see the module docstring for who may use it when."""

    __slots__ = (
        "_body",
        "_done",
        "_failure",
        "_head_bytes",
        "_head_request",
        "_headers",
        "_idle_since",
        "_interim",
        "_keep_alive",
        "_keepalive_expiry",
        "_parser",
        "_poller",
        "_response",
        "_socket",
        "_stopped",
        "_stream",
        "_tls",
        "_trailers",
        "on_body",
    )

    def __init__(
        self,
        stream: PlainStream | trio.SSLStream,
        sock: socket.socket | trio.socket.SocketType,
        tls: trio.SSLStream | None,
        keepalive_expiry: float,
    ) -> None:
        self._stream = stream
        self._tls = tls
        self._socket = sock  # the stdlib socket (plain TCP) or the trio socket under TLS
        self._poller: select.poll | None = select.poll()
        self._poller.register(self._socket.fileno(), select.POLLIN)
        self._keepalive_expiry = keepalive_expiry
        self._idle_since = trio.current_time()
        # Body pieces parsed from the current read; llhttp calls `list.append` directly.
        self._body: list[bytes] = []
        self.on_body = self._body.append
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0  # of the head being parsed (`on_header`)
        self._trailers: list[tuple[bytes, bytes]] = []  # parsed, then dropped
        self._response: Response | None = None
        self._done = True  # the last response (none yet) was read to its end
        self._keep_alive = True  # ...and the connection may carry another request
        self._interim = False
        self._head_request = False
        self._stopped = False
        self._failure: str | None = None  # why the connection cannot be read any more
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)

    # -- the caller's API -------------------------------------------------------------------

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
    ) -> Response:
        """Send one request exactly as given (no header is added) and return once the final
        response's status line and headers are parsed; 1xx responses are skipped."""
        if not (self._done and self._keep_alive) or self._failure is not None:
            raise RuntimeError("request() on a connection that is busy, closed or spent")
        parts = [method, b" ", target, b" HTTP/1.1\r\n"]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"\r\n")
        head = b"".join(parts)
        lines = len(headers) + 2
        if head.count(b"\n") != lines or head.count(b"\r") != lines or b" " in target:
            raise ValueError("CR, LF or a space where the request line or a header forbids it")
        self._done = False
        self._response = None
        self._body.clear()
        self._headers = []
        self._head_bytes = 0
        self._trailers.clear()
        self._head_request = method == b"HEAD"
        if self._parser is None:  # after a HEAD response llhttp was stopped: start afresh
            self._parser = httptools.HttpResponseParser(self)
            self._stopped = False
        try:
            if len(body) <= JOIN_BODY_LIMIT:
                await self._stream.send_all(head + body if body else head)
            else:
                await self._stream.send_all(head)
                await self._stream.send_all(body)
        except (trio.BrokenResourceError, OSError) as exc:
            # The server may have answered and closed before reading everything (an early
            # 413, say): take its answer when there is one, else report the failed send.
            self._keep_alive = False
            try:
                return await self._read_head()
            except TransportError:
                raise self._fail(exc, "sending the request") from exc
        except trio.ClosedResourceError as exc:
            raise self._fail(exc, "sending the request") from exc
        except BaseException:
            self._interrupt()
            raise
        return await self._read_head()

    def is_reusable(self) -> bool:
        """True when the last response was read to its end, the server allows keep-alive and
        nothing went wrong: only then may the connection carry another request."""
        return self._done and self._keep_alive and self._failure is None

    def is_stale(self) -> bool:
        """For an idle connection: True when it sat idle longer than `keepalive_expiry`, or the
        peer closed it or sent anything while idle (one non-blocking poll(2), no read)."""
        if not self.is_reusable():
            return True
        if trio.current_time() - self._idle_since > self._keepalive_expiry:
            return True
        if self._tls is not None and self._tls.pending():
            return True
        return bool(self._poller.poll(0))  # type: ignore[union-attr]

    def close_now(self) -> None:
        """Close the socket at once; a task blocked reading it gets a TransportError."""
        if self._failure is None:
            self._failure = "connection closed"
        self._keep_alive = False
        self._poller = None
        self._parser = None  # also breaks the parser <-> connection reference cycle
        if self._socket.fileno() != -1:
            trio.lowlevel.notify_closing(self._socket)  # a task waiting on it gets woken
            self._socket.close()

    async def aclose(self) -> None:
        """Close the connection (no TLS close_notify: HTTP framing does not need it, and a
        close must never wait on the peer)."""
        self.close_now()
        await trio.lowlevel.checkpoint()

    # -- reading ----------------------------------------------------------------------------

    async def _read_head(self) -> Response:
        received = 0
        while self._response is None:
            received += await self._receive()
            if received > MAX_HEAD_BYTES and self._response is None:
                raise self._fail(None, f"response head larger than {MAX_HEAD_BYTES} bytes")
        return self._response

    async def _receive(self) -> int:
        """One read from the socket, fed to the parser; the callbacks below record the rest."""
        if self._failure is not None:
            raise TransportError("transport", self._failure)
        try:
            data = await self._stream.receive_some(RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise self._fail(exc, "reading the response") from exc
        except BaseException:
            self._interrupt()
            raise
        if not data:
            self._at_eof()
            return 0
        try:
            self._parser.feed_data(data)  # type: ignore[union-attr]
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self._stopped:  # the head of a HEAD response is all there is
                self._parser = None
            elif self._failure is not None:  # a callback refused the response
                raise self._fail(None, self._failure) from exc
            elif self._done:  # bytes after a complete response: it stands, the connection not
                self._keep_alive = False
            else:
                raise self._fail(None, f"malformed response: {exc}") from exc
        return len(data)

    def _at_eof(self) -> None:
        self._keep_alive = False
        response = self._response
        if response is not None and not self._done and _ends_at_eof(response):
            self._done = response.complete = True
            self._failure = "server closed the connection"
            return
        if response is None:
            message = "server closed the connection without answering"
        elif self._done:
            message = "server closed the connection"
        else:
            message = "server closed the connection before the response body ended"
        raise self._fail(None, message)

    def _fail(self, exc: BaseException | None, message: str) -> TransportError:
        """Mark the connection unreadable and build the error to raise."""
        if exc is not None:
            message = f"{message}: {describe_error(exc)}"
        self._failure = message
        self._keep_alive = False
        return TransportError("transport", message)

    def _interrupt(self) -> None:
        """A read or write was cancelled half-way: nothing may be read or sent any more."""
        if self._failure is None:
            self._failure = "an earlier read or write on this connection was interrupted"
        self._keep_alive = False

    # -- httptools callbacks (on_body is the body list's append) ----------------------------

    def on_message_begin(self) -> None:
        if self._done:  # a second response nobody asked for: never reuse this connection, and
            self._keep_alive = False  # stop before its body joins the one being read
            raise _StopParsing

    def on_header(self, name: bytes, value: bytes) -> None:
        # Counted here, exactly: `_read_head` only sees reads, and the head may end in the
        # middle of one. A 1xx head starts the count afresh; trailers are counted as a head.
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if len(self._headers) >= MAX_RESPONSE_HEADERS:
            self._failure = f"response has more than {MAX_RESPONSE_HEADERS} headers"
            raise _StopParsing
        if self._head_bytes > MAX_HEAD_BYTES:
            self._failure = f"response head larger than {MAX_HEAD_BYTES} bytes"
            raise _StopParsing
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()  # type: ignore[union-attr]
        if status == 101:
            self._failure = "server switched protocols (101) though nobody asked"
            raise _StopParsing
        if status < 200:  # 1xx: skipped (its headers too), the final response follows
            self._interim = True
            self._headers = []
            self._head_bytes = 0
            return
        self._response = Response(self, status, self._headers)
        self._headers = self._trailers  # trailers of a chunked body land there
        self._head_bytes = 0
        if self._head_request:
            self._stopped = True
            self._message_complete()
            raise _StopParsing  # llhttp would wait for a Content-Length body that never comes

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._message_complete()

    def _message_complete(self) -> None:
        self._done = self._response.complete = True  # type: ignore[union-attr]
        if self._keep_alive:
            self._keep_alive = self._parser.should_keep_alive()  # type: ignore[union-attr]
        self._idle_since = trio.current_time()


def _ends_at_eof(response: Response) -> bool:
    """Is this a close-delimited body (no Content-Length, not chunked)?"""
    for name, value in response.headers:
        if name == b"content-length":
            return False
        if name == b"transfer-encoding" and value.rstrip().lower().endswith(b"chunked"):
            return False
    return True


class Response:
    """Status, headers and body of one response; the body is read by the caller's task."""

    __slots__ = ("_conn", "complete", "headers", "status")

    def __init__(self, conn: Connection, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers  # names lower-cased, values as sent
        self.complete = False  # the body was read to its end

    def __repr__(self) -> str:
        return f"<Response {self.status} complete={self.complete}>"

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (give it lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def chunks(self) -> Response:
        """The body, de-chunked: one item per network read that produced body bytes (the bytes
        that came with the head are the first item).

        The iterator is the response itself: after a `break`, a later `chunks()` or `read()`
        goes on where it stopped. After a cancelled or failed read it does not: every further
        read raises TransportError, and the connection is not reusable.
        """
        return self

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        body = conn._body
        while not body:
            if self.complete:
                raise StopAsyncIteration
            if conn._response is not self:
                raise RuntimeError("this response's connection has moved on to another request")
            await conn._receive()
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        return data

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body, or its first `limit` bytes (then, unless the body happened to end
        there, the connection is not reusable)."""
        conn = self._conn
        body = conn._body
        if limit is None:
            while not self.complete:
                if conn._response is not self:
                    raise RuntimeError("this response's connection has moved on")
                await conn._receive()
            if not body:
                return b""
            data = body[0] if len(body) == 1 else b"".join(body)
            body.clear()
            return data
        parts = []
        size = 0
        while True:
            if body:
                piece = b"".join(body)
                body.clear()
                parts.append(piece)
                size += len(piece)
                if size >= limit:
                    break
            if self.complete:
                break
            if conn._response is not self:
                raise RuntimeError("this response's connection has moved on")
            await conn._receive()
        if not self.complete:
            conn._keep_alive = False
        data = b"".join(parts)
        return data[:limit] if size > limit else data

    def close_connection_now(self) -> None:
        """Close this response's connection at once, from any task (see Connection.close_now)."""
        self._conn.close_now()

    async def aclose(self) -> None:
        """Finish with the response: an unread body makes the connection not reusable (the
        owner closes it). Not a checkpoint: it never blocks."""
        if not self.complete:
            self._conn._keep_alive = False
