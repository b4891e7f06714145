"""Containment, part 4 (issue 26): what the data port takes and what it gives away.

- N13: the 16 KiB bound on a request head held only while the head was incomplete: 61 KB of
  head in one segment was taken whole and its 1,462 `x-request-id-*` headers reached both
  workers. Now the bound holds however the head arrives: a 431 envelope, no worker sees it.
- N14: the data port's 403 for a keyless change named the admin listener's address to anyone;
  now it names the flags only. A router key inside a forwarded value (`tracestate: k=<key>`,
  `Authorization: Bearer <key>,x`, `Basic` credentials) reached the workers; now a header
  holding a key anywhere is not forwarded, and one that does not is (the control).
"""

from __future__ import annotations

import base64

import orjson
import trio

from tests.conftest import Cluster, start_cluster
from tests.router.helpers import generate_body
from tests.router.test_http_surface import (
    HANG_SECS,
    address,
    answer,
    engine_bytes,
    envelope,
    exchange,
    whole_response,
)
from tests.router.test_security import ADMIN, USER, secrets_seen

BODY = orjson.dumps(generate_body())
HEAD_LIMIT = 16 * 1024  # hypercorn's h11_max_incomplete_size, the router's bound on a head


def generate_head(head_bytes: int) -> bytes:
    """A POST /generate with its body, whose head (with `x-request-id-*` headers, which the
    router forwards to both legs) is about `head_bytes` long."""
    start = (
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n" % len(BODY)
    )
    fields = []
    size = len(start) + 2
    while size < head_bytes - 40:
        field = b"x-request-id-%d: %s\r\n" % (len(fields), b"v" * 24)
        fields.append(field)
        size += len(field)
    return start + b"".join(fields) + b"\r\n"


async def exchange_in_pieces(cluster: Cluster, raw: bytes, piece: int) -> bytes:
    """Send `raw` in `piece`-byte writes, each after the router has had a turn to read."""
    stream = await trio.open_tcp_stream(*address(cluster))
    for at in range(0, len(raw), piece):
        try:
            await stream.send_all(raw[at : at + piece])
        except trio.BrokenResourceError:
            break  # refused mid-head: the answer is waiting
        await trio.sleep(0.005)  # let the router read this piece on its own
    data = b""
    with trio.fail_after(HANG_SECS):  # a hang guard: the answer is what is waited for
        try:
            while not whole_response(data) and (chunk := await stream.receive_some(65536)):
                data += chunk
        except trio.BrokenResourceError:
            pass
    await stream.aclose()
    return data


async def test_a_head_past_the_limit_in_one_segment_is_a_431_no_worker_sees(
    cluster: Cluster,
) -> None:
    """N13: 61 KB of head sent at once (one read of the router's: 64 KiB)."""
    head = generate_head(61_000)
    assert len(head) > 60_000 and head.count(b"\r\nx-request-id-") > 1_300
    data = await exchange(cluster, head + BODY, until_closed=True)
    assert "too large" in envelope(data, 431)["message"]
    assert engine_bytes(cluster) == 0  # no worker saw the request


async def test_a_head_past_the_limit_in_pieces_is_the_same_431(cluster: Cluster) -> None:
    data = await exchange_in_pieces(cluster, generate_head(61_000) + BODY, 2_048)
    assert "too large" in envelope(data, 431)["message"]
    assert engine_bytes(cluster) == 0


async def test_a_head_within_the_limit_in_one_segment_is_served(cluster: Cluster) -> None:
    """The control: the same shape of head, under 16 KiB, is served and its forwarded
    headers do reach both workers (so the refusals above are about the size alone)."""
    head = generate_head(HEAD_LIMIT - 512)
    data = await exchange(cluster, head + BODY)
    status, headers, _ = answer(data)
    assert status == 200, data
    rid = headers[b"x-request-id"].decode()
    for engine in (cluster.prefill, cluster.decode):
        seen = engine.events.find("request_start", rid=rid)[0]["headers"]
        assert sum(name.startswith("x-request-id-") for name in seen) > 300


async def test_the_data_ports_403_names_no_admin_address(cluster: Cluster) -> None:
    """N14: the keyless change refused on the data port says which flags, not where."""
    admin_url = cluster.router.access.admin_url
    assert admin_url is not None  # the router does have an admin listener
    assert (await cluster.admin.get("/workers")).status_code == 200  # and it answers
    port = admin_url.rsplit(":", 1)[1]
    for method, path in [("POST", "/flush_cache"), ("DELETE", "/workers/x"), ("POST", "/workers")]:
        refused = await cluster.client.request(method, path, json={})
        assert refused.status_code == 403, refused.text
        assert "--admin-port" in refused.json()["error"]["message"]
        assert admin_url not in refused.text and port not in refused.text


async def test_a_router_key_inside_a_forwarded_value_reaches_no_worker(
    nursery: trio.Nursery,
) -> None:
    """N14: keys inside a value, not only as the whole value, are the router's too."""
    cluster = await start_cluster(nursery, control_plane_api_keys=(ADMIN, USER))
    basic = base64.b64encode(b"someone:" + USER.key.encode()).decode()
    shapes = [
        {"tracestate": f"k={ADMIN.key}", "authorization": f"Bearer {USER.key},x"},
        {"traceparent": f"00-{USER.key}-01", "x-correlation-id": f"a,{ADMIN.key};b"},
        {"x-request-id-team": f"team={USER.key}", "x-smg-routing-key": f"{ADMIN.key}-tail"},
        {"authorization": f"Basic {basic}", "x-request-id": f"id-{USER.key}"},
    ]
    for headers in shapes:
        response = await cluster.client.post("/generate", json=generate_body(), headers=headers)
        assert response.status_code == 200, response.text
        rid = response.headers["x-request-id"]
        assert USER.key not in rid and ADMIN.key not in rid
        for engine in (cluster.prefill, cluster.decode):
            assert engine.events.find("request_start", rid=rid)  # it did go through
    for engine in (cluster.prefill, cluster.decode):
        assert secrets_seen(engine) == []
    # The control: the same headers without a key are forwarded as they came.
    plain = {"tracestate": "k=other", "authorization": "Bearer client-token,x"}
    response = await cluster.client.post("/generate", json=generate_body(), headers=plain)
    seen = cluster.prefill.events.find("request_start", rid=response.headers["x-request-id"])
    assert seen[0]["headers"]["tracestate"] == "k=other"
    assert seen[0]["headers"]["authorization"] == "Bearer client-token,x"
    await cluster.client.aclose()
    await cluster.admin.aclose()
