"""trio_pd.http11 against real servers on 127.0.0.1: a scripted raw trio server for the protocol's
edge cases (exact bytes, split where we choose), the engine simulator (hypercorn) for the real
thing, and a TLS server with a trustme certificate.

Splits are deterministic: the scripted server sends one piece, then waits until every task is
blocked (`wait_all_tasks_blocked`), i.e. until the client has read that piece and waits for
more, before it sends the next one.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import attrs
import orjson
import pytest
import trio
import trio.testing
import trustme

from tests.engine.helpers import new_room, pd_body
from trio_pd.upstream.connect import connect
from trio_pd.upstream.http11 import (
    MAX_HEAD_BYTES,
    MAX_RESPONSE_HEADERS,
    Connection,
    Response,
    TransportError,
)
from trio_pd_testing.engine import EngineConfig, EngineHandle, serve_engine

# -- the scripted server ------------------------------------------------------------------------


@attrs.define(eq=False)
class Peer:
    """The server's side of one accepted connection."""

    stream: trio.abc.Stream
    server: ScriptServer
    buffer: bytes = b""

    async def read_request(self) -> bytes:
        """The next request, head and body (by its Content-Length); EOFError if none comes."""
        while b"\r\n\r\n" not in self.buffer:
            data = await self.stream.receive_some(65536)
            if not data:
                raise EOFError
            self.buffer += data
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            data = await self.stream.receive_some(65536)
            if not data:
                raise EOFError
            rest += data
        self.buffer = rest[length:]
        request = head + b"\r\n\r\n" + rest[:length]
        self.server.requests.append(request)
        return request

    async def send(self, *pieces: bytes) -> None:
        """Send each piece as its own read on the client's side (see the module docstring)."""
        for piece in pieces:
            await self.stream.send_all(piece)
            await trio.testing.wait_all_tasks_blocked()

    async def reset(self) -> None:
        """Close with an RST (SO_LINGER 0) instead of a FIN."""
        sock = self.stream.socket  # type: ignore[attr-defined]
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


Script = Callable[[Peer], Awaitable[None]]


@attrs.define(eq=False)
class ScriptServer:
    script: Script
    tls: ssl.SSLContext | None = None
    port: int = 0
    accepted: int = 0
    closed: int = 0
    requests: list[bytes] = attrs.Factory(list)

    async def handle(self, stream: trio.SocketStream) -> None:
        self.accepted += 1
        peer_stream: trio.abc.Stream = stream
        try:
            if self.tls is not None:
                peer_stream = trio.SSLStream(stream, self.tls, server_side=True)
                await peer_stream.do_handshake()
            await self.script(Peer(peer_stream, self))
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.closed += 1
            stream.socket.close()


async def start_server(
    nursery: trio.Nursery, script: Script, tls: ssl.SSLContext | None = None
) -> ScriptServer:
    server = ScriptServer(script, tls)
    listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
    server.port = listeners[0].socket.getsockname()[1]
    return server


def answer(*pieces: bytes) -> Script:
    """A keep-alive server: every request gets `pieces`, each arriving as its own read."""

    async def script(peer: Peer) -> None:
        while True:
            await peer.read_request()
            await peer.send(*pieces)

    return script


def answer_once(*pieces: bytes, then: str = "wait") -> Script:
    """Answer one request with `pieces`, then "close", "reset" or "wait" (silent until EOF)."""

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(*pieces)
        if then == "close":
            await peer.stream.aclose()
        elif then == "reset":
            await peer.reset()
        else:  # stay silent until the client goes
            while await peer.stream.receive_some(65536):
                pass

    return script


async def open_to(server: ScriptServer, **options: object) -> Connection:
    options = {"connect_timeout": 5.0, "keepalive_expiry": 30.0, **options}
    return await connect("127.0.0.1", server.port, **options)  # type: ignore[arg-type]


def headers_for(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"host", b"upstream.test"), (b"content-length", str(len(body)).encode())]


async def post(connection: Connection, body: bytes = b'{"x":1}', target: bytes = b"/generate"):
    return await connection.request(b"POST", target, headers_for(body), body)


