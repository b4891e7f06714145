"""Abort on cancel (issue 12): a leg the router gives up on is aborted in its engine at once
(`POST /abort_request`), so its slot is freed in milliseconds, not at the engine's next
disconnect poll. The engines here poll for disconnects every 30 s: a slot freed within seconds
was freed by the abort."""

from __future__ import annotations

import re

import pytest
import trio

from tests.conftest import Cluster, start_cluster
from tests.router.fleet_tools import LOOSE
from tests.router.helpers import CANCELLED, generate_body, leave_when, read_sse, settle
from trio_pd.config import RetryConfig

RID = re.compile(r"trio-pd-[0-9a-f]{32}")

SLOW_POLL = {"disconnect_poll_secs": 30.0}


async def abort_cluster(nursery: trio.Nursery, **options) -> Cluster:
    engine = options.pop("engine", {})
    return await start_cluster(
        nursery,
        prefill={**SLOW_POLL, **engine},
        decode={**SLOW_POLL, **engine},
        abort_on_cancel=True,
        **options,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_failed_prefill_frees_the_decode_slot_at_once(
    nursery: trio.Nursery, stream: bool
) -> None:
    cluster = await abort_cluster(nursery)
    response = await cluster.client.post(
        "/generate", json=generate_body(stream=stream, sim_fault="prefill:500@200")
    )
    assert response.status_code == 502
    rid = response.headers["x-request-id"]
    fault = await cluster.prefill.events.wait_for("fault", timeout=LOOSE, rid=rid)
    assert await cluster.decode.events.wait_for("slot_acquired", timeout=LOOSE, rid=rid)
    freed = await cluster.decode.events.wait_for("slot_freed", timeout=LOOSE, rid=rid)
    assert freed["t"] - fault["t"] < 15.0  # the disconnect poll would take up to 30 s
    # A non-stream leg is freed by the router's abort; a stream leg by the engine itself, the
    # moment its connection closed (SGLang aborts a stream on disconnect): the router's abort
    # then finds the rid gone, which is harmless.
    assert freed["reason"] == ("aborted_disconnect" if stream else "aborted_request")
    started = cluster.decode.events.find("request_start", rid=rid)[0]
    abort = await cluster.decode.events.wait_for(  # the router's own rid for the attempt
        "abort_request", timeout=LOOSE, sglang_rid=started["sglang_rid"]
    )
    assert abort["matched"] is (not stream)
    assert RID.fullmatch(started["sglang_rid"])
    await settle(lambda: cluster.router.metrics.aborts.labels("decode", "sent")._value.get() >= 1)
    await cluster.client.aclose()


async def test_the_abort_is_sent_again_early_and_two_seconds_later(nursery: trio.Nursery) -> None:
    """An abort that reaches an engine before it registered the rid is dropped (yet answered
    200): so each one goes three times, at once, 0.1 s later and 2 s later
    (tests/router/test_fault_matrix_sim.py shows the early one freeing such a request)."""
    cluster = await abort_cluster(nursery)
    response = await cluster.client.post(
        "/generate", json=generate_body(sim_fault="prefill:500@200")
    )
    rid = response.headers["x-request-id"]
    sglang_rid = cluster.decode.events.find("request_start", rid=rid)[0]["sglang_rid"]
    with trio.fail_after(60):  # a hang guard: the last abort comes ~2 s after the first
        while len(cluster.decode.events.find("abort_request", sglang_rid=sglang_rid)) < 3:
            await trio.sleep(0.05)
    first, early, last = cluster.decode.events.find("abort_request", sglang_rid=sglang_rid)
    assert first["matched"] is True  # the first one freed it ...
    assert early["matched"] is False and last["matched"] is False  # ... gone by then
    assert early["t"] - first["t"] >= 0.09  # each waited its time (a busy box only adds)
    assert last["t"] - first["t"] > 1.5
    await cluster.client.aclose()


async def test_a_client_that_leaves_has_both_legs_aborted(nursery: trio.Nursery) -> None:
    cluster = await abort_cluster(nursery, engine={"inter_token_ms": 50.0})
    body = generate_body(stream=True, max_new_tokens=1000, sim_fault="prefill:hang+kv")

    async def stream() -> None:
        async with cluster.client.stream(
            "POST", "/generate", json=body, headers={"x-request-id": "gone"}
        ) as response:
            await read_sse(response)

    # Gone once the decode's first token was out (both legs then run: decode streams, the
    # prefill hangs after sending the KV).
    left = await leave_when(
        stream, lambda: cluster.decode.events.wait_for("first_token", timeout=LOOSE, rid="gone")
    )
    assert left.cancelled_caught
    freed = await cluster.decode.events.wait_for("slot_freed", timeout=LOOSE, rid="gone")
    assert freed["reason"] in CANCELLED  # a stream: the engine's own abort on the disconnect
    # The prefill was aborted too (the simulator's prefill stops at the disconnect itself, so
    # the abort may find it gone already: sent is what counts here).
    sglang_rid = cluster.prefill.events.find("request_start", rid="gone")[0]["sglang_rid"]
    await cluster.prefill.events.wait_for("abort_request", timeout=LOOSE, sglang_rid=sglang_rid)
    cancelled = cluster.router.metrics.legs_cancelled
    await settle(lambda: cancelled.labels("decode", "client_gone")._value.get() == 1)
    await cluster.client.aclose()


async def test_a_failed_decode_has_prefill_aborted(nursery: trio.Nursery) -> None:
    cluster = await abort_cluster(nursery)
    response = await cluster.client.post("/generate", json=generate_body(sim_fault="decode:500"))
    assert response.status_code == 500
    rid = response.headers["x-request-id"]
    start = await cluster.prefill.events.wait_for("request_start", timeout=LOOSE, rid=rid)
    await cluster.prefill.events.wait_for(
        "abort_request", timeout=LOOSE, sglang_rid=start["sglang_rid"]
    )
    await settle(lambda: cluster.router.metrics.aborts.labels("prefill", "sent")._value.get() >= 1)
    await cluster.client.aclose()


async def test_no_abort_on_cancel_leaves_it_to_the_disconnect_poll(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, decode={"disconnect_poll_secs": 1.0}, abort_on_cancel=False
    )
    response = await cluster.client.post(
        "/generate", json=generate_body(sim_fault="prefill:500@200")
    )
    rid = response.headers["x-request-id"]
    freed = await cluster.decode.events.wait_for("slot_freed", timeout=LOOSE, rid=rid)
    assert freed["reason"] == "aborted_disconnect"
    assert not cluster.decode.events.find("abort_request")
    started = cluster.decode.events.find("request_start", rid=rid)[0]
    assert RID.fullmatch(started["sglang_rid"])  # the router's own rid, aborts or not
    await cluster.client.aclose()


async def test_engine_rids_are_the_routers_own_and_fresh_per_attempt(
    nursery: trio.Nursery,
) -> None:
    """A client's `rid` never reaches an engine (it stays in the access log): each attempt has
    a rid of its own, which no other live rid extends (the engine aborts by prefix)."""
    cluster = await abort_cluster(
        nursery,
        n_prefill=2,
        retry=RetryConfig(max_retries=2, initial_backoff_ms=1, jitter_factor=0),
    )
    response = await cluster.client.post(
        "/generate",
        json=generate_body(rid="my-rid", sim_fault="prefill:503@50"),
        headers={"x-request-id": "with-rid"},
    )
    assert response.status_code == 502
    seen = [
        e["sglang_rid"]
        for engine in cluster.prefills
        for e in engine.events.find("request_start", rid="with-rid")
    ]
    assert len(seen) == 2  # provoked: a retry happened
    assert all(RID.fullmatch(r) for r in seen) and len(set(seen)) == 2
    assert not seen[0].startswith(seen[1]) and not seen[1].startswith(seen[0])
    decode_seen = [e["sglang_rid"] for e in cluster.decode.events.find("request_start")]
    assert sorted(decode_seen) == sorted(seen)  # each attempt's legs share its rid
    assert "my-rid" not in str(cluster.decode.events.find("request_start"))
    await cluster.client.aclose()


async def test_aborts_keep_connections_of_their_own(nursery: trio.Nursery) -> None:
    """A storm of failing prefills (issue 19): on the hot path's pool a doomed decode leg took
    the connection an abort had just left, sent its request on it and closed it, so most aborts
    paid a fresh connect. The service's own connections stay out of the shared pool: every
    request the decode engine got is aborted, and no abort connection is left there."""
    cluster = await abort_cluster(nursery)
    storm = 24

    async def failing() -> None:
        response = await cluster.client.post(
            "/generate", json=generate_body(sim_fault="prefill:500@200")
        )
        assert response.status_code == 502

    async with trio.open_nursery() as requests:
        for _ in range(storm):
            requests.start_soon(failing)
    aborts = cluster.router.aborts
    assert aborts is not None
    sent = cluster.router.metrics.aborts.labels("decode", "sent")
    await settle(lambda: sent._value.get() >= storm, timeout=LOOSE)  # the first POSTs (provoked)
    # Every decode request the engine got was freed by the router's abort.
    started = cluster.decode.events.find("request_start")
    assert started
    for event in started:
        freed = await cluster.decode.events.wait_for(
            "slot_freed", timeout=LOOSE, sglang_rid=event["sglang_rid"]
        )
        assert freed["reason"] == "aborted_request"
    # The aborts went over the service's own connections, and none is in the shared pool.
    assert aborts.connections() and {url for url, _ in aborts.connections()} == {cluster.decode.url}
    assert cluster.upstream_connections(cluster.decode) == []
    await cluster.client.aclose()
