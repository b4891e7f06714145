"""The rest of the docs/protocol.md §4 matrix, each case checked on both sides: what the client got,
what the engines saw (connection closed, slot freed, KV or not), and that the router's pool holds
no active connection afterwards.

- the request deadline with decode as the slow leg (json and sse, before decode's first event);
- the client leaving at every point not covered elsewhere: before decode's first event, while
  decode's 2xx is held for prefill, while queued in admission, during a retry's backoff;
- decode's in-band failure before its first event, and whose breaker it counts against;
- in-band 4xx (the client's request refused inside a 200), from prefill or decode: its status,
  no retry, a breaker success;
- byte-for-byte passthrough of prefill 4xx and decode error bodies, content type included;
- which of decode's response headers are relayed and which are not.

Sequences of faults: a body's `sim_fault` may be a list (one spec per role), e.g.
`["prefill:hang+kv", "decode:slow:5000"]`: prefill sends the KV then never answers, decode got
the KV and waits 5 s before its first token. Bounds are loose (seconds).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import orjson
import pytest
import trio

from tests.conftest import Cluster, start_cluster
from tests.router.helpers import CANCELLED, generate_body, read_sse, settle
from trio_pd.config import RetryConfig
from trio_pd_testing.engine.responses import error_body

LOOSE = 15.0  # a hang guard; what it rules out (a 60 s slow decode, a 60 s wait) is far above
SLOW_DECODE = "decode:slow:60000"  # decode got its KV, then waits 60 s before its first token


def assert_envelope(response: httpx2.Response, status: int, error_type: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert error["type"] == error_type
    assert isinstance(error["message"], str)
    assert error["message"]
    assert error["code"] == status
    return error


def starts(engines: list[Any], rid: str) -> int:
    return sum(len(e.events.find("request_start", rid=rid)) for e in engines)


async def assert_no_active_connection(cluster: Cluster) -> None:
    for engine in (*cluster.prefills, *cluster.decodes):
        await settle(lambda e=engine: "active" not in cluster.upstream_connections(e))


async def assert_decode_closed(cluster: Cluster, rid: str) -> dict[str, Any]:
    """Decode saw the router close its connection, then ended the request as cancelled (an
    abort, its own or the router's), freeing whatever it held: its slot, if it had one yet (a
    request aborted while still registering its room never takes one)."""
    closed = await cluster.decode.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    ended = await cluster.decode.events.wait_for("request_end", timeout=LOOSE, rid=rid)
    assert ended["ended"] in CANCELLED, ended
    assert ended["t"] >= closed["t"]
    for freed in cluster.decode.events.find("slot_freed", rid=rid):
        assert freed["reason"] in CANCELLED
    await settle(lambda: cluster.decode.running == 0)
    return closed


def breaker_counts(cluster: Cluster) -> dict[str, tuple[int, int]]:
    """(total_failures, total_successes) of every worker, keyed by its URL."""
    return {
        w.url: (w.breaker.total_failures, w.breaker.total_successes)
        for w in cluster.router.fleet.workers()
    }


async def leave_when(
    cluster: Cluster,
    body: dict[str, Any],
    rid: str,
    ready: Callable[[], Awaitable[Any]],
    path: str = "/generate",
) -> tuple[trio.CancelScope, float]:
    """Post `body` as a client that goes away once `ready()` returns: the client's cancel scope
    (its `cancelled_caught` says the client really left mid-request) and when it left
    (time.monotonic, the engines' event clock)."""
    scope = trio.CancelScope()

    async def client() -> None:
        with scope:
            headers = {"x-request-id": rid}
            if body.get("stream"):
                async with cluster.client.stream("POST", path, json=body, headers=headers) as r:
                    await r.aread()
            else:
                await cluster.client.post(path, json=body, headers=headers)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        with trio.fail_after(LOOSE):
            await ready()
        left = time.monotonic()
        scope.cancel()
    return scope, left


# -- the request deadline, decode being the slow leg ------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_deadline_with_decode_slow_is_504(nursery: trio.Nursery, stream: bool) -> None:
    cluster = await start_cluster(nursery, request_timeout_secs=1.0)
    body = generate_body(stream=stream, sim_fault=SLOW_DECODE)
    started = trio.current_time()
    response = await cluster.client.post("/generate", json=body)
    # A real 504 status, also for a stream: decode had sent its 200 and SSE headers, but no
    # event, so nothing went to the client before the deadline.
    error = assert_envelope(response, 504, "timeout_error")
    assert "decode worker timed out" in error["message"]
    assert 0.9 < trio.current_time() - started < LOOSE
    rid = response.headers["x-request-id"]
    # Prefill was done (KV sent, answered 200): decode was the slow leg, and it was cut.
    assert cluster.prefill.events.find("kv_sent", rid=rid)
    assert cluster.prefill.events.find("request_end", rid=rid)[0]["status"] == 200
    assert cluster.decode.events.find("kv_ready", rid=rid)
    if stream:
        assert cluster.decode.events.find("response_start", rid=rid)[0]["status"] == 200
    await assert_decode_closed(cluster, rid)
    assert not cluster.decode.events.find("first_token", rid=rid)
    await assert_no_active_connection(cluster)
    await cluster.client.aclose()


# -- the client leaves ------------------------------------------------------------------------


async def test_client_gone_before_decodes_first_event_closes_both(cluster: Cluster) -> None:
    rid = "gone-before-first-event"
    body = generate_body(stream=True, sim_fault=["prefill:hang+kv", SLOW_DECODE])

    async def decode_waits_for_its_first_token() -> None:
        await cluster.decode.events.wait_for("kv_ready", rid=rid)
        await cluster.prefill.events.wait_for("kv_sent", rid=rid)

    scope, left = await leave_when(cluster, body, rid, decode_waits_for_its_first_token)
    assert scope.cancelled_caught  # the client really left, before any response header
    # Both legs were open (prefill hangs after the KV, decode waits before its first token);
    # the router closed both.
    closed = await assert_decode_closed(cluster, rid)
    assert closed["t"] >= left
    assert not cluster.decode.events.find("first_token", rid=rid)
    prefill_closed = await cluster.prefill.events.wait_for(
        "connection_closed", timeout=LOOSE, rid=rid
    )
    assert prefill_closed["t"] >= left
    await assert_no_active_connection(cluster)
    assert breaker_counts(cluster) == {w: (0, 0) for w in breaker_counts(cluster)}


async def test_client_gone_while_decodes_answer_is_held(cluster: Cluster) -> None:
    """Decode answered 200 (it had the KV) while prefill still runs: the router holds decode's
    answer for prefill's outcome; the client leaving then must close prefill at once."""
    rid = "gone-while-held"
    body = generate_body(sim_fault="prefill:hang+kv")

    async def decode_answered() -> None:
        await cluster.decode.events.wait_for("request_end", rid=rid)
        await trio.sleep(0.2)  # the router has read decode's (small) answer and holds it

    scope, left = await leave_when(cluster, body, rid, decode_answered)
    assert scope.cancelled_caught  # the client left without its answer
    ended = cluster.decode.events.find("request_end", rid=rid)[0]
    assert ended["status"] == 200
    assert ended["t"] < left  # decode's answer was there, held by the router
    assert cluster.decode.events.find("slot_freed", rid=rid)[0]["reason"] == "finished"
    closed = await cluster.prefill.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    assert 0 <= closed["t"] - left < LOOSE
    assert cluster.prefill.events.find("kv_sent", rid=rid)
    await assert_no_active_connection(cluster)
    # The whole decode answer was read, so its connection went back to the pool.
    assert cluster.upstream_connections(cluster.decode) == ["idle"]
    assert breaker_counts(cluster) == {w: (0, 0) for w in breaker_counts(cluster)}


async def test_client_gone_while_queued_in_admission_reaches_no_worker(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, max_concurrent_requests=1, queue_size=10)
    holder = "holds-the-only-slot"
    queued = "queued-then-gone"
    results: dict[str, int] = {}

    async def hold_the_slot() -> None:
        response = await cluster.client.post(
            "/generate",
            json=generate_body(sim_fault="decode:slow:2000"),
            headers={"x-request-id": holder},
        )
        results[holder] = response.status_code

    async with trio.open_nursery() as traffic:
        traffic.start_soon(hold_the_slot)
        await cluster.decode.events.wait_for("request_start", timeout=LOOSE, rid=holder)

        async def waiting_in_line() -> None:
            await settle(lambda: cluster.router.admission.waiting == 1)

        scope, _ = await leave_when(cluster, generate_body(), queued, waiting_in_line)
        assert scope.cancelled_caught
        await settle(lambda: cluster.router.admission.waiting == 0)
    assert results[holder] == 200
    # The slot is free now: had the queued request stayed in line, it would go out now.
    ok = await cluster.client.post("/generate", json=generate_body())
    assert ok.status_code == 200
    assert starts([cluster.prefill, cluster.decode], holder) == 2
    assert starts([cluster.prefill, cluster.decode], queued) == 0
    await assert_no_active_connection(cluster)
    await cluster.client.aclose()


async def test_client_gone_during_retry_backoff_stops_the_retries(nursery: trio.Nursery) -> None:
    backoff = 3.0
    retry = RetryConfig(max_retries=3, initial_backoff_ms=int(backoff * 1000), jitter_factor=0.0)
    cluster = await start_cluster(nursery, n_prefill=2, retry=retry)
    rid = "gone-during-backoff"
    body = generate_body(sim_fault="prefill:500")
    engines = [*cluster.prefills, *cluster.decodes]

    async def first_attempt_failed() -> None:
        await settle(
            lambda: any(e.events.find("request_end", rid=rid, status=500) for e in cluster.prefills)
        )
        await cluster.decode.events.wait_for("connection_closed", rid=rid)
        await trio.sleep(0.3)  # well inside the 3 s backoff

    started = time.monotonic()
    scope, left = await leave_when(cluster, body, rid, first_attempt_failed)
    assert scope.cancelled_caught
    assert left - started < backoff  # the client left during the backoff
    assert starts(engines, rid) == 2  # the first attempt's two legs
    await assert_decode_closed(cluster, rid)
    # Past the point where the second attempt would have gone out: nothing more came.
    await trio.sleep(started + backoff + 0.5 - time.monotonic())
    assert starts(engines, rid) == 2
    assert sum(len(e.events.find("request_start")) for e in engines) == 2
    await assert_no_active_connection(cluster)
    await cluster.client.aclose()


# -- decode's in-band failure before its first event ------------------------------------------


async def test_decode_inband_failure_before_first_event_is_502_on_decodes_breaker(
    cluster: Cluster,
) -> None:
    body = generate_body(stream=True, sim_fault="decode:sse_error")
    response = await cluster.client.post("/generate", json=body)
    error = assert_envelope(response, 502, "upstream_error")
    assert "decode" in error["message"]
    rid = response.headers["x-request-id"]
    assert cluster.decode.events.find("response_start", rid=rid)[0]["status"] == 200  # in-band
    # Prefill was waiting for decode's registration: the router closed it at once.
    await cluster.prefill.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    assert not cluster.prefill.events.find("kv_sent", rid=rid)
    decode = cluster.router.fleet.workers("decode")[0]
    prefill = cluster.router.fleet.workers("prefill")[0]
    await settle(lambda: decode.breaker.total_failures == 1)
    assert (prefill.breaker.total_failures, prefill.breaker.total_successes) == (0, 0)
    assert decode.breaker.total_successes == 0
    await assert_no_active_connection(cluster)


# -- in-band 4xx: the client's request refused inside a 200 -----------------------------------


def the_one(engines: list[Any], rid: str) -> Any:
    """The engine of `engines` that got `rid` (there must be exactly one)."""
    [engine] = [e for e in engines if e.events.find("request_start", rid=rid)]
    return engine


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(
    ("fault", "status"),
    [
        ("prefill:sse_error:400", 400),
        ("prefill:abort:422", 422),
        ("decode:sse_error:400", 400),
        ("decode:abort:422", 422),
    ],
)
async def test_inband_4xx_is_the_clients_status_not_retried_a_breaker_success(
    nursery: trio.Nursery, fault: str, status: int, stream: bool
) -> None:
    retry = RetryConfig(max_retries=3, initial_backoff_ms=1, jitter_factor=0.0)
    cluster = await start_cluster(nursery, n_prefill=2, n_decode=2, retry=retry)
    role = fault.split(":")[0]
    response = await cluster.client.post(
        "/generate", json=generate_body(stream=stream, sim_fault=fault)
    )
    # SGLang answers an abort with a status in-band on a stream only; without one it is that
    # HTTP status with its flat `{"object": "error", "message": ...}` body, relayed as it came.
    inband = stream or ":sse_error:" in f":{fault}"
    if inband:
        error = assert_envelope(response, status, "invalid_request_error")
        message = error["message"]
    else:
        assert response.status_code == status, response.text
        message = response.json()["message"]
    assert f"simulated {role} fault {fault!r}" in message
    rid = response.headers["x-request-id"]
    prefill, decode = the_one(cluster.prefills, rid), the_one(cluster.decodes, rid)
    culprit, victim = (prefill, decode) if role == "prefill" else (decode, prefill)
    assert culprit.events.find("fault", rid=rid)
    started = culprit.events.find("response_start", rid=rid)[0]["status"]
    assert started == (200 if inband else status)
    # The other leg was cancelled at once: its connection closed (decode: its slot freed).
    closed = await victim.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    if victim is decode:
        ended = await decode.events.wait_for("request_end", timeout=LOOSE, rid=rid)
        assert ended["ended"] in CANCELLED
        assert ended["t"] >= closed["t"]
    await trio.sleep(0.2)  # a retry (1 ms backoff) would have reached an engine by now
    assert starts(cluster.prefills, rid) == 1  # retries are on, yet one attempt only
    assert starts(cluster.decodes, rid) == 1
    await settle(lambda: breaker_counts(cluster)[culprit.url] == (0, 1))
    counts = breaker_counts(cluster)
    assert counts.pop(culprit.url) == (0, 1)  # a success: the client's fault
    assert set(counts.values()) == {(0, 0)}  # the victim and the idle workers: nothing
    await settle(lambda: cluster.decode.running == 0 and cluster.decodes[1].running == 0)
    await assert_no_active_connection(cluster)
    await cluster.client.aclose()


# -- error bodies relayed byte for byte --------------------------------------------------------


async def direct_pd(cluster: Cluster, body: dict[str, Any]) -> httpx2.Response:
    """Decode's own answer to a whole PD request made without the router (both legs at once,
    a fresh room): what the router had to relay."""
    pd_body = {
        **body,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.prefill.bootstrap_port,
        "bootstrap_room": 4242,
    }
    answers: dict[str, httpx2.Response] = {}

    async def leg(engine: Any) -> None:
        async with httpx2.AsyncClient(base_url=engine.url) as direct:
            answers[engine.role] = await direct.post("/generate", json=pd_body)

    async with trio.open_nursery() as legs:
        legs.start_soon(leg, cluster.prefill)
        legs.start_soon(leg, cluster.decode)
    assert answers["prefill"].status_code == answers["decode"].status_code == 200
    return answers["decode"]


async def engine_answer(engine_url: str, body: dict[str, Any]) -> httpx2.Response:
    """The engine's own answer to a PD request carrying `body` (made-up bootstrap fields: the
    faults tested here fire before any rendezvous)."""
    pd_body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7}
    async with httpx2.AsyncClient(base_url=engine_url) as direct:
        return await direct.post("/generate", json=pd_body, headers={"x-request-id": "direct"})


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(
    ("role", "status"),
    [
        *(("prefill", s) for s in (400, 401, 403, 413, 422, 429)),
        *(("decode", s) for s in (400, 429, 500, 503)),
    ],
)
async def test_error_bodies_are_relayed_byte_for_byte(
    cluster: Cluster, role: str, status: int, stream: bool
) -> None:
    fault = f"{role}:{status}"
    body = generate_body(stream=stream, sim_fault=fault)
    engine = cluster.prefill if role == "prefill" else cluster.decode
    direct = await engine_answer(engine.url, body)
    assert direct.status_code == status
    # The simulator's bytes, as its source says they are made:
    assert direct.content == orjson.dumps(error_body(f"simulated {role} fault {fault!r}", status))
    response = await cluster.client.post("/generate", json=body)
    assert response.status_code == status
    assert response.content == direct.content  # byte for byte
    assert response.headers.get_list("content-type") == direct.headers.get_list("content-type")
    assert response.headers["content-length"] == str(len(direct.content))
    rid = response.headers["x-request-id"]
    assert engine.events.find("fault", rid=rid)
    if role == "prefill":
        await assert_decode_closed(cluster, rid)
    else:
        await cluster.prefill.events.wait_for("connection_closed", timeout=LOOSE, rid=rid)
    await assert_no_active_connection(cluster)


