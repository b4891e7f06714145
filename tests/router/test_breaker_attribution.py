"""Circuit-breaker attribution (docs/protocol.md §5) for every outcome of §4, over real sockets:
who records what, read from the router's breakers after the engines saw the request."""

from __future__ import annotations

import pytest
import trio

from tests.conftest import Cluster, start_cluster
from tests.router.fleet_tools import LOOSE, build_cluster, who_started
from tests.router.helpers import generate_body, leave_when, read_sse, settle
from trio_pd.config import BreakerConfig


def counts(cluster: Cluster) -> dict[str, tuple[int, int]]:
    """(total_failures, total_successes) of every worker's breaker, by worker id."""
    return {
        w.id: (w.breaker.total_failures, w.breaker.total_successes)
        for w in cluster.router.fleet.workers()
    }


async def run(cluster: Cluster, fault: str | None, stream: bool) -> str:
    body = generate_body(stream=stream, sim_fault=fault, max_new_tokens=4)
    async with cluster.client.stream("POST", "/generate", json=body) as response:
        if response.headers["content-type"].startswith("text/event-stream"):
            await read_sse(response)
        else:
            await response.aread()
    rid = response.headers["x-request-id"]
    # The engine that fails it saw the request (the other one may not have, it was cancelled).
    engine = cluster.decode if fault and fault.startswith("decode") else cluster.prefill
    await engine.events.wait_for("request_start", timeout=LOOSE, rid=rid)
    return rid


NOTHING, FAILURE, SUCCESS = (0, 0), (1, 0), (0, 1)
OUTCOMES = [
    # fault, prefill's record, decode's record
    ("prefill:500@200", FAILURE, NOTHING),
    ("prefill:503@200", FAILURE, NOTHING),
    ("prefill:close@200", FAILURE, NOTHING),  # transport
    ("prefill:sse_error@200", FAILURE, NOTHING),  # in-band error
    ("prefill:abort@200", FAILURE, NOTHING),  # in-band abort
    ("prefill:hang", FAILURE, NOTHING),  # timeout (request deadline)
    ("prefill:400", SUCCESS, NOTHING),  # the client's fault
    ("prefill:429", SUCCESS, NOTHING),
    ("decode:500", NOTHING, FAILURE),
    ("decode:503", NOTHING, FAILURE),
    ("decode:close", NOTHING, FAILURE),  # transport
]


