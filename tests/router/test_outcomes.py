"""Every row of the outcome table (docs/protocol.md §4), streaming and not, checked on both sides:
what the client got, and what the engines saw (connection closed, slot freed).

Bounds are loose (seconds): the engines' KV waiting timeout is 60 s here, so a decode leg the
router failed to cancel would hold its slot far past any of them.
"""

from __future__ import annotations

import pytest
import trio

from tests.conftest import Cluster, start_cluster
from tests.router.helpers import CANCELLED, generate_body, leave_when, read_sse, settle

LOOSE = 5.0  # seconds: "at once" for a test on a shared, noisy 2-core machine

PREFILL_FAILURES = [
    # (fault, client status, what the router must have seen)
    ("prefill:500@300", 502),
    ("prefill:503@300", 502),
    ("prefill:400@300", 400),
    ("prefill:429@300", 429),
    ("prefill:sse_error@300", 502),
    ("prefill:abort@300", 502),
    ("prefill:close@300", 502),
]


async def assert_decode_cancelled(cluster: Cluster, rid: str) -> None:
    """Decode saw its connection close, then freed the slot it held while waiting for KV."""
    closed = await cluster.decode.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    freed = await cluster.decode.events.wait_for("slot_freed", timeout=LOOSE, rid=rid)
    assert freed["reason"] in CANCELLED
    assert freed["t"] >= closed["t"]
    assert not cluster.decode.events.find("kv_ready", rid=rid)
    await settle(lambda: cluster.decode.running == 0)
    assert "active" not in cluster.upstream_connections(cluster.decode)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("fault", "status"), PREFILL_FAILURES)
async def test_prefill_failure_cancels_decode_at_once(
    cluster: Cluster, fault: str, status: int, stream: bool
) -> None:
    body = generate_body(stream=stream, sim_fault=fault)
    response = await cluster.client.post("/generate", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"]
    rid = response.headers["x-request-id"]
    if status < 500:
        # A prefill 4xx is the client's fault: its own status and body come through.
        assert error["code"] == status
    else:
        assert error["type"] == "upstream_error"
        assert "prefill" in error["message"]
    registered = await cluster.decode.events.wait_for("room_registered", timeout=LOOSE, rid=rid)
    assert (
        registered["room"] == cluster.prefill.events.find("request_start", rid=rid)[0]["rooms"][0]
    )
    await assert_decode_cancelled(cluster, rid)
    fault_at = cluster.prefill.events.find("fault", rid=rid)[0]["t"]
    closed_at = cluster.decode.events.find("connection_closed", rid=rid)[0]["t"]
    assert 0 <= closed_at - fault_at < LOOSE


async def test_prefill_connection_refused_cancels_decode(nursery: trio.Nursery) -> None:
    """A prefill that died since its last health check: transport error -> 502, decode freed."""
    cluster = await start_cluster(nursery)
    dead = trio.socket.socket()
    await dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there now: connection refused
    worker = cluster.router.fleet.workers("prefill")[0]
    worker.spec = type(worker.spec)(
        f"http://127.0.0.1:{port}", "prefill", cluster.prefill.bootstrap_port
    )
    rids = []
    for stream in (False, True):
        response = await cluster.client.post("/generate", json=generate_body(stream=stream))
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "upstream_error"
        assert "prefill" in error["message"]
        rids.append(response.headers["x-request-id"])
    # The router saw a transport failure of prefill, once per request, and nothing else.
    sample = cluster.router.metrics.registry.get_sample_value
    assert sample("trio_pd_leg_failures_total", {"role": "prefill", "kind": "transport"}) == 2
    assert sample("trio_pd_leg_failures_total", {"role": "decode", "kind": "transport"}) is None
    prefill = cluster.router.fleet.workers("prefill")[0]
    assert prefill.breaker.total_failures == 2
    # The refusal is immediate, so decode may or may not have read its request by then; what
    # must hold either way: every request decode got was closed by the router, none of them
    # registered a room that KV could reach or finished, and no slot is held.
    await settle(lambda: cluster.decode.running == 0 and cluster.decode.queued == 0)
    await trio.sleep(0.6)  # past the engine's disconnect poll: a late leg would show by now
    for rid in rids:
        got = cluster.decode.events.find("request_start", rid=rid)
        closed = cluster.decode.events.find("connection_closed", rid=rid)
        assert len(closed) == len(got) <= 1
        assert not cluster.decode.events.find("kv_ready", rid=rid)
        assert not cluster.decode.events.find("first_token", rid=rid)
        for ended in cluster.decode.events.find("request_end", rid=rid):
            assert ended["ended"] in CANCELLED  # (a stream has its 200 headers)
        for freed in cluster.decode.events.find("slot_freed", rid=rid):
            assert freed["reason"] in CANCELLED
    assert cluster.router.fleet.workers("decode")[0].in_flight == 0
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.decode))
    await cluster.client.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_prefill_hang_hits_deadline_and_both_legs_close(
    nursery: trio.Nursery, stream: bool
) -> None:
    cluster = await start_cluster(nursery, request_timeout_secs=1.0)
    body = generate_body(stream=stream, sim_fault="prefill:hang")
    response = await cluster.client.post("/generate", json=body)
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "timeout_error"
    rid = response.headers["x-request-id"]
    await cluster.prefill.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    await assert_decode_cancelled(cluster, rid)
    assert "active" not in cluster.upstream_connections(cluster.prefill)
    await cluster.client.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("fault", "status"), [("decode:500", 500), ("decode:503", 503)])
