"""Admission control: a bounded number of requests in flight, a bounded queue, 429 beyond it."""

from __future__ import annotations

import httpx2
import trio

from tests.conftest import start_cluster
from tests.router.helpers import generate_body


async def test_full_queue_and_queue_timeout_get_429_and_reach_no_worker(
    nursery: trio.Nursery,
) -> None:
    # One request at a time, one waiting; each request takes ~1 s of decoding.
    cluster = await start_cluster(
        nursery,
        max_concurrent_requests=1,
        queue_size=1,
        queue_timeout_secs=0.3,
        decode={"inter_token_ms": 25.0},
    )
    results: dict[str, httpx2.Response] = {}

    async def send(rid: str) -> None:
        body = generate_body(max_new_tokens=40)
        results[rid] = await cluster.client.post(
            "/generate", json=body, headers={"x-request-id": rid}
        )

    async with trio.open_nursery() as burst:
        burst.start_soon(send, "running")
        await cluster.decode.events.wait_for("request_start", timeout=5, rid="running")
        burst.start_soon(send, "queued")
        await trio.sleep(0.05)  # let it take its place in line
        burst.start_soon(send, "rejected")

    assert results["running"].status_code == 200
    for rid in ("queued", "rejected"):  # queue timed out / queue was full
        response = results[rid]
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert not cluster.decode.events.find("request_start", rid=rid)
        assert not cluster.prefill.events.find("request_start", rid=rid)
    assert "queue" in results["queued"].json()["error"]["message"]
    assert "waiting" in results["rejected"].json()["error"]["message"]
    await cluster.client.aclose()


async def test_queued_request_runs_when_a_slot_frees(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, max_concurrent_requests=2, queue_size=10, queue_timeout_secs=30.0,
        decode={"inter_token_ms": 10.0},
    )  # fmt: skip
    statuses = []

    async def send() -> None:
        response = await cluster.client.post("/generate", json=generate_body(max_new_tokens=20))
        statuses.append(response.status_code)

    async with trio.open_nursery() as burst:
        for _ in range(6):
            burst.start_soon(send)
    assert statuses == [200] * 6
    # Never more than two requests were decoding at once.
    assert max(e["running"] for e in cluster.decode.events.find("slot_acquired")) <= 2
    await cluster.client.aclose()
