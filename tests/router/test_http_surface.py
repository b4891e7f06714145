"""The router's HTTP surface, as raw bytes on a real socket (issue 19, item 12).

RFC 9112 lets a server refuse what a proxy in front of it might read differently, and the router
does: a head with both Content-Length and Transfer-Encoding (§6.3, the request-smuggling shape),
bare-LF line endings (§2.2) and obs-fold lines (§5.2) are a 400 and the connection is closed,
before any engine sees a byte. Every error the HTTP layer makes itself (a malformed head, headers
too large, a transfer coding it does not do, a WebSocket handshake) is the JSON envelope. HTTP/2
(h2c upgrade, prior knowledge, ALPN h2) is off unless `enable_http2`, and a TLS client must
finish its handshake within `tls_handshake_timeout_secs`.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import h11
import orjson
import pytest
import trio
import trustme

from tests.conftest import Cluster, start_cluster
from trio_pd.serve.listeners import hypercorn_config

# A hang guard, never a bound: what a test waits for is the router's answer or its close.
HANG_SECS = 60.0
# hypercorn's own TLS handshake timeout (`ssl_handshake_timeout`), which the router's replaces.
HYPERCORN_HANDSHAKE_SECS = 60.0

SMUGGLE_BODY = b"0\r\n\r\nPOST /flush_cache HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"


def address(cluster: Cluster) -> tuple[str, int]:
    host, port = cluster.url.split("://")[1].rsplit(":", 1)
    return host, int(port)


async def exchange(cluster: Cluster, raw: bytes, *, until_closed: bool = False) -> bytes:
    """Send `raw` on a new connection: what came back, up to the end of the first response, or
    with `until_closed` up to the router's close (the test fails if it never comes)."""
    stream = await trio.open_tcp_stream(*address(cluster))
    await stream.send_all(raw)
    data = b""
    try:
        with trio.fail_after(HANG_SECS):
            while until_closed or not whole_response(data):
                piece = await stream.receive_some(65536)
                if not piece:
                    break
                data += piece
    except trio.TooSlowError:
        kept = f"the router kept the connection open; it sent {data[:300]!r}"
        raise AssertionError(kept) from None
    finally:
        await stream.aclose()
    return data


def whole_response(data: bytes) -> bool:
    """Whether `data` holds a whole first response (a 101's head is all of it)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    if b" 101 " in head.split(b"\r\n", 1)[0]:
        return True
    for line in head.lower().split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip() == b"content-length":
            return len(body) >= int(value)
    return body.endswith(b"0\r\n\r\n")  # chunked


def answer(data: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """The first response in `data`: status, headers, body."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(b":") for x in lines[1:])}
    return status, headers, body[: int(headers.get(b"content-length", len(body)))]


def envelope(data: bytes, status: int) -> dict[str, Any]:
    got, headers, body = answer(data)
    assert got == status, data
    assert headers[b"content-type"] == b"application/json"
    error = orjson.loads(body)["error"]
    assert error["code"] == status and error["message"] and error["type"]
    return error


def engine_bytes(cluster: Cluster) -> int:
    return sum(len(e.events.find("request_start")) for e in (*cluster.prefills, *cluster.decodes))


REFUSED_HEADS = {
    # Transfer-Encoding would win over Content-Length: the chunked body ends at once and the
    # rest would be read as a second request (a POST /flush_cache) by this server but not by
    # a proxy in front that trusted Content-Length.
    "content-length and transfer-encoding": (
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n" % len(SMUGGLE_BODY)
    )
    + SMUGGLE_BODY,
    "bare LF": b"GET /health HTTP/1.1\nhost: x\n\n",
    "bare LF in one line": b"GET /health HTTP/1.1\r\nhost: x\nx-a: b\r\n\r\n",
    "obs-fold": b"GET /health HTTP/1.1\r\nhost: x\r\nx-a: b\r\n  c\r\n\r\n",
    "non-ASCII target": b"GET /h\xffalth HTTP/1.1\r\nhost: x\r\n\r\n",
    "not a request line": b"HELLO\r\n\r\n",
    "no host": b"GET /health HTTP/1.1\r\n\r\n",
    "bad content-length": b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 1x\r\n\r\n",
}


@pytest.mark.parametrize("name", sorted(REFUSED_HEADS))
async def test_a_head_rfc_9112_lets_us_refuse_is_a_400_and_the_connection_closes(
    cluster: Cluster, name: str
) -> None:
    data = await exchange(cluster, REFUSED_HEADS[name], until_closed=True)
    envelope(data, 400)
    assert answer(data)[1][b"connection"] == b"close"
    assert data.count(b"\r\ndate: ") == 1  # one answer: nothing read past the refused head
    assert engine_bytes(cluster) == 0
    assert not cluster.prefill.events.find("info_request", path="/flush_cache")


async def test_the_same_heads_well_formed_are_served(cluster: Cluster) -> None:
    """The control: each refusal above is about the framing, not the request."""
    data = await exchange(cluster, b"GET /health HTTP/1.1\r\nhost: x\r\nx-a: b c\r\n\r\n")
    assert answer(data)[0] == 200
    body = orjson.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    data = await exchange(
        cluster,
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" + chunked,
    )
    assert answer(data)[0] == 200, data


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"POST /generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n", 501),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),  # HTTP/2 prior knowledge, not enabled
    ],
    ids=["headers too large", "gzip transfer coding", "h2 prior knowledge"],
)
async def test_the_http_layers_own_errors_are_envelopes(
    cluster: Cluster, raw: bytes, status: int
) -> None:
    data = await exchange(cluster, raw, until_closed=True)
    envelope(data, status)
    assert engine_bytes(cluster) == 0