async def collect(response: Response) -> list[bytes]:
    return [chunk async for chunk in response.chunks()]


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Mixed-Case: VaLuE\r\n"
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def length_answer(body: bytes, head: bytes = OK_HEAD) -> bytes:
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


# -- request and Content-Length bodies ----------------------------------------------------------


async def test_content_length_body_and_exact_request_bytes(nursery):
    server = await start_server(nursery, answer(length_answer(b'{"ok":true}')))
    connection = await open_to(server)
    spy = connection._stream = SendCounter(connection._stream)  # type: ignore[assignment]
    sends = spy.sizes
    body = b'{"text":"hi"}'
    response = await connection.request(
        b"POST", b"/v1/x?a=1", [(b"host", b"w:1"), (b"Content-Length", b"13")], body
    )
    assert server.requests == [
        b"POST /v1/x?a=1 HTTP/1.1\r\nhost: w:1\r\nContent-Length: 13\r\n\r\n" + body
    ]
    assert sends == [len(server.requests[0])]  # head and small body: one send_all
    assert response.status == 200
    assert response.headers == [
        (b"content-type", b"application/json"),
        (b"x-mixed-case", b"VaLuE"),
        (b"content-length", b"11"),
    ]
    assert response.header(b"x-mixed-case") == b"VaLuE"
    assert response.header(b"nope") is None
    assert await response.read() == b'{"ok":true}'
    assert response.complete and connection.is_reusable() and not connection.is_stale()

    big = b"b" * 200_000  # above the join limit: the body goes in its own send_all
    response = await post(connection, big)
    assert await response.read() == b'{"ok":true}'
    assert len(sends) == 3 and sends[2] == len(big)
    assert server.requests[1].endswith(big)
    await connection.aclose()


