"""One client connection: hypercorn's HTTP/1.1 handling, made strict where RFC 9112 says so.

hypercorn (h11 underneath) is lenient where a router in front of other servers must not be:
- a request head with both `Content-Length` and `Transfer-Encoding` is taken (Transfer-Encoding
  wins): the request-smuggling shape RFC 9112 §6.3 says to treat as an error and close;
- bare-LF line endings and obs-fold continuation lines are accepted (§2.2 and §5.2 allow a
  server to refuse them; a proxy in front that reads them differently is how smuggling starts);
- a request target with bytes above 0x7F crashes the connection without an answer;
- its own error answers (a malformed head, headers too large) are empty, not the JSON envelope
  every other error of the router is;
- h11's bound on a head (`h11_max_incomplete_size`, 16 KiB) holds only while the head is
  incomplete: a 61 KB head that arrives in one segment is taken whole (issue 26, N13);
- it speaks HTTP/2 when asked: `Upgrade: h2c`, the prior-knowledge preface, and ALPN `h2` over
  TLS. The router is built and tested over HTTP/1.1, and hypercorn's only bound on rapid resets
  is its requests-per-connection cap, so HTTP/2 is off unless `--enable-http2`;
- a TLS handshake may take `ssl_handshake_timeout` (60 s by default; `listeners.py` sets it);
- one timer, `keep_alive_timeout`, bounds a connection from its accept and between requests
  until a request head is complete: a client that trickles a head is cut only by that, and a
  load balancer's pooled connection by the same short bound. And a client that closes an idle
  connection leaves it in CLOSE_WAIT until the timer runs out (the timer's task holds the
  connection's task group open).

`StrictHead` checks each request head as h11 cuts it out of the receive buffer (its size first:
the same bound however the head arrived, 431), and raises h11's own protocol error: h11 then
refuses the request (400) and hypercorn closes the connection, as it does for any head it
cannot parse. `StrictH11` installs it, answers those errors with the
envelope and `Connection: close`, and ignores `Upgrade: h2c` without HTTP/2. `Connection` is
hypercorn's TCPServer with that protocol, the handshake bound, and SMG 1.13's two client
timeouts in place of hypercorn's one (`ClientTimeouts`): `--header-read-timeout-secs` from the
accept until the first request head is complete (and from the first byte of each later head),
`--idle-connection-timeout-secs` between requests; a client's close ends the timer at once.

The head check reaches into h11's receive buffer (`Connection._receive_buffer`): h11 has no
public hook for it. `tests/router/test_http_surface.py` fails if an h11 release changes it.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Literal

import attrs
import h11
import trio
from h11._receivebuffer import ReceiveBuffer, blank_line_regex
from h11._util import LocalProtocolError
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr

from trio_pd.errors import error_body

# What the router says when h11 or the head check refuses a request (h11 gives a status only).
PROTOCOL_ERRORS: dict[int, tuple[str, str]] = {
    400: ("malformed HTTP/1.1 request", "invalid_request_error"),
    431: ("request header fields too large", "invalid_request_error"),
    501: ("transfer coding not implemented (only chunked is)", "not_implemented"),
    505: ("HTTP version not supported: the router speaks HTTP/1.1", "invalid_request_error"),
}


class StrictHead(ReceiveBuffer):
    """h11's receive buffer, refusing a request head RFC 9112 lets a server refuse."""

    def __init__(self, connection: h11.Connection, *, http2: bool) -> None:
        super().__init__()
        self.connection = connection
        self.http2 = http2

    def maybe_extract_lines(self) -> list[bytearray] | None:
        match = blank_line_regex.search(self._data, self._multiple_lines_search)
        if match is not None:
            limit = self.connection._max_incomplete_event_size
            if match.end() > limit:  # h11 bounds only a head still incomplete: whole, the same
                raise LocalProtocolError(f"head past {limit} bytes", error_status_hint=431)
            check_head(
                bytes(self._data[: match.end()]),
                request=self.connection.their_state is h11.IDLE,
                http2=self.http2,
            )
        return super().maybe_extract_lines()


def check_head(head: bytes, *, request: bool, http2: bool) -> None:
    """Raise h11's LocalProtocolError (h11 answers 400, or the hint) for a head to refuse.
    `request`: a request line and its fields; else the trailer fields of a chunked body.
    Byte searches first (~1 µs a head); the fields are split only when both framing headers
    may be there."""
    if head.count(b"\n") != head.count(b"\r\n"):
        raise LocalProtocolError("bare LF line ending (RFC 9112 §2.2)")
    if b"\r\n " in head or b"\r\n\t" in head or (not request and head[:1] in (b" ", b"\t")):
        raise LocalProtocolError("obs-fold continuation line (RFC 9112 §5.2)")
    if not request:
        return
    first = head[: head.find(b"\r\n")]
    if not first.isascii():
        raise LocalProtocolError("request line with non-ASCII bytes")
    if not http2 and first == b"PRI * HTTP/2.0":
        raise LocalProtocolError("HTTP/2 is not enabled (--enable-http2)", error_status_hint=505)
    lowered = head.lower()
    if b"\r\ntransfer-encoding" in lowered and b"\r\ncontent-length" in lowered:
        names = {line.partition(b":")[0].strip() for line in lowered.split(b"\r\n")[1:]}
        if b"content-length" in names and b"transfer-encoding" in names:
            raise LocalProtocolError("both Content-Length and Transfer-Encoding (RFC 9112 §6.3)")