async def test_a_websocket_handshake_is_refused_with_the_envelope(cluster: Cluster) -> None:
    data = await exchange(
        cluster,
        b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n",
    )
    assert "WebSocket" in envelope(data, 400)["message"]


H2C_UPGRADE = (
    b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: upgrade, http2-settings\r\n"
    b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\nconnection: close\r\n\r\n"
)


async def test_h2c_is_off_unless_enabled(nursery: trio.Nursery) -> None:
    off = await start_cluster(nursery)
    data = await exchange(off, H2C_UPGRADE)
    assert answer(data)[0] == 200  # the upgrade is ignored: answered in HTTP/1.1
    assert b"101" not in data.split(b"\r\n", 1)[0]
    on = await start_cluster(nursery, enable_http2=True)
    data = await exchange(on, H2C_UPGRADE)
    assert data.startswith(b"HTTP/1.1 101 ")  # hypercorn's HTTP/2 when asked for
    assert b"upgrade: h2c" in data.lower()
    for cluster in (off, on):
        await cluster.client.aclose()
        await cluster.admin.aclose()


# -- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_files(ca: trustme.CA, tmp_path: Path) -> dict[str, str]:
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    cert.private_key_pem.write_to_path(tmp_path / "key.pem")
    return {"tls_cert_path": str(tmp_path / "cert.pem"), "tls_key_path": str(tmp_path / "key.pem")}


async def alpn_of(cluster: Cluster, ca: trustme.CA) -> str | None:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    context.set_alpn_protocols(["h2", "http/1.1"])
    raw = await trio.open_tcp_stream(*address(cluster))
    stream = trio.SSLStream(raw, context, server_hostname="127.0.0.1")
    await stream.do_handshake()
    chosen = stream.selected_alpn_protocol()
    await stream.aclose()
    return chosen


async def test_tls_offers_http2_only_when_enabled(
    nursery: trio.Nursery, ca: trustme.CA, tls_files: dict[str, str]
) -> None:
    off = await tls_cluster(nursery, ca, tls_files)
    assert await alpn_of(off, ca) == "http/1.1"
    on = await tls_cluster(nursery, ca, tls_files, enable_http2=True)
    assert await alpn_of(on, ca) == "h2"


async def tls_cluster(
    nursery: trio.Nursery, ca: trustme.CA, files: dict[str, str], **options: Any
) -> Cluster:
    from tests.conftest import ROUTER_DEFAULTS, start_engine, start_router
    from trio_pd.config import RouterConfig
    from trio_pd.spec import WorkerSpec

    prefill, decode = await start_engine(nursery, "prefill"), await start_engine(nursery, "decode")
    config = RouterConfig(
        prefill=(WorkerSpec(prefill.url, "prefill", prefill.bootstrap_port),),
        decode=(WorkerSpec(decode.url, "decode"),),
        **{**ROUTER_DEFAULTS, **files, **options},
    )
    router, url = await start_router(nursery, config)
    assert url.startswith("https://")
    return Cluster([prefill], [decode], router, url, None, None)  # type: ignore[arg-type]


async def test_a_tls_client_that_never_handshakes_is_cut_off(
    nursery: trio.Nursery, ca: trustme.CA, tls_files: dict[str, str]
) -> None:
    cluster = await tls_cluster(nursery, ca, tls_files, tls_handshake_timeout_secs=0.5)
    started = trio.current_time()  # before either connection: their timeouts start later
    silent = await trio.open_tcp_stream(*address(cluster))
    partial = await trio.open_tcp_stream(*address(cluster))
    await partial.send_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello begun
    for stream in (silent, partial):
        with trio.fail_after(HYPERCORN_HANDSHAKE_SECS):  # a hang guard: hypercorn's own cut
            while True:
                try:
                    if not await stream.receive_some(1024):
                        break
                except trio.BrokenResourceError:
                    break
        await stream.aclose()
    took = trio.current_time() - started
    # Cut by the router's timeout: the listener's hypercorn config carries the flag in place of
    # hypercorn's 60 s default (the mechanism, read without a clock), and the cut came no
    # sooner than it (a busy machine can only make it later).
    assert hypercorn_config(cluster.router.config).ssl_handshake_timeout == 0.5
    assert took >= 0.5, took
    # A client that does handshake is served as before.
    assert await alpn_of(cluster, ca) == "http/1.1"


def test_strict_head_still_fits_h11() -> None:
    """The head check reaches into h11's receive buffer (`serve/connection.py`): an h11 whose
    layout changed must fail here, not silently stop checking."""
    from trio_pd.serve.connection import StrictHead

    connection = h11.Connection(h11.SERVER)
    assert type(connection._receive_buffer).__name__ == "ReceiveBuffer"
    connection._receive_buffer = StrictHead(connection, http2=False)
    connection.receive_data(b"GET / HTTP/1.1\nhost: x\n\n")
    with pytest.raises(h11.RemoteProtocolError):
        connection.next_event()