class SendCounter:
    """Wraps a connection's stream to record the size of each send_all."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    async def send_all(self, data: bytes) -> None:
        self.sizes.append(len(data))
        await self.inner.send_all(data)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.inner.receive_some(max_bytes)


async def test_response_larger_than_one_read(nursery):
    body = bytes(range(256)) * 8192  # 2 MiB
    server = await start_server(nursery, answer(length_answer(body)))
    connection = await open_to(server)
    response = await post(connection)
    chunks = await collect(response)
    assert len(chunks) > 2  # more than one network read, each its own item
    assert max(map(len, chunks)) <= 65536
    assert b"".join(chunks) == body
    assert connection.is_reusable()
    assert await (await post(connection)).read() == body  # and the connection goes on


async def test_keep_alive_reuse_many_requests(nursery):
    server = await start_server(nursery, answer(length_answer(b"pong")))
    connection = await open_to(server)
    for i in range(200):
        response = await post(connection, b'{"i":%d}' % i)
        assert await response.read() == b"pong"
        assert connection.is_reusable()
    assert server.accepted == 1 and len(server.requests) == 200
    assert server.requests[-1].endswith(b'{"i":199}')


# -- chunked bodies -----------------------------------------------------------------------------

CHUNKED_BODY = chunked(b"data: 1\n\n", b"data: two\n\n", b"x" * 17) + b""
CHUNKED_ANSWER = CHUNKED_HEAD + CHUNKED_BODY


async def test_chunked_split_at_every_byte(nursery):
    """Every two-piece split of a chunked answer (inside the size lines, the data, the CRLFs,
    the last chunk) gives the same body, on one connection reused throughout."""
    splits = list(range(1, len(CHUNKED_ANSWER)))
    pieces = [(CHUNKED_ANSWER[:i], CHUNKED_ANSWER[i:]) for i in splits]

    async def script(peer: Peer) -> None:
        for first, second in pieces:
            await peer.read_request()
            await peer.send(first, second)

    server = await start_server(nursery, script)
    connection = await open_to(server)
    for _ in splits:
        response = await post(connection)
        assert await response.read() == b"data: 1\n\ndata: two\n\n" + b"x" * 17
        assert response.complete and connection.is_reusable()
    assert server.accepted == 1 and len(server.requests) == len(splits)


async def test_chunked_split_into_many_reads_and_trailers(nursery):
    answer_bytes = CHUNKED_HEAD + b"1" + b"0\r\n" + b"a" * 16 + b"\r\n5;ext=1\r\nhello\r\n0\r\n"
    pieces = [answer_bytes[:-25], answer_bytes[-25:-12], answer_bytes[-12:]]
    pieces.append(b"X-Trailer: t\r\n\r")  # the final CRLF split in two
    pieces.append(b"\n")
    server = await start_server(nursery, answer(*pieces))
    connection = await open_to(server)
    for _ in range(3):
        response = await post(connection)
        assert await response.read() == b"a" * 16 + b"hello"
        assert response.headers[-1] == (b"transfer-encoding", b"chunked")  # no trailer in there
        assert connection.is_reusable()


async def test_one_item_per_network_read(nursery):
    """All the body bytes of one read come as one item, across chunk boundaries; the bytes
    that came with the head are the first item; a read with no body bytes yields nothing."""
    reads = [
        CHUNKED_HEAD + chunked(b"data: a\n\n")[:-5],  # head and one event
        b"9\r\ndata: b\n\n\r\n9\r\ndata: c\n\n\r\n",  # two events in one read
        b"9\r\nda",  # an event split across reads
        b"ta: d\n\n\r\n",
        b"9\r\n",  # only framing: no item
        b"data: e\n\n\r\n0\r\n\r\n",
    ]
    server = await start_server(nursery, answer(*reads))
    connection = await open_to(server)
    response = await post(connection)
    assert await collect(response) == [
        b"data: a\n\n",
        b"data: b\n\ndata: c\n\n",
        b"da",
        b"ta: d\n\n",
        b"data: e\n\n",
    ]
    assert connection.is_reusable()


# -- bodies delimited otherwise, and bodiless answers -------------------------------------------


@pytest.mark.parametrize("version", [b"1.0", b"1.1"])
async def test_close_delimited_body(nursery, version):
    head = b"HTTP/" + version + b" 200 OK\r\nContent-Type: text/plain\r\n\r\n"
    server = await start_server(
        nursery, answer_once(head + b"part one,", b" part two", then="close")
    )
    connection = await open_to(server)
    response = await post(connection)
    assert await response.read() == b"part one, part two"
    assert response.complete
    assert not connection.is_reusable() and connection.is_stale()
    with pytest.raises(RuntimeError):
        await post(connection)


async def test_connection_close_from_server(nursery):
    head = OK_HEAD + b"Connection: close\r\n"
    server = await start_server(nursery, answer_once(length_answer(b"bye", head), then="wait"))
    connection = await open_to(server)
    response = await post(connection)
    assert await response.read() == b"bye"
    assert response.complete and not connection.is_reusable()


@pytest.mark.parametrize(
    ("extra", "reusable"), [(b"", False), (b"Connection: keep-alive\r\n", True)]
)
async def test_http10_response(nursery, extra, reusable):
    head = b"HTTP/1.0 200 OK\r\n" + extra
    server = await start_server(nursery, answer(length_answer(b"old", head)))
    connection = await open_to(server)
    response = await post(connection)
    assert await response.read() == b"old"
    assert response.complete
    assert connection.is_reusable() is reusable


async def test_interim_1xx_then_chunked_with_trailers(nursery):
    """Neither the 1xx's headers nor the trailers end up in the response's headers, and the
    headers of an earlier response stay as they were."""
    final = CHUNKED_HEAD[:-2] + b"Trailer: x-checksum\r\n\r\n" + chunked(b"body")[:-2]
    pieces = (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + final, b"X-Checksum: 1\r\n\r\n")
    server = await start_server(nursery, answer(*pieces))
    connection = await open_to(server)
    expected = [
        (b"content-type", b"text/event-stream"),
        (b"transfer-encoding", b"chunked"),
        (b"trailer", b"x-checksum"),
    ]
    first = await post(connection)
    assert await first.read() == b"body"
    assert first.headers == expected
    second = await post(connection)
    assert await second.read() == b"body"
    assert first.headers == expected and second.headers == expected
    assert connection.is_reusable()


async def test_interim_1xx_skipped(nursery):
    pieces = (
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\nHTTP/1.1 201 Created\r\n",
        b"X-Final: yes\r\nContent-Length: 4\r\n\r\ndone",
    )
    server = await start_server(nursery, answer(*pieces))
    connection = await open_to(server)
    for _ in range(2):
        response = await post(connection)
        assert response.status == 201
        assert response.headers == [(b"x-final", b"yes"), (b"content-length", b"4")]
        assert await response.read() == b"done"
        assert connection.is_reusable()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\nETag: x\r\n\r\n",
    ],
)
async def test_bodiless_statuses(nursery, head):
    server = await start_server(nursery, answer(head, length_answer(b"next")))
    connection = await open_to(server)
    response = await post(connection)
    assert response.status in (204, 304)
    assert response.complete  # known at the head: nothing to read
    assert await collect(response) == []
    assert connection.is_reusable()
    # The next answer starts right after the head: nothing was taken as the 304's body.
    response = await post(connection)
    assert await response.read() == b"next"


async def test_head_request_with_content_length(nursery):
    server = await start_server(
        nursery, answer(OK_HEAD + b"Content-Length: 1234\r\n\r\n", length_answer(b"after"))
    )
    connection = await open_to(server)
    response = await connection.request(b"HEAD", b"/", [(b"host", b"h")], b"")
    assert response.header(b"content-length") == b"1234"
    assert await response.read() == b"" and response.complete and connection.is_reusable()
    response = await post(connection)
    assert await response.read() == b"after"


# -- broken answers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        ((OK_HEAD + b"Content-Length: 100\r\n\r\n", b"only part"), "before the response body"),
        ((CHUNKED_HEAD + b"5\r\nhello\r\n", b"3\r\nab"), "before the response body"),
        ((CHUNKED_HEAD + chunked(b"abc")[:-2],), "before the response body"),
        ((b"HTTP/1.1 200 OK\r\nContent-Le",), "without answering"),
    ],
)
async def test_truncated_answer(nursery, pieces, message):
    server = await start_server(nursery, answer_once(*pieces, then="close"))
    connection = await open_to(server)
    with pytest.raises(TransportError, match=message) as caught:
        response = await post(connection)
        await response.read()
    assert caught.value.kind == "transport"
    assert not connection.is_reusable()
    with pytest.raises(RuntimeError):
        await post(connection)


async def test_truncated_body_seen_by_the_iterator(nursery):
    head = OK_HEAD + b"Content-Length: 100\r\n\r\n"
    server = await start_server(nursery, answer_once(head + b"first", b"second", then="close"))
    connection = await open_to(server)
    response = await post(connection)
    got = []
    with pytest.raises(TransportError, match="before the response body ended"):
        async for chunk in response.chunks():
            got.append(chunk)
    assert got == [b"first", b"second"]
    assert not response.complete and not connection.is_reusable()


async def test_reset_mid_body(nursery):
    head = OK_HEAD + b"Content-Length: 100\r\n\r\n"
    server = await start_server(nursery, answer_once(head + b"some", then="reset"))
    connection = await open_to(server)
    response = await post(connection)
    with pytest.raises(TransportError, match="reset") as caught:
        await response.read()
    assert caught.value.kind == "transport"


@pytest.mark.parametrize(
    ("garbage", "message"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "malformed response"),
        (b"HTTP/1.1 2xx Fine\r\n\r\n", "malformed response"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc", "malformed"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", "switched protocols"),
    ],
)
async def test_garbled_answer(nursery, garbage, message):
    server = await start_server(nursery, answer_once(garbage))
    connection = await open_to(server)
    with pytest.raises(TransportError, match=message) as caught:
        response = await post(connection)
        await response.read()
    assert caught.value.kind == "transport"
    assert not connection.is_reusable()


async def test_bytes_after_a_complete_answer(nursery):
    """An answer followed by more bytes stands; the connection is not reused."""
    for extra in (b"HTTP/1.1 200 OK\r\n", b"junk", length_answer(b"stray")):
        server = await start_server(nursery, answer_once(length_answer(b"fine") + extra))
        connection = await open_to(server)
        response = await post(connection)
        assert await response.read() == b"fine"
        assert response.complete and not connection.is_reusable() and connection.is_stale()


async def test_head_too_large(nursery):
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.stream.send_all(b"HTTP/1.1 200 OK\r\n")
        while True:
            await peer.stream.send_all(b"X-Filler: " + b"f" * 1000 + b"\r\n")

    server = await start_server(nursery, script)
    connection = await open_to(server)
    with pytest.raises(TransportError, match="response head larger"):
        await post(connection)


# -- connecting ---------------------------------------------------------------------------------


async def test_connection_refused():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket is closed
    with pytest.raises(TransportError, match=r"cannot connect to 127\.0\.0\.1:.*refused") as caught:
        await connect("127.0.0.1", port, connect_timeout=5, keepalive_expiry=1)
    assert caught.value.kind == "transport"


async def test_connect_timeout_on_a_full_backlog():
    """A listener whose accept queue is full drops SYNs (Linux): connect() hangs there."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(3):
                filler = socket.socket()
                filler.setblocking(False)
                filler.connect_ex(("127.0.0.1", port))
                fillers.append(filler)
            await trio.sleep(0.05)
            start = trio.current_time()
            with pytest.raises(TransportError, match=r"timed out after 0\.3 s") as caught:
                await connect("127.0.0.1", port, connect_timeout=0.3, keepalive_expiry=1)
            elapsed = trio.current_time() - start
        finally:
            for filler in fillers:
                filler.close()
    # The router's 0.3 s timeout ended it (its kind and message; the kernel's own SYN retries,
    # about 2 minutes, end in a connection error instead), and not before it ran out: a busy
    # machine can only make `elapsed` longer, so no upper bound is needed.
    assert caught.value.kind == "timeout"
    assert elapsed >= 0.29