class StrictH11(H11Protocol):
    """hypercorn's HTTP/1.1 protocol with the head check, enveloped errors and, without
    HTTP/2, `Upgrade: h2c` ignored (RFC 9110 §7.8 lets a server ignore an upgrade)."""

    def __init__(self, *args: Any, http2: bool) -> None:
        super().__init__(*args)
        self.http2 = http2
        connection = self.connection
        assert isinstance(connection, h11.Connection)
        assert isinstance(connection._receive_buffer, ReceiveBuffer)  # h11's layout, checked
        connection._receive_buffer = StrictHead(connection, http2=http2)

    async def _check_protocol(self, event: h11.Request) -> None:
        if self.http2:
            await super()._check_protocol(event)

    async def _send_error_response(self, status_code: int) -> None:
        message, kind = PROTOCOL_ERRORS.get(status_code, PROTOCOL_ERRORS[400])
        body = error_body(message, kind, status_code)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *self.config.response_headers("h11"),
        ]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


class Protocols(ProtocolWrapper):
    """hypercorn's choice of protocol, with StrictH11 in place of its HTTP/1.1."""

    def __init__(self, *args: Any, http2: bool) -> None:
        super().__init__(*args)
        if isinstance(self.protocol, H11Protocol):
            self.protocol = StrictH11(*protocol_args(self), http2=http2)


def protocol_args(wrapper: ProtocolWrapper) -> tuple[Any, ...]:
    w = wrapper
    return (w.app, w.config, w.context, w.task_group, w.state, w.ssl, w.client, w.server, w.send)


@attrs.frozen
class ClientTimeouts:
    """A client connection's two bounds (0: none). `header_secs`: from the accept until the
    first request head is complete, and from the first byte of a later head until it is;
    `idle_secs`: between a response's end and the next request's first byte."""

    header_secs: float = 30.0
    idle_secs: float = 90.0


Phase = Literal["head", "busy", "idle"]  # reading a head, a request in flight, between requests


class Connection(TCPServer):
    """hypercorn's TCPServer serving `Protocols`; a TLS handshake is bounded by the config's
    `ssl_handshake_timeout` and a connection that does not finish it is closed; a head and the
    wait between requests are bounded by `ClientTimeouts`."""

    def __init__(
        self, *args: Any, http2: bool = False, timeouts: ClientTimeouts = ClientTimeouts()
    ) -> None:
        super().__init__(*args)
        self.http2 = http2
        self.timeouts = timeouts
        self.phase: Phase = "head"

    async def _arm(self, phase: Phase) -> None:
        """Enter `phase` and (re)start its timer (hypercorn's idle task is the one timer)."""
        self.phase = phase
        secs = self.timeouts.header_secs if phase == "head" else self.timeouts.idle_secs
        await self.idle_task.restart(self._task_group, partial(self._close_after, secs))

    async def _close_after(self, secs: float) -> None:
        """hypercorn's `_idle_timeout` with our bound: close after `secs` (0: never), or at
        once when the server is terminating (the drain closes idle connections)."""
        with trio.move_on_after(secs if secs > 0 else math.inf):
            await self.context.terminated.wait()
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated):  # h11: a head is complete (busy), a response done (idle)
            if event.idle:
                await self._arm("idle")
            else:
                self.phase = "busy"
                await self.idle_task.stop()
            return
        await super().protocol_send(event)

    async def _read_data(self) -> None:
        """hypercorn's read loop; the first bytes after an idle wait start the head's timer,
        and the client's close stops the timer (else its task holds the connection open)."""
        while True:
            try:
                data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            if data and self.phase == "idle" and isinstance(self.protocol.protocol, H11Protocol):
                await self._arm("head")  # (HTTP/2 frames between requests are no head)
            await self.protocol.handle(RawData(bytes(data)))
            if data == b"":
                break
        await self.protocol.handle(Closed())
        await self.idle_task.stop()

    async def run(self) -> None:
        if isinstance(self.stream, trio.SSLStream):
            with trio.move_on_after(self.config.ssl_handshake_timeout) as handshake:
                try:
                    await self.stream.do_handshake()
                except trio.BrokenResourceError:
                    return
            if handshake.cancelled_caught:
                return
            alpn = self.stream.selected_alpn_protocol()
            sock = self.stream.transport_stream.socket
            tls = True
        else:
            alpn, sock, tls = "http/1.1", self.stream.socket, False
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
            async with TaskGroup() as task_group:
                self._task_group = task_group
                self.protocol = Protocols(
                    self.app, self.config, self.context, task_group,
                    ConnectionState(self.state), tls, client, server, self.protocol_send, alpn,
                    http2=self.http2,
                )  # fmt: skip
                await self.protocol.initiate()
                await self._arm("head")
                await self._read_data()
        except OSError:
            pass
        finally:
            await self._close()
