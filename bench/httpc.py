"""A minimal HTTP/1.1 client on raw trio sockets, cheap enough that the load generator is not the
bottleneck: keep-alive, Content-Length and chunked bodies, SSE event timing.

Only what the benchmarks need: one request at a time per connection, no TLS, no redirects.
"""

from __future__ import annotations

import time

import attrs
import trio

MAX_HEADER = 64 * 1024


class ProtocolError(Exception):
    """The server sent something this client cannot parse."""


@attrs.define
class Reply:
    status: int = 0
    headers: dict[str, str] = attrs.Factory(dict)
    body: bytes = b""
    t_start: float = 0.0
    t_headers: float = 0.0
    t_end: float = 0.0
    events: int = 0  # SSE `data:` events other than [DONE]
    t_first_event: float = 0.0
    event_times: list[float] | None = None  # arrival time of each event when asked for
    stream_error: bool = False  # an SSE data event carried "error"
    done: bool = False  # saw `data: [DONE]`
    error: str | None = None  # transport problem: "reset", "eof", "timeout", "refused", ...

    @property
    def latency(self) -> float:
        return self.t_end - self.t_start

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300 and not self.stream_error


class SSECounter:
    """Counts SSE data events as bytes arrive (events end with a blank line)."""

    def __init__(self, reply: Reply, keep_times: bool) -> None:
        self.reply = reply
        self.buf = b""
        if keep_times:
            reply.event_times = []

    def feed(self, data: bytes) -> None:
        self.buf += data
        if b"\n\n" not in self.buf:
            return
        *events, self.buf = self.buf.split(b"\n\n")
        now = time.monotonic()
        reply = self.reply
        for event in events:
            payload = event.strip()
            if not payload.startswith(b"data:"):
                continue
            payload = payload[5:].strip()
            if payload == b"[DONE]":
                reply.done = True
                continue
            if reply.events == 0:
                reply.t_first_event = now
            reply.events += 1
            if reply.event_times is not None:
                reply.event_times.append(now)
            if b'"error"' in payload[:40] or payload.startswith(b'{"error"'):
                reply.stream_error = True


class Connection:
    """One keep-alive connection; `request()` reconnects transparently when the server closed it."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.stream: trio.SocketStream | None = None
        self.buf = b""

    async def connect(self) -> None:
        self.stream = await trio.open_tcp_stream(self.host, self.port)
        self.buf = b""

    async def aclose(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _recv(self) -> bytes:
        assert self.stream is not None
        data = await self.stream.receive_some(65536)
        if not data:
            raise ProtocolError("eof")
        return data

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        *,
        keep_body: bool = True,
        event_times: bool = False,
        on_event: object = None,
    ) -> Reply:
        """Send one request and read the whole answer. Transport errors end up in Reply.error."""
        reply = Reply(t_start=time.monotonic())
        fresh = self.stream is None
        try:
            if fresh:
                await self.connect()
            try:
                await self._send(method, path, body, headers)
                await self._read_head(reply)
            except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                if fresh or reply.status:
                    raise
                # a keep-alive connection the server had closed: retry once on a new one
                await self.aclose()
                await self.connect()
                reply.t_start = time.monotonic()
                await self._send(method, path, body, headers)
                await self._read_head(reply)
            await self._read_body(reply, keep_body, event_times)
        except OSError as exc:
            reply.error = "refused" if "refused" in str(exc).lower() else f"oserror:{exc.errno}"
            await self.aclose()
        except ProtocolError as exc:
            reply.error = str(exc)
            await self.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            reply.error = "reset"
            await self.aclose()
        except BaseException:
            await self.aclose()  # cancelled mid-request: the connection is unusable
            raise
        reply.t_end = time.monotonic()
        if reply.headers.get("connection", "").lower() == "close":
            await self.aclose()
        return reply

    async def _send(
        self, method: str, path: str, body: bytes, headers: dict[str, str] | None
    ) -> None:
        assert self.stream is not None
        lines = [f"{method} {path} HTTP/1.1", f"host: {self.host}:{self.port}"]
        if body or method == "POST":
            lines.append(f"content-length: {len(body)}")
            lines.append("content-type: application/json")
        for name, value in (headers or {}).items():
            lines.append(f"{name}: {value}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        await self.stream.send_all(head + body)

    async def _read_head(self, reply: Reply) -> None:
        while b"\r\n\r\n" not in self.buf:
            if len(self.buf) > MAX_HEADER:
                raise ProtocolError("header too large")
            self.buf += await self._recv()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise ProtocolError(f"bad status line {lines[0]!r}")
        reply.status = int(parts[1])
        reply.t_headers = time.monotonic()
        for line in lines[1:]:
            name, _, value = line.partition(":")
            reply.headers[name.strip().lower()] = value.strip()

    async def _read_body(self, reply: Reply, keep_body: bool, event_times: bool) -> None:
        sse = None
        if reply.headers.get("content-type", "").startswith("text/event-stream"):
            sse = SSECounter(reply, event_times)
        chunks: list[bytes] = []

        def take(data: bytes) -> None:
            if sse is not None:
                sse.feed(data)
            if keep_body:
                chunks.append(data)

        if reply.headers.get("transfer-encoding", "").lower() == "chunked":
            await self._read_chunked(take)
        elif "content-length" in reply.headers:
            remaining = int(reply.headers["content-length"])
            while remaining > 0:
                if not self.buf:
                    self.buf = await self._recv()
                data, self.buf = self.buf[:remaining], self.buf[remaining:]
                remaining -= len(data)
                take(data)
        elif reply.status in (204, 304) or 100 <= reply.status < 200:
            pass
        else:  # read until close
            if self.buf:
                take(self.buf)
                self.buf = b""
            assert self.stream is not None
            while data := await self.stream.receive_some(65536):
                take(data)
            await self.aclose()
        reply.body = b"".join(chunks)

    async def _read_chunked(self, take: object) -> None:
        while True:
            while b"\r\n" not in self.buf:
                self.buf += await self._recv()
            line, _, self.buf = self.buf.partition(b"\r\n")
            size = int(line.split(b";")[0], 16)
            if size == 0:
                while b"\r\n" not in self.buf:  # trailers end with an empty line
                    self.buf += await self._recv()
                trailer, _, self.buf = self.buf.partition(b"\r\n")
                while trailer:
                    while b"\r\n" not in self.buf:
                        self.buf += await self._recv()
                    trailer, _, self.buf = self.buf.partition(b"\r\n")
                return
            while len(self.buf) < size + 2:
                self.buf += await self._recv()
            take(self.buf[:size])  # type: ignore[operator]
            self.buf = self.buf[size + 2 :]


async def one_request(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    *,
    timeout: float = 30.0,  # noqa: ASYNC109 - reported in the Reply, not raised
    event_times: bool = False,
) -> Reply:
    """A request on a fresh connection, closed afterwards; a timeout is reported, not raised."""
    conn = Connection(host, port)
    t0 = time.monotonic()
    reply = Reply(t_start=t0)
    with trio.move_on_after(timeout):
        reply = await conn.request(method, path, body, headers, event_times=event_times)
    await conn.aclose()
    if not reply.t_end:
        reply.t_start = t0
        reply.t_end = time.monotonic()
        reply.error = reply.error or "timeout"
    return reply