async def test_tcp_nodelay_is_on(nursery):
    server = await start_server(nursery, answer(length_answer(b"")))
    connection = await open_to(server)
    assert connection._socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


# -- idle connections: staleness ----------------------------------------------------------------


async def test_server_closes_idle_connection_becomes_stale(nursery):
    closed = trio.Event()

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(length_answer(b"one"))
        await trio.sleep(0.05)
        await peer.stream.aclose()
        closed.set()

    server = await start_server(nursery, script)
    connection = await open_to(server)
    assert await (await post(connection)).read() == b"one"
    assert connection.is_reusable() and not connection.is_stale()
    await closed.wait()
    with trio.fail_after(10):
        while not connection.is_stale():
            await trio.sleep(0.005)
    assert len(server.requests) == 1  # found out without sending anything
    assert connection.is_reusable()  # stale is the idle check; the pool closes it


async def test_bytes_while_idle_make_stale(nursery):
    sent = trio.Event()

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(length_answer(b"one"))
        await trio.sleep(0.05)
        await peer.stream.send_all(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
        sent.set()
        await trio.sleep_forever()

    server = await start_server(nursery, script)
    connection = await open_to(server)
    await (await post(connection)).read()
    assert not connection.is_stale()
    await sent.wait()
    with trio.fail_after(10):
        while not connection.is_stale():
            await trio.sleep(0.005)


async def test_idle_past_keepalive_expiry_is_stale(nursery):
    server = await start_server(nursery, answer(length_answer(b"x")))
    connection = await open_to(server, keepalive_expiry=0.1)
    await (await post(connection)).read()
    assert not connection.is_stale()
    await trio.sleep(0.15)
    assert connection.is_stale()


async def test_engine_keepalive_timeout_makes_stale(nursery):
    """hypercorn (the engine simulator) closes an idle keep-alive connection after its
    keep_alive_secs: the connection shows stale with no request sent."""
    engine = await nursery.start(
        serve_engine, EngineConfig(role="decode", keep_alive_secs=0.3, disconnect_poll_secs=0.5)
    )
    connection = await connect("127.0.0.1", engine.port, connect_timeout=5, keepalive_expiry=30)
    response = await connection.request(b"GET", b"/health", [(b"host", b"engine")], b"")
    assert response.status == 200
    await response.read()
    assert connection.is_reusable() and not connection.is_stale()
    with trio.fail_after(5):
        while not connection.is_stale():
            await trio.sleep(0.02)
    await engine.wait_open_connections(0)


# -- closing and cancelling ---------------------------------------------------------------------


async def test_close_now_wakes_a_blocked_reader(nursery):
    server = await start_server(nursery, answer_once(OK_HEAD + b"Content-Length: 10\r\n\r\nab"))
    connection = await open_to(server)
    response = await post(connection)
    caught: list[BaseException] = []

    async def reader() -> None:
        try:
            await response.read()
        except TransportError as exc:
            caught.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as inner:
            inner.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert not caught  # the reader is blocked on the socket
            connection.close_now()
    assert len(caught) == 1 and caught[0].kind == "transport"  # type: ignore[attr-defined]
    assert "closed" in str(caught[0])
    assert not connection.is_reusable() and connection.is_stale()
    with trio.fail_after(10):
        while server.closed < 1:  # the server saw the connection go
            await trio.sleep(0.005)


async def test_close_now_wakes_a_blocked_tls_reader(nursery, ca, server_tls):
    head = OK_HEAD + b"Content-Length: 10\r\n\r\nab"
    server = await start_server(nursery, answer_once(head), server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    connection = await open_to(server, ssl_context=client_tls)
    response = await post(connection)

    async def close_soon() -> None:
        await trio.testing.wait_all_tasks_blocked()
        connection.close_now()

    with trio.fail_after(10):
        async with trio.open_nursery() as inner:
            inner.start_soon(close_soon)
            with pytest.raises(TransportError, match="closed"):
                await response.read()


async def test_close_now_while_waiting_for_the_head(nursery):
    server = await start_server(nursery, answer_once(b""))
    connection = await open_to(server)

    async def close_soon() -> None:
        await trio.testing.wait_all_tasks_blocked()
        connection.close_now()

    with trio.fail_after(10):
        async with trio.open_nursery() as inner:
            inner.start_soon(close_soon)
            with pytest.raises(TransportError, match="closed"):
                await post(connection)
    assert server.requests  # the request was on the wire


async def test_cancel_mid_body_leaves_connection_unusable(nursery):
    head = CHUNKED_HEAD + chunked(b"data: 1\n\n")[:-5]
    server = await start_server(nursery, answer_once(head))
    connection = await open_to(server)
    response = await post(connection)
    chunks = response.chunks()
    got = []
    with trio.move_on_after(0.1) as scope:
        async for chunk in chunks:
            got.append(chunk)
    assert scope.cancelled_caught and got == [b"data: 1\n\n"]
    assert not response.complete and not connection.is_reusable()
    # Not resumable: the interrupted read poisoned the connection.
    with trio.fail_after(10), pytest.raises(TransportError, match="interrupted"):
        await response.read()
    await connection.aclose()


async def test_iteration_resumes_after_break(nursery):
    server = await start_server(
        nursery, answer(OK_HEAD + b"Content-Length: 8\r\n\r\nabcd", b"efgh")
    )
    connection = await open_to(server)
    response = await post(connection)
    async for chunk in response.chunks():
        assert chunk == b"abcd"
        break
    assert await response.read() == b"efgh"
    assert response.complete and connection.is_reusable()


async def test_unfinished_body_then_aclose(nursery):
    server = await start_server(
        nursery, answer(OK_HEAD + b"Content-Length: 8\r\n\r\nabcd", b"efgh")
    )
    connection = await open_to(server)
    response = await post(connection)
    async for chunk in response.chunks():
        assert chunk == b"abcd"
        break  # leave the rest unread
    await response.aclose()
    assert not connection.is_reusable()
    with pytest.raises(RuntimeError, match="busy, closed or spent"):
        await post(connection)


async def test_bounded_read(nursery):
    body = b"e" * 300_000
    server = await start_server(nursery, answer(length_answer(body)))
    connection = await open_to(server)
    response = await post(connection)
    assert await response.read(limit=1000) == b"e" * 1000
    assert not response.complete and not connection.is_reusable()

    connection = await open_to(server)
    response = await post(connection)
    assert await response.read(limit=len(body) + 10) == body  # the limit was not reached
    assert response.complete and connection.is_reusable()


async def test_caller_mistakes_are_refused(nursery):
    server = await start_server(nursery, answer(length_answer(b"")))
    connection = await open_to(server)
    for headers, target in [
        ([(b"x-evil", b"a\r\nx-injected: 1")], b"/"),
        ([(b"x-evil", b"a\nb")], b"/"),
        ([(b"host", b"h")], b"/a b"),
    ]:
        with pytest.raises(ValueError):
            await connection.request(b"GET", target, headers, b"")
    assert server.requests == []
    assert connection.is_reusable()  # nothing was sent


async def test_early_answer_while_the_body_is_still_going_out(nursery):
    """The server answers 413 and closes before reading the body: the send fails, the
    answer is still returned."""
    body = b"z" * (32 << 20)  # more than the loopback buffers hold

    async def script(peer: Peer) -> None:
        while b"\r\n\r\n" not in peer.buffer:
            peer.buffer += await peer.stream.receive_some(65536)
        peer.server.requests.append(peer.buffer)
        await peer.stream.send_all(length_answer(b"too big", b"HTTP/1.1 413 Too Large\r\n"))
        await peer.stream.aclose()  # unread data in the receive queue: the kernel sends an RST

    server = await start_server(nursery, script)
    connection = await open_to(server)
    response = await post(connection, body)
    assert response.status == 413
    assert await response.read() == b"too big"
    assert len(server.requests[0]) < len(body)  # the body could not have gone out in full
    assert not connection.is_reusable()


# -- TLS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server_tls(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return context


async def test_tls_request_and_reuse(nursery, ca, server_tls):
    server = await start_server(nursery, answer(CHUNKED_HEAD, chunked(b"secret") + b""), server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    connection = await open_to(server, ssl_context=client_tls, server_hostname="localhost")
    for _ in range(3):
        response = await post(connection)
        assert await response.read() == b"secret"
        assert connection.is_reusable() and not connection.is_stale()
    assert server.accepted == 1
    assert server.requests[0].startswith(b"POST /generate HTTP/1.1\r\n")


async def test_tls_server_close_makes_stale(nursery, ca, server_tls):
    server = await start_server(
        nursery, answer_once(length_answer(b"one"), then="close"), server_tls
    )
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    connection = await open_to(server, ssl_context=client_tls)  # verifies the IP address
    assert await (await post(connection)).read() == b"one"
    with trio.fail_after(10):
        while not connection.is_stale():
            await trio.sleep(0.005)


async def test_tls_verification_failure(nursery, server_tls):
    server = await start_server(nursery, answer(length_answer(b"")), server_tls)
    untrusting = ssl.create_default_context()  # does not know the trustme CA
    with pytest.raises(
        TransportError, match=r"TLS handshake with 127\.0\.0\.1:.*certificate verif"
    ):
        await open_to(server, ssl_context=untrusting)


async def test_tls_hostname_mismatch(nursery, ca, server_tls):
    server = await start_server(nursery, answer(length_answer(b"")), server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    with pytest.raises(TransportError, match=r"certificate verify failed.*mismatch") as caught:
        await open_to(server, ssl_context=client_tls, server_hostname="other.example")
    assert caught.value.kind == "transport"


# -- the engine simulator: a PD pair as the router drives it --------------------------------------


@pytest.fixture
async def pd_pair(nursery: trio.Nursery) -> AsyncIterator[tuple[EngineHandle, EngineHandle]]:
    prefill = await nursery.start(
        serve_engine, EngineConfig(role="prefill", disconnect_poll_secs=0.5)
    )
    decode = await nursery.start(
        serve_engine,
        EngineConfig(role="decode", disconnect_poll_secs=0.5, inter_token_ms=5.0),
    )
    yield prefill, decode


async def test_engine_pd_streams_over_reused_connections(pd_pair):
    prefill, decode = pd_pair
    prefill_conn = await connect("127.0.0.1", prefill.port, connect_timeout=5, keepalive_expiry=30)
    decode_conn = await connect("127.0.0.1", decode.port, connect_timeout=5, keepalive_expiry=30)
    results: dict[str, tuple[Response, list[bytes]]] = {}

    async def leg(name: str, connection: Connection, body: bytes) -> None:
        headers = [
            (b"host", b"engine"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        response = await connection.request(b"POST", b"/generate", headers, body)
        results[name] = (response, await collect(response))

    for _ in range(3):
        payload = pd_body(
            prefill, new_room(), text="hello", stream=True, sampling_params={"max_new_tokens": 8}
        )
        body = orjson.dumps(payload)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(leg, "prefill", prefill_conn, body)
            nursery.start_soon(leg, "decode", decode_conn, body)
        response, chunks = results["decode"]
        assert response.status == 200
        assert response.header(b"content-type").startswith(b"text/event-stream")
        events = b"".join(chunks).split(b"\n\n")
        data = [e for e in events if e.startswith(b"data: ")]
        assert data[-1] == b"data: [DONE]" and len(data) == 9
        # Paced 5 ms apart: several reads, each one item (never more items than events).
        assert 2 <= len(chunks) <= len(data)
        assert results["prefill"][0].status == 200
        assert prefill_conn.is_reusable() and decode_conn.is_reusable()
    assert decode.total_connections == 1 and prefill.total_connections == 1
    await decode_conn.aclose()
    await decode.wait_open_connections(0)


# -- bounds on a response head ------------------------------------------------------------------


def head_with(lines: list[bytes]) -> bytes:
    """A 200 head of exactly these header lines plus Content-Length (one more line)."""
    return b"HTTP/1.1 200 OK\r\n" + b"".join(line + b"\r\n" for line in lines)


@pytest.mark.parametrize(
    ("lines", "failure"),
    [
        ([b"x-%d: v" % i for i in range(MAX_RESPONSE_HEADERS - 1)], None),  # 100 with the length
        ([b"x-%d: v" % i for i in range(MAX_RESPONSE_HEADERS)], "more than 100 headers"),
        ([b"x-big: " + b"b" * (MAX_HEAD_BYTES - 60)], None),  # just under, in one read or two
        ([b"x-big: " + b"b" * MAX_HEAD_BYTES], "head larger than 65536 bytes"),
        # A 1xx head's headers do not count against the final head's.
        ([b"x-%d: v" % i for i in range(60)], None),
    ],
)
async def test_a_response_head_is_bounded_in_count_and_size(nursery, lines, failure):
    interim = b"HTTP/1.1 100 Continue\r\n" + b"".join(b"y-%d: v\r\n" % i for i in range(60))
    server = await start_server(
        nursery, answer_once(interim + b"\r\n", length_answer(b"{}", head_with(lines)))
    )
    connection = await open_to(server)
    if failure is None:
        response = await post(connection)
        assert len(response.headers) == len(lines) + 1
        assert await response.read() == b"{}"
        return
    with pytest.raises(TransportError, match=failure):
        await post(connection)
    assert not connection.is_reusable()


async def test_trailers_are_bounded_like_a_head(nursery):
    trailers = b"".join(b"t-%d: v\r\n" % i for i in range(MAX_RESPONSE_HEADERS + 1))
    body = b"5\r\nhello\r\n0\r\n" + trailers + b"\r\n"
    server = await start_server(nursery, answer_once(CHUNKED_HEAD, body))
    connection = await open_to(server)
    response = await post(connection)
    with pytest.raises(TransportError, match="more than 100 headers"):
        await response.read()