async def test_decode_failure_cancels_prefill(
    cluster: Cluster, fault: str, status: int, stream: bool
) -> None:
    response = await cluster.client.post(
        "/generate", json=generate_body(stream=stream, sim_fault=fault)
    )
    assert response.status_code == status  # decode's own status and body
    assert response.json()["error"]["code"] == status
    rid = response.headers["x-request-id"]
    # Prefill was waiting for decode's registration (30 s bootstrap timeout); it must see the
    # router close its connection long before that.
    await cluster.prefill.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    assert not cluster.prefill.events.find("kv_sent", rid=rid)
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.prefill))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_decode_transport_failure_is_502(cluster: Cluster, stream: bool) -> None:
    body = generate_body(stream=stream, sim_fault="decode:close")
    response = await cluster.client.post("/generate", json=body)
    assert response.status_code == 502
    assert "decode" in response.json()["error"]["message"]
    rid = response.headers["x-request-id"]
    await cluster.prefill.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)


async def test_both_succeed_non_stream(cluster: Cluster) -> None:
    response = await cluster.client.post("/generate", json=generate_body(max_new_tokens=5))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    answer = response.json()
    assert answer["meta_info"]["completion_tokens"] == 5
    rid = response.headers["x-request-id"]
    freed = await cluster.decode.events.wait_for("slot_freed", timeout=LOOSE, rid=rid)
    assert freed["reason"] == "finished"
    assert cluster.prefill.events.find("kv_sent", rid=rid)
    # Both legs finished cleanly: their connections went back to the pool, none is closed.
    await settle(lambda: cluster.upstream_connections(cluster.decode) == ["idle"])
    await settle(lambda: cluster.upstream_connections(cluster.prefill) == ["idle"])


async def test_both_succeed_stream(cluster: Cluster) -> None:
    async with cluster.client.stream(
        "POST", "/generate", json=generate_body(stream=True, max_new_tokens=6)
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = await read_sse(response)
    assert events[-1] == "[DONE]"
    data = [e for e in events if e != "[DONE]"]
    assert len(data) == 6
    assert data[-1]["meta_info"]["completion_tokens"] == 6
    # The end of a complete response is no client disconnect: both outcomes get recorded.
    for worker in cluster.router.fleet.workers():
        await settle(lambda w=worker: w.breaker.total_successes == 1)


async def test_client_disconnect_during_prefill_cancels_both(cluster: Cluster) -> None:
    rid = "client-gone-during-prefill"
    body = generate_body(sim_fault="prefill:hang")
    await leave_when(  # gone while the prefill works (it hangs): once it started
        lambda: cluster.client.post("/generate", json=body, headers={"x-request-id": rid}),
        lambda: cluster.prefill.events.wait_for("request_start", timeout=LOOSE, rid=rid),
    )
    await cluster.prefill.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    await assert_decode_cancelled(cluster, rid)
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.prefill))


async def test_client_disconnect_mid_stream_cancels_decode(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, decode={"inter_token_ms": 50.0})
    rid = "client-gone-mid-stream"
    body = generate_body(stream=True, max_new_tokens=200)
    async with cluster.client.stream(
        "POST", "/generate", json=body, headers={"x-request-id": rid}
    ) as response:
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break
    closed = await cluster.decode.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    freed = await cluster.decode.events.wait_for("slot_freed", timeout=LOOSE, rid=rid)
    assert freed["reason"] in CANCELLED
    assert freed["t"] - closed["t"] < LOOSE
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.decode))
    await cluster.client.aclose()


