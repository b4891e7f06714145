"""Containment: no request, client or worker can take the whole router down (issue 9).

Each test provokes one way a single request, a slow client or a bad interleaving could hurt
everyone else, through a real router over real sockets, and checks both what the clients got
and what the engines saw.
"""

from __future__ import annotations

import json
import resource

import orjson
import pytest
import trio

from tests.conftest import Cluster, start_cluster
from tests.router.fleet_tools import LOOSE, build_cluster, start_stoppable
from tests.router.helpers import CANCELLED, generate_body, read_sse, settle
from trio_pd.config import BreakerConfig, RetryConfig, TimeoutConfig
from trio_pd.serve.listeners import USER_TIMEOUT_MARGIN_SECS, user_timeout_secs
from trio_pd.upstream.http11 import Connection
from trio_pd.upstream.pool import UpstreamPool

FAST_RETRY = RetryConfig(max_retries=5, initial_backoff_ms=5, max_backoff_ms=20, jitter_factor=0)


def engines_saw(cluster: Cluster, rid: str) -> int:
    return sum(
        len(e.events.find("request_start", rid=rid)) for e in (*cluster.prefills, *cluster.decodes)
    )


# -- poison requests --------------------------------------------------------------------------


async def test_poison_requests_never_open_the_fleet_for_everyone(nursery: trio.Nursery) -> None:
    """20 requests whose prefill fails deterministically (the kinds a client can provoke), with
    retries and the breaker at their defaults, then 32 ordinary streams: all succeed."""
    cluster = await start_cluster(nursery, retry=FAST_RETRY, breaker=BreakerConfig())
    poisons = ["prefill:500@20", "prefill:sse_error@20", "prefill:400", "prefill:abort@20"]
    statuses: list[int] = []

    async def poison(i: int) -> None:
        body = generate_body(stream=i % 2 == 0, sim_fault=poisons[i % len(poisons)])
        statuses.append((await cluster.client.post("/generate", json=body)).status_code)

    async with trio.open_nursery() as burst:
        for i in range(20):
            burst.start_soon(poison, i)
    assert sorted(set(statuses)) == [400, 502]
    prefill = cluster.router.fleet.workers("prefill")[0]
    # 15 requests failed through the worker's fault kinds, each voting once however many
    # times it was retried: enough to open the breaker of the only prefill.
    assert prefill.breaker.total_failures == 15
    assert prefill.breaker.state == "open"

    ok = 0

    async def ordinary() -> None:
        nonlocal ok
        body = generate_body(stream=True, max_new_tokens=3)
        async with cluster.client.stream("POST", "/generate", json=body) as response:
            events = await read_sse(response)
        if response.status_code == 200 and events[-1] == "[DONE]":
            ok += 1

    async with trio.open_nursery() as streams:
        for _ in range(32):
            streams.start_soon(ordinary)
    assert ok == 32
    assert cluster.router.fleet.panics["prefill"] >= 32  # routed in panic, not refused
    await cluster.client.aclose()


async def test_the_same_failure_on_two_workers_stops_the_retries(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, n_prefill=3, retry=FAST_RETRY)
    rid = "poison-everywhere"
    response = await cluster.client.post(
        "/generate", json=generate_body(sim_fault="prefill:500@20"), headers={"x-request-id": rid}
    )
    assert response.status_code == 502
    tried = [i for i, e in enumerate(cluster.prefills) if e.events.find("request_start", rid=rid)]
    assert len(tried) == 2  # a third worker would only fail the same way
    workers = cluster.router.fleet.workers("prefill")
    assert [workers[i].breaker.total_failures for i in tried] == [1, 1]
    await cluster.client.aclose()


