"""Hostile worker answers (issue 19 item 13) and hop-by-hop headers both ways.

The decode worker is a real simulated engine behind a few lines of trio that add headers to
its answer's head (`HeadAdder`), so the PD protocol stays real while the answer turns hostile:
thousands of headers, a head too large, headers a `Connection` header names. The client's own
`Connection`-named headers are checked as the engine saw them.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
import trio

from tests.conftest import Cluster, cluster_of, start_engine
from tests.router.helpers import generate_body, read_sse
from trio_pd.upstream.http11 import MAX_HEAD_BYTES, MAX_RESPONSE_HEADERS


class HeadAdder:
    """A TCP forwarder to an engine that puts `extra` header lines into the head of every
    answer to a POST (generation; the health probes' GETs pass as they are), with
    `Connection: close` so each connection carries exactly one answer."""

    def __init__(self, target_port: int, extra: Sequence[bytes]) -> None:
        self.target_port = target_port
        self.extra = b"".join(line + b"\r\n" for line in extra)
        self.heads_sent: list[int] = []  # sizes of the heads it sent

    async def serve(self, *, task_status: trio.TaskStatus[int]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self.forward, listeners)

    async def forward(self, client: trio.SocketStream) -> None:
        first = await client.receive_some(65536)
        extra = b"Connection: close\r\n" + self.extra if first.startswith(b"POST") else b""
        async with client, await trio.open_tcp_stream("127.0.0.1", self.target_port) as engine:
            await engine.send_all(first)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.upstream, client, engine)
                await self.downstream(engine, client, extra)
                nursery.cancel_scope.cancel()

    async def upstream(self, client: trio.SocketStream, engine: trio.SocketStream) -> None:
        try:
            async for data in client:
                await engine.send_all(data)
        except trio.BrokenResourceError:
            pass

    async def downstream(
        self, engine: trio.SocketStream, client: trio.SocketStream, extra: bytes
    ) -> None:
        buffer: bytes | None = b"" if extra else None
        try:
            async for data in engine:
                if buffer is not None:
                    buffer += data
                    if b"\r\n\r\n" not in buffer:
                        continue
                    status, _, rest = buffer.partition(b"\r\n")
                    head = status + b"\r\n" + extra + rest
                    self.heads_sent.append(head.index(b"\r\n\r\n"))
                    data, buffer = head, None
                await client.send_all(data)
        except trio.BrokenResourceError:
            pass


async def hostile_decode_cluster(
    nursery: trio.Nursery, extra: Sequence[bytes]
) -> tuple[Cluster, HeadAdder]:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    adder = HeadAdder(decode.port, extra)
    port = await nursery.start(adder.serve)
    cluster = await cluster_of(nursery, [prefill], [attrs.evolve(decode, port=port)])
    return cluster, adder


def decode_failures(cluster: Cluster) -> float:
    value = cluster.router.metrics.registry.get_sample_value(
        "trio_pd_leg_failures_total", {"role": "decode", "kind": "transport"}
    )
    return value or 0.0


# (the head lines added, the reason the router must give): the 20,009 headers
# (229 KB), one header past the count bound, and a head past the size bound in few headers.
TOO_MUCH = [
    ([b"h%d: v" % i for i in range(20_009)], "more than 100 headers"),  # 218 KB
    ([b"x-h%d: v" % i for i in range(MAX_RESPONSE_HEADERS + 1)], "more than 100 headers"),
    ([b"x-big%d: %s" % (i, b"b" * 30_000) for i in range(3)], "head larger than 65536 bytes"),
]


@pytest.mark.parametrize(("extra", "reason"), TOO_MUCH, ids=["20009", "101", "90KiB"])
async def test_a_worker_answer_head_past_the_bounds_is_a_502_against_the_worker(
    nursery: trio.Nursery, extra: list[bytes], reason: str
) -> None:
    cluster, adder = await hostile_decode_cluster(nursery, extra)
    response = await cluster.client.post("/generate", json=generate_body())
    rid = response.headers["x-request-id"]
    assert cluster.decode.events.find("request_start", rid=rid)  # the engine did answer...
    assert adder.heads_sent and max(adder.heads_sent) > min(MAX_HEAD_BYTES, 100 * 8)  # ...big
    assert response.status_code == 502, response.text
    assert reason in response.json()["error"]["message"]
    assert len(response.headers.raw) < 20  # none of the worker's headers reached the client
    decode = cluster.router.fleet.workers("decode")[0]
    assert decode.breaker.total_failures == 1  # counted against the worker
    assert decode_failures(cluster) == 1
    await cluster.client.aclose()


async def test_headers_a_worker_names_in_connection_are_not_relayed(
    nursery: trio.Nursery,
) -> None:
    extra = [
        b"Connection: x-hop-one, X-Hop-Two",
        b"x-hop-one: 1",
        b"X-Hop-Two: 2",
        b"Proxy-Connection: x-hop-three",
        b"x-hop-three: 3",
        b"Keep-Alive: timeout=5",
        b"x-end-to-end: kept",
        *(b"x-h%d: v" % i for i in range(80)),  # within the bound: relayed as they came
    ]
    cluster, adder = await hostile_decode_cluster(nursery, extra)
    for stream in (False, True):
        body = generate_body(stream=stream)
        async with cluster.client.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            if stream:
                assert (await read_sse(response))[-1] == "[DONE]"
            else:
                await response.aread()
        names = {name.lower() for name, _ in response.headers.raw}
        assert b"x-end-to-end" in names and b"x-h79" in names  # the worker's headers came...
        relayed_hops = names & {b"x-hop-one", b"x-hop-two", b"x-hop-three", b"keep-alive"}
        assert relayed_hops == set()  # ...less the hop-by-hop ones
        assert b"proxy-connection" not in names
    assert len(adder.heads_sent) == 2
    await cluster.client.aclose()


async def test_headers_a_client_names_in_connection_are_not_forwarded(
    nursery: trio.Nursery,
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    cluster = await cluster_of(nursery, [prefill], [decode])
    headers = {
        "connection": "keep-alive, traceparent, x-request-id-hop",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "x-request-id-hop": "hop",
        "x-request-id-kept": "kept",
        "x-correlation-id": "corr-1",
    }
    response = await cluster.client.post("/generate", json=generate_body(), headers=headers)
    assert response.status_code == 200
    for engine in (prefill, decode):
        seen = engine.events.find("request_start", rid=response.headers["x-request-id"])[0]
        assert seen["headers"]["x-correlation-id"] == "corr-1"  # forwarded headers go on...
        assert seen["headers"]["x-request-id-kept"] == "kept"
        assert "traceparent" not in seen["headers"]  # ...unless the client said hop-by-hop
        assert "x-request-id-hop" not in seen["headers"]
    await cluster.client.aclose()