# -- response headers on success ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_success_relays_end_to_end_headers_only(cluster: Cluster, stream: bool) -> None:
    rid = f"headers-{stream}"
    body = generate_body(stream=stream)
    direct = await direct_pd(cluster, body)
    async with cluster.client.stream(
        "POST", "/generate", json=body, headers={"x-request-id": rid}
    ) as response:
        if stream:
            events = await read_sse(response)
            assert events[-1] == "[DONE]"
        else:
            await response.aread()
    assert response.status_code == 200
    # What decode really sent, from its own log and from a direct request.
    ended = await cluster.decode.events.wait_for("request_end", timeout=LOOSE, rid=rid)
    assert ended["status"] == 200
    names = [k.lower() for k, _ in response.headers.raw]
    engine_names = [k.lower() for k, _ in direct.headers.raw]
    assert b"server" in engine_names and b"date" in engine_names  # both servers set them
    # End-to-end headers of decode's answer are relayed, once.
    expected_type = b"text/event-stream" if stream else b"application/json"
    assert response.headers.raw.count((b"content-type", expected_type)) == 1
    assert names.count(b"content-type") == 1
    if stream:
        assert (b"cache-control", b"no-cache") in direct.headers.raw
        assert response.headers.raw.count((b"cache-control", b"no-cache")) == 1
    # The router's own, once each: its request id, its date and server (not the engine's too).
    assert response.headers.raw.count((b"x-request-id", rid.encode())) == 1
    assert names.count(b"x-request-id") == 1
    assert names.count(b"date") == 1
    assert names.count(b"server") == 1
    # Hop-by-hop headers are not relayed; framing is the router's own.
    assert b"keep-alive" not in names
    assert names.count(b"connection") <= 1
    if stream:
        assert names.count(b"transfer-encoding") == 1
        assert b"content-length" not in names
    else:
        assert b"transfer-encoding" not in names
        assert response.headers.get_list("content-length") == [str(len(response.content))]
    await assert_no_active_connection(cluster)