async def test_a_dead_prefill_beside_a_healthy_one_stops_getting_traffic(
    nursery: trio.Nursery,
) -> None:
    """Its health checks pass (it answers /health) but every request fails: the breaker takes
    it out of rotation because another prefill is there to serve."""
    cluster = await build_cluster(
        nursery,
        prefills=[{"faults": ("prefill:500",)}, {}],
        retry=FAST_RETRY,
        breaker=BreakerConfig(failure_threshold=3),
    )
    dead, healthy = cluster.prefills
    for i in range(30):
        response = await cluster.client.post("/generate", json=generate_body())
        assert response.status_code == 200, i
    assert len(dead.events.find("request_start")) == 3  # three votes, then out of rotation
    assert len(healthy.events.find("request_start")) == 30
    assert cluster.router.fleet.workers("prefill")[0].breaker.state == "open"
    assert cluster.router.fleet.panics["prefill"] == 0
    await cluster.client.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("fault", "status"), [("sse_error:400", 400), ("abort:422", 422)])
async def test_an_inband_4xx_is_the_clients_refused_request(
    nursery: trio.Nursery, stream: bool, fault: str, status: int
) -> None:
    cluster = await start_cluster(nursery, retry=FAST_RETRY)
    rid = f"inband-{status}"
    response = await cluster.client.post(
        "/generate",
        json=generate_body(stream=stream, sim_fault=f"prefill:{fault}@20"),
        headers={"x-request-id": rid},
    )
    assert response.status_code == status
    if stream or fault.startswith("sse_error"):  # in-band: the router's envelope
        error = response.json()["error"]
        assert error["code"] == status and error["type"] == "invalid_request_error"
        message = error["message"]
    else:  # SGLang's non-stream abort with a status is that HTTP status, its body relayed
        message = response.json()["message"]
    assert "simulated prefill fault" in message
    assert len(cluster.prefill.events.find("request_start", rid=rid)) == 1  # not retried
    prefill = cluster.router.fleet.workers("prefill")[0]
    assert (prefill.breaker.total_failures, prefill.breaker.total_successes) == (0, 1)
    await cluster.decode.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    await cluster.client.aclose()


# -- bounds -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2**64}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3000000}),
        ("/generate", {"text": ["a"] * 1025}),
        ("/generate", {"input_ids": [[1]] * 1025}),
        ("/v1/completions", {"prompt": ["a"] * 1025}),
    ],
)
async def test_a_batch_over_the_limit_is_refused_before_any_work(
    cluster: Cluster, path: str, body: dict
) -> None:
    response = await cluster.client.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "--max-batch-size 1024" in error["message"]
    assert engines_saw(cluster, response.headers["x-request-id"]) == 0


async def test_the_injected_body_is_checked_against_the_payload_limit(
    nursery: trio.Nursery,
) -> None:
    raw = orjson.dumps(generate_body(text="x" * 400))
    cluster = await start_cluster(nursery, max_payload_size=len(raw) + 20)
    # The client's body fits; with the router's fields (some 90 bytes) it does not.
    response = await cluster.client.post("/generate", content=raw)
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "payload_too_large"
    assert engines_saw(cluster, response.headers["x-request-id"]) == 0
    await cluster.client.aclose()


# -- never a bare 500, never an altered value -----------------------------------------------


async def test_content_parts_of_any_type_route_fine(cluster: Cluster) -> None:
    """A text part whose `text` is a number once crashed the router's routing-text reader
    (hypercorn's bare 500). The router routes it; the engines judge it (400, relayed)."""
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": 42}, {"type": "text"}, 7]},
            {"role": "user", "content": None},
        ],
        "max_tokens": 2,
    }
    response = await cluster.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert "string `text`" in response.json()["message"]  # the engine's flat body, relayed
    rid = response.headers["x-request-id"]
    engines = cluster.prefills + cluster.decodes
    await settle(lambda: any(e.events.find("request_end", rid=rid, status=400) for e in engines))
    good = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, 7]}]}
    assert (await cluster.client.post("/v1/chat/completions", json=good)).status_code == 200