async def test_deadline_mid_stream_ends_with_error_event(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, request_timeout_secs=1.0, decode={"inter_token_ms": 50.0}
    )
    body = generate_body(stream=True, max_new_tokens=500)
    async with cluster.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        events = await read_sse(response)
        rid = response.headers["x-request-id"]
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 504
    assert len(events) > 3  # tokens flowed before the deadline cut the stream
    await cluster.decode.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    await cluster.client.aclose()


async def test_decode_failure_mid_stream_ends_with_error_event(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, decode={"inter_token_ms": 20.0})
    body = generate_body(stream=True, max_new_tokens=100, sim_fault="decode:close@3tok")
    async with cluster.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        events = await read_sse(response)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "upstream_error"
    # The three tokens the decode sent before its connection dropped reached the client.
    assert [e["meta_info"]["completion_tokens"] for e in events[:-2]] == [1, 2, 3]
    await cluster.client.aclose()


async def test_nothing_leaks_after_many_failures(cluster: Cluster) -> None:
    """A burst of mixed failures leaves no slot held and no connection active."""
    faults = ["prefill:500@50", "decode:500", "prefill:close@50", None, "prefill:sse_error@50"]

    async def one(fault: str | None, stream: bool) -> None:
        await cluster.client.post("/generate", json=generate_body(stream=stream, sim_fault=fault))

    async with trio.open_nursery() as burst:
        for i in range(30):
            burst.start_soon(one, faults[i % len(faults)], i % 2 == 0)
    await settle(lambda: cluster.decode.running == 0 and cluster.decode.queued == 0)
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.decode))
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.prefill))
    assert cluster.router.fleet.workers("decode")[0].in_flight == 0
    assert cluster.router.fleet.workers("prefill")[0].in_flight == 0


@pytest.mark.parametrize(
    ("fault", "status"), [("prefill:500@held+kv", 502), ("prefill:400@held+kv", 400)]
)
async def test_decode_answer_is_held_until_prefill_is_known(
    cluster: Cluster, fault: str, status: int
) -> None:
    """Decode answered first (the KV had arrived), prefill failed later: the client gets it.
    The prefill's failure is let go once the decode's answer ended (`@held`), not at a time."""
    rid = f"held-{status}"
    answers = []

    async def ask() -> None:
        body = generate_body(sim_fault=fault)
        answers.append(
            await cluster.client.post("/generate", json=body, headers={"x-request-id": rid})
        )

    async with trio.open_nursery() as asking:
        asking.start_soon(ask)
        await settle(lambda: cluster.decode.events.find("request_end", rid=rid), LOOSE)
        assert not answers  # held: the prefill has not answered yet
        cluster.prefill.state.release_held()
    (response,) = answers
    assert response.status_code == status
    finished = cluster.decode.events.find("request_end", rid=rid)[0]
    failed = cluster.prefill.events.find("fault", rid=rid)[0]
    assert finished["status"] == 200
    assert finished["t"] < failed["t"]  # decode's answer really came first and was held
    assert cluster.decode.events.find("slot_freed", rid=rid)[0]["reason"] == "finished"


async def test_prefill_failing_after_the_stream_started_does_not_cut_it(
    nursery: trio.Nursery,
) -> None:
    """Decode's first token proves the KV arrived; a later prefill error only counts against
    prefill's breaker, and the client's stream runs to its end. The prefill's error is let go
    once the client read the first token (`@held`), not at a time."""
    cluster = await start_cluster(nursery, decode={"inter_token_ms": 20.0})
    body = generate_body(stream=True, max_new_tokens=40, sim_fault="prefill:500@held+kv")
    events: list[object] = []
    async with cluster.client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        rid = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            events.append(line[5:].strip())
            if len(events) == 1:
                cluster.prefill.state.release_held()
                await settle(lambda: cluster.prefill.events.find("fault", rid=rid), LOOSE)
    assert events[-1] == "[DONE]"
    assert len(events) == 41
    assert cluster.prefill.events.find("fault", rid=rid)
    breaker = cluster.router.fleet.workers("prefill")[0].breaker
    await settle(lambda: breaker.total_failures == 1)  # recorded once the attempt's nursery closed
    await cluster.client.aclose()
