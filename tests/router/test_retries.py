"""Retries over the wire: a new pair and a new bootstrap room per attempt, as the engines saw it;
never after the first streamed byte, never for a 4xx, never when disabled."""

from __future__ import annotations

import pytest
import trio

from tests.conftest import start_cluster
from tests.router.fleet_tools import build_cluster, rooms_seen, who_started
from tests.router.helpers import generate_body, read_sse
from trio_pd.config import RetryConfig

RETRY = RetryConfig(max_retries=3, initial_backoff_ms=1, max_backoff_ms=5, jitter_factor=0.0)


async def post(cluster, rid: str, stream: bool, **body) -> tuple[int, list]:
    payload = generate_body(stream=stream, **body)
    async with cluster.client.stream(
        "POST", "/generate", json=payload, headers={"x-request-id": rid}
    ) as response:
        if response.headers["content-type"].startswith("text/event-stream"):
            return response.status_code, await read_sse(response)
        await response.aread()
        return response.status_code, [response.json()]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_failing_prefill_is_retried_on_the_other_with_a_new_room(
    nursery: trio.Nursery, stream: bool
) -> None:
    cluster = await build_cluster(nursery, prefills=[{"faults": ("prefill:500",)}, {}], retry=RETRY)
    bad, good = cluster.prefills
    decode = cluster.decode
    retried = 0
    for i in range(4):
        rid = f"retry-{i}"
        status, events = await post(cluster, rid, stream, max_new_tokens=3)
        assert status == 200
        if stream:
            assert events[-1] == "[DONE]" and "error" not in events[-2]
        tried = who_started(cluster.prefills, rid)
        assert tried in ([1], [0, 1])  # the bad one at most once, then avoided
        rooms = rooms_seen(decode, rid)
        assert len(rooms) == len(tried)
        assert len(set(rooms)) == len(rooms)  # a fresh room per attempt
        assert rooms[-1] == rooms_seen(good, rid)[0]
        assert decode.events.find("kv_ready", rid=rid, room=rooms[-1])
        if tried == [0, 1]:
            retried += 1
            assert rooms[0] == rooms_seen(bad, rid)[0]
            assert bad.events.find("fault", rid=rid)
            # The failed attempt's decode leg was cancelled, not left waiting for its KV.
            assert not decode.events.find("kv_ready", rid=rid, room=rooms[0])
            assert decode.events.find("connection_closed", rid=rid, room=rooms[0])
    assert retried >= 2  # round robin sends at least every other first attempt to the bad one
    await cluster.client.aclose()


async def test_attempts_are_capped_at_max_retries(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, retry=RETRY)
    status, [body] = await post(cluster, "capped", False, sim_fault="prefill:503@20")
    assert status == 502
    assert body["error"]["type"] == "upstream_error"
    rooms = rooms_seen(cluster.prefill, "capped")
    assert len(rooms) == 3 == len(set(rooms))  # max_retries counts total attempts
    assert sorted(rooms_seen(cluster.decode, "capped")) == sorted(rooms)
    await cluster.client.aclose()


async def test_decode_failure_is_retried(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, n_decode=2, retry=RETRY)
    # decode:500 fires at once on whichever decode gets it: every attempt fails.
    status, [body] = await post(cluster, "d500", False, sim_fault="decode:500")
    assert status == 500
    assert body["error"]["code"] == 500  # decode's own answer
    starts = sorted(
        (r["t"], i, r["rooms"][0])
        for i, engine in enumerate(cluster.decodes)
        for r in engine.events.find("request_start", rid="d500")
    )
    # The failed decode is avoided while another is up; the same failure on the second decode
    # too says it is the request, not the workers: no third attempt.
    assert len(starts) == 2
    assert starts[0][1] != starts[1][1]
    assert len({room for _, _, room in starts}) == 2
    await cluster.client.aclose()


@pytest.mark.parametrize("status", [400, 422])
async def test_client_errors_are_not_retried(nursery: trio.Nursery, status: int) -> None:
    cluster = await start_cluster(nursery, retry=RETRY)
    got, [body] = await post(cluster, "c4xx", False, sim_fault=f"prefill:{status}")
    assert got == status
    assert body["error"]["code"] == status
    assert len(rooms_seen(cluster.prefill, "c4xx")) == 1
    await cluster.client.aclose()


async def test_no_retry_after_the_first_streamed_byte(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, retry=RETRY, decode={"inter_token_ms": 20.0})
    status, events = await post(
        cluster, "mid", True, max_new_tokens=100, sim_fault="decode:close@3tok"
    )
    assert status == 200
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "upstream_error"
    assert len(events) > 3
    await trio.sleep(0.2)  # a retry would have reached the engines by now
    assert len(rooms_seen(cluster.decode, "mid")) == 1
    assert len(rooms_seen(cluster.prefill, "mid")) == 1
    await cluster.client.aclose()


async def test_retries_disabled_means_one_attempt(nursery: trio.Nursery) -> None:
    cluster = await build_cluster(
        nursery,
        prefills=[{"faults": ("prefill:500",)}, {}],
        retry=RetryConfig(max_retries=3, initial_backoff_ms=1, enabled=False),
    )
    status, [body] = await post(cluster, "once", False)
    assert status == 502
    assert "prefill" in body["error"]["message"]
    assert who_started(cluster.prefills, "once") == [0]
    assert len(rooms_seen(cluster.decode, "once")) == 1
    await cluster.client.aclose()