async def test_an_internal_error_is_a_json_500_with_the_request_id(cluster: Cluster) -> None:
    router = cluster.router
    original = router.fleet.select_pair

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in selection")

    router.fleet.select_pair = broken  # type: ignore[method-assign]
    response = await cluster.client.post(
        "/generate", json=generate_body(), headers={"x-request-id": "bug-1"}
    )
    router.fleet.select_pair = original  # type: ignore[method-assign]
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"] == "bug-1"
    assert response.json()["error"]["type"] == "internal_error"
    metrics = (await cluster.client.get("/metrics")).text
    assert 'trio_pd_requests_total{path="/generate",status="500"} 1.0' in metrics
    assert "trio_pd_internal_errors_total 1.0" in metrics
    assert (await cluster.client.post("/generate", json=generate_body())).status_code == 200


async def test_an_internal_error_mid_stream_ends_it_with_an_error_event(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_pd.respond import Responder

    cluster = await start_cluster(nursery, decode={"inter_token_ms": 10.0})
    original = Responder.send
    sends = 0

    async def flaky_send(self, chunk):
        nonlocal sends
        sends += 1
        if sends == 3:
            raise RuntimeError("a bug in the relay")
        await original(self, chunk)

    monkeypatch.setattr(Responder, "send", flaky_send)
    body = generate_body(stream=True, max_new_tokens=50)
    async with cluster.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        events = await read_sse(response)
        rid = response.headers["x-request-id"]
    assert sends == 3
    assert events[-1] == "[DONE]"
    assert events[-2]["error"] == {
        "message": "internal router error",
        "type": "internal_error",
        "code": 500,
    }
    await cluster.decode.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.decode))
    await cluster.client.aclose()


async def test_big_integers_reach_both_legs_exactly(cluster: Cluster) -> None:
    """Values above 64 bits, even when the router must rewrite the body (the client sent a
    `bootstrap_room` of its own, which the router replaces)."""
    raw = (
        b'{"text": "hi there", "sampling_params": {"max_new_tokens": 2, "seed": '
        b'18446744073709551616}, "big": -99999999999999999999999, "f": 1e5, "g": 0.1000, '
        b'"u": "\\u00e9\\ud83d\\ude00", "bootstrap_room": 5}'
    )
    response = await cluster.client.post("/generate", content=raw)
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    expected = json.loads(raw)
    for engine in (cluster.prefill, cluster.decode):
        got = json.loads(engine.events.find("request_start", rid=rid)[0]["raw"])
        assert got["sampling_params"]["seed"] == 18446744073709551616
        assert isinstance(got["big"], int) and got["big"] == expected["big"]
        assert got["bootstrap_room"] != 5
        assert got["rid"].startswith("trio-pd-")  # the router's own rid, on every attempt
        ours = ("bootstrap_", "rid")
        assert {k: v for k, v in got.items() if not k.startswith(ours)} == {
            k: v for k, v in expected.items() if not k.startswith(ours)
        }


async def test_client_bytes_pass_through_byte_for_byte(cluster: Cluster) -> None:
    raw = (
        b'{ "text" : "keep  my   spacing", "f": 1e5, "g": 0.1000, "seed": 18446744073709551616,'
        b'\n  "u": "\\u00e9", "sampling_params": {"max_new_tokens": 1} }\n'
    )
    response = await cluster.client.post("/generate", content=raw)
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    cut = raw.rstrip().rindex(b"}")
    for engine in (cluster.prefill, cluster.decode):
        got = engine.events.find("request_start", rid=rid)[0]["raw"].encode()
        assert got.startswith(raw[:cut] + b',"bootstrap_host":"127.0.0.1","bootstrap_port":')
        assert got.endswith(b"}") and got.count(b'"bootstrap_room":') == 1


# -- the pool and the background tasks -------------------------------------------------------