async def check_outcomes(cluster: Cluster, outcomes: list, stream: bool) -> None:
    for fault, prefill_record, decode_record in outcomes:
        before = counts(cluster)
        await run(cluster, fault, stream)

        def recorded(before=before) -> dict[str, tuple[int, int]]:
            after = counts(cluster)
            return {k: (after[k][0] - v[0], after[k][1] - v[1]) for k, v in before.items()}

        expected = {"prefill-1": prefill_record, "decode-1": decode_record}
        # A streamed answer is recorded just after the client's last byte: wait a little, then
        # check that exactly the expected records arrived, and nothing more.
        with trio.move_on_after(LOOSE):
            while recorded() != expected:
                await trio.sleep(0.02)
        await trio.sleep(0.05)
        assert recorded() == expected, (fault, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_every_failure_is_attributed_once(nursery: trio.Nursery, stream: bool) -> None:
    cluster = await start_cluster(nursery, request_timeout_secs=2.0)
    await check_outcomes(cluster, OUTCOMES, stream)
    for worker in cluster.router.fleet.workers():
        assert worker.breaker.state == "closed"  # 6 failures < the default threshold of 10
    await cluster.client.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_success_is_recorded_for_both(nursery: trio.Nursery, stream: bool) -> None:
    """Streamed too: the client's connection ending after the last byte is no disconnect."""
    cluster = await start_cluster(nursery)
    await check_outcomes(cluster, [(None, SUCCESS, SUCCESS)] * 3, stream)
    await cluster.client.aclose()


async def test_decode_failure_mid_stream_is_recorded_against_decode(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, decode={"inter_token_ms": 20.0})
    body = generate_body(stream=True, max_new_tokens=100, sim_fault="decode:close@3tok")
    async with cluster.client.stream("POST", "/generate", json=body) as response:
        events = await read_sse(response)
    assert events[-2]["error"]["type"] == "upstream_error"  # the stream had started
    prefill, decode = cluster.router.fleet.workers()
    with trio.move_on_after(LOOSE):
        while decode.breaker.total_failures == 0:
            await trio.sleep(0.02)
    await trio.sleep(0.05)
    assert (decode.breaker.total_failures, decode.breaker.total_successes) == (1, 0)
    assert (prefill.breaker.total_failures, prefill.breaker.total_successes) == (0, 0)
    await cluster.client.aclose()


async def test_client_disconnect_records_nothing(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, decode={"inter_token_ms": 30.0})
    before = counts(cluster)
    # Gone while prefill works.
    await leave_when(
        lambda: cluster.client.post(
            "/generate",
            json=generate_body(sim_fault="prefill:hang"),
            headers={"x-request-id": "gone-1"},
        ),
        lambda: cluster.prefill.events.wait_for("request_start", timeout=LOOSE, rid="gone-1"),
    )
    # Gone mid-stream.
    body = generate_body(stream=True, max_new_tokens=200)
    async with cluster.client.stream(
        "POST", "/generate", json=body, headers={"x-request-id": "gone-2"}
    ) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                break
    for rid in ("gone-1", "gone-2"):
        await cluster.decode.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    await cluster.prefill.events.wait_for("connection_closed", timeout=LOOSE, rid="gone-1")
    await settle(lambda: all(w.in_flight == 0 for w in cluster.router.fleet.workers()), LOOSE)
    assert counts(cluster) == before
    await cluster.client.aclose()


async def test_prefill_burst_opens_only_the_prefill_breaker_and_panic_routes(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(
        nursery, breaker=BreakerConfig(failure_threshold=3, timeout_duration_secs=60)
    )
    prefill, decode = cluster.router.fleet.workers()
    for i in range(3):
        rid = await run(cluster, "prefill:500@50", stream=i % 2 == 0)
        await settle(lambda n=i + 1: prefill.breaker.total_failures == n)
    assert prefill.breaker.state == "open"
    assert decode.breaker.state == "closed"
    assert decode.breaker.consecutive_failures == decode.breaker.total_failures == 0
    assert decode.breaker.total_successes == 0

    # Its breaker is open, but it is the only prefill: panic routing keeps it in rotation
    # (a breaker never takes a role's last workers out), so requests still get through.
    for stream in (False, True):
        response = await cluster.client.post("/generate", json=generate_body(stream=stream))
        assert response.status_code == 200
        rid = response.headers["x-request-id"]
        assert cluster.prefill.events.find("request_start", rid=rid)
    assert cluster.router.fleet.panics["prefill"] == 2
    assert (await cluster.client.get("/readiness")).status_code == 200
    assert prefill.breaker.state == "open"  # still reported as it is
    await cluster.client.aclose()


async def test_open_breaker_steers_traffic_to_the_other_prefill(nursery: trio.Nursery) -> None:
    cluster = await build_cluster(
        nursery,
        prefills=[{"faults": ("prefill:500",)}, {}],
        breaker=BreakerConfig(failure_threshold=2, timeout_duration_secs=60),
    )
    bad, good = cluster.router.fleet.workers("prefill")
    statuses = []
    for i in range(8):
        response = await cluster.client.post(
            "/generate", json=generate_body(), headers={"x-request-id": f"rr-{i}"}
        )
        statuses.append(response.status_code)
    # Round robin: requests 0 and 2 hit the bad prefill and open its breaker; then only good.
    assert statuses == [502, 200, 502, 200, 200, 200, 200, 200]
    assert bad.breaker.state == "open" and good.breaker.state == "closed"
    assert [who_started(cluster.prefills, f"rr-{i}") for i in range(8)] == [
        [0],
        [1],
        [0],
        [1],
        [1],
        [1],
        [1],
        [1],
    ]
    assert cluster.router.fleet.workers("decode")[0].breaker.total_failures == 0
    await cluster.client.aclose()
