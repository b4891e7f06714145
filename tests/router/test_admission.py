"""Admission control over real sockets: the cap on requests in flight, the rate limit's token
bucket, a bounded line in front of both, 429 when the line is full and 408 when a wait in it
runs out (`trio_pd/admission.py`)."""

from __future__ import annotations

import httpx2
import trio

from tests.conftest import start_cluster
from tests.router.helpers import generate_body, settle


async def test_full_queue_gets_429_and_queue_timeout_408_and_neither_reaches_a_worker(
    nursery: trio.Nursery,
) -> None:
    # One running, one waiting; each request takes ~1 s of decoding, so the queued request's
    # 0.3 s run out first.
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
    # The queue timed out (SMG: 408) / the queue was full (SMG: 429); both with the envelope.
    for rid, status, error_type in (
        ("queued", 408, "timeout_error"),
        ("rejected", 429, "rate_limit_error"),
    ):
        response = results[rid]
        assert response.status_code == status
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"] == {
            "message": response.json()["error"]["message"],
            "type": error_type,
            "code": status,
        }
        assert response.headers["x-request-id"] == rid
        assert not cluster.decode.events.find("request_start", rid=rid)
        assert not cluster.prefill.events.find("request_start", rid=rid)
    assert "queue" in results["queued"].json()["error"]["message"]
    assert "waiting" in results["rejected"].json()["error"]["message"]
    await cluster.client.aclose()


def test_the_queue_flags_help_says_what_the_router_answers() -> None:
    """`--queue-timeout-secs`' help once said 429 while the router answers 408 (SMG's)."""
    from tests.flag_surface import serve_actions

    actions = serve_actions()
    assert "408" in (actions["--queue-timeout-secs"].help or "")
    assert "429" not in (actions["--queue-timeout-secs"].help or "")
    assert "429" in (actions["--queue-size"].help or "")


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


def assert_rejected(response: httpx2.Response, rid: str) -> None:
    """SMG's 429 for a request admission has no room for, with trio_pd's envelope."""
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.headers["x-request-id"] == rid
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", 429)


async def test_the_cap_holds_while_requests_run_and_a_rate_limits_beside_it(
    nursery: trio.Nursery,
) -> None:
    # Cap 2, a token every 2 s, no line. Two requests hold the cap (`hold`: until the test lets
    # them go): a third is refused at once and still refused once the bucket has refilled (SMG
    # 0.3.2 would have let two more in by then); once they are done the burst is spent, so the
    # next is let in only by the refill. The waits are on the bucket's own state, and its slow
    # refill leaves a wide window (2 s) for the request it must refuse, on a loaded machine too.
    cluster = await start_cluster(
        nursery, max_concurrent_requests=2, rate_limit_tokens_per_second=0.5, queue_size=0
    )
    bucket = cluster.router.admission.bucket
    assert bucket is not None
    holders = ("holder-0", "holder-1")
    results: dict[str, httpx2.Response] = {}

    async def send(rid: str, body: dict) -> None:
        results[rid] = await cluster.client.post(
            "/generate", json=body, headers={"x-request-id": rid}
        )

    async with trio.open_nursery() as traffic:
        for rid in holders:  # each holds its slot until released
            traffic.start_soon(send, rid, generate_body(sim_fault="decode:hold"))
        for rid in holders:
            await cluster.decode.events.wait_for("request_start", timeout=5, rid=rid)
        await send("beyond", generate_body())
        assert_rejected(results["beyond"], "beyond")
        await settle(lambda: bucket.tokens >= 2, timeout=60)  # refilled; the cap holds
        assert not cluster.decode.events.find("request_end", rid="holder-0")
        await send("still-beyond", generate_body())
        assert_rejected(results["still-beyond"], "still-beyond")
        for rid in ("beyond", "still-beyond"):
            for engine in (cluster.prefill, cluster.decode):
                assert not engine.events.find("request_start", rid=rid)
        cluster.decode.state.release_held()
    assert [results[rid].status_code for rid in holders] == [200, 200]
    # The cap is free again (the holders' slots are given back as the router's side of each
    # ends, which can be just after its client read the answer) and the bucket full (2
    # tokens): two requests take them, the next finds none though nothing runs (the rate
    # limit), and one more is let in a second later.
    limiter = cluster.router.admission.limiter
    assert limiter is not None
    await settle(lambda: limiter.borrowed_tokens == 0)
    for rid in ("after-0", "after-1"):
        await send(rid, generate_body())
        assert results[rid].status_code == 200
    assert bucket.tokens < 1  # provoked: the burst is spent (a refill takes 2 s)
    await send("too-fast", generate_body())
    assert_rejected(results["too-fast"], "too-fast")
    await settle(lambda: bucket.tokens >= 1, timeout=60)
    await send("paced", generate_body())
    assert results["paced"].status_code == 200
    await cluster.client.aclose()


async def test_a_stream_holds_its_slot_until_its_last_event(nursery: trio.Nursery) -> None:
    # Cap 1 (rate 0: no rate limit): the slot comes back only when a response has ended, as
    # SMG's TokenGuardBody gives its token back after a stream's last byte.
    cluster = await start_cluster(
        nursery,
        max_concurrent_requests=1,
        rate_limit_tokens_per_second=0,
        queue_size=0,
        decode={"inter_token_ms": 20.0},
    )
    body = generate_body(stream=True, max_new_tokens=20)
    async with cluster.client.stream("POST", "/generate", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        assert (await anext(lines)).startswith("data:")  # decode has started streaming
        during = await cluster.client.post(
            "/generate", json=generate_body(), headers={"x-request-id": "during-stream"}
        )
        assert_rejected(during, "during-stream")
        assert not cluster.decode.events.find("request_start", rid="during-stream")
        rest = [line async for line in lines]
        assert "data: [DONE]" in rest
    # The router gives the slot back right after the last event went out.
    limiter = cluster.router.admission.limiter
    assert limiter is not None and cluster.router.admission.bucket is None
    await settle(lambda: limiter.borrowed_tokens == 0)
    after = await cluster.client.post("/generate", json=generate_body())
    assert after.status_code == 200
    await cluster.client.aclose()