async def test_pool_prune_decides_before_closing(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections returned or taken while a prune closes expired ones are left alone, and a
    new worker origin appearing meanwhile does not break the prune."""
    pool = UpstreamPool(keepalive_expiry=0.05)
    urls = [cluster.prefill.url, cluster.decode.url]

    async def touch(url: str) -> None:
        # Any answer is fine (400: no bootstrap room); the point is a connection's round trip.
        async with pool.post(url, "/generate", [], b"{}") as response:
            await response.read()

    await touch(urls[0])
    await trio.sleep(0.1)  # the idle connection to urls[0] is now past its keep-alive
    original = Connection.aclose
    slow_closes = 0

    async def slow_aclose(self: Connection) -> None:
        nonlocal slow_closes
        slow_closes += 1
        await trio.sleep(0.05)  # other tasks run while the prune closes it
        await original(self)

    monkeypatch.setattr(Connection, "aclose", slow_aclose)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.prune)
        await trio.sleep(0.01)  # the prune is inside its close now
        nursery.start_soon(touch, urls[1])  # a new origin appears meanwhile
        nursery.start_soon(touch, urls[0])
    assert slow_closes == 1
    idle = [c for stack in pool._idle.values() for c in stack]
    assert len(idle) == len(set(idle)) == 2
    assert not pool._busy
    monkeypatch.undo()
    await pool.aclose()


async def test_a_crashing_background_task_is_restarted_and_health_checks_go_on(
    nursery: trio.Nursery,
) -> None:
    prefill = await start_stoppable(nursery, "prefill")
    decode = await start_stoppable(nursery, "decode")
    from tests.conftest import cluster_of
    from tests.router.fleet_tools import FAST_HEALTH

    cluster = await cluster_of(nursery, [prefill.handle], [decode.handle], health=FAST_HEALTH)
    pool = cluster.router.pool
    original = pool.prune
    crashes = 0

    async def crash_once() -> None:
        nonlocal crashes
        if crashes == 0:
            crashes += 1
            raise RuntimeError("dictionary changed size during iteration")
        await original()

    pool.prune = crash_once  # type: ignore[method-assign]
    await settle(lambda: crashes == 1, timeout=LOOSE)
    metrics = cluster.router.metrics
    await settle(
        lambda: metrics.background_restarts.labels("pool_pruning")._value.get() == 1,
        timeout=LOOSE,
    )
    # The lifespan's other tasks survived: health checks still notice a dead engine.
    decode.stop()
    await settle(lambda: not cluster.router.fleet.workers("decode")[0].healthy, timeout=LOOSE)
    assert (await cluster.client.get("/readiness")).status_code == 503
    await cluster.client.aclose()


# -- slow and stalled clients, silent workers ------------------------------------------------


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def server_side_established(router_port: int, client_port: int) -> bool:
    """Whether the router's end of the connection from `client_port` is still ESTABLISHED
    (/proc/net/tcp: the kernel drops it from the table once TCP_USER_TIMEOUT aborted it)."""
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            local, remote, state = line.split()[1:4]
            if (int(local.split(":")[1], 16), int(remote.split(":")[1], 16)) == (
                router_port, client_port,
            ) and state == "01":  # fmt: skip
                return True
    return False


async def test_a_client_that_stops_reading_frees_the_decode_slot(nursery: trio.Nursery) -> None:
    """The stream watchdog cuts a stalled client's legs at --stream-stall-timeout-secs; the
    kernel's TCP_USER_TIMEOUT, a little longer, only frees the client's connection afterwards.
    Were they equal, the kernel could win and the cut would be a "client gone", not the
    watchdog's "stall": the connection must still be up when decode is freed."""
    cluster = await start_cluster(
        nursery, timeouts=TimeoutConfig(stream_stall_secs=1.0, stream_idle_secs=60.0)
    )
    host, port = cluster.url.removeprefix("http://").split(":")
    sock = trio.socket.socket()
    sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
    await sock.connect((host, int(port)))
    client_port = sock.getsockname()[1]
    stream = trio.SocketStream(sock)
    body = orjson.dumps(generate_body(stream=True, max_new_tokens=200_000))
    head = (
        f"POST /generate HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"x-request-id: stalled\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    before = rss_mib()
    await stream.send_all(head + body)
    first = await stream.receive_some(1024)
    assert first.startswith(b"HTTP/1.1 200")
    # ...and the client never reads again.
    freed = await cluster.decode.events.wait_for("slot_freed", timeout=LOOSE, rid="stalled")
    assert server_side_established(int(port), client_port), "the kernel ended it first"
    assert freed["reason"] in CANCELLED  # backpressure held decode, then cut it
    assert not cluster.decode.events.find("request_end", rid="stalled", status=200, ended=None)
    assert rss_mib() - before < 30  # 200k tokens were never buffered in the router
    metrics = cluster.router.metrics
    await settle(lambda: metrics.legs_cancelled.labels("decode", "stall")._value.get() == 1, LOOSE)
    assert metrics.legs_cancelled.labels("decode", "client_gone")._value.get() == 0
    # Then the kernel's bound ends the connection the router could no longer write to.
    assert user_timeout_secs(1.0) >= 1.0 + USER_TIMEOUT_MARGIN_SECS
    await settle(lambda: not server_side_established(int(port), client_port), LOOSE)
    await stream.aclose()
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.decode))
    await cluster.client.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_client_body_that_never_ends_is_a_408(nursery: trio.Nursery, stream: bool) -> None:
    cluster = await start_cluster(nursery, timeouts=TimeoutConfig(client_body_secs=1.0))
    host, port = cluster.url.removeprefix("http://").split(":")
    conn = await trio.open_tcp_stream(host, int(port))
    await conn.send_all(
        b"POST /generate HTTP/1.1\r\nhost: x\r\nx-request-id: slowloris\r\n"
        b'content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"text": '
    )
    data = b""
    with trio.fail_after(LOOSE):
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            piece = await conn.receive_some(65536)
            if not piece:
                break
            data += piece
    assert data.startswith(b"HTTP/1.1 408")
    assert b'"type":"timeout_error"' in data
    assert engines_saw(cluster, "slowloris") == 0
    await conn.aclose()
    await cluster.client.aclose()


async def test_no_first_token_in_time_is_a_504_and_both_legs_close(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, timeouts=TimeoutConfig(first_token_secs=1.0))
    response = await cluster.client.post(
        "/generate", json=generate_body(stream=True, sim_fault="decode:slow:5000")
    )
    assert response.status_code == 504
    assert "no first token within 1s" in response.json()["error"]["message"]
    rid = response.headers["x-request-id"]
    await cluster.decode.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.decode))
    decode = cluster.router.fleet.workers("decode")[0]
    assert decode.breaker.total_failures == 1
    await cluster.client.aclose()


async def test_a_decode_gone_silent_mid_stream_ends_it_with_a_504_frame(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(
        nursery,
        timeouts=TimeoutConfig(stream_idle_secs=1.0),
        decode={"inter_token_ms": 20.0},
    )
    body = generate_body(stream=True, max_new_tokens=100, sim_fault="decode:hang@3tok")
    async with cluster.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        events = await read_sse(response)
        rid = response.headers["x-request-id"]
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 504
    assert "decode sent nothing for 1s" in events[-2]["error"]["message"]
    assert len(events) > 4  # tokens flowed before the silence
    await cluster.decode.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    await cluster.client.aclose()


async def test_a_prefill_that_never_finishes_after_decode_answered_is_a_504(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, timeouts=TimeoutConfig(prefill_hold_secs=1.0))
    response = await cluster.client.post(
        "/generate", json=generate_body(sim_fault="prefill:hang+kv")
    )
    assert response.status_code == 504
    assert "prefill" in response.json()["error"]["message"]
    rid = response.headers["x-request-id"]
    assert cluster.decode.events.find("request_end", rid=rid)[0]["status"] == 200  # was held
    await cluster.prefill.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    prefill = cluster.router.fleet.workers("prefill")[0]
    assert prefill.breaker.total_failures == 1
    await cluster.client.aclose()


async def test_a_finished_stream_does_not_wait_on_a_hung_prefill(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, timeouts=TimeoutConfig(prefill_hold_secs=1.0))
    body = generate_body(stream=True, max_new_tokens=5, sim_fault="prefill:hang+kv")
    async with cluster.client.stream("POST", "/generate", json=body) as response:
        events = await read_sse(response)
        rid = response.headers["x-request-id"]
    assert response.status_code == 200
    assert events[-1] == "[DONE]" and len(events) == 6  # the client's stream is intact
    await cluster.prefill.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.prefill))
    await cluster.client.aclose()
